"""How a manager writes its epochs to its prefix: each save started (its id, where it goes, what it
reuses), the node groups and hooks that write, flush, wait for and end saves, and an epoch's commit."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._execution.plan import GroupRunFailed
from ..._model.group import TaskGroup
from ..._model.task import Task, WorkspaceType
from ...errors import CheckpointError, CheckpointWriteError, InvalidStateError
from .._format.records import make_commit_record
from .._node.async_saves import AsyncSaveFinish, AsyncSaveStep, EndWrites, WaitSaveStep
from .._node.memory_steps import DurableWrite
from .._node.outcomes import SaveOutcome
from .._node.save_steps import ENTRY_BLOB, FlushFinish, ResaveFinish, SaveFinish, SaveStep, idle, reported
from .._node.sharing import unseen_groups
from .._protocol.retention import Retention, retention_warning
from .._protocol.staging import Staging
from .ledger import PendingCommit, Received, SaveLedger, StartedSave, write_error
from .saving import Hook

if TYPE_CHECKING:
    from ...session import Session
    from .._format.documents import CommitRecord
    from .._protocol.store import CheckpointStore
    from .last import LastCheckpoint
    from .manager import MultiNodeCheckpointManager
    from .metadata import MetadataHandler

logger = logging.getLogger("daskjobs")


def node_group(
    nodes: list[str], make_task: Callable[[TaskGroup, str], object], workspace_type: WorkspaceType
) -> TaskGroup:
    """A group of ``workspace_type`` holding what ``make_task(group, node)`` adds for each of ``nodes``."""
    group = TaskGroup(workspace_type)
    for node in nodes:
        make_task(group, node)
    return group


@dataclass(frozen=True)
class EpochHooks:
    """What :meth:`EpochWriter.hooks` made to save an epoch in its graph: the hooks, by node, and
    whether the epoch's commit may wait while the next epoch runs (see ``may_defer_commit``)."""

    hooks: dict[str, Hook]
    defer_commit: bool


