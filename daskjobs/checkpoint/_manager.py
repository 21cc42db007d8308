"""Checkpoint managers: save and load node workspaces as TaskGroups, commit epochs."""

from __future__ import annotations

import html
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .._model.group import TaskGroup
from .._model.node import Node
from .._model.task import Task, WorkspaceType
from .._validation import validate_name
from ..errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
)
from ._files import fsync_path
from ._format import make_commit_record
from ._metadata import CommitRecordHandler, MetadataHandler
from ._steps import (
    ENTRY_BLOB,
    AsyncSaveFinish,
    AsyncSaveStep,
    CheckStep,
    LoadStep,
    SaveFinish,
    SaveStep,
    WaitSaveStep,
)
from ._store import CheckpointStore

if TYPE_CHECKING:
    from ..session import Session

logger = logging.getLogger("daskjobs")

_STAGING = "__daskjobs__/staging"
"""Where the first save after resuming from an older epoch is written (see ``resume_older``)."""


def get_ckpt_filename(node: str, epoch: int) -> str:
    """The checkpoint name of a node at an epoch: ``"<node>.<epoch>"``."""
    return f"{node}.{epoch}"


def db_name(epoch: int, node: str, db_prefix: str, path_prefix: str | None = None) -> str:
    """Where a node's checkpoint of ``epoch`` lives: ``"<db_prefix>/<node>.<epoch>"``.

    A non-empty ``path_prefix`` is prepended as it is, without a separator (as in Caffe2).

    Examples
    --------
    >>> db_name(5, "trainer_0", "T")
    'T/trainer_0.5'
    """
    name = get_ckpt_filename(node, epoch)
    if path_prefix:
        return f"{path_prefix}{name}"
    return f"{db_prefix.rstrip('/')}/{name}"


def best_epochs(values: dict[int, float | None], mode: str) -> list[int]:
    """Epochs ordered best first by their metric value (``None``: no value, never best); ties: earlier first.

    Examples
    --------
    >>> best_epochs({1: 0.5, 2: 0.25, 3: None, 4: 0.25}, "min")
    [2, 4, 1]
    >>> best_epochs({1: 0.5, 2: 0.25}, "max")
    [1, 2]
    """
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * value, epoch) for epoch, value in values.items() if value is not None]
    return [epoch for _, epoch in sorted(scored)]


