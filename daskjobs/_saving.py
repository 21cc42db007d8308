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
        self._with_retries(epoch, lambda: self._commit(epoch, stop_values, metrics, timings))
        return node_seconds + time.perf_counter() - started

    def flush(self, session: Session) -> None:
        """Commit the asynchronous save in flight, if any."""
        manager = self.manager
        pending = manager.pending_epoch()
        if pending is not None:

            def flush() -> None:
                manager.flush(session)
                self.last_committed = pending

            self._with_retries(pending, flush, give_up=manager.discard_pending)

    def bytes(self) -> tuple[int, int]:
        """Bytes written and reused by the last commit (``bytes`` counts as written when a
        checkpoint format without delta reports no split)."""
        record = self.manager.last_commit
        if record is None:
            return 0, 0
        entries = record["node_entries"].values()
        written = sum(int(e.get("bytes_written", e.get("bytes", 0))) for e in entries)
        return written, sum(int(e.get("bytes_reused", 0)) for e in entries)

    def failed(self, epoch: int, error: BaseException | None) -> None:
        """Give up on saving ``epoch``: raise :class:`CheckpointWriteError` or warn, by policy."""
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
        if not self.manager.holds_lock:
            return
        holder = self.manager.store.read_lock()
        if holder is None or "unreadable" not in holder:
            self.manager.store.check_lock()

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
