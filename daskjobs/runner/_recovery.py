"""Recovering a run from a lost node: whether one more recovery is allowed (planned departures do
not count), waiting for every node (a pool node is placed on the workers that remain), restoring
all of them from the last commit (or emptying their workspaces for init to run again), and what a
lost session says about resuming; and, at an epoch boundary, letting workers that joined take
nodes (:func:`rebalance`)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from .._config import config_count, config_timeout
from .._model.group import TaskGroup
from .._model.task import Task, WorkspaceType
from .._model.workspace import Workspace, node_state
from ..checkpoint._managers.damage import with_intact_epoch
from ..errors import CheckpointCorruptError, NodeLostError, NodePlacementError, SessionLostError

if TYPE_CHECKING:
    from .._model.job import Job
    from ..checkpoint import MultiNodeCheckpointManager
    from ..checkpoint._managers.pipeline import CommitPipeline
    from ..session import Session

logger = logging.getLogger("daskjobs")


def with_last_commit(exc: SessionLostError, manager: MultiNodeCheckpointManager | None) -> SessionLostError:
    """``exc`` told with what the run committed durably (``manager``: its checkpoints, ``None``: none)
    and what running the job again does."""
    told, again = str(exc).rstrip("."), "run the job again on a working scheduler"
    if manager is None:
        return SessionLostError(f"{told}; nothing was checkpointed (no checkpoint manager): {again} to start over")
    if not manager.durable:
        return SessionLostError(
            f"{told}; the run's checkpoints were in cluster memory only and went with it (db_prefix=None): "
            f"{again} to start over"
        )
    try:
        epochs = manager.store.committed_epochs()
    except OSError as error:
        return SessionLostError(
            f"{told}; the committed epochs under {manager.store.url} could not be listed ({error}): {again} to "
            "resume from the last of them"
        )
    if not epochs:
        return SessionLostError(f"{told}; no epoch was committed under {manager.store.url}: {again} to start over")
    return SessionLostError(
        f"{told}; the last committed epoch, {epochs[-1]} under {manager.store.url}, is intact: {again} to resume "
        "from it"
    )


def check_recoverable(
    manager: MultiNodeCheckpointManager | None, exc: NodeLostError, failures: int, max_failures: int, last: int | None
) -> None:
    """Raise the final :class:`NodeLostError` unless one more recovery is allowed.

    ``last`` is the newest epoch the run committed (``None``: none), named in the error.
    """
    if manager is not None and failures < max_failures:
        return
    where = "no committed epoch" if last is None else f"last committed epoch {last}"
    if manager is None:
        raise NodeLostError(f"{exc} — no checkpoint manager ({where})", exc.nodes) from exc
    why = f"giving up after {failures} recoveries (max_failures={max_failures})"
    if exc.departure is not None:
        why += (
            f"; planned departures beyond daskjobs.max-departures ({config_count('max-departures')}) between two "
            "commits count as failures"
        )
    raise NodeLostError(f"{exc} — {why} ({where})", exc.nodes) from exc


def prepare_restore(
    session: Session,
    nodes: list[str],
    latest: int | None,
    timeout: float,
    *,
    lost: list[str],
    departed: str | None,
    failures: tuple[int, int],
    in_memory: bool = False,
) -> None:
    """Before restoring from ``latest`` (``None``: from scratch; ``in_memory``: from its snapshots in
    cluster memory) after the loss of the nodes ``lost``: wait up to ``timeout`` seconds for every
    node to have a worker again, forget the session's tokens, and without a commit empty the nodes'
    GLOBAL workspaces (init then runs again).

    Logs one line: an INFO naming the nodes and ``departed`` (why their worker left) for a planned
    departure, else a WARNING with the ``(failures, max_failures)`` count.
    """
    start = "scratch" if latest is None else f"epoch {latest}{' in cluster memory' if in_memory else ''}"
    if departed is not None:
        logger.info(
            "node(s) %s: the worker left on purpose (%s); waiting for its replacement and restoring all nodes "
            "from %s (a planned departure, not counted against max_failures)",
            lost,
            departed,
            start,
        )
    else:
        logger.warning("node(s) %s lost; restoring all nodes from %s (recovery %d of %d)", lost, start, *failures)
    try:
        session.wait_for_nodes(nodes, timeout=timeout)
    except NodePlacementError as exc:
        raise NodePlacementError(
            f"{exc}; a recovery waits daskjobs.recovery-timeout ({timeout:g} s) for every node to have a "
            "worker again: raise it (Dask config) when replacement workers take longer to start",
            exc.nodes,
        ) from exc
    session.forget_tokens()
    if latest is None:
        session.run(_clear_group(nodes))


def _clear_workspace(ws: Workspace) -> None:
    """Step: empty the node's GLOBAL workspace (before init runs again after a node loss)."""
    node_state(ws).replace_blobs({})


def _clear_group(nodes: list[str]) -> TaskGroup:
    with TaskGroup(WorkspaceType.GLOBAL) as group:
        for node in nodes:
            Task(_clear_workspace, node=node, name="clear_workspace")
    return group


