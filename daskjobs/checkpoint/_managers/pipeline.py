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
``meanwhile`` while it runs, ``accept`` (or :meth:`CommitPipeline.drop`,
:meth:`CommitPipeline.salvage`) once it ran, :meth:`CommitPipeline.when_committed` once it is
saved. Accepting an epoch, its commit and flushes are :class:`~.commits.CommitQueue`'s, the base
class; this module plans each save and holds the way out of a failed run.

With tier 0 (``MultiNodeCheckpointManager(in_memory=True)``) a run's pipeline is a
:class:`~.tiered.TieredPipeline`, which commits every epoch in cluster memory first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .._node.outcomes import SaveOutcome
from .commits import CommitQueue
from .ledger import in_flight_outcomes, write_error
from .saving import FATAL, OnCommit, SaveMode, SavePlan, SavePolicy

if TYPE_CHECKING:
    from ..._model.group import TaskGroup
    from ...session import Session
    from .memory import MemoryTier
    from .writer import EpochWriter

logger = logging.getLogger("daskjobs")


class CommitPipeline(CommitQueue):
    """The epochs one run (or one ``save_checkpoints``) saves through ``writer``, until committed.

    Get it from ``MultiNodeCheckpointManager.writing``, which holds the prefix's lock around it
    (see :class:`~.commits.CommitQueue` for :attr:`last_committed`).
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
        super().__init__(writer, policy, on_commit, save_group)
        self.nested = nested
        """Another pipeline of this process holds the lock (``save_checkpoints`` called while training)."""
        self.memory: MemoryTier | None = None
        """The run's epochs committed in cluster memory (tier 0, see ``TieredPipeline``); ``None`` here."""

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
    def when_committed(self, call: Callable[[], object], epoch: int | None = None) -> None:
        """Call ``call`` once the last epoch saved (``epoch``, where the caller knows it) is committed
        (or given up): now, or after its waiting commit (or the commit of its asynchronous save)."""
        in_flight = None if self.ledger.in_flight is None else self.ledger.in_flight.epoch
        if self._waiting:
            self._then.append((self._waiting[-1].epoch, True, call))
        elif in_flight is not None:
            self._then.append((in_flight, True, call))
        else:
            call()

    # -- the way out ------------------------------------------------------------------------
    def settle(self, session: Session | None = None) -> bool:
        """On the way out of a failed run: commit the waiting epochs (they finished) once durable, and
        through ``session`` (when it still works: it asks the nodes for their flushes) the asynchronous
        save in flight; a flush no node can report (its worker died) is made from here. Failures are
        logged, what cannot be committed is forgotten. ``True`` if an epoch was committed."""
        before = self.last_committed
        if session is not None and not session.is_open():  # closed with its lost scheduler: nothing to ask
            session = None
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
