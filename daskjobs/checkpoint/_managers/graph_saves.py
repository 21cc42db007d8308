"""The manager's side of saves made inside an epoch's own graph (finish hooks): what the nodes
returned, their background flushes, and the asynchronous save in flight."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._model.task import Task, WorkspaceType
from ...errors import CheckpointError, CheckpointWriteError
from .._node.save_steps import AsyncSaveFinish, EndSaveStep, FlushFinish, SaveFinish, WaitSaveStep, idle, reported

if TYPE_CHECKING:
    from ...session import Session
    from .._protocol.retention import Retention
    from .._protocol.staging import Staging
    from .._protocol.store import CheckpointStore
    from .pending import Saves

logger = logging.getLogger("daskjobs")


class GraphSaves:
    """Mixed into :class:`~daskjobs.MultiNodeCheckpointManager`: saves through :meth:`finish_hooks`
    (synchronous, or asynchronous with one save in flight), and when they are ready for a commit.

    Uses the manager's attributes below and its ``nodes()``, ``_new_save()``, ``reuses_chunks()``,
    ``_group()``, ``_entry_group()`` and ``_commit()``.
    """

    store: CheckpointStore
    retention: Retention
    async_save: bool
    async_snapshot: str
    holds_lock: bool
    _saves: Saves
    _salvaged: dict[str, Any]
    _staging: Staging
    _job_name: str
    _nodes_delete: bool
    reuses_chunks: Callable[[int], bool]

    def finish_hooks(self, epoch: int, *, flush_later: bool = False) -> dict[str, Callable[[Any], Any]]:
        """Per node, a hook that saves ``epoch`` at the end of the epoch's own Dask task.

        Pass them to :meth:`~daskjobs.Session.run_group` (``finish=``) with the epoch group and
        the results to :meth:`accept_finished`: the save then costs no round trip of its own.
        With ``async_save`` each hook first waits, on its node, for the save in flight.
        ``flush_later`` (while :attr:`may_defer_commit`, on a local disk): the nodes fsync their
        groups in the background (and write them there, for a small workspace, see
        ``SaveFinish``); the epoch is ready for its commit once :meth:`flushed` says so.
        They also delete their groups of the epochs retention un-committed, in the background.
        """
        pending = self._saves.pending_epoch()
        in_flight = None if pending is None else self._saves.ids.get(pending)
        save_id, store, previous = self._new_save(epoch)
        if self.async_save:
            snapshot = self.async_snapshot
            return {
                n: AsyncSaveFinish(
                    store, n, epoch, save_id, in_flight, previous.get(n), snapshot, self.reuses_chunks(epoch)
                )
                for n in self.nodes()
            }
        later = self._nodes_delete = flush_later and self.may_defer_commit and self.store.defers_flush
        doomed = self.retention.retired.hand_out(self.nodes()) if later else {}
        return {
            n: SaveFinish(store, n, epoch, save_id, previous.get(n), flush_later=later, doomed=doomed.get(n, ()))
            for n in self.nodes()
        }

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
        return self._saves.accept(epoch, results, self.nodes(), self.async_save, self._commit)

    def flush(self, session: Session) -> int | None:
        """Wait for an asynchronous save to finish on every node and commit it; return its epoch.

        The nodes that already reported its outcome (see ``salvage_finished``) are not asked again.
        """
        epoch = self._saves.pending_epoch()
        if epoch is None:
            return None
        save_id = self._saves.ids[epoch]
        known, self._salvaged = self._salvaged, {}
        waiting = [n for n in self.nodes() if n not in known]
        if waiting:
            group = self._entry_group(
                epoch, lambda node: WaitSaveStep(node, epoch, save_id), "checkpoint_wait", nodes=waiting
            )
            session.run_group(group, job=self._job_name, epoch=epoch)
        if known:
            failed: dict[int, CheckpointWriteError] = {}
            waited = self._saves.finished(epoch) if waiting else {}
            if not self._saves.take(epoch, {**known, **{n: {"entry": e} for n, e in waited.items()}}, failed):
                self._saves.pending = None
                raise failed[epoch]
        self._commit(*self._saves.take_pending())
        return epoch

    def flushed(self, epoch: int) -> bool:
        """Whether ``epoch``'s save is written and durable on every node, ready for its commit.

        A save through :meth:`finish_hooks` while :attr:`may_defer_commit` fsyncs in the
        background: the next epoch's hooks, or :meth:`wait_flushes`, report it.
        """
        return self._saves.flushed(epoch)

    def wait_flushes(self, session: Session) -> dict[int, CheckpointWriteError]:
        """Wait for the nodes' background flushes (one small group); return the epochs that failed."""
        failed: dict[int, CheckpointWriteError] = {}
        if not self._saves.unflushed:
            return failed
        group = self._group(
            lambda g, node: Task(idle, group=g, node=node, name="checkpoint_flush"), WorkspaceType.PRIVATE
        )
        finished: dict[str, Any] = {}
        session.run_group(group, job=self._job_name, finish={n: FlushFinish() for n in self.nodes()}, finished=finished)
        self._saves.note_flushes(finished, failed)
        return failed

    def flush_here(self, epoch: int) -> bool:
        """Make ``epoch``'s groups whose flush no node reported durable from this process (their
        worker died, see ``CheckpointStore.make_durable``); ``True`` if ``epoch`` is then
        ready for its commit. Failures are logged."""
        entries = self._saves.entries.get(epoch, {})
        for node in sorted(self._saves.unflushed.get(epoch, ())):
            try:
                entries[node] = reported(self.store.make_durable(node, epoch, entries[node]))
            except (CheckpointError, KeyError) as exc:
                logger.warning(
                    "epoch %d cannot be committed: its group of node %r is not durable: %s", epoch, node, exc
                )
                return False
            self._saves.unflushed[epoch].discard(node)
        return self._saves.flushed(epoch)

    def discard_pending(self) -> None:
        """Forget an asynchronous save that will not be committed (its node was lost, or saving gave up)."""
        self._saves.discard_pending()
        self._salvaged = {}

    def salvage_finished(self, epoch: int, results: dict[str, Any]) -> dict[int, CheckpointWriteError]:
        """After ``epoch``'s run failed: take what the hooks of the nodes that finished reported
        (``results``) of the earlier saves (background flushes; the asynchronous save in flight, for
        :meth:`flush`), so that those can still be committed, and forget ``epoch``'s own save (its
        files are debris); return the earlier epochs whose flush failed (forgotten too)."""
        failed: dict[int, CheckpointWriteError] = {}
        self._saves.note_flushes(results, failed)
        if self.async_save and self._saves.pending is not None:  # the save in flight those hooks waited for
            self._salvaged = {n: (r or {}).get("previous") for n, r in results.items()}
        self._saves.forget(epoch)
        return failed

    def forget_save(self, epoch: int) -> None:
        """Forget the save of ``epoch``, written but never to be committed (its commit gave up)."""
        self._saves.forget(epoch)

    def end_saves(self, session: Session) -> None:
        """End every node's background save without committing it (a run that fails stops its writers
        before it gives up the lock): forked writers are killed, writing threads waited for."""
        self._saves.discard_pending()
        if self.async_save:
            group = self._group(lambda g, node: Task(EndSaveStep(), group=g, node=node, name="checkpoint_end_save"))
            session.run_group(group, job=self._job_name)

    @property
    def may_defer_commit(self) -> bool:
        """Whether a runner may write the commit record of a synchronous save while the next epoch
        runs: it holds the lock, and no newer commits wait for this one to retire them (after a
        resume from an older epoch). The next save then reuses that epoch's chunks (delta)."""
        return self.holds_lock and not self.async_save and not self._staging.retire

    def pending_epoch(self) -> int | None:
        """The epoch whose asynchronous save is written but not yet committed."""
        return self._saves.pending_epoch()
