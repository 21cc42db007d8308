"""How a run checkpoints its epochs: inside the epoch's own graph when it can, else as a group of
its own; retries, the ``on_save_error`` policy, and which epoch is committed last."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .._model.metrics import means
from ..checkpoint import MultiNodeCheckpointManager
from ..errors import CheckpointLockedError, CheckpointWriteError, NodeLostError, SessionClosedError, SessionLostError
from ..session import Session, as_session
from ._writer import holding_lock

if TYPE_CHECKING:
    from .._model.group import TaskGroup

logger = logging.getLogger("daskjobs")


class EpochSaver:
    """Saves and commits the epochs of one run through ``manager``.

    :attr:`last_committed` is the newest epoch this run committed (or resumed from): what a
    recovery restores and what a graceful stop reports.

    An epoch saved inside its own graph is committed while a later epoch runs (:meth:`meanwhile`)
    where the manager allows it (:attr:`~daskjobs.MultiNodeCheckpointManager.may_defer_commit`):
    the nodes write the epoch's groups at the end of its graph and fsync them in the background;
    the next epoch's hooks report them durable, and the epoch after it writes the commit record.
    The fsyncs and the commit then cost the epoch loop nothing. Whatever ends the loop waits for
    the flushes and commits first (:meth:`flush`, :meth:`settle`).
    """

    def __init__(
        self,
        manager: MultiNodeCheckpointManager,
        job: str,
        *,
        save_retries: int,
        on_save_error: Literal["raise", "warn"],
        last_committed: int | None = None,
    ) -> None:
        self.manager, self.job = manager, job
        self.save_retries, self.on_save_error = save_retries, on_save_error
        self.last_committed = last_committed
        self._waiting: list[tuple[int, dict[str, bool], dict[str, float], dict[str, float]]] = []
        self._deferred_error: Exception | None = None
        self._written: tuple[int, int] | None = None
        self._then: list[tuple[int, Callable[[], object]]] = []

    def hooks(
        self, epoch: int, used_nodes: list[str], session: Session, *, last: bool = False
    ) -> dict[str, Callable[[Any], Any]] | None:
        """The ``finish`` hooks saving ``epoch`` inside the graph of the group that runs it (the
        epoch group, or the init group for epoch 0); ``None`` when a checkpointed node does not
        run in it (then :meth:`save` saves as a group of its own); ``{}`` when the storage is not
        accessible, or the save cannot start (e.g. ``epoch`` is already committed): then the
        save is skipped with a warning (``on_save_error="warn"``) or :meth:`failed` raises.

        ``last``: the run is expected to end with this epoch. Its nodes then fsync inside the
        graph instead of in the background, so that ending the run needs no round trip to ask
        for the flushes (a wrong guess costs time, never safety).
        """
        manager = self.manager
        if not set(manager.nodes()) <= set(used_nodes) or overrides(manager, "save"):
            return None
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return {}
        try:
            return manager.finish_hooks(epoch, flush_later=session.background_flushes and not last)
        except (NodeLostError, CheckpointLockedError, SessionLostError, SessionClosedError):
            raise
        except Exception as exc:  # e.g. the epoch is already committed: a save error, by policy, not retried
            self.failed(epoch, exc)
            return {}

    def run_init(self, session: Session, init_group: TaskGroup, nodes: list[str], *, attempt: int) -> None:
        """Run the job's ``init_group`` and save epoch 0 (inside its graph when possible, see :meth:`hooks`)."""
        manager, job = self.manager, self.job
        hooks = self.hooks(0, init_group.used_nodes(), session)
        if hooks:
            # The driver checked the prefix before anything ran (prepare_manager); on the nodes,
            # the save's write is the check, so the group manager.init returns is not run (it
            # registers the nodes) unless a subclass of the manager overrides init().
            check = manager.init(nodes)
            if overrides(manager, "init"):
                session.run_group(check, job=job, attempt=attempt)
        finished: dict[str, Any] = {}
        sums = session.run_group(init_group, job=job, attempt=attempt, finish=hooks or None, finished=finished)
        metrics = means(sums)  # what the init group's steps logged: epoch 0's metrics
        if hooks:
            self.accept(0, session, finished, {}, metrics)
            return
        session.run_group(manager.init(nodes), job=job, attempt=attempt)
        if hooks is None:
            self.save(0, session, {}, metrics)

    def save(self, epoch: int, session: Session, stop_values: dict[str, bool], metrics: dict[str, float]) -> float:
        """Save ``epoch`` as a group run of its own and commit it; returns the seconds it took."""
        manager = self.manager
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return 0.0
        started = time.perf_counter()
        self.flush(session)
        self._written = None

        def save() -> None:
            session.run_group(manager.save(epoch), job=self.job, epoch=epoch)
            self._commit(epoch, stop_values, metrics, {"save_seconds": time.perf_counter() - started})

        self._with_retries(epoch, save)
        return time.perf_counter() - started

    def accept(
        self,
        epoch: int,
        session: Session,
        finished: dict[str, Any],
        stop_values: dict[str, bool],
        metrics: dict[str, float],
    ) -> float:
        """Commit what the epoch's save hooks returned (one small write); a failed save is
        retried as a group of its own. Returns the node-side save time plus the commit time."""
        manager = self.manager
        started = time.perf_counter()
        node_seconds = max(
            (float(r["entry"].get("seconds", 0.0)) for r in finished.values() if r and "entry" in r), default=0.0
        )
        failed = self._take_reports(epoch, finished)
        if epoch in failed:
            self._check_lock()
            logger.warning("saving epoch %d failed: %s; saving it again", epoch, failed[epoch])
            return node_seconds + self.save(epoch, session, stop_values, metrics)
        timings = {"save_seconds": node_seconds + time.perf_counter() - started}
        entries = [r["entry"] for r in finished.values() if r and "entry" in r]
        self._written = None
        if len(entries) == len(finished):
            self._written = sum(e["bytes_written"] for e in entries), sum(e["bytes_reused"] for e in entries)
        if manager.may_defer_commit:
            self._waiting.append((epoch, stop_values, metrics, timings))
        else:
            self.commit_deferred()
            self._with_retries(epoch, lambda: self._commit(epoch, stop_values, metrics, timings))
        return node_seconds + time.perf_counter() - started

    def drop(self, epoch: int, finished: dict[str, Any]) -> None:
        """``epoch`` ran but is not committed (e.g. a stop value is invalid): take what its save hooks
        reported of earlier epochs' saves (a flush, the async save in flight), so that those are
        still committed, and forget its own save (its files are debris for the next run's cleanup)."""
        if finished:
            self._take_reports(epoch, finished)
        self.manager.forget_save(epoch)

    def salvage(self, epoch: int, finished: dict[str, Any]) -> None:
        """``epoch``'s run failed: take the flush reports its save hooks gave on the nodes that finished,
        so that the epochs before it are still committed when the failed run settles (a node whose
        hook ran has no flush of them left to report); ``epoch`` itself is not committed. A flush
        that failed is logged: the run's own error is what surfaces. An epoch whose flush failed is
        never committed, so its ``on_epoch`` call is dropped."""
        for other, error in sorted(self.manager.salvage_finished(epoch, finished).items()):
            self._waiting = [w for w in self._waiting if w[0] != other]
            self._then = [(e, call) for e, call in self._then if e != other]
            logger.warning("could not write the checkpoint of epoch %d: %s", other, error)

    def _take_reports(self, epoch: int, finished: dict[str, Any]) -> dict[int, CheckpointWriteError]:
        """Give the manager what ``epoch``'s save hooks returned (committing the asynchronous save
        they waited for); give up the earlier epochs whose saves failed; return the failed saves."""
        in_flight = self.manager.pending_epoch()
        failed = self.manager.accept_finished(epoch, finished)
        if in_flight is not None and in_flight not in failed:
            self.last_committed = in_flight
            self._call_then(in_flight)
        for other, error in sorted(failed.items()):
            if other != epoch:
                self._give_up(other, error)
        return failed

    def commit_deferred(self) -> None:
        """Commit, oldest first, the waiting epochs that are durable on every node (retries, then
        ``on_save_error``); an epoch not yet reported durable and those after it keep waiting."""
        while self._waiting and self.manager.flushed(self._waiting[0][0]):
            waiting = self._waiting[0]
            epoch = waiting[0]
            try:
                self._with_retries(
                    epoch, lambda: self._commit(*waiting), give_up=lambda: self.manager.forget_save(epoch)
                )
            except KeyboardInterrupt:
                # A second signal struck during the commit: unless its record made it, the epoch stays
                # first in line, so that the way out (settle) commits it before any later epoch.
                if self._on_disk(epoch):
                    self._waiting.pop(0)
                raise
            except BaseException:
                self._waiting.pop(0)
                raise
            self._waiting.pop(0)
            self._call_then(epoch)

    def _on_disk(self, epoch: int) -> bool:
        """Whether ``epoch``'s commit record is under the prefix (``False`` if it cannot be listed)."""
        try:
            return epoch in self.manager.store.committed_epochs()
        except Exception:
            return False

    def when_committed(self, call: Callable[[], object]) -> None:
        """Call ``call`` once the last epoch saved is committed: now, or after its waiting commit
        (or the commit of its asynchronous save)."""
        in_flight = self.manager.pending_epoch()
        if self._waiting:
            self._then.append((self._waiting[-1][0], call))
        elif in_flight is not None:
            self._then.append((in_flight, call))
        else:
            call()

    def _call_then(self, epoch: int) -> None:
        """Make the calls :meth:`when_committed` kept for ``epoch`` and the epochs before it."""
        now = [call for e, call in self._then if e <= epoch]
        self._then = [(e, call) for e, call in self._then if e > epoch]
        for call in now:
            call()

    def _give_up(self, epoch: int, error: BaseException | None) -> None:
        """A waiting epoch whose save failed after all (its background flush; the manager forgot it
        already): by policy, as :meth:`failed`."""
        self._waiting = [w for w in self._waiting if w[0] != epoch]
        self.failed(epoch, error)
        self._call_then(epoch)

    def _wait_flushes(self, session: Session) -> None:
        """Wait for the nodes' background flushes of the waiting epochs (one small group)."""
        if any(not self.manager.flushed(w[0]) for w in self._waiting):
            for epoch, error in sorted(self.manager.wait_flushes(session).items()):
                self._give_up(epoch, error)

    def meanwhile(self) -> None:
        """While the next epoch runs: commit the waiting epochs that are durable, then delete the
        groups of the epochs retention un-committed.

        An error is kept for :meth:`check_meanwhile` (a session's ``meanwhile`` must not raise);
        an interruption (``KeyboardInterrupt``) goes through at once.
        """
        try:
            self.commit_deferred()
        except Exception as exc:
            self._deferred_error = exc
        self.manager.tidy()

    def check_meanwhile(self, epoch: int | None = None) -> None:
        """Raise the error of the commit :meth:`meanwhile` wrote, if it failed.

        That error ends the run, which commits nothing after the epoch that failed: the epochs
        still waiting for their commit and ``epoch`` (whose run just ended) are forgotten, so the
        way out neither commits them nor asks the nodes for their flushes (a node reports only
        its newest flush: the others would read as lost with a restarted worker).
        """
        error, self._deferred_error = self._deferred_error, None
        if error is not None:
            for waiting in [w[0] for w in self._waiting] + ([] if epoch is None else [epoch]):
                self.manager.forget_save(waiting)
            self._waiting = []
            raise error

    def settle(self, session: Session | None = None) -> bool:
        """On the way out of a failed run: commit the waiting epochs (they finished), once durable,
        and, through ``session``, the asynchronous save in flight. The flushes are asked of the
        nodes through ``session`` (when it still works); a flush no node can report (its worker
        died) is made from here. A failure is logged, and epochs that cannot be committed are
        forgotten. ``True`` if an epoch was committed."""
        before = self.last_committed
        try:
            if session is not None:
                self._wait_flushes(session)
        except Exception as exc:
            logger.warning("%s", exc)
        try:
            for epoch, *_ in self._waiting:
                if not self.manager.flushed(epoch) and not self.manager.flush_here(epoch):
                    break
            self.commit_deferred()
        except Exception as exc:
            logger.warning("%s", exc)
        pending = self.manager.pending_epoch()
        if session is not None and pending is not None:  # the asynchronous save of a finished epoch
            try:
                self.manager.flush(session)
                self.last_committed = pending
            except Exception as exc:
                logger.warning("could not commit the asynchronous save of epoch %d: %s", pending, exc)
                self.manager.discard_pending()
            else:
                try:  # committed like any other epoch: its on_epoch call, with its bytes
                    self._call_then(pending)
                except Exception as exc:
                    logger.warning("%s", exc)
        for epoch, *_ in self._waiting:
            self.manager.forget_save(epoch)
        self._waiting, self._then = [], []
        return self.last_committed != before

    def flush(self, session: Session) -> None:
        """Commit the epochs waiting for their commit (once their nodes report them durable) and
        the asynchronous save in flight, if any."""
        self._wait_flushes(session)
        self.commit_deferred()
        manager = self.manager
        pending = manager.pending_epoch()
        if pending is not None:

            def flush() -> None:
                manager.flush(session)
                self.last_committed = pending

            self._with_retries(pending, flush, give_up=manager.discard_pending)
            self._call_then(pending)

    def bytes(self, epoch: int) -> tuple[int, int] | None:
        """Bytes written and reused by the save of ``epoch``: from its commit when it is committed,
        else from the nodes' entries of an epoch saved in its graph; ``None`` while an asynchronous
        save is still running (the figures come with its commit)."""
        committed = self.manager.committed_bytes.get(epoch)
        if committed is not None:
            return committed
        return self._written

    def failed(self, epoch: int, error: BaseException | None) -> None:
        """Give up on saving ``epoch``: raise :class:`CheckpointWriteError` or warn, by policy; a lock
        that provably vanished or changed hands stops the run with :class:`CheckpointLockedError`."""
        self._check_lock()
        message = f"could not write the checkpoint of epoch {epoch} under {self.manager.store.url}: {error}"
        if self.on_save_error == "raise":
            raise CheckpointWriteError(f"{message}; the last committed checkpoint is intact") from error
        logger.warning("%s; continuing (on_save_error='warn')", message)

    def _commit(
        self, epoch: int, stop_values: dict[str, bool], metrics: dict[str, float], timings: dict[str, float]
    ) -> None:
        manager = self.manager
        manager.write_checkpoint_metadata(epoch, stop_values=stop_values, timings=timings, metrics=metrics)
        if manager.pending_epoch() is None:
            self.last_committed = epoch
            manager.report_checkpoint_stats("checkpoint_save")

    def _check_lock(self) -> None:
        """After a failed save: stop with :class:`CheckpointLockedError` if the lock (or the whole
        prefix) provably vanished or changed hands, rather than retry into a prefix that is no
        longer ours. Storage that cannot be read is a save error (``on_save_error`` decides); the
        commit's own lock check stays strict."""
        if self.manager.holds_lock:
            self.manager.store.check_not_taken()

    def _with_retries(
        self, epoch: int, attempt: Callable[[], object], give_up: Callable[[], None] | None = None
    ) -> None:
        error: BaseException | None = None
        for number in range(self.save_retries + 1):
            try:
                attempt()
                return
            except (NodeLostError, CheckpointLockedError, SessionLostError, SessionClosedError):
                raise
            except Exception as exc:
                error = exc
                self._check_lock()
                logger.warning(
                    "saving epoch %d failed (attempt %d of %d): %s", epoch, number + 1, self.save_retries + 1, exc
                )
                time.sleep(min(0.05 * 2**number, 1.0))
        if give_up is not None:
            give_up()
        self.failed(epoch, error)


