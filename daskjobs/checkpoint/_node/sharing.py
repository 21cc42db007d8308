"""Proving that the driver and every node's worker see one checkpoint prefix (SPEC §3 "Shared storage").

On a cluster of several machines a local path is a different directory on every machine unless a
shared filesystem is mounted there, and ``memory://`` is private to each process. A run that did
not notice would write each node's groups where the driver never looks. So before anything is
written or loaded, :func:`prove_shared` writes a probe file from the driver, has every node's
worker read it and write one of its own, reads those back, and removes them all: one round trip
to the nodes, whatever their number.

Probe files are ``__daskjobs__/probe.tmp-<32 hex digits>``: daskjobs temp files, so the cleanup at
the start of the next run removes any that a crash left behind.

The proof runs on every kind of prefix, object stores included: a worker without the driver's
credentials, or an ``endpoint_url`` that points at ``localhost`` (another server, or none, on each
machine) is the same mistake. It costs ``3 N + 2`` small requests for ``N`` nodes (one PUT and
one bulk DELETE from the driver; per node one GET and one PUT there and one GET back here, the
GETs concurrent), next to the hundreds of an epoch's save. A session whose nodes live in this
process (:attr:`~daskjobs.Session.in_process`) needs no proof.

When a load fails on a node because its group is not there, :func:`unseen_commit` tells, on that
node, whether the node sees the prefix at all, so that the error says so instead of calling the
checkpoint corrupt.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ..._execution.plan import GroupRunFailed
from ..._model.group import TaskGroup
from ..._model.task import Task, WorkspaceType
from ...errors import CheckpointError, CheckpointStorageError, CheckpointWriteError
from .._storage.cleanup import Tree
from .outcomes import ProbeReport
from .save_steps import idle

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..._execution.node_run import NodeState
    from ...session import Session
    from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")

RETRY_AFTER = 0.25
"""Seconds before a probe file that is not there is looked for once more (a cache of the
filesystem's; only a failing proof waits)."""


def advice(store: CheckpointStore) -> str:
    """What would work instead, for the kind of prefix ``store`` is."""
    if isinstance(store.fs, MemoryFileSystem):
        return (
            "memory:// is private to each process: use it only with a LocalSession or "
            "node_cluster(..., processes=False); for workers in other processes use a shared filesystem "
            "(NFS, Lustre, ...) mounted at the same path on every machine, or an object store prefix "
            "(s3://bucket/path, with storage_options)"
        )
    if isinstance(store.fs, LocalFileSystem):
        return (
            "a local path must be one directory for the driver and every node's worker: use a shared filesystem "
            f"(NFS, Lustre, ...) mounted at {store.url} on every machine, or an object store prefix "
            "(s3://bucket/path, with storage_options for its endpoint and credentials)"
        )
    return (
        "every node's worker must reach the same object store with the same access: check that the "
        "storage_options (an endpoint_url every machine reaches, not localhost) and the credentials work "
        "on every machine, or use a shared filesystem (NFS, Lustre, ...) mounted at the same path on every machine"
    )


def _why(error: BaseException) -> str:
    return "no such file" if isinstance(error, FileNotFoundError) else f"{type(error).__name__}: {error}"


def _read(store: CheckpointStore, paths: Sequence[str]) -> list[bytes | OSError]:
    """The probe files at ``paths``; those not there are looked for once more after :data:`RETRY_AFTER`."""
    found = store.read_probes(paths)
    missing = [i for i, data in enumerate(found) if isinstance(data, FileNotFoundError)]
    if missing:
        time.sleep(RETRY_AFTER)
        for i, data in zip(missing, store.read_probes([paths[i] for i in missing]), strict=True):
            found[i] = data
    return found


@dataclass(frozen=True)
class ProbeFinish:
    """On a node's worker (a ``finish`` hook): read the driver's probe file and, if it holds what the
    driver wrote, write the node's own. Never raises: returns what it found (see
    :class:`~.outcomes.ProbeReport`)."""

    store: CheckpointStore
    driver_probe: str
    driver_data: bytes
    node_probe: str
    node_data: bytes

    def __call__(self, state: NodeState) -> ProbeReport:
        try:
            found: bytes | BaseException = _read(self.store, [self.driver_probe])[0]
        except Exception as exc:
            found = exc
        if isinstance(found, BaseException):
            return ProbeReport(state.where, unseen=_why(found))
        if found != self.driver_data:
            return ProbeReport(state.where, unseen="it holds other bytes than this process wrote")
        try:
            self.store.write_probe(self.node_probe, self.node_data)
        except Exception as exc:
            return ProbeReport(state.where, unwritable=_why(exc))
        return ProbeReport(state.where, wrote=True)


def prove_shared(store: CheckpointStore, session: Session, nodes: Sequence[str], *, job: str) -> None:
    """Prove that ``nodes``' workers in ``session`` see the prefix of ``store`` as this process does.

    Writes a probe file, has every node read it and write its own (one group run), reads those
    back and removes every probe file (also when the proof fails). Nothing else is written.

    Raises
    ------
    CheckpointStorageError
        A node's worker does not see this process's probe file, cannot write to the prefix, or
        wrote a file this process does not see; the message names each such node, its worker
        and the path, and what to use instead.
    CheckpointWriteError
        This process cannot write its probe file.
    """
    if session.in_process or not nodes:
        return
    driver_probe, driver_data = store.new_probe(), os.urandom(16).hex().encode()
    probes = {node: (store.new_probe(), os.urandom(16).hex().encode()) for node in nodes}
    try:
        try:
            store.write_probe(driver_probe, driver_data)
        except OSError as exc:
            raise CheckpointWriteError(f"checkpoint prefix {store.url} is not writable: {exc}") from exc
        group = TaskGroup(WorkspaceType.PRIVATE)
        group.label = "checkpoint_probe"
        for node in nodes:
            Task(idle, group=group, node=node, name="checkpoint_probe")
        finish = {node: ProbeFinish(store, driver_probe, driver_data, *probes[node]) for node in nodes}
        try:
            finished = session.run_group(group, job=job, finish=finish).finished
        except GroupRunFailed as failed:
            error: Exception | None = failed.error
        else:
            error, problems = None, _problems(store, probes, finished)
    finally:
        try:
            Tree(store.fs).unlink([driver_probe, *(path for path, _ in probes.values())])
        except OSError as exc:  # leftovers are temp files: the next run's cleanup removes them
            logger.warning("could not remove the probe files under %s: %s", store.url, exc)
    if error is not None:
        raise error
    if problems:
        raise CheckpointStorageError(
            f"checkpoint prefix {store.url} is not the same storage for every node: this process wrote "
            f"{driver_probe}, and {'; '.join(problems.values())}; {advice(store)}",
            list(problems),
        )


def _problems(
    store: CheckpointStore, probes: dict[str, tuple[str, bytes]], finished: Mapping[str, object]
) -> dict[str, str]:
    """Node -> what its report (and reading back the file it wrote) says is wrong."""
    problems = {}
    reports = {node: report for node, report in finished.items() if isinstance(report, ProbeReport)}
    wrote = [node for node, report in reports.items() if report.wrote]
    for node, data in zip(wrote, _read(store, [probes[n][0] for n in wrote]), strict=True):
        if data != probes[node][1]:
            why = _why(data) if isinstance(data, OSError) else "it holds other bytes than the node wrote"
            reports[node] = dataclasses.replace(reports[node], unread=why)
    for node in probes:
        report = reports.get(node) or ProbeReport("its worker", unseen="the node did not report")
        at = f"node {node!r} on {report.where}"
        if report.unseen is not None:
            problems[node] = f"{at} does not see it ({report.unseen})"
        elif report.unwritable is not None:
            problems[node] = f"{at} reads it but cannot write next to it ({report.unwritable})"
        elif report.unread is not None:
            problems[node] = f"{at} wrote {probes[node][0]}, which this process does not see ({report.unread})"
    return problems


def unseen_commit(store: CheckpointStore, node: str, epoch: int, where: str) -> CheckpointStorageError | None:
    """On a node whose group of committed ``epoch`` is not there: the error saying that the node's
    worker does not see the prefix the driver read that commit from, if it sees neither that commit
    nor a newer one (a newer one: the epoch was deleted meanwhile, not another directory); else ``None``."""
    try:
        seen = store.committed_epochs()
    except (CheckpointError, OSError):
        return None
    if epoch in seen or any(e > epoch for e in seen):
        return None
    sees = f"it sees the commits of epochs {seen}" if seen else "it sees no commit at all"
    return CheckpointStorageError(
        f"node {node!r} on {where} does not see the commit record of epoch {epoch} that this process read "
        f"({store.commit_path(epoch)}); {sees}: the node's worker sees another directory at {store.url}; "
        f"{advice(store)}",
        [node],
    )


def unseen_groups(store: CheckpointStore, epoch: int, nodes: Sequence[str]) -> CheckpointStorageError | None:
    """Before committing ``epoch`` saved outside a runner: the error naming the nodes whose groups this
    process does not see (they wrote them elsewhere), else ``None``."""
    missing = [node for node in nodes if not store.has_group(node, epoch)]
    if not missing:
        return None
    paths = ", ".join(store.db_name(node, epoch) for node in missing)
    return CheckpointStorageError(
        f"not committing epoch {epoch}: node(s) {missing} wrote their checkpoint, but this process does not see "
        f"{paths}: their workers see another directory at {store.url}; {advice(store)}",
        missing,
    )
