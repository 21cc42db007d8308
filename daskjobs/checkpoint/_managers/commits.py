"""The commit side of a run's commit pipeline: accepting an epoch once it ran (the reports of its
save hooks), the epochs waiting for their commit, the commits and flushes, and the run's save policy.

:class:`CommitQueue` is the base of :class:`~.pipeline.CommitPipeline`. Once an epoch ran
(:meth:`CommitQueue.accept`), the pipeline hands the ledger the whole of what its save hooks
returned, once (``SaveLedger.receive``), and gets back one answer: the epoch's own failure, the
flushes of earlier epochs that failed, and the epochs now durable on every node, handed out with
their entries. A waiting epoch handed out is committed (:meth:`CommitQueue.meanwhile`, while the
next epoch runs) without asking the ledger again; the ledger is asked only when something changed
since (its ``version``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

from ...errors import CheckpointWriteError
from .._format.records import record_bytes
from .._node.outcomes import SaveOutcome
from .ledger import PendingCommit, Received, saved_entries, write_error
from .saving import FATAL, OnCommit, Saved, SaveMode, SavePlan, SavePolicy

if TYPE_CHECKING:
    from ..._model.group import TaskGroup
    from ...session import Session
    from .._format.documents import EntryReport
    from .writer import EpochWriter

logger = logging.getLogger("daskjobs")


class CommitQueue:
    """The epochs a run saved through ``writer`` (in their graphs, or by ``save_group``) and has still
    to commit, in order, and how it commits them: through ``policy`` (without one, a failure is
    raised), telling ``on_commit`` of each commit.

    :attr:`last_committed` is the newest epoch the run committed (or resumed from): what a recovery
    restores and what a graceful stop reports.
    """

    def __init__(
        self,
        writer: EpochWriter,
        policy: SavePolicy | None = None,
        on_commit: OnCommit | None = None,
        save_group: Callable[[int], TaskGroup] | None = None,
    ) -> None:
        self.writer, self.ledger = writer, writer.ledger
        self.policy, self.on_commit = policy, on_commit
        self.save_group = save_group
        """The manager's ``save`` where its class overrides it: each epoch is saved by its group (Caffe2)."""
        self.last_committed: int | None = None
        self._waiting: list[PendingCommit] = []
        self._then: list[tuple[int, bool, Callable[[], object]]] = []
        """``(epoch, whether only its durable commit will do, call)``, in epoch order (:meth:`when_committed`)."""
        self._deferred_error: Exception | None = None
        self._asked = -1
        """The ledger's ``version`` when it last handed out the durable waiting epochs."""
        self._unsure = False
        """A group of this pipeline's saves was interrupted: what its nodes still write is unknown."""
        self.debris = False
        """Something this run wrote may be left uncommitted (a save failed, retried or forgotten)."""
        self._strays: set[str] = set()
        """Nodes that may still write in the background for saves this pipeline forgot."""

    # -- saving an epoch -------------------------------------------------------------------
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

    # -- the nodes' reports -------------------------------------------------------------------
    def _receive(
        self,
        session: Session,
        plan: SavePlan,
        finished: Mapping[str, object],
        stop_values: Mapping[str, bool],
        metrics: Mapping[str, float],
    ) -> tuple[Saved, CheckpointWriteError | None]:
        """Take what the hooks of ``plan``'s epoch returned (``finished``) and commit the epoch (now, or
        while the next epoch runs). Returns what saving it cost and its own failure (then it is neither
        committed nor waiting: its cost is the nodes' part)."""
        started, epoch = time.perf_counter(), plan.epoch
        entries = [r.entry for r in finished.values() if isinstance(r, SaveOutcome) and r.entry is not None]
        node_seconds = max((float(e.get("seconds", 0.0)) for e in entries), default=0.0)
        defer = self.writer.may_defer_commit if plan.defer_commit is None else plan.defer_commit
        waiting = [w.epoch for w in self._waiting if w.entries is None] + [epoch] if defer and not plan.memory else []
        received, failure = self._take_reports(epoch, finished, session, plan.nodes, waiting)
        if failure is not None:
            return Saved(node_seconds), failure
        timings = {"save_seconds": node_seconds + time.perf_counter() - started}
        written = None
        if len(entries) == len(finished):
            written = sum(e["bytes_written"] for e in entries), sum(e["bytes_reused"] for e in entries)
        pending = PendingCommit(epoch, dict(stop_values), dict(metrics), timings, received.durable.get(epoch))
        if defer:
            self._waiting.append(pending)
        else:
            self.commit_ready()
            self._attempt(epoch, lambda: self._commit(pending))
        return Saved(node_seconds + time.perf_counter() - started, written), None

    def _take_reports(
        self,
        epoch: int,
        finished: Mapping[str, object],
        session: Session | None,
        nodes: Sequence[str] = (),
        waiting: Sequence[int] = (),
    ) -> tuple[Received, CheckpointWriteError | None]:
        """Take what ``epoch``'s save hooks on ``nodes`` (default: the manager's) returned, in one answer
        of the ledger: the flushes they report of earlier epochs (a failed one written again through
        ``session``, by policy), the asynchronous save they waited for (committed now), the epochs of
        ``waiting`` now durable (handed out); give up the earlier epochs whose saves failed; return
        the answer and ``epoch``'s own failure, if any."""
        manager = self.writer.manager
        received = self.ledger.receive(
            epoch, finished, nodes or manager.nodes(), async_save=manager.async_save, waiting=waiting
        )
        if waiting:
            self._hand_over(received.durable)
        own = received.failure
        failed: dict[int, CheckpointWriteError] = {}
        in_flight = None
        if manager.async_save:
            in_flight, failed = self.writer.commit_waited(received)
            if in_flight is not None:
                self.last_committed = in_flight
            self.debris |= bool(failed)
            if received.not_started and own is None:
                self.ledger.forget(epoch)
                own = write_error(epoch, received.not_started)
        if in_flight is not None:
            self._call_then(in_flight)
        for other, error in sorted(failed.items()):
            if other != epoch:
                self._settle_waiting(other, error)
        for other, errors in sorted(received.flushes.items()):
            self._write_again(session, other, errors)
        return received, own

    def _write_again(self, session: Session | None, epoch: int, errors: Mapping[str, BaseException | str]) -> None:
        """``epoch``'s background flush failed on the nodes of ``errors``: have those nodes write their
        groups again, durably (a group of its own, through ``session``), by policy; else give it up."""
        error = write_error(epoch, errors)
        self.debris = True
        if session is None:
            self._forget(epoch)
            self._settle_waiting(epoch, error)
            return
        logger.warning("could not make the checkpoint of epoch %d durable: %s; writing it again", epoch, error)
        nodes = sorted(errors)

        def write_again() -> None:
            with self._writing():
                outcomes = self.writer.run_hooks(session, "checkpoint_resave", self.writer.resave_hooks(epoch, nodes))
            entries, bad = saved_entries(outcomes)
            if bad:
                raise write_error(epoch, bad)
            self.ledger.rewritten(epoch, entries)

        if not self._attempt(epoch, write_again, give_up=lambda: self._forget(epoch)):
            self._settle_waiting(epoch, None)

    # -- commits ----------------------------------------------------------------------------
    def meanwhile(self) -> None:
        """While the next epoch runs: commit the waiting epochs that are durable, then delete the groups
        of the epochs retention un-committed (each commit starts that). An error is kept for ``check``
        (a session's ``meanwhile`` must not raise); an interruption (``KeyboardInterrupt``) goes
        through at once."""
        committed = False
        try:
            committed = self.commit_ready(tidy=True)
        except Exception as exc:
            self._deferred_error = exc
        if not committed:
            self.writer.tidy()

    def commit_ready(self, *, tidy: bool = False) -> bool:
        """Commit, oldest first, the waiting epochs that are durable on every node (retries, then
        ``on_save_error``); an epoch not yet reported durable and those after it keep waiting.
        ``tidy``: each commit then starts deleting what its retention un-committed (see
        ``EpochWriter.tidy``). ``True`` if an epoch was committed."""
        refused, committed = None, False  # a durable epoch whose entries are of another save: its commit refuses it
        while self._waiting:
            pending = self._waiting[0]
            if pending.entries is None and pending.epoch != refused:
                if self.ledger.version == self._asked:  # nothing changed since the ledger last answered
                    return committed
                handed, refused = self.ledger.hand_out([w.epoch for w in self._waiting])
                self._hand_over(handed)
                continue
            try:
                done = self._attempt(
                    pending.epoch, lambda: self._commit(pending, tidy=tidy), give_up=lambda: self._forget(pending.epoch)
                )
            except KeyboardInterrupt:
                # A second signal struck during the commit: unless its record made it, the epoch stays
                # first in line, so that the way out (settle) commits it before any later epoch.
                if self.writer.on_disk(pending.epoch):
                    self._waiting.pop(0)
                raise
            except BaseException:
                self._waiting.pop(0)
                raise
            self._waiting.pop(0)
            if pending.epoch == refused:  # the ledger forgot it: ask again for those after it
                self._asked = -1
            committed |= done
            self._call_then(pending.epoch)
        return committed

    def _hand_over(self, durable: Mapping[int, Mapping[str, EntryReport]]) -> None:
        """The ledger handed out ``durable`` (epoch -> entries) for their commit: the waiting epochs keep
        their entries."""
        if durable:
            self._waiting = [replace(w, entries=durable[w.epoch]) if w.epoch in durable else w for w in self._waiting]
        self._asked = self.ledger.version

    @property
    def newest_commit(self) -> int | None:
        """The newest epoch this run committed (or resumed from), in any tier."""
        return self.last_committed

    def _commit(self, pending: PendingCommit, *, tidy: bool = False) -> None:
        self.writer.ask_commit(pending, tidy=tidy)
        if self.ledger.in_flight is None:
            self.last_committed = pending.epoch
            self.writer.manager.report_checkpoint_stats("checkpoint_save")

    def _call_then(self, epoch: int) -> None:
        """Make the calls :meth:`when_committed` kept for ``epoch`` and the epochs before it, after
        telling :attr:`on_commit` of the commit."""
        record = self.writer.last_commit
        if self.on_commit is not None and record is not None and record["epoch"] == epoch:
            self.on_commit(epoch, *record_bytes(record)[1:])
        now = [call for e, _, call in self._then if e <= epoch]
        self._then = [(e, durable, call) for e, durable, call in self._then if e > epoch]
        for call in now:
            call()

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

    # -- policy -----------------------------------------------------------------------------
    def _attempt(self, epoch: int, attempt: Callable[[], object], give_up: Callable[[], None] | None = None) -> bool:
        """``attempt`` through the policy: tried again up to its ``retries`` times (not after a ``FATAL``
        error), then given up, by policy (without one: once, its error raised); ``give_up`` when it
        failed. ``True`` once it succeeded, ``False`` when the policy gave up with a warning."""
        policy = self.policy
        if policy is None:
            attempt()
            return True
        try:
            error: BaseException | None = None
            for number in range(policy.retries + 1):
                try:
                    attempt()
                    return True
                except FATAL:  # no retry mends these: the run itself cannot go on as it is
                    raise
                except Exception as exc:
                    error = exc
                    self._after_failure()
                    policy.failed(epoch, number, exc)
            policy.give_up(epoch, error)
        except BaseException as exc:
            if give_up is not None and not isinstance(exc, KeyboardInterrupt):
                give_up()
            self.debris = True
            raise
        self.debris = True
        if give_up is not None:
            give_up()
        return False

    def _give_up(self, epoch: int, error: BaseException) -> None:
        """A save of ``epoch`` failed for good: raise ``CheckpointWriteError`` or warn, by policy (a lock
        that provably vanished or changed hands stops the run with ``CheckpointLockedError``)."""
        self._after_failure()
        if self.policy is None:
            raise error
        self.policy.give_up(epoch, error)

    def _settle_waiting(self, epoch: int, error: BaseException | None) -> None:
        """Drop ``epoch`` from the waiting commits (its save failed for good, by policy when ``error``
        is given) and make its :meth:`when_committed` calls."""
        self._waiting = [w for w in self._waiting if w.epoch != epoch]
        if error is not None:
            self._give_up(epoch, error)
        self._call_then(epoch)

    def _after_failure(self) -> None:
        """After a failed save: what it wrote may be left (:attr:`debris`, removed when the run ends even
        if a retry succeeded); ``CheckpointLockedError`` if the lock (or the prefix) provably vanished or
        changed hands, rather than retry into a prefix no longer ours (storage that cannot be read is a
        save error, for the policy; the commit's own lock check stays strict)."""
        self.debris = True
        if self.writer.locked:
            self.writer.store.check_not_taken()

    def _forget(self, epoch: int) -> None:
        """Forget the save of ``epoch``, written (maybe in part) but never to be committed."""
        if epoch in self.ledger.ids:
            self.debris = True
        self.ledger.forget(epoch)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a group run of this pipeline's: an interruption leaves what its nodes write unknown."""
        self._unsure = True
        try:
            yield
        except Exception:
            self._unsure = False
            raise
        self._unsure = False