class EpochWriter:
    """Writes the epochs of ``manager`` (its store, nodes, job name and save options, read when
    used): starts each save, builds the groups and hooks that write it, and commits it.

    :attr:`ledger` holds the saves started and not yet committed; :attr:`locked` says whether a
    run holds the prefix's writer lock (see ``MultiNodeCheckpointManager.writing``): retention
    then un-commits epochs with the commit (one fsync for both) and their groups are deleted later
    (:meth:`tidy`), and the newest commit is remembered instead of listed for every save.
    """

    def __init__(
        self,
        manager: MultiNodeCheckpointManager,
        handler: MetadataHandler,
        retention: Retention,
        last: LastCheckpoint,
    ) -> None:
        self.manager, self.handler, self.retention, self.last = manager, handler, retention, last
        self.ledger = SaveLedger()
        self.staging = Staging()
        self.locked = False
        self.nodes_delete = False
        """Whether the last hooks handed retired groups to the nodes (see :meth:`hooks`)."""
        self.newest_seen: int | None = None
        self.last_commit: CommitRecord | None = None
        self.done: list[int] = []
        """Epochs committed with the entries the ledger handed out, which it forgets when the next save
        starts (:meth:`new_save`) or the run ends (:meth:`forget_done`): till then, as if forgotten."""

    @property
    def store(self) -> CheckpointStore:
        return self.manager.store

    # -- groups ---------------------------------------------------------------------------
    def group(
        self,
        make_task: Callable[[TaskGroup, str], object],
        workspace_type: WorkspaceType = WorkspaceType.GLOBAL,
        nodes: list[str] | None = None,
    ) -> TaskGroup:
        """A group of one task per checkpointed node (of ``nodes``, default all)."""
        return node_group(self.manager.nodes() if nodes is None else nodes, make_task, workspace_type)

    def entry_group(
        self, epoch: int, make_step: Callable[[str], Any], name: str, nodes: list[str] | None = None
    ) -> TaskGroup:
        """A PRIVATE group of one task per node (of ``nodes``, default all) whose output is that node's
        checkpoint entry; the commit of ``epoch`` reads the entries from those tasks."""
        tasks: list[Task] = []
        group = self.group(
            lambda g, node: tasks.append(Task(make_step(node), group=g, node=node, name=name, outputs=ENTRY_BLOB)),
            WorkspaceType.PRIVATE,
            nodes,
        )
        self.ledger.tasks[epoch] = tasks
        return group

    def run_hooks(
        self, session: Session, name: str, finish: Mapping[str, Hook], epoch: int | None = None
    ) -> dict[str, object]:
        """Run ``finish`` (node -> hook) alone, in a small PRIVATE group on those nodes; return what the
        hooks returned, by node. A failed run raises its own error (a lost node, a lost scheduler)."""
        group = self.group(lambda g, node: Task(idle, group=g, node=node, name=name), WorkspaceType.PRIVATE, [*finish])
        try:
            return session.run_group(group, job=self.manager._job_name, epoch=epoch, finish=finish).finished
        except GroupRunFailed as failed:
            raise failed.error from None

    def flush_hooks(self, nodes: list[str]) -> dict[str, Hook]:
        """Hooks waiting for the nodes' background flushes (see ``FlushFinish``)."""
        return {node: FlushFinish() for node in nodes}

    def resave_hooks(self, epoch: int, nodes: list[str]) -> dict[str, Hook]:
        """Hooks writing again, durably, the nodes' groups of ``epoch`` whose background flush failed
        (see ``ResaveFinish``): same save, same entries once written."""
        save_id, entries = self.ledger.ids[epoch], self.ledger.entries[epoch]
        return {n: ResaveFinish(self.store, n, epoch, save_id, entries[n]) for n in nodes}

    def end_hooks(self) -> Hook:
        """What ends a node's background writes without using them (see ``EndWrites``)."""
        return EndWrites()

    # -- saves ----------------------------------------------------------------------------
    def save_group(self, epoch: int) -> TaskGroup:
        """A group writing every checkpointed node's GLOBAL workspace for ``epoch`` (see the
        manager's ``save``)."""
        in_flight = self.ledger.in_flight_epoch()
        if in_flight is not None:
            raise CheckpointError(f"epoch {in_flight} is still being written: flush() before saving epoch {epoch}")
        started, store = self.new_save(epoch)
        save_id, previous, manager = started.save_id, started.previous, self.manager
        if manager.async_save:
            return self.group(
                lambda g, node: Task(
                    AsyncSaveStep(store, node, epoch, save_id, previous.get(node), manager.async_snapshot),
                    group=g,
                    node=node,
                    name="checkpoint_save",
                )
            )
        return self.entry_group(
            epoch, lambda node: SaveStep(store, node, epoch, save_id, previous.get(node)), "checkpoint_save"
        )

    def hooks(self, epoch: int, nodes: list[str], *, flush_later: bool = False) -> EpochHooks:
        """Per node of ``nodes`` (the checkpointed ones), a hook that saves ``epoch`` at the end of the
        epoch's own Dask task.

        With ``async_save`` each hook first waits, on its node, for the save in flight.
        ``flush_later`` (while :attr:`may_defer_commit`, on a local disk): the nodes fsync their
        groups in the background (and write them there, for a small workspace, see
        ``SaveFinish``); their next hooks report the flushes. They also delete their groups of the
        epochs retention un-committed, in the background.
        """
        manager = self.manager
        reuses = manager.reuses_chunks(epoch)
        started, store = self.new_save(epoch, reuses=reuses)
        save_id, previous = started.save_id, started.previous
        if manager.async_save:
            snapshot, waits_for = manager.async_snapshot, started.in_flight_id
            return EpochHooks(
                {
                    n: AsyncSaveFinish(store, n, epoch, save_id, waits_for, previous.get(n), snapshot, reuses)
                    for n in nodes
                },
                defer_commit=False,
            )
        defer = self.may_defer_commit
        later = self.nodes_delete = flush_later and defer and self.store.defers_flush
        doomed = self.retention.retired.hand_out(nodes) if later else {}
        return EpochHooks(
            {
                n: SaveFinish(store, n, epoch, save_id, previous.get(n), flush_later=later, doomed=doomed.get(n, ()))
                for n in nodes
            },
            defer_commit=defer,
        )

    def durable_writes(self, epoch: int, nodes: list[str], *, background: bool) -> dict[str, DurableWrite]:
        """Per node of ``nodes``, how it writes its tier-0 snapshot of ``epoch`` under the prefix
        (see ``KeepFinish``): in the background while :attr:`may_defer_commit` and ``background``
        (the nodes' next hooks report the writes), else at once. On a local disk the nodes also
        delete (or write over) their groups of the epochs retention un-committed, as with
        :meth:`hooks`."""
        started, store = self.new_save(epoch)
        save_id, previous = started.save_id, started.previous
        later = background and self.may_defer_commit
        self.nodes_delete = later and self.store.defers_flush
        doomed = self.retention.retired.hand_out(nodes) if self.nodes_delete else {}
        return {
            n: DurableWrite(store, save_id, previous.get(n), background=later, doomed=doomed.get(n, ())) for n in nodes
        }

    @property
    def may_defer_commit(self) -> bool:
        """Whether a synchronous save's commit may be written while the next epoch runs: a run holds
        the lock, and no newer commits wait for this one to retire them (after a resume from an
        older epoch). The next save then reuses that epoch's chunks (delta)."""
        return self.locked and not self.manager.async_save and not self.staging.retire

    def new_save(self, epoch: int, *, reuses: bool | None = None) -> tuple[StartedSave, CheckpointStore]:
        """Start a save of ``epoch`` (its id and the node entries it reuses chunks from, delta, when
        ``reuses``: by default the manager's ``reuses_chunks``) and the store to write it to; refuses
        to overwrite a commit."""
        committed = self._committed_at_least(epoch)
        retire = self.staging.retire
        if epoch in committed and epoch not in retire:
            raise CheckpointError(
                f"epoch {epoch} is already committed under {self.store.url}; a committed checkpoint is never "
                f"overwritten: delete it first, or resume from an earlier epoch (which retires newer commits)"
            )
        if not committed and self.newest_seen is not None and self.newest_seen >= 0:
            committed = [self.newest_seen]
        if reuses is None:
            reuses = self.manager.reuses_chunks(epoch)
        # Never reuse from a commit that is about to be retired (its files may go while we link them).
        reusable = [e for e in committed if e not in retire] if reuses else None
        done, self.done = self.done, []
        started = self.ledger.begin(epoch, self.store, reusable, self.last.record, done=done)
        return started, self.staging.target(self.store, epoch)

    def _committed_at_least(self, epoch: int) -> list[int]:
        """The committed epochs, or ``[]`` when ``epoch`` is provably newer than all of them.

        While :attr:`locked` (no other writer), the newest commit seen is remembered, so a save of
        a new epoch costs no listing (a listing grows with the number of commits).
        """
        if self.locked and self.newest_seen is not None and epoch > self.newest_seen:
            return []
        epochs = self.store.committed_epochs()
        self.newest_seen = max(epochs, default=-1)
        return epochs

    # -- commits --------------------------------------------------------------------------
    def ask_commit(self, pending: PendingCommit, *, tidy: bool = False) -> None:
        """Commit ``pending`` (see :meth:`commit`, which ``tidy`` s); with ``async_save`` it is the save in
        flight, committed once its background writes finished (:meth:`commit_in_flight`)."""
        if not self.manager.async_save:
            self.commit(pending, tidy=tidy)
            return
        if pending.epoch not in self.ledger.ids:
            raise InvalidStateError(
                f"no save of epoch {pending.epoch} to commit: run manager.save({pending.epoch}) in a session first"
            )
        self.ledger.in_flight = pending

    def commit_in_flight(self, session: Session) -> PendingCommit | None:
        """Wait for the asynchronous save in flight to finish on every node and commit it; return it.

        The nodes that already reported its outcome (see the ledger's ``salvaged``) are not asked again.
        """
        ledger = self.ledger
        pending = ledger.in_flight
        if pending is None:
            return None
        epoch = pending.epoch
        if epoch not in ledger.entries:
            known, ledger.salvaged = ledger.salvaged, {}
            waiting = [n for n in self.manager.nodes() if n not in known]
            if waiting:
                save_id = ledger.ids[epoch]
                group = self.entry_group(
                    epoch, lambda node: WaitSaveStep(node, epoch, save_id), "checkpoint_wait", nodes=waiting
                )
                session.run_group(group, job=self.manager._job_name, epoch=epoch)
            if known:
                waited = ledger.finished(epoch) if waiting else {}
                bad = ledger.take(epoch, {**known, **{n: SaveOutcome(entry=e) for n, e in waited.items()}})
                if bad:
                    ledger.in_flight = None
                    raise write_error(epoch, bad)
        self.commit(pending)
        ledger.in_flight = None
        return pending

    def commit_waited(self, received: Received) -> tuple[int | None, dict[int, CheckpointWriteError]]:
        """Commit the asynchronous save in flight, which the hooks that reported ``received`` waited
        for; return its epoch once committed, or its failure (a node's write of it, or its commit)."""
        pending = received.in_flight
        if pending is None:
            return None, dict(received.in_flight_failure)
        try:
            self.commit(pending)
        except CheckpointWriteError as exc:
            self.ledger.forget(pending.epoch)
            return None, {pending.epoch: exc}
        return pending.epoch, {}

    def flush_here(self, epoch: int) -> bool:
        """Make ``epoch``'s groups whose flush no node reported durable from this process (their
        worker died, see ``CheckpointStore.make_durable``); ``True`` if ``epoch`` is then ready
        for its commit. Failures are logged."""
        ledger = self.ledger
        entries = ledger.entries.get(epoch, {})
        for node in sorted(ledger.unflushed.get(epoch, ())):
            try:
                entry = reported(self.store.make_durable(node, epoch, entries[node]))
            except (CheckpointError, KeyError) as exc:
                logger.warning(
                    "epoch %d cannot be committed: its group of node %r is not durable: %s", epoch, node, exc
                )
                return False
            ledger.rewritten(epoch, {node: entry})
        return ledger.flushed(epoch)

    def commit(self, pending: PendingCommit, *, tidy: bool = False) -> CommitRecord:
        """Commit ``pending.epoch``, saved and durable on every node (with the entries the ledger handed
        out, else those it keeps): write its commit record last, then apply retention; ``tidy``: then
        start deleting the groups of the epochs retention un-committed (:meth:`tidy`, a run commits
        while the next epoch runs). Returns the record."""
        ledger, store, epoch = self.ledger, self.store, pending.epoch
        entries = pending.entries
        if entries is None:
            if not ledger.flushed(epoch) and epoch in ledger.entries:
                raise InvalidStateError(f"epoch {epoch} is not durable on every node yet: wait for its flushes first")
            entries = ledger.finished(epoch)
        if not self.locked:  # saved outside a runner (which proves the storage shared before it saves)
            unseen = unseen_groups(self.staging.target(store, epoch), epoch, list(entries))
            if unseen is not None:
                raise unseen
        record = make_commit_record(
            self.manager._job_name,
            epoch,
            entries,
            dict(pending.stop_values),
            dict(pending.timings),
            metrics=dict(pending.metrics),
        )
        self.retention.stamp(record)
        self.staging.before_commit(store, epoch, list(entries))
        store.commit(record, sync_folder=not self.locked)
        self.retention.committed(record, mine=self.locked)
        self.last.record = self.last_commit = record
        self.newest_seen = max(epoch, -1 if self.newest_seen is None else self.newest_seen)
        self.last.remember(store, epoch, entries, self.manager.db_prefix)
        if pending.entries is None:
            ledger.forget(epoch)
        else:
            self.done.append(epoch)
        self.handler.write(epoch=epoch)
        retention_warning(self._retention(), epoch, store.url)
        if self.locked:
            store.sync_commits()
        if tidy:
            self.tidy()
        return record

    def on_disk(self, epoch: int) -> bool:
        """Whether ``epoch``'s commit record is under the prefix (``False`` if it cannot be listed)."""
        try:
            return epoch in self.store.committed_epochs()
        except Exception:
            return False

    def remove_debris(self) -> None:
        """Remove what saves that never committed left under the prefix for the manager's nodes (see the
        store's ``cleanup_uncommitted``); only while nothing writes there."""
        for leftover in self.store.cleanup_uncommitted(self.manager.nodes()):
            logger.info("removed uncommitted checkpoint leftover %s", leftover)

    def _retention(self) -> Callable[[int], None]:
        """Retention after the commit of an epoch (``newest``): delete committed epochs retention does not
        keep (see ``Retention``), but those whose chunks saves not yet committed reuse."""
        sources = {source for epoch, source in self.ledger.sources.items() if epoch not in self.done}
        return functools.partial(self.retention.apply, self.store, deferred=self.locked, keeping=sources)

    def forget_done(self) -> None:
        """Have the ledger forget the epochs committed with the entries it handed out (see :attr:`done`)."""
        for epoch in self.done:
            self.ledger.forget(epoch)
        self.done = []

    def tidy(self, *, final: bool = False) -> None:
        """Delete the groups of the epochs retention un-committed (see :attr:`locked`) in a
        background thread; ``final``: here, after that thread (the run ends, the lock is about to
        be released). Failures are logged warnings, never raised. While the nodes delete them
        (see :meth:`hooks`), only ``final`` deletes what they were not handed."""
        self.retention.tidy(self.store, final=final, by_nodes=self.nodes_delete)
