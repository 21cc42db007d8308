"""How a run checkpoints its epochs: inside the epoch's own graph when it can, else as a group of
its own; retries, the ``on_save_error`` policy, and which epoch is committed last."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .errors import CheckpointLockedError, CheckpointWriteError, NodeLostError, SessionClosedError, SessionLostError

if TYPE_CHECKING:
    from .checkpoint import MultiNodeCheckpointManager
    from .session import Session

logger = logging.getLogger("daskjobs")


class EpochSaver:
    """Saves and commits the epochs of one run through ``manager``.

    :attr:`last_committed` is the newest epoch this run committed (or resumed from): what a
    recovery restores and what a graceful stop reports.

    An epoch saved inside its own graph is committed while the next epoch runs (:meth:`meanwhile`)
    where the manager allows it: the commit record's write and fsync then cost the epoch loop
    nothing. Whatever ends the loop commits it first (:meth:`flush`, :meth:`settle`).
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
        self._deferred: tuple[int, dict[str, bool], dict[str, float], dict[str, float]] | None = None
        self._deferred_error: Exception | None = None
        self._written: tuple[int, int] | None = None
        self._then: list[Callable[[], object]] = []

    def hooks(self, epoch: int, used_nodes: list[str]) -> dict[str, Callable[[Any], Any]] | None:
        """The ``finish`` hooks saving ``epoch`` inside the epoch's graph; ``None`` when a
        checkpointed node does not run in it (then :meth:`save` saves as a group of its own);
        ``{}`` when the storage is not accessible (the save is skipped, with a warning)."""
        manager = self.manager
        if not set(manager.nodes()) <= set(used_nodes):
            return None
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return {}
        return manager.finish_hooks(epoch)

    def save(self, epoch: int, session: Session, stop_values: dict[str, bool], metrics: dict[str, float]) -> float:
        """Save ``epoch`` as a group run of its own and commit it; returns the seconds it took."""
        manager = self.manager
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return 0.0
        started = time.perf_counter()
        self.flush(session)

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
        in_flight = manager.pending_epoch()
        failed = manager.accept_finished(epoch, finished)
        if in_flight is not None and in_flight not in failed:
            self.last_committed = in_flight
        for other, error in failed.items():
            if other != epoch:
                self.failed(other, error)
        if epoch in failed:
            self._check_lock()
            logger.warning("saving epoch %d failed: %s; saving it again", epoch, failed[epoch])
            return node_seconds + self.save(epoch, session, stop_values, metrics)
        timings = {"save_seconds": node_seconds + time.perf_counter() - started}
        if manager.may_defer_commit:
            self.commit_deferred()
            self._deferred = (epoch, stop_values, metrics, timings)
            entries = [r["entry"] for r in finished.values()]
            self._written = sum(e["bytes_written"] for e in entries), sum(e["bytes_reused"] for e in entries)
        else:
            self._with_retries(epoch, lambda: self._commit(epoch, stop_values, metrics, timings))
        return node_seconds + time.perf_counter() - started

    def commit_deferred(self) -> None:
        """Commit the epoch whose commit waits for the next epoch, if any (retries, then ``on_save_error``)."""
        deferred, self._deferred = self._deferred, None
        then, self._then = self._then, []
        if deferred is not None:
            epoch = deferred[0]
            self._with_retries(epoch, lambda: self._commit(*deferred), give_up=lambda: self.manager.forget_save(epoch))
        for call in then:
            call()

    def when_committed(self, call: Callable[[], object]) -> None:
        """Call ``call`` once the last epoch saved is committed: now, or after its waiting commit."""
        if self._deferred is None:
            call()
        else:
            self._then.append(call)

    def meanwhile(self) -> None:
        """While the next epoch runs: commit the waiting epoch, then delete the groups of the
        epochs retention un-committed.

        An error is kept for :meth:`check_meanwhile` (a session's ``meanwhile`` must not raise);
        an interruption (``KeyboardInterrupt``) goes through at once.
        """
        try:
            self.commit_deferred()
        except Exception as exc:
            self._deferred_error = exc
        self.manager.tidy()

    def check_meanwhile(self) -> None:
        """Raise the error of the commit :meth:`meanwhile` wrote, if it failed."""
        error, self._deferred_error = self._deferred_error, None
        if error is not None:
            raise error

    def settle(self) -> bool:
        """On the way out of a failed run: commit the waiting epoch (it finished); a failure is
        logged. ``True`` if an epoch was committed."""
        before = self.last_committed
        try:
            self.commit_deferred()
        except Exception as exc:
            logger.warning("%s", exc)
        return self.last_committed != before

    def flush(self, session: Session) -> None:
        """Commit the epoch waiting for its commit and the asynchronous save in flight, if any."""
        self.commit_deferred()
        manager = self.manager
        pending = manager.pending_epoch()
        if pending is not None:

            def flush() -> None:
                manager.flush(session)
                self.last_committed = pending

            self._with_retries(pending, flush, give_up=manager.discard_pending)

    def bytes(self) -> tuple[int, int]:
        """Bytes written and reused by the last save (of the last commit where the save is not
        waiting for its commit; ``bytes`` counts as written when a format without delta reports no split)."""
        if self._deferred is not None and self._written is not None:
            return self._written
        record = self.manager.last_commit
        if record is None:
            return 0, 0
        entries = record["node_entries"].values()
        written = sum(int(e.get("bytes_written", e.get("bytes", 0))) for e in entries)
        return written, sum(int(e.get("bytes_reused", 0)) for e in entries)

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
