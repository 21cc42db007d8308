"""The one writer of a checkpoint prefix: a runner holds the prefix's lock while it writes there."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..checkpoint._protocol.lock import local_holder
from ..errors import CheckpointWriteError

if TYPE_CHECKING:
    from .._model.job import Job
    from ..checkpoint import MultiNodeCheckpointManager
    from ..session import Session

logger = logging.getLogger("daskjobs")


@contextmanager
def holding_lock(manager: MultiNodeCheckpointManager, job: str, *, break_lock: bool = False) -> Iterator[None]:
    """Hold the writer lock of ``manager``'s prefix for ``job`` (this process) inside the block.

    On the way out the groups of epochs retention dropped are deleted, then the lock is released
    (a failure to release is a warning naming the command that removes the lock).

    Raises
    ------
    CheckpointLockedError
        Another writer holds the prefix; the message names it. Nothing was written.
    """
    manager.store.acquire_lock(local_holder(job), break_lock=break_lock)
    manager.holds_lock = True
    try:
        yield
    finally:
        manager.tidy(final=True)
        manager.holds_lock = False
        try:
            manager.store.release_lock()
        except Exception as exc:
            url = manager.store.url
            advice = f"run 'daskjobs checkpoints unlock {url}'"
            logger.warning("could not release the writer lock of %s: %s; %s", url, exc, advice)


def end_saves(manager: MultiNodeCheckpointManager, session: Session) -> None:
    """A failed run stops its background writers before it gives up the lock (best effort)."""
    try:
        manager.end_saves(session)
    except Exception as exc:
        logger.warning("could not stop the background checkpoint writes of %s: %s", manager.store.url, exc)


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
