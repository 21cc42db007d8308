"""A run's policy for failed saves (``save_retries``, ``on_save_error``), the check of a prefix
before a run, and the checkpoint calls a job makes itself (:class:`ManualCheckpoints`: saves and
loads outside :meth:`~daskjobs.JobRunner.train`, commits from its hooks). Saving and committing
themselves are the commit pipeline's (``MultiNodeCheckpointManager.writing``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..checkpoint import MultiNodeCheckpointManager
from ..errors import CheckpointWriteError, JobDefinitionError
from ..session import Session, as_session

if TYPE_CHECKING:
    from .._model.job import Job
    from ..checkpoint._managers.pipeline import CommitPipeline

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class RetryPolicy:
    """What a run does when a save of an epoch fails, wherever it failed (a node's save hook, its
    background flush, the commit record): the commit pipeline tries again up to ``retries`` times,
    waiting a little longer each time (:meth:`failed`), then raise
    :class:`~daskjobs.errors.CheckpointWriteError` (``on_save_error="raise"``) or log a warning and go
    on (``"warn"``) (:meth:`give_up`). ``url`` names the prefix in those messages."""

    retries: int
    on_save_error: Literal["raise", "warn"]
    url: str

    def failed(self, epoch: int, number: int, error: BaseException) -> None:
        """Attempt ``number`` (from 0) of saving ``epoch`` failed with ``error``: log it, then wait a little
        longer after each failure before the next attempt."""
        logger.warning("saving epoch %d failed (attempt %d of %d): %s", epoch, number + 1, self.retries + 1, error)
        time.sleep(min(0.05 * 2**number, 1.0))

    def give_up(self, epoch: int, error: BaseException | None) -> None:
        """Give up on saving ``epoch``: raise :class:`CheckpointWriteError` or warn, by policy."""
        message = f"could not write the checkpoint of epoch {epoch} under {self.url}: {error}"
        if self.on_save_error == "raise":
            raise CheckpointWriteError(f"{message}; the last committed checkpoint is intact") from error
        logger.warning("%s; continuing (on_save_error='warn')", message)


class ManualCheckpoints:
    """Mixed into :class:`~daskjobs.JobRunner`: the checkpoint calls a job makes itself, Caffe2's
    ``save_checkpoints`` and ``load_blobs_from_checkpoints`` (before :meth:`~daskjobs.JobRunner.train`
    too) and ``commit_saved`` (from a hook while it trains).

    Uses the runner's attributes below; ``_pipeline`` and ``_session`` are set while it trains.
    """

    job: Job
    checkpoint_manager: MultiNodeCheckpointManager | None
    save_retries: int
    on_save_error: Literal["raise", "warn"]
    break_lock: bool
    _pipeline: CommitPipeline | None
    _session: Session | None

    def commit_saved(self) -> None:
        """Commit now every epoch the running :meth:`train` saved and has not committed yet, waiting
        for the nodes' background writes (a run commits an epoch while a later one runs): for a hook
        that must find an epoch committed before the next one starts (``before_epoch``). Only from
        the thread that runs ``train`` (a hook's); outside a checkpointed ``train`` it does nothing.
        """
        if self._pipeline is not None and self._session is not None:
            self._pipeline.flush(self._session)

    def save_checkpoints(self, epoch: int, session: Session, stop_values: dict[str, bool] | None = None) -> None:
        """Save every checkpointed node's workspace as ``epoch`` and commit it.

        With an asynchronous manager the previous epoch's background save is committed first
        and this one is committed later. Failures are retried ``save_retries`` times; then
        ``on_save_error`` decides. Works before :meth:`train` too: the manager is first set up
        for the job's checkpointed nodes and name, and the prefix's writer lock is held for the
        save (and the commit of an asynchronous save, waited for), as :meth:`train` holds it.

        Raises
        ------
        CheckpointLockedError
            Another writer (a running :meth:`train`) holds the prefix; nothing was written.
        CheckpointStorageError
            A node's worker does not see the prefix as this process does (see
            :meth:`~daskjobs.MultiNodeCheckpointManager.check_shared`); nothing was written.
        """
        manager = self._set_up_manager()
        stop_values = stop_values or {}
        with manager.writing(self.job.name, break_lock=self.break_lock, policy=self._policy(manager)) as pipeline:
            if pipeline.nested:  # called while this runner trains (from on_epoch, for instance)
                pipeline.save(session, epoch, stop_values, {})
                return
            manager.check_shared(session)
            pipeline.save(session, epoch, stop_values, {})
            pipeline.flush(session)

    def load_blobs_from_checkpoints(self, blob_names: list[str], epoch: int, session: Session) -> bool:
        """Load ``blob_names`` of ``epoch`` into every checkpointed node; ``False`` (nothing loaded)
        if any node has no committed checkpoint of that epoch (works before :meth:`train` too)."""
        manager, nodes = self._set_up_manager(), self.job.nodes_to_checkpoint()
        own, session = not isinstance(session, Session), as_session(session)
        try:
            loaded = manager.load_blobs_locally(nodes, blob_names, epoch, session)
        finally:
            if own:
                session.close()
        manager.report_checkpoint_stats("checkpoint_partial_load")
        return loaded

    def _policy(self, manager: MultiNodeCheckpointManager) -> RetryPolicy:
        return RetryPolicy(self.save_retries, self.on_save_error, manager.store.url)

    def _set_up_manager(self) -> MultiNodeCheckpointManager:
        """The checkpoint manager, told the job's checkpointed nodes and name (as :meth:`train` does)."""
        manager = self.checkpoint_manager
        if manager is None:
            raise JobDefinitionError("this JobRunner has no checkpoint manager")
        manager.set_params(nodes=self.job.nodes_to_checkpoint(), job_name=self.job.name)
        return manager


def prepare_manager(
    manager: MultiNodeCheckpointManager, job: Job, resume_from_epoch: int | None, *, warn_unwritable: bool
) -> tuple[MultiNodeCheckpointManager | None, int | None]:
    """Check ``manager``'s prefix for a run of ``job`` before anything runs.

    Returns the manager to use (``None``: run without checkpoints, when the prefix is not
    writable and ``warn_unwritable``) and the metadata handler's answer to ``resume_from_epoch``
    (``None`` when that is ``None``). Only reads: the epoch to resume from must be committed.
    """
    manager.set_params(nodes=job.nodes_to_checkpoint(), job_name=job.name)
    resume = None
    if resume_from_epoch is not None:
        resume = manager.get_resume_from_epoch_id(resume_from_epoch)  # reads its record
        if resume_from_epoch not in manager.store.committed_epochs():
            manager.store.read_commit(resume_from_epoch)  # CheckpointNotFoundError naming it
    try:
        manager.store.check_writable()
    except CheckpointWriteError as exc:
        if not warn_unwritable:
            raise
        logger.warning("%s; running job %r without checkpoints (on_save_error='warn')", exc, job.name)
        return None, None
    return manager, resume
