"""The multi-node checkpoint manager: its options, its init, save and commit groups, the writer lock a
run holds for its commit pipeline (``writing``) and its statistics; which nodes it checkpoints
(:mod:`.nodes`), how it loads (:mod:`.loads`) and resumes (:mod:`.resumes`) is mixed in."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..._model.group import TaskGroup
from ..._model.node import Node
from ..._model.task import Task, WorkspaceType
from ...errors import JobDefinitionError
from .._format.naming import db_name, get_ckpt_filename
from .._format.records import record_bytes
from .._node.fork import resolve_snapshot
from .._node.load_steps import CheckStep
from .._protocol.lock import local_holder
from .._protocol.retention import DEFAULT_FULL_EVERY, Retention, best_epochs, check_full_every, writes_in_full
from .._protocol.store import CheckpointStore
from .last import LastCheckpoint
from .ledger import PendingCommit
from .loads import Loads
from .memory import memory_options
from .metadata import CommitRecordHandler, MetadataHandler
from .nodes import CheckpointedNodes
from .pipeline import CommitPipeline
from .resumes import Resumes
from .saving import OnCommit, OnMemoryCommit, SavePolicy
from .tiered import TieredPipeline
from .views import prefix_html
from .writer import EpochWriter, node_group

if TYPE_CHECKING:
    from ...session import Session
    from .._format.documents import CommitRecord, EntryRef

__all__ = [
    "MultiNodeCheckpointManager",
    "best_epochs",
    "db_name",
    "get_ckpt_filename",
    "overrides",
]

logger = logging.getLogger("daskjobs")


def overrides(manager: MultiNodeCheckpointManager, method: str) -> bool:
    """Whether ``manager``'s class overrides ``method`` (``"save"``, ``"load"``, ``"init"``): a runner
    then runs the group it returns, as in Caffe2, instead of its own equivalent."""
    return getattr(type(manager), method) is not getattr(MultiNodeCheckpointManager, method)


class MultiNodeCheckpointManager(CheckpointedNodes, Resumes, Loads):
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
        with ``ws.log``; default ``"loss"`` when ``keep_best`` is given; epochs without it never
        count as best; ties keep the earlier epoch). The
        kept sets of ``keep_last``, ``keep_every`` and ``keep_best`` are united, and the newest
        committed epoch is always kept. ``keep_best`` alone keeps the best ``keep_best`` and the
        newest. With ``best_metric`` set (also without ``keep_best``) commit records name the
        metric and mode, so ``dj.open_checkpoint(prefix, epoch="best")`` finds the same best epoch.
    compression
        ``None`` (default, fastest) or a compressor name the store supports.
    async_save
        Snapshot each node's workspace at the epoch boundary and write it in the background
        while the next epoch runs (at most one save in flight; the epoch is committed once its
        write finished, at the next save or before the job ends).
    async_snapshot
        How an asynchronous save takes its snapshot. ``"fork"``: the node's process forks and the
        child writes its copy-on-write image of the workspace (a stall of about a millisecond;
        memory only for pages changed in place while the child writes); needs Linux and a
        local-disk prefix, else ``ValueError``. ``"copy"``: every array is copied (a stall of one
        memory copy; memory for one copy of every workspace) and written by a thread. ``"auto"``
        (default): ``"fork"`` where it is possible and a node's arrays hold at least 16 MiB
        (below that a copy is cheaper than a fork), else ``"copy"``.
    delta
        Delta checkpoints (default on): a chunk whose XXH3-128 digest equals the same chunk of
        the previous committed epoch is hard-linked (server-side copied on object stores)
        instead of written. Every epoch stays a complete group, verifiable on its own, also
        after retention deleted the epoch it reused from. Epochs that share a file also share
        its damage: see ``full_every``.
    full_every
        With ``delta``: every epoch divisible by ``full_every`` (default 10; ``0``: none), and
        every epoch ``keep_every`` keeps, is written in full, sharing no file with an earlier
        epoch. A damaged file then spoils at most the epochs from the last full one before it to
        the next full one; ``daskjobs checkpoints verify`` names them and the newest epoch that
        still verifies.
    in_memory
        Tier 0 (default off): every epoch, each node's snapshot (every blob, JSON value and
        reader position, as a save writes it) is kept in the memory of its own worker and of
        ``replicas`` other workers, as Dask data of the run's client; an epoch is committed in
        memory once every snapshot is held there. A lost worker's nodes are restored from the
        newest epoch committed in memory whose snapshots all survive, reading nothing from the
        prefix (else from the newest durable commit); a worker that retires gracefully hands its
        snapshots to others (Dask moves them). Durable commits under ``db_prefix`` (same format,
        verification, retention and delta as always) are written from the snapshot in the
        background at epoch 0, every ``durable_every`` epochs, ``durable_interval`` seconds after
        the last one, at the last epoch, at a graceful stop and before the download, exit and
        upload groups. Losing the driver loses the memory: a re-run resumes from the newest durable
        commit, repeating fewer than ``2 * durable_every`` epochs. :func:`list_checkpoints`,
        :func:`open_checkpoint`, resume and the command line see durable commits only. Not with
        ``async_save`` (durable writes from the snapshot are asynchronous already).
    durable_every
        With ``in_memory``: every epoch divisible by it is also committed durably (default 10).
    replicas
        With ``in_memory``: how many workers besides a node's own hold a copy of its snapshot
        (default 1; ``0``: a lost worker falls back to the durable commits). With fewer workers
        in the cluster, fewer (a warning says so).
    durable_interval
        With ``in_memory``: an epoch at least this many seconds after the last durable one is
        committed durably too (default: none).

    ``db_prefix=None`` with ``in_memory=True`` checkpoints in cluster memory only: a lost worker
    is recovered from, but nothing is written and a lost driver cannot be resumed from.

    Examples
    --------
    >>> import daskjobs as dj, tempfile
    >>> manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp())
    >>> manager.get_ckpt_db_name("ps", 3).endswith("/ps.3")
    True
    >>> tiered = dj.MultiNodeCheckpointManager(tempfile.mkdtemp(), in_memory=True, durable_every=10)
    >>> tiered.memory_options.replicas, tiered.memory_options.durable_every
    (1, 10)
    """

    def __init__(
        self,
        db_prefix: str | None,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        compression: str | None = None,
        fsync: bool = True,
        async_save: bool = False,
        async_snapshot: str = "auto",
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        delta: bool = True,
        full_every: int = DEFAULT_FULL_EVERY,
        in_memory: bool = False,
        durable_every: int | None = None,
        replicas: int | None = None,
        durable_interval: float | None = None,
    ) -> None:
        if db_type != "zarr":
            raise JobDefinitionError(f"unsupported db_type {db_type!r}: daskjobs checkpoints are 'zarr'")
        self.memory_options = memory_options(
            in_memory, durable_every, replicas, durable_interval, has_prefix=db_prefix is not None
        )
        """Tier 0's options (``None``: checkpoints are durable only, see ``in_memory``)."""
        if self.memory_options is not None and async_save:
            raise JobDefinitionError(
                "async_save with in_memory=True: tier 0 already writes its durable commits from the snapshot in "
                "the background; drop async_save"
            )
        self.retention = Retention(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.durable = db_prefix is not None
        """Whether epochs are committed under a prefix (``False``: ``db_prefix=None``, tier 0 only)."""
        self.db_prefix = str(db_prefix) if db_prefix is not None else f"memory://daskjobs-no-prefix-{uuid.uuid4().hex}"
        self.db_type = db_type
        self.store = CheckpointStore(self.db_prefix, storage_options, compression=compression, fsync=fsync)
        """The prefix's ``CheckpointStore``: its commit records, groups and writer lock (with
        ``db_prefix=None``, a private stand-in in this process that never holds a commit)."""
        self._handler: MetadataHandler = metadata_handler or CommitRecordHandler(self.store)
        self.async_save = bool(async_save)
        self.async_snapshot = resolve_snapshot(async_snapshot, self.store)
        """``"fork"``, ``"copy"`` or ``"auto"``: how asynchronous saves take their snapshot
        (``"auto"`` where forking is possible at all, else ``"copy"``)."""
        self.delta = bool(delta)
        self.full_every = check_full_every(full_every)
        """With ``delta``: every epoch divisible by it (and every epoch ``keep_every`` keeps) is written in full."""
        self._fresh = False
        """Whether the next run starts from epoch 0 although epochs are committed (see :meth:`start_fresh`)."""
        self._nodes: list[str] | None = None
        self._initialised_nodes: list[str] | None = None
        self._job_name = "job"
        self._job_named = False
        """Whether :meth:`set_params` was given the job's name (else a resume adopts the prefix's)."""
        self._last = LastCheckpoint()
        self._writer: EpochWriter = EpochWriter(self, self._handler, self.retention, self._last)

    keep_last = property(lambda self: self.retention.keep_last, doc="Retention: the newest epochs kept.")
    keep_every = property(lambda self: self.retention.keep_every, doc="Retention: every epoch divisible by it is kept.")
    keep_best = property(lambda self: self.retention.keep_best, doc="Retention: the best epochs by metric kept.")
    best_metric = property(lambda self: self.retention.best_metric, doc="The metric best-k retention ranks by.")
    best_mode = property(lambda self: self.retention.best_mode, doc='``"min"`` or ``"max"``: which metric is best.')

    @property
    def last_commit(self) -> CommitRecord | None:
        """The commit record written last by this manager (``None``: none yet)."""
        return self._writer.last_commit

    @property
    def last_commit_bytes(self) -> int:
        """Bytes of the checkpoint committed last by this manager (0: none yet)."""
        return self._last_bytes()[0]

    @property
    def last_commit_written(self) -> int:
        """Bytes the save of the epoch committed last wrote (the rest it reused, see ``delta``)."""
        return self._last_bytes()[1]

    @property
    def last_commit_reused(self) -> int:
        """Bytes the save of the epoch committed last reused from the epoch before (delta)."""
        return self._last_bytes()[2]

    def _last_bytes(self) -> tuple[int, int, int]:
        record = self._writer.last_commit
        return (0, 0, 0) if record is None else record_bytes(record)

    # -- handler pass-throughs --------------------------------------------------------------
    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether checkpoint storage is reachable (the handler's answer)."""
        return self._handler.cp_accessible(epoch)

    # -- task groups ----------------------------------------------------------------------
    def _group(
        self,
        make_task: Callable[[TaskGroup, str], object],
        workspace_type: WorkspaceType = WorkspaceType.GLOBAL,
        nodes: list[str] | None = None,
    ) -> TaskGroup:
        return node_group(self.nodes() if nodes is None else nodes, make_task, workspace_type)

    def _remember(self, epoch: int, entries: Mapping[str, EntryRef], store: CheckpointStore | None = None) -> None:
        """Keep the durations of the node ``entries`` (or their summaries) of ``epoch`` just loaded, and
        where their blob names are (read only when :meth:`blob_list` asks)."""
        self._last.remember(store or self.store, epoch, entries, self.db_prefix)

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
        committed = retrieve_from_epoch is not None and retrieve_from_epoch in self.store.committed_epochs()
        return self._group(
            lambda group, node: Task(
                CheckStep(self.store, node, retrieve_from_epoch, committed),
                group=group,
                node=node,
                name="checkpoint_init",
            )
        )

    def save(self, epoch: int) -> TaskGroup:
        """A group writing every checkpointed node's GLOBAL workspace for ``epoch``.

        The epoch is committed by :meth:`write_checkpoint_metadata` after the group ran (with
        ``async_save``, by :meth:`flush` after the background writes finished).
        """
        return self._writer.save_group(epoch)

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
        the commit waits for :meth:`flush`.
        """
        self._writer.ask_commit(PendingCommit(epoch, dict(stop_values or {}), dict(metrics or {}), dict(timings or {})))

    def flush(self, session: Session) -> int | None:
        """With ``async_save``: wait for the save in flight to finish on every node and commit it;
        return its epoch (``None``: no save in flight)."""
        committed = self._writer.commit_in_flight(session)
        return None if committed is None else committed.epoch

    # -- writing under the lock -------------------------------------------------------------
    @contextmanager
    def writing(
        self,
        job: str,
        *,
        break_lock: bool = False,
        policy: SavePolicy | None = None,
        on_commit: OnCommit | None = None,
        on_memory_commit: OnMemoryCommit | None = None,
    ) -> Iterator[CommitPipeline]:
        """Hold the prefix's writer lock for ``job`` (this process) and yield the pipeline a run saves
        and commits its epochs through (its interface is daskjobs' own: :class:`~daskjobs.JobRunner`
        uses it). While the lock is held, commits are written while the next epoch runs and retention
        deletes in the background. On the way out the groups of the epochs retention dropped, and
        whatever the run left uncommitted, are deleted, then the lock is released (a failure to
        release is a warning naming the command that removes the lock). Inside a block of this
        manager's that holds the lock already, nothing is taken or released.

        ``policy`` decides what a failed save does (retries, then raise or warn; without one, the
        error is raised); ``on_commit(epoch, bytes_written, bytes_reused)`` is called for every commit,
        and with tier 0 ``on_memory_commit(epoch, tier0_bytes)`` for every commit in cluster memory.

        Raises
        ------
        CheckpointLockedError
            Another writer holds the prefix; the message names it. Nothing was written.

        Examples
        --------
        >>> import daskjobs as dj, tempfile
        >>> manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp())
        >>> with manager.writing("job") as pipeline:
        ...     manager.store.read_lock()["job"]
        'job'
        >>> manager.store.read_lock() is None
        True
        """
        writer = self._writer
        save_group = self.save if overrides(self, "save") else None
        if writer.locked:
            yield CommitPipeline(writer, policy, on_commit, save_group=save_group, nested=True)
            return
        self.store.acquire_lock(local_holder(job), break_lock=break_lock)
        writer.locked = True
        pipeline = (
            CommitPipeline(writer, policy, on_commit, save_group=save_group)
            if self.memory_options is None
            else TieredPipeline(writer, policy, on_commit, save_group=save_group, on_memory_commit=on_memory_commit)
        )
        try:
            yield pipeline
        finally:
            try:
                pipeline.close()
            finally:
                writer.locked = False
                try:
                    self.store.release_lock()
                except Exception as exc:
                    url = self.store.url
                    advice = f"run 'daskjobs checkpoints unlock {url}'"
                    logger.warning("could not release the writer lock of %s: %s; %s", url, exc, advice)

    # -- delta ---------------------------------------------------------------------------
    def reuses_chunks(self, epoch: int) -> bool:
        """Whether a save of ``epoch`` may reuse chunks of an earlier epoch: ``delta``, and not an
        epoch written in full (see ``full_every``)."""
        return self.delta and not writes_in_full(epoch, self.full_every, self.keep_every)

    # -- statistics -----------------------------------------------------------------------
    def report_checkpoint_stats(self, action_name: str) -> None:
        """Pass the durations (ns) of the last save or load, by checkpoint name, to the handler."""
        self._handler.report(action_name, dict(self._last.stats))

    def blob_list(self) -> dict[str, list[str]]:
        """Blob names per node in the last checkpoint saved or loaded (from its nodes' manifests)."""
        return self._last.blob_list()

    def __repr__(self) -> str:
        prefix = self.store.url if self.durable else None
        options = self.memory_options
        tier0 = (
            ""
            if options is None
            else f", in_memory=True, durable_every={options.durable_every}, replicas={options.replicas}"
        )
        return f"{type(self).__name__}(db_prefix={prefix!r}, nodes={self._nodes}{tier0})"

    def _repr_html_(self) -> str:
        options = {
            "nodes": self._nodes,
            **self.retention.describe(),
            "async_save": f"{self.async_snapshot} snapshots" if self.async_save else None,
        }
        if self.memory_options is not None:
            tier0 = self.memory_options
            options["in_memory"] = f"{tier0.replicas} replica(s), durable every {tier0.durable_every} epochs"
            if tier0.durable_interval is not None:
                options["durable_interval"] = f"{tier0.durable_interval:g} s"
        return prefix_html(type(self).__name__, self.store, options)