def overrides(manager: MultiNodeCheckpointManager, method: str) -> bool:
    """Whether ``manager``'s class overrides ``method`` (``"save"``, ``"load"``, ``"init"``): the
    runner then runs the group it returns, as in Caffe2, instead of its own equivalent."""
    return getattr(type(manager), method) is not getattr(MultiNodeCheckpointManager, method)


def save_now(
    manager: MultiNodeCheckpointManager,
    job: str,
    epoch: int,
    session: Session,
    stop_values: dict[str, bool],
    *,
    save_retries: int,
    on_save_error: str,
    break_lock: bool,
) -> None:
    """:meth:`~daskjobs.JobRunner.save_checkpoints`: save and commit ``epoch`` now, holding the
    prefix's lock for it (unless this process holds it already: a running ``train()``)."""
    saver = EpochSaver(manager, job, save_retries=save_retries, on_save_error=on_save_error)
    if manager.holds_lock:  # called while this runner trains (from on_epoch, for instance)
        saver.save(epoch, session, stop_values, {})
        return
    with holding_lock(manager, job, break_lock=break_lock):
        manager.check_shared(session)
        saver.save(epoch, session, stop_values, {})
        saver.flush(session)


def load_now(
    manager: MultiNodeCheckpointManager, nodes: list[str], blob_names: list[str], epoch: int, session: Any
) -> bool:
    """:meth:`~daskjobs.JobRunner.load_blobs_from_checkpoints` (``session`` may also be a Client or
    ``None``: a session made here is closed here)."""
    own, session = not isinstance(session, Session), as_session(session)
    try:
        loaded = manager.load_blobs_locally(nodes, blob_names, epoch, session)
    finally:
        if own:
            session.close()
    manager.report_checkpoint_stats("checkpoint_partial_load")
    return loaded