class MultiNodeCheckpointManager:
    """Checkpoints every node of a job, one save/load task per node, run on that node.

    Parameters
    ----------
    db_prefix
        A local path or an fsspec URL (``file://``, ``memory://``, ``s3://`` …). Each node's
        checkpoint of epoch ``e`` is the Zarr v3 group ``<db_prefix>/<node>.<e>``; an epoch
        counts only once its commit record is written.
    db_type
        Only ``"zarr"``.
    metadata_handler
        An object following :class:`~daskjobs.checkpoint.MetadataHandler`; default: resume
        from the latest committed epoch.
    storage_options
        Passed to fsspec (credentials, endpoint …). Never written to a checkpoint or a log.
    keep_last, keep_every
        Retention: keep the newest ``keep_last`` committed epochs and every epoch divisible by
        ``keep_every``; older ones are deleted after a newer commit. Default: keep all.
    keep_best, best_metric, best_mode
        Best-k retention: also keep the ``keep_best`` committed epochs with the lowest
        (``best_mode="min"``, default) or highest (``"max"``) value of metric ``best_metric`` (logged
        with ``ws.log``; epochs without it never count as best; ties keep the earlier epoch). The
        kept sets of ``keep_last``, ``keep_every`` and ``keep_best`` are united, and the newest
        committed epoch is always kept. ``keep_best`` alone keeps the best ``keep_best`` and the
        newest. With ``best_metric`` set (also without ``keep_best``) commit records name the
        metric and mode, so ``dj.open_checkpoint(prefix, epoch="best")`` finds the same best epoch.
    compression
        ``None`` (default, fastest) or a compressor name the store supports.
    async_save
        Snapshot each node's workspace at the epoch boundary and write it in the background
        while the next epoch runs (at most one save in flight; the epoch is committed once its
        write finished, at the next save or before the job ends). Needs memory for one copy of
        every workspace.
    delta
        Delta checkpoints (default on): a chunk whose XXH3-128 digest equals the same chunk of
        the previous committed epoch is hard-linked (server-side copied on object stores)
        instead of written. Every epoch stays a complete group, verifiable on its own, also
        after retention deleted the epoch it reused from.

    Examples
    --------
    >>> import daskjobs as dj, tempfile
    >>> manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp())
    >>> manager.get_ckpt_db_name("ps", 3).endswith("/ps.3")
    True
    """

    def __init__(
        self,
        db_prefix: str,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        compression: str | None = None,
        fsync: bool = True,
        async_save: bool = False,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        delta: bool = True,
    ) -> None:
        if db_type != "zarr":
            raise JobDefinitionError(f"unsupported db_type {db_type!r}: daskjobs checkpoints are 'zarr'")
        for label, value in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise JobDefinitionError(f"{label} must be a positive int or None, got {value!r}")
        if best_mode not in ("min", "max"):
            raise JobDefinitionError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and not (isinstance(best_metric, str) and best_metric):
            raise JobDefinitionError(
                f"keep_best={keep_best} needs best_metric, the name of a metric logged with ws.log, got {best_metric!r}"
            )
        self.db_prefix = str(db_prefix)
        self.db_type = db_type
        self.store = CheckpointStore(self.db_prefix, storage_options, compression=compression, fsync=fsync)
        self._handler: MetadataHandler = metadata_handler or CommitRecordHandler(self.store)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.keep_best, self.best_metric, self.best_mode = keep_best, best_metric, best_mode
        self._best_values: dict[int, float | None] = {}
        self.async_save = bool(async_save)
        self.delta = bool(delta)
        self._last_record: dict[str, Any] | None = None
        self._pending: tuple[int, dict[str, bool], dict[str, float], dict[str, float]] | None = None
        self.last_commit_bytes = 0
        self.last_commit_written = 0
        self.last_commit_reused = 0
        self._nodes: list[str] | None = None
        self._initialised_nodes: list[str] | None = None
        self._job_name = "job"
        self._save_ids: dict[int, str] = {}
        self._save_tasks: dict[int, list[Task]] = {}
        self._stats: dict[str, int] = {}
        self._blob_names: dict[str, list[str]] = {}
        self._entries: dict[int, dict[str, dict[str, Any]]] = {}
        self._retire: list[int] = []
        self._staged: set[int] = set()
        self.holds_lock = False
        """Whether a runner holds the prefix's writer lock for this manager (set by the runner)."""
        self._newest_seen: int | None = None
        self.last_commit: dict[str, Any] | None = None
        """The commit record written last by this manager."""

    # -- parameters -----------------------------------------------------------------------
    def _node_names(self, nodes: Iterable[str | Node]) -> list[str]:
        return [validate_name(str(n), "node") for n in nodes]

    def set_params(
        self,
        nodes: Sequence[str | Node],
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        job_name: str | None = None,
    ) -> None:
        """Record the checkpointed nodes (and the job's name) and tell the metadata handler."""
        self._nodes = self._node_names(nodes)
        self._newest_seen = None
        if job_name is not None:
            self._job_name = validate_name(job_name, "job")
        self._handler.set_params(
            db_prefix=self.db_prefix,
            db_type=self.db_type,
            node_names=list(self._nodes),
            path_prefix=path_prefix,
            path_type=path_type,
        )

    def nodes(self) -> list[str]:
        """The checkpointed nodes (after :meth:`init` or :meth:`set_params`)."""
        if self._nodes is None:
            raise RuntimeError("checkpoint manager has no nodes yet: call init() or set_params() first")
        return list(self._nodes)

    def get_ckpt_db_name(self, node_name: str, epoch: int) -> str:
        """The checkpoint name of ``node_name`` at ``epoch``: ``db_name(epoch, node_name, db_prefix)``."""
        return db_name(epoch, str(node_name), self.db_prefix)

    # -- handler pass-throughs --------------------------------------------------------------
    def get_resume_from_epoch_id(self, user_epoch: int | None = None) -> int | None:
        """The epoch to resume from (the handler's answer), after checking the prefix holds this job."""
        self._check_same_job()
        return self._handler.last_epoch(user_epoch=user_epoch)

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether checkpoint storage is reachable (the handler's answer)."""
        return self._handler.cp_accessible(epoch)

    def _check_same_job(self) -> None:
        latest = self.store.latest_commit()
        if latest is None or self._nodes is None:
            return
        if latest["job"] != self._job_name or sorted(latest["nodes"]) != sorted(self._nodes):
            raise CheckpointError(
                f"{self.store.url} holds checkpoints of job {latest['job']!r} with nodes {latest['nodes']} "
                f"(latest epoch {latest['epoch']}), but this job is {self._job_name!r} with nodes {self._nodes}; "
                "use another db_prefix or delete the old checkpoints"
            )

    # -- task groups ----------------------------------------------------------------------
    def _group(self, make_task: Any, workspace_type: WorkspaceType = WorkspaceType.GLOBAL) -> TaskGroup:
        group = TaskGroup(workspace_type)
        for node in self.nodes():
            make_task(group, node)
        return group

    def _entry_group(self, epoch: int, make_step: Callable[[str], Any], name: str) -> TaskGroup:
        """A PRIVATE group of one task per node whose output is that node's checkpoint entry;
        :meth:`_commit` reads the entries of ``epoch`` from those tasks."""
        tasks: list[Task] = []
        group = self._group(
            lambda g, node: tasks.append(Task(make_step(node), group=g, node=node, name=name, outputs=ENTRY_BLOB)),
            WorkspaceType.PRIVATE,
        )
        self._save_tasks[epoch] = tasks
        return group

    def init(
        self,
        nodes: Sequence[str | Node] | None = None,
        retrieve_from_epoch: int | None = None,
        path_prefix: str | None = None,
        path_type: str | None = None,
    ) -> TaskGroup:
        """A group checking, on each node, that the prefix is writable (or ``retrieve_from_epoch`` readable)."""
        if nodes is not None:
            names = self._node_names(nodes)
            if self._initialised_nodes is not None and names != self._initialised_nodes:
                raise JobDefinitionError(
                    f"checkpoint manager was initialised for nodes {self._initialised_nodes}, not {names}"
                )
            self._nodes = self._initialised_nodes = names
        if path_type not in (None, "zarr"):
            raise JobDefinitionError(f"unsupported path_type {path_type!r}: daskjobs checkpoints are 'zarr'")
        return self._group(
            lambda group, node: Task(
                CheckStep(self.store, node, retrieve_from_epoch), group=group, node=node, name="checkpoint_init"
            )
        )

    def save(self, epoch: int) -> TaskGroup:
        """A group writing every checkpointed node's GLOBAL workspace for ``epoch``.

        The epoch is committed by :meth:`write_checkpoint_metadata` after the group ran (with
        ``async_save``, by the :meth:`flush` after the background writes finished).
        """
        if self._pending is not None:
            raise CheckpointError(
                f"epoch {self._pending[0]} is still being written: flush() before saving epoch {epoch}"
            )
        save_id, store, previous = self._new_save(epoch)
        if self.async_save:
            return self._group(
                lambda g, node: Task(
                    AsyncSaveStep(store, node, epoch, save_id, previous.get(node)),
                    group=g,
                    node=node,
                    name="checkpoint_save",
                )
            )
        return self._entry_group(
            epoch, lambda node: SaveStep(store, node, epoch, save_id, previous.get(node)), "checkpoint_save"
        )

    def _new_save(self, epoch: int) -> tuple[str, CheckpointStore, dict[str, dict[str, Any]]]:
        """A new save id for ``epoch``, the store to write it to and the node entries to reuse
        chunks from (delta); refuses to overwrite a commit."""
        committed = self._committed_at_least(epoch)
        if epoch in committed and epoch not in self._retire:
            raise CheckpointError(
                f"epoch {epoch} is already committed under {self.store.url}; a committed checkpoint is never "
                f"overwritten: delete it first, or resume from an earlier epoch (which retires newer commits)"
            )
        if not committed and self._newest_seen is not None and self._newest_seen >= 0:
            committed = [self._newest_seen]
        # Never reuse from a commit that is about to be retired (its files may go while we link them).
        previous = self._previous_entries(epoch, [e for e in committed if e not in self._retire])
        self._save_ids[epoch] = uuid.uuid4().hex
        self._entries.pop(epoch, None)
        if epoch in self._retire:  # its place still holds a commit that is kept until ours
            self._staged.add(epoch)
            return self._save_ids[epoch], self._staging(), previous
        self._staged.discard(epoch)
        return self._save_ids[epoch], self.store, previous

    def _committed_at_least(self, epoch: int) -> list[int]:
        """The committed epochs, or ``[]`` when ``epoch`` is provably newer than all of them.

        While :attr:`holds_lock` (no other writer), the newest commit seen is remembered, so a
        save of a new epoch costs no listing (a listing grows with the number of commits).
        """
        if self.holds_lock and self._newest_seen is not None and epoch > self._newest_seen:
            return []
        epochs = self.store.committed_epochs()
        self._newest_seen = max(epochs, default=-1)
        return epochs

    def _staging(self) -> CheckpointStore:
        return CheckpointStore(
            f"{self.store.url}/{_STAGING}",
            self.store.storage_options,
            compression=self.store.compression,
            fsync=self.store.fsync,
        )

    def finish_hooks(self, epoch: int) -> dict[str, Callable[[Any], Any]]:
        """Per node, a hook that saves ``epoch`` at the end of the epoch's own Dask task.

        Pass them to :meth:`~daskjobs.Session.run_group` (``finish=``) with the epoch group and
        the results to :meth:`accept_finished`: the save then costs no round trip of its own.
        With ``async_save`` each hook first waits, on its node, for the save in flight.
        """
        in_flight = None if self._pending is None else self._save_ids.get(self._pending[0])
        save_id, store, previous = self._new_save(epoch)
        if self.async_save:
            return {
                n: AsyncSaveFinish(store, n, epoch, save_id, in_flight, previous.get(n)) for n in self.nodes()
            }
        return {n: SaveFinish(store, n, epoch, save_id, previous.get(n)) for n in self.nodes()}

    def accept_finished(self, epoch: int, results: dict[str, Any]) -> dict[int, CheckpointWriteError]:
        """Take what the hooks of :meth:`finish_hooks` returned for ``epoch``; return failed saves by epoch.

        Synchronous saves: ``epoch`` is then ready for :meth:`write_checkpoint_metadata`.
        Asynchronous: the save that was in flight (which the hooks waited for) is committed now,
        with the values given to :meth:`write_checkpoint_metadata` for it, and ``epoch`` is
        in flight once :meth:`write_checkpoint_metadata` is called for it.

        A failed epoch is not committed and its save is forgotten: save ``epoch`` again with
        :meth:`save`; an asynchronous save that failed in the background is lost (its
        snapshot is gone).
        """
        failed: dict[int, CheckpointWriteError] = {}
        missing = sorted(set(self.nodes()) - set(results))
        if missing:
            self._forget_save(epoch)
            failed[epoch] = CheckpointWriteError(f"epoch {epoch}: no save result from nodes {missing}")
        elif not self.async_save:
            self._take_entries(epoch, dict(results), failed)
            return failed
        if self._pending is not None:
            pending, self._pending = self._pending, None
            outcomes = {n: (r or {}).get("previous") for n, r in results.items()}
            if self._take_entries(pending[0], outcomes, failed):
                try:
                    self._commit(*pending)
                except CheckpointWriteError as exc:
                    failed[pending[0]] = exc
        starts = {n: r["error"] for n, r in results.items() if r and r.get("error") is not None}
        if starts and epoch not in failed:
            self._forget_save(epoch)
            failed[epoch] = self._write_error(epoch, starts)
        return failed

    def _take_entries(self, epoch: int, outcomes: dict[str, Any], failed: dict[int, CheckpointWriteError]) -> bool:
        bad = {n: (o or {}).get("error", "no result") for n, o in outcomes.items() if "entry" not in (o or {})}
        if bad:
            self._forget_save(epoch)
            failed[epoch] = self._write_error(epoch, bad)
            return False
        self._entries[epoch] = {n: o["entry"] for n, o in outcomes.items()}
        return True

    @staticmethod
    def _write_error(epoch: int, failed: dict[str, Any]) -> CheckpointWriteError:
        detail = "; ".join(f"node {n!r}: {e}" for n, e in sorted(failed.items()))
        error = CheckpointWriteError(f"saving epoch {epoch} failed on {len(failed)} node(s): {detail}")
        first = next(iter(failed.values()))
        error.__cause__ = first if isinstance(first, BaseException) else None
        return error

    def _forget_save(self, epoch: int) -> None:
        self._save_ids.pop(epoch, None)
        self._entries.pop(epoch, None)

    def _previous_entries(self, epoch: int, committed: list[int]) -> dict[str, dict[str, Any]]:
        """The node entries of the newest committed epoch before ``epoch`` (for delta reuse); {} without."""
        older = [e for e in committed if e < epoch]
        if not self.delta or not older:
            return {}
        record = self._last_record
        if record is None or record["epoch"] != older[-1]:
            try:
                record = self.store.read_commit(older[-1])
            except CheckpointError as exc:  # an unreadable commit is never reused from: write everything
                logger.warning("not reusing chunks of epoch %d: %s", older[-1], exc)
                return {}
        return dict(record["node_entries"])

    def flush(self, session: Session) -> int | None:
        """Wait for an asynchronous save to finish on every node and commit it; return its epoch."""
        if self._pending is None:
            return None
        epoch = self._pending[0]
        save_id = self._save_ids[epoch]
        group = self._entry_group(epoch, lambda node: WaitSaveStep(node, epoch, save_id), "checkpoint_wait")
        session.run_group(group, job=self._job_name, epoch=epoch)
        pending, self._pending = self._pending, None
        self._commit(*pending)
        return epoch

    def discard_pending(self) -> None:
        """Forget an asynchronous save that will not be committed (its node was lost, or saving gave up)."""
        if self._pending is not None:
            self._forget_save(self._pending[0])
            self._pending = None

    def pending_epoch(self) -> int | None:
        """The epoch whose asynchronous save is written but not yet committed."""
        return None if self._pending is None else self._pending[0]

    def _commit_of(self, epoch: int, path_prefix: str | None = None) -> tuple[CheckpointStore, dict[str, Any]]:
        store = self.store if not path_prefix else CheckpointStore(path_prefix, self.store.storage_options)
        return store, store.read_commit(epoch)

    def load(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> TaskGroup:
        """A group restoring every checkpointed node's workspace to committed ``epoch``, verified."""
        store, record = self._commit_of(epoch, path_prefix)
        missing = [n for n in self.nodes() if n not in record["nodes"]]
        if missing:
            raise CheckpointError(
                f"epoch {epoch} under {store.url} has no checkpoint for nodes {missing}; it holds {record['nodes']}"
            )
        entries = record["node_entries"]
        if store is self.store:
            self._last_record = record
        self._blob_names = {n: sorted(entries[n]["blobs"]) for n in self.nodes()}
        self._stats = {self.get_ckpt_db_name(n, epoch): int(entries[n].get("seconds", 0) * 1e9) for n in self.nodes()}
        return self._group(
            lambda g, node: Task(
                LoadStep(store, node, epoch, entries[node]), group=g, node=node, name="checkpoint_load"
            )
        )

    def load_blobs_from_checkpoint(self, blob_names: Sequence[str], epoch: int) -> TaskGroup:
        """A group loading only ``blob_names`` (skipping names a node lacks) from committed ``epoch``."""
        return self._partial_load(self.store.read_commit(epoch), blob_names)

    def _partial_load(self, record: dict[str, Any], blob_names: Sequence[str]) -> TaskGroup:
        names = tuple(validate_name(b, "blob") for b in blob_names)
        entries, epoch = record["node_entries"], record["epoch"]
        return self._group(
            lambda g, node: Task(
                LoadStep(self.store, node, epoch, entries[node], names),
                group=g,
                node=node,
                name="checkpoint_partial_load",
            )
        )

    def _complete_commit(self, epoch: int) -> dict[str, Any] | None:
        """The commit record of ``epoch`` if it holds every checkpointed node, else ``None``."""
        try:
            record = self.store.read_commit(epoch)
        except CheckpointNotFoundError:
            return None
        return record if all(n in record["nodes"] for n in self.nodes()) else None

    def check_db_exists(self, epoch: int) -> bool:
        """Whether ``epoch`` is committed and holds every checkpointed node."""
        return self._complete_commit(epoch) is not None

    def load_blobs_locally(
        self, nodes: Sequence[str | Node], blob_names: Sequence[str], epoch: int, session: Session
    ) -> bool:
        """Load ``blob_names`` of ``epoch`` into ``nodes``' workspaces in ``session``.

        Returns ``False`` and loads nothing if any node has no committed checkpoint for ``epoch``.
        """
        names = self._node_names(nodes)
        if self._nodes is not None and sorted(names) != sorted(self._nodes):
            raise JobDefinitionError(f"checkpoint manager is set up for nodes {self._nodes}, not {names}")
        self._nodes = names
        record = self._complete_commit(epoch)
        if record is None:
            return False
        started = time.perf_counter()
        session.run_group(self._partial_load(record, blob_names), job=self._job_name)
        elapsed = int((time.perf_counter() - started) * 1e9)
        self._stats = {self.get_ckpt_db_name(n, epoch): elapsed for n in names}
        return True

    # -- commit ---------------------------------------------------------------------------
    def write_checkpoint_metadata(
        self,
        epoch: int,
        *,
        stop_values: dict[str, bool] | None = None,
        timings: dict[str, float] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Commit ``epoch`` (after its save group ran): write the commit record last, then retention.

        ``metrics`` (the epoch's metric means) go into the commit record. With ``async_save``
        the commit waits for :meth:`flush` (or the next epoch's save hooks).
        """
        if self.async_save:
            if epoch not in self._save_ids:
                raise RuntimeError(f"no save of epoch {epoch} to commit: run manager.save({epoch}) in a session first")
            self._pending = (epoch, dict(stop_values or {}), dict(timings or {}), dict(metrics or {}))
            return
        self._commit(epoch, stop_values or {}, timings or {}, metrics or {})

    def _commit(
        self, epoch: int, stop_values: dict[str, bool], timings: dict[str, float], metrics: dict[str, float]
    ) -> None:
        entries = self._entries.pop(epoch, None)
        if entries is None:
            tasks = self._save_tasks.pop(epoch, None)
            if tasks is None:
                raise RuntimeError(f"no save of epoch {epoch} to commit: run manager.save({epoch}) in a session first")
            entries = {task.node: json.loads(task.outputs()[0].fetch().tobytes()) for task in tasks}
        save_id = self._save_ids.pop(epoch)
        stale = [n for n, e in entries.items() if e.get("save_id") != save_id]
        if stale:
            raise CheckpointError(
                f"epoch {epoch}: nodes {stale} returned entries of another save; not committing; save the epoch again"
            )
        record = make_commit_record(self._job_name, epoch, entries, stop_values, timings, metrics=metrics)
        if self.best_metric is not None:
            record["best"] = {"metric": self.best_metric, "mode": self.best_mode}
        if self._retire:
            self._retire_newer(epoch)
        if epoch in self._staged:
            self._adopt_staged(epoch, list(entries))
        self.store.commit(record)
        self._last_record = record
        self._best_values[epoch] = record["metrics"].get(self.best_metric) if self.best_metric else None
        self._newest_seen = max(epoch, -1 if self._newest_seen is None else self._newest_seen)
        self.last_commit = record
        self.last_commit_bytes = sum(e["bytes"] for e in record["node_entries"].values())
        self.last_commit_written = sum(e["bytes_written"] for e in record["node_entries"].values())
        self.last_commit_reused = sum(e["bytes_reused"] for e in record["node_entries"].values())
        self._blob_names = {n: sorted(e["blobs"]) for n, e in entries.items()}
        self._stats = {self.get_ckpt_db_name(n, epoch): int(e.get("seconds", 0) * 1e9) for n, e in entries.items()}
        self._handler.write(epoch=epoch)
        self._retention_warning(epoch)

    def _retention_warning(self, newest: int) -> None:
        try:
            self._apply_retention(newest)
        except Exception as exc:
            logger.warning(
                "epoch %d is committed, but retention under %s failed: %s; it is retried after the next commit",
                newest,
                self.store.url,
                exc,
            )

    # -- resuming from an older epoch ------------------------------------------------------
    def resume_older(self, epoch: int) -> list[int]:
        """Prepare to resume from committed ``epoch`` while newer epochs are committed.

        Nothing is deleted now: the newer commits stay until the first new epoch is committed.
        That epoch's groups are written to a staging folder under ``__daskjobs__/``; right
        before its commit record is written, the newer epochs are retired (newest first, one
        warning listing them) and the staged groups moved into place. Returns the newer epochs.
        """
        self._retire = [e for e in self.store.committed_epochs() if e > epoch]
        self._staged = set()
        self._clear_staging()
        return list(self._retire)

    def _clear_staging(self) -> None:
        staging = self._staging()
        fs, root = fsspec.core.url_to_fs(staging.url, **self.store.storage_options)
        if fs.exists(root):
            fs.rm(root, recursive=True)

    def _retire_newer(self, epoch: int) -> None:
        """Delete the commits newer than the resumed epoch, newest first, right before ``epoch`` commits."""
        retired = sorted(self._retire, reverse=True)
        for old in retired:
            record = self.store.read_commit(old)
            self.store.delete_epoch(old, record["nodes"])
        logger.warning(
            "resumed from an older epoch: retired the newer committed epochs %s under %s now that epoch %d commits",
            sorted(retired),
            self.store.url,
            epoch,
        )
        self._retire = []

    def _adopt_staged(self, epoch: int, nodes: list[str]) -> None:
        """Move ``epoch``'s groups from the staging folder to their place (a rename on local disks)."""
        self._staged.discard(epoch)
        staging = self._staging()
        for node in nodes:
            fs, source = fsspec.core.url_to_fs(staging.db_name(node, epoch), **self.store.storage_options)
            target = fsspec.core.url_to_fs(self.store.db_name(node, epoch), **self.store.storage_options)[1]
            if fs.exists(target):
                fs.rm(target, recursive=True)
            if isinstance(fs, LocalFileSystem):
                os.rename(source, target)
                if self.store.fsync:
                    fsync_path(os.path.dirname(target))
            else:
                fs.mv(source, target, recursive=True)

    def _apply_retention(self, newest: int) -> None:
        """Delete committed epochs that retention does not keep; failures are logged warnings."""
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return
        try:
            epochs = self.store.committed_epochs()
            best = self._best_epochs(epochs) if self.keep_best is not None else []
        except OSError as exc:
            logger.warning("retention: could not list the epochs under %s: %s", self.store.url, exc)
            return
        keep = {newest}
        if self.keep_last is not None:
            keep.update(epochs[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(e for e in epochs if e % self.keep_every == 0)
        keep.update(best)
        for epoch in epochs:
            if epoch < newest and epoch not in keep:
                try:
                    self.store.delete_epoch(epoch, self.store.read_commit(epoch)["nodes"])
                except Exception as exc:  # the new epoch is committed: never fail the save for this
                    logger.warning("retention: could not delete epoch %d under %s: %s", epoch, self.store.url, exc)
                    if isinstance(exc, CheckpointLockedError):
                        return
                    continue
                logger.info("retention: deleted epoch %d under %s", epoch, self.store.url)

    def _best_epochs(self, epochs: list[int]) -> list[int]:
        """The ``keep_best`` best of ``epochs`` by ``best_metric``; each commit record is read once per manager."""
        known = self._best_values
        self._best_values = {
            e: known[e] if e in known else self.store.read_commit(e).get("metrics", {}).get(self.best_metric)
            for e in epochs
        }
        return best_epochs(self._best_values, self.best_mode)[: self.keep_best]

    def stop_values(self, epoch: int) -> dict[str, bool]:
        """The stop-condition values recorded when ``epoch`` was committed."""
        return dict(self.store.read_commit(epoch).get("stop_values", {}))

    def discard_after(self, epoch: int) -> list[int]:
        """Un-commit epochs newer than ``epoch`` (a run resumed from an earlier epoch rewrites them)."""
        newer = [e for e in self.store.committed_epochs() if e > epoch]
        for later in newer:
            self.store.uncommit(later)
        if newer:
            logger.warning(
                "resuming from epoch %d: discarded newer committed epochs %s under %s", epoch, newer, self.store.url
            )
        return newer

    # -- statistics -----------------------------------------------------------------------
    def report_checkpoint_stats(self, action_name: str) -> None:
        """Pass the durations (ns) of the last save or load, by checkpoint name, to the handler."""
        self._handler.report(action_name, dict(self._stats))

    def blob_list(self) -> dict[str, list[str]]:
        """Blob names per node in the last checkpoint saved or loaded."""
        if not self._blob_names:
            raise RuntimeError("no checkpoint saved or loaded yet by this manager")
        return {n: list(b) for n, b in self._blob_names.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(db_prefix={self.store.url!r}, nodes={self._nodes})"

    def _repr_html_(self) -> str:
        epochs = self.store.committed_epochs()
        options = {
            "nodes": self._nodes,
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": self.keep_best and f"{self.keep_best} by {self.best_mode} {self.best_metric}",
            "async_save": self.async_save or None,
        }
        facts = "".join(f", {k}={html.escape(str(v))}" for k, v in options.items() if v)
        latest = ""
        if epochs:
            metrics = self.store.read_commit(epochs[-1]).get("metrics", {})
            shown = "".join(f" {html.escape(k)}={v:.6g}" for k, v in metrics.items())
            listed = ", ".join(map(str, epochs)) if len(epochs) <= 12 else f"{epochs[0]} &hellip; {epochs[-1]}"
            latest = f" ({listed}); latest {epochs[-1]}{shown}"
        return (
            f"<b>{type(self).__name__}</b> <code>{html.escape(self.store.url)}</code>{facts}: "
            f"{len(epochs)} committed epochs{latest}"
        )


class CheckpointManager(MultiNodeCheckpointManager):
    """Checkpoints one node's workspace; see :class:`MultiNodeCheckpointManager`.

    Examples
    --------
    >>> import daskjobs as dj, tempfile
    >>> dj.CheckpointManager(tempfile.mkdtemp(), "trainer").nodes()
    ['trainer']
    """

    def __init__(
        self,
        db_prefix: str,
        node_name: str | Node,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        **options: Any,
    ) -> None:
        super().__init__(db_prefix, db_type, metadata_handler, **options)
        self.node_name = validate_name(str(node_name), "node")
        self._nodes = [self.node_name]

    def _node_names(self, nodes: Iterable[str | Node]) -> list[str]:
        names = super()._node_names(nodes)
        if len(names) > 1 or (names and names[0] != self.node_name):
            raise JobDefinitionError(
                f"CheckpointManager checkpoints only node {self.node_name!r}, got {names}; "
                "use MultiNodeCheckpointManager for several nodes"
            )
        return [self.node_name]

    def set_params(
        self,
        nodes: Sequence[str | Node],
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        job_name: str | None = None,
    ) -> None:
        """As :meth:`MultiNodeCheckpointManager.set_params`; ``nodes`` is ignored (always this node)."""
        super().set_params([self.node_name], path_prefix, path_type, job_name=job_name)

    def blob_list(self) -> list[str]:  # type: ignore[override]
        """Blob names in the last checkpoint saved or loaded."""
        return super().blob_list()[self.node_name]
