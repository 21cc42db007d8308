"""One run's commit pipeline: the epochs it saved and has still to commit, in order.

An epoch saved inside its own graph (the ``finish`` hooks of :meth:`CommitPipeline.plan`) is
committed while a later epoch runs (:meth:`CommitPipeline.meanwhile`) where the writer allows it
(``EpochWriter.may_defer_commit``): the nodes write the epoch's groups at the end of its graph and
fsync them in the background; the next epoch's hooks report them durable, and the epoch after it
writes the commit record. The fsyncs and the commit then cost the epoch loop nothing. Whatever
ends the loop waits for the flushes and commits first (:meth:`CommitPipeline.flush`,
:meth:`CommitPipeline.settle`).

Every save error goes through the run's :class:`SavePolicy` (retries, then ``on_save_error``):
a save that failed in its hook is saved again as a group of its own, a background flush that
failed is written again by the nodes (``ResaveFinish``), a commit record is written again.

The runner makes one call per phase of an epoch: :meth:`CommitPipeline.plan` before it runs,
``meanwhile`` while it runs, :meth:`CommitPipeline.accept` (or ``drop``, ``salvage``) once it ran.
Taking the hooks' reports and committing are :class:`~.commits.CommitQueue`'s, the base class.

With tier 0 (``MultiNodeCheckpointManager(in_memory=True)``) a run's pipeline is a
:class:`~.tiered.TieredPipeline`, which commits every epoch in cluster memory first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .._format.records import record_bytes
from .._node.outcomes import SaveOutcome
from .commits import CommitQueue
from .ledger import PendingCommit, in_flight_outcomes, write_error
from .saving import FATAL, OnCommit, Saved, SaveMode, SavePlan, SavePolicy

if TYPE_CHECKING:
    from ..._model.group import TaskGroup
    from ...session import Session
    from .memory import MemoryTier
    from .writer import EpochWriter

logger = logging.getLogger("daskjobs")


class CommitPipeline(CommitQueue):
    """The epochs one run (or one ``save_checkpoints``) saves through ``writer``, until committed.

    Get it from ``MultiNodeCheckpointManager.writing``, which holds the prefix's lock around it.
    :attr:`last_committed` is the newest epoch the run committed (or resumed from): what a recovery
    restores and what a graceful stop reports.
    """

    def __init__(
        self,
        writer: EpochWriter,
        policy: SavePolicy | None = None,
        on_commit: OnCommit | None = None,
        *,
        save_group: Callable[[int], TaskGroup] | None = None,
        nested: bool = False,
    ) -> None:
        super().__init__(writer, policy, on_commit)
        self.save_group = save_group
        """The manager's ``save`` where its class overrides it: each epoch is saved by its group (Caffe2)."""
        self.nested = nested
        """Another pipeline of this process holds the lock (``save_checkpoints`` called while training)."""
        self.memory: MemoryTier | None = None
        """The run's epochs committed in cluster memory (tier 0, see ``TieredPipeline``); ``None`` here."""
        self._strays: set[str] = set()
        """Nodes that may still write in the background for saves this pipeline forgot."""

    # -- saving an epoch --------------------------------------------------------------------
    def plan(
        self,
        epoch: int,
        used_nodes: list[str],
        *,
        background: bool,
        last: bool = False,
        session: Session | None = None,
    ) -> SavePlan:
        """How to save ``epoch``: in the graph of the group that runs it (the epoch group, or the init
        group for epoch 0) when every checkpointed node runs in it, else as a group of its own after
        it (:meth:`save`); not at all when the storage is not accessible or the save cannot start
        (``epoch`` is already committed, say: a save error, by policy, not retried). ``background``:
        nodes may fsync while the next epoch runs; ``last``: the run should end with this epoch, its
        nodes fsync inside the graph (a wrong guess costs time, never safety). ``session`` runs the
        epoch (tier 0 keeps its snapshots there)."""
        manager = self.writer.manager
        nodes = manager.nodes()
        if self.save_group is not None or not set(nodes) <= set(used_nodes):
            return SavePlan(epoch, SaveMode.OWN_GROUP)
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return SavePlan(epoch, SaveMode.SKIP)
        try:
            made = self.writer.hooks(epoch, nodes, flush_later=background and not last)
        except FATAL:
            raise
        except Exception as exc:
            self._give_up(epoch, exc)
            return SavePlan(epoch, SaveMode.SKIP)
        self._unsure = True
        return SavePlan(epoch, SaveMode.IN_GRAPH, made.hooks, defer_commit=made.defer_commit, nodes=tuple(nodes))

    def accept(
        self,
        session: Session,
        plan: SavePlan,
        finished: Mapping[str, object],
        stop_values: Mapping[str, bool],
        metrics: Mapping[str, float],
    ) -> Saved:
        """Save ``plan``'s epoch once it ran: take what its hooks returned (``finished``) and commit it (now,
        or while the next epoch runs); a failed save is saved again as a group of its own, a failed
        background flush of an earlier epoch written again, by policy. A plan of its own group saves
        it now (:meth:`save`); a plan to skip does nothing."""
        self.check(plan.epoch)
        if plan.mode is SaveMode.OWN_GROUP:
            return self.save(session, plan.epoch, stop_values, metrics)
        if plan.mode is SaveMode.SKIP:
            return Saved()
        self._unsure = False
        saved, failure = self._receive(session, plan, finished, stop_values, metrics)
        if failure is None:
            return saved
        self._after_failure()
        logger.warning("saving epoch %d failed: %s; saving it again", plan.epoch, failure)
        again = self.save(session, plan.epoch, stop_values, metrics)
        return Saved(saved.seconds + again.seconds, again.bytes)

    def save(
        self, session: Session, epoch: int, stop_values: Mapping[str, bool], metrics: Mapping[str, float]
    ) -> Saved:
        """Save ``epoch`` as a group run of its own (see :attr:`save_group`) and commit it, the epochs
        saved before committed first."""
        manager = self.writer.manager
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return Saved()
        started = time.perf_counter()
        self.flush(session)
        make_group = self.save_group or self.writer.save_group

        def save() -> None:
            with self._writing():
                session.run_group(make_group(epoch), job=manager._job_name, epoch=epoch)
            timings = {"save_seconds": time.perf_counter() - started}
            self._commit(PendingCommit(epoch, dict(stop_values), dict(metrics), timings))

        if self._attempt(epoch, save, give_up=lambda: self._forget(epoch)) and self.last_committed == epoch:
            self._call_then(epoch)  # committed like an epoch saved in its graph: on_commit hears of it
        committed = self.writer.last_commit
        if manager.async_save or committed is None or committed["epoch"] != epoch:
            return Saved(time.perf_counter() - started, None)
        return Saved(time.perf_counter() - started, record_bytes(committed)[1:])

    def drop(self, session: Session, plan: SavePlan, finished: Mapping[str, object]) -> None:
        """``plan``'s epoch ran but is not committed (e.g. a stop value is invalid): take what its hooks
        reported of earlier epochs' saves (a flush, the async save in flight), so that those are still
        committed, and forget its own save (its files are debris)."""
        self.check(plan.epoch)
        if plan.mode is not SaveMode.IN_GRAPH:
            return
        self._unsure = False
        if finished:
            self._take_reports(plan.epoch, finished, session, plan.nodes)
        self._forget(plan.epoch)

    def salvage(self, plan: SavePlan, finished: Mapping[str, object]) -> None:
        """``plan``'s epoch failed to run: take the flush reports the hooks of the nodes that finished gave
        (``finished``: a node whose hook ran has none left to report), so that the epochs before it are
        still committed when the failed run settles; not the epoch itself. A failed flush is logged and
        its epoch given up: the run's own error is what surfaces."""
        ledger = self.ledger
        self._unsure = False
        self._strays |= {n for n, r in finished.items() if isinstance(r, SaveOutcome) and r.later}
        for other, errors in sorted(ledger.note_flushes(finished).items()):
            self._forget(other)
            self._waiting = [w for w in self._waiting if w.epoch != other]
            self._then = [(e, durable, call) for e, durable, call in self._then if e != other]
            logger.warning("could not write the checkpoint of epoch %d: %s", other, write_error(other, errors))
        if self.writer.manager.async_save and ledger.in_flight is not None:  # the save those hooks waited for
            ledger.salvaged = in_flight_outcomes(finished)
        self._forget(plan.epoch)
        self.check(plan.epoch)

    # -- commits ----------------------------------------------------------------------------
    def check(self, epoch: int | None = None) -> None:
        """Raise the error of the commit :meth:`meanwhile` wrote, if it failed (:meth:`accept`,
        :meth:`salvage` and :meth:`drop` check). It ends the run, which commits nothing after the
        failed epoch: the waiting epochs and ``epoch`` are forgotten, so the way out neither commits
        them nor asks the nodes for their flushes (a node reports only its newest flush)."""
        error, self._deferred_error = self._deferred_error, None
        if error is not None:
            for waiting in [w.epoch for w in self._waiting] + ([] if epoch is None else [epoch]):
                self._forget(waiting)
            self._waiting = []
            raise error

    def flush(self, session: Session) -> None:
        """Commit the epochs waiting for their commit (once their nodes report them durable) and
        the asynchronous save in flight, if any."""
        self._wait_flushes(session)
        self.commit_ready()
        pending = self.ledger.in_flight
        if pending is not None:

            def commit() -> None:
                with self._writing():
                    self.writer.commit_in_flight(session)
                self.last_committed = pending.epoch

            self._attempt(pending.epoch, commit, give_up=self.ledger.discard_in_flight)
            self._call_then(pending.epoch)

    def finish(self, session: Session) -> None:
        """The run ends after the epoch it ran last, or stops gracefully after it: commit every epoch
        saved (:meth:`flush`)."""
        self.flush(session)

    # -- flushes ----------------------------------------------------------------------------
    def _wait_flushes(self, session: Session) -> None:
        """Wait for the nodes' background flushes of the waiting epochs (one small group); a flush that
        failed is written again, by policy."""
        if all(w.entries is not None or self.ledger.flushed(w.epoch) for w in self._waiting):
            return
        nodes = self.writer.manager.nodes()
        with self._writing():
            finished = self.writer.run_hooks(session, "checkpoint_flush", self.writer.flush_hooks(nodes))
        self._strays = set()  # every node waited for its background flush
        for epoch, errors in sorted(self.ledger.note_flushes(finished).items()):
            self._write_again(session, epoch, errors)

    # -- the way out ------------------------------------------------------------------------
    def settle(self, session: Session | None = None) -> bool:
        """On the way out of a failed run: commit the waiting epochs (they finished) once durable, and
        through ``session`` (when it still works: it asks the nodes for their flushes) the asynchronous
        save in flight; a flush no node can report (its worker died) is made from here. Failures are
        logged, what cannot be committed is forgotten. ``True`` if an epoch was committed."""
        before = self.last_committed
        try:
            if session is not None:
                self._wait_flushes(session)
        except Exception as exc:
            logger.warning("%s", exc)
        try:
            for pending in self._waiting:
                if pending.entries is not None or self.ledger.flushed(pending.epoch):
                    continue
                if not self._flush_here(pending.epoch):
                    break
            self.commit_ready()
        except Exception as exc:
            logger.warning("%s", exc)
        in_flight = self.ledger.in_flight
        if session is not None and in_flight is not None:  # the asynchronous save of a finished epoch
            try:
                with self._writing():
                    self.writer.commit_in_flight(session)
                self.last_committed = in_flight.epoch
            except Exception as exc:
                logger.warning("could not commit the asynchronous save of epoch %d: %s", in_flight.epoch, exc)
                self.ledger.discard_in_flight()
            else:
                try:  # committed like any other epoch: its on_epoch call, with its bytes
                    self._call_then(in_flight.epoch)
                except Exception as exc:
                    logger.warning("%s", exc)
        self._strays |= self.ledger.writing_nodes()
        for pending in self._waiting:
            self._forget(pending.epoch)
        self._waiting, self._then = [], []
        return self.last_committed != before

    def _flush_here(self, epoch: int) -> bool:
        """After a loss: make ``epoch``'s groups whose flush no node reported durable from this process
        (see ``EpochWriter.flush_here``)."""
        return self.writer.flush_here(epoch)

    def end_writes(self, session: Session, lost: list[str] | tuple[str, ...] = ()) -> None:
        """Stop the background writes of saves that will not be committed, on every node that may still
        write but those ``lost`` (forked writers killed, threads and flushes waited for): a failed run
        before it gives up the lock, a recovery before it restores. A failure is a warning."""
        ledger = self.ledger
        writers = self._strays | ledger.writing_nodes()
        if self.writer.manager.async_save:
            writers |= set(self.writer.manager.nodes())
        ledger.discard_in_flight()
        writers -= set(lost)
        if not writers:
            self._strays = set()
            return
        try:
            ends = dict.fromkeys(sorted(writers), self.writer.end_hooks())
            with self._writing():
                self.writer.run_hooks(session, "checkpoint_end_save", ends)
        except Exception as exc:
            logger.warning("could not stop the background checkpoint writes of %s: %s", self.writer.store.url, exc)
            return
        self._strays = set()

    def recover(self, session: Session, lost: list[str]) -> None:
        """After the loss of the nodes ``lost``, once :meth:`settle` committed what it could: end the
        other nodes' background writes and remove what this run left uncommitted."""
        self.debris = True
        self.end_writes(session, lost)
        self._remove_debris()

    def recovered(self, epoch: int | None, *, in_memory: bool) -> None:
        """The nodes were restored from ``epoch`` (``in_memory``: by tier 0; else from the prefix, or
        from scratch when ``None``)."""

    def remove_debris(self) -> None:
        """Remove what saves that never committed left under the prefix for the job's nodes (of this run
        or an earlier one), when nothing of this run may still write there (a run starts with it);
        raises as the store's ``cleanup_uncommitted``."""
        if self._unsure or self._strays or self.ledger.writing_nodes() or self.ledger.in_flight is not None:
            return
        self.writer.remove_debris()
        self.debris = False

    def _remove_debris(self) -> None:
        """:meth:`remove_debris`, a failure logged: what is left, the next run removes."""
        try:
            self.remove_debris()
        except Exception as exc:
            logger.warning("could not remove uncommitted checkpoint leftovers: %s", exc)

    def resume_older(self, epoch: int) -> list[int]:
        """Prepare to resume from committed ``epoch`` while newer epochs are committed: they stay until
        the first new epoch is committed (see ``Staging``); return them."""
        return self.writer.staging.resume_older(self.writer.store, epoch)

    def close(self) -> None:
        """The run ends (the lock is about to be released): delete the groups of the epochs retention
        un-committed, then what this run left uncommitted, if anything, when nothing writes any more."""
        self.writer.tidy(final=True)
        self.writer.forget_done()
        if self.debris:
            self._remove_debris()
