"""A run's policy for failed saves (``save_retries``, ``on_save_error``), the check of a prefix
before a run, and the runner's saves and loads outside :meth:`~daskjobs.JobRunner.train`. Saving and
committing themselves are the commit pipeline's (``MultiNodeCheckpointManager.writing``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..checkpoint import MultiNodeCheckpointManager
from ..errors import CheckpointWriteError
from ..session import Session, as_session

if TYPE_CHECKING:
    from .._model.job import Job

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


def save_now(
    manager: MultiNodeCheckpointManager,
    job: str,
    epoch: int,
    session: Session,
    stop_values: dict[str, bool],
    *,
    policy: RetryPolicy,
    break_lock: bool,
) -> None:
    """:meth:`~daskjobs.JobRunner.save_checkpoints`: save and commit ``epoch`` now, holding the
    prefix's lock for it (unless this process holds it already: a running ``train()``)."""
    with manager.writing(job, break_lock=break_lock, policy=policy) as pipeline:
        if pipeline.nested:  # called while this runner trains (from on_epoch, for instance)
            pipeline.save(session, epoch, stop_values, {})
            return
        manager.check_shared(session)
        pipeline.save(session, epoch, stop_values, {})
        pipeline.flush(session)


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