class Departures:
    """Tells the planned departures a run recovers from without counting them as failures."""

    def __init__(self) -> None:
        self._at: int | None = None
        self._in_a_row = 0

    def planned(self, exc: NodeLostError, manager: object, last_committed: int | None) -> str | None:
        """Why ``exc``'s worker left, when that is a planned departure to recover from without counting
        a failure: it left on purpose, there is a checkpoint ``manager`` to restore from, and the job
        still moves: at most ``daskjobs.max-departures`` (Dask config, default 10) departures between two
        commits; more count against ``max_failures`` (workers that leave faster than an epoch commits
        would otherwise loop forever)."""
        if exc.departure is None or manager is None:
            return None
        if last_committed != self._at:
            self._at, self._in_a_row = last_committed, 0
        self._in_a_row += 1
        return exc.departure if self._in_a_row <= config_count("max-departures") else None


@dataclass(frozen=True)
class Recovery:
    """One recovery of a run: the counts so far, the nodes lost, and why their worker left when
    that was a planned departure (``departed``, see :class:`Departures`)."""

    failures: int
    departures: int
    max_failures: int
    lost: list[str]
    departed: str | None


def restore(
    session: Session,
    manager: MultiNodeCheckpointManager,
    pipeline: CommitPipeline,
    job: Job,
    latest: int | None,
    recovery: Recovery,
    max_epochs: int | None,
) -> tuple[int, bool] | None:
    """After a loss: end the background writes of the nodes that survived and remove what the run left
    uncommitted (``pipeline``), wait for every node of ``job`` and restore all of them from ``latest``,
    the last epoch the run committed.

    With tier 0 the nodes are restored from the newest epoch committed in cluster memory whose
    snapshots all survive, when that is not older than ``latest``: nothing is read from the prefix.

    Returns the epoch to run next and whether to stop, or ``None`` when nothing was committed
    yet (init runs again from scratch, on emptied workspaces).
    """
    pipeline.recover(session, recovery.lost)
    memory = pipeline.memory
    source = None if memory is None else memory.source(latest)
    prepare_restore(
        session,
        job.nodes(),
        latest if source is None else source[0],
        config_timeout("recovery-timeout"),
        lost=recovery.lost,
        departed=recovery.departed,
        failures=(recovery.failures, recovery.max_failures),
        in_memory=source is not None,
    )
    if memory is not None and source is not None:
        record = memory.restore(source)
        return next_epoch(record.epoch, record.stop_values, max_epochs)
    pipeline.recovered(latest, in_memory=False)
    if latest is None:
        return None
    manager.check_shared(session)  # a node's new worker may be on a machine without the prefix
    return load_epoch(session, manager, job.name, latest, recovery.failures + recovery.departures, max_epochs)


def load_epoch(
    session: Session, manager: MultiNodeCheckpointManager, job: str, epoch: int, attempt: int, max_epochs: int | None
) -> tuple[int, bool]:
    """Restore every checkpointed node from ``epoch``; return the next epoch and whether to stop
    (a stop condition was true, or ``max_epochs`` is reached).

    The commit record is read once: the load and the stop values come from it. A manager whose
    class overrides ``load`` (Caffe2-style) has its group run instead (see ``manager.restore``). A
    damaged epoch raises :class:`~daskjobs.errors.CheckpointCorruptError` naming the newest epoch
    that verifies.
    """
    record = manager.store.read_commit(epoch)
    try:
        manager.restore(session, record, job=job, attempt=attempt)
    except CheckpointCorruptError as exc:  # say which epoch does verify, and how to resume from it
        raise with_intact_epoch(exc, manager.store, epoch) from exc
    manager.report_checkpoint_stats("checkpoint_load")
    return next_epoch(epoch, record.get("stop_values", {}), max_epochs)


def next_epoch(epoch: int, stop_values: dict[str, bool], max_epochs: int | None) -> tuple[int, bool]:
    """After restoring ``epoch`` (committed with ``stop_values``): the next epoch and whether to stop
    (a stop condition was true, or ``max_epochs`` is reached)."""
    stopped = [name for name, value in stop_values.items() if value]
    if stopped or (max_epochs is not None and epoch >= max_epochs):
        why = f"stop conditions {stopped} true" if stopped else f"max_epochs={max_epochs} reached"
        logger.info("epoch %d was committed with %s: no further epoch runs", epoch, why)
        return epoch, True
    return epoch + 1, False


def rebalance(session: Session, pipeline: CommitPipeline | None) -> None:
    """At an epoch boundary: let workers that joined the cluster take nodes when that evens the
    spread (a session that places nodes on a pool decides, see ``DaskSession.rebalance``). The
    epochs run so far are committed first when a node moves: it moves with its workspace, so
    nothing is rolled back and no epoch runs again."""
    session.rebalance(before=None if pipeline is None else partial(pipeline.flush, session))


def placement_of(session: Session) -> Callable[[], dict[str, str]]:
    """A function giving ``session``'s current placement (node -> worker address; empty for a session
    without one, or once the session is gone), for the runner's repr."""
    ref = weakref.ref(session)

    def placement() -> dict[str, str]:
        current = ref()
        return current.placement if current is not None and current.is_open() else {}

    return placement
