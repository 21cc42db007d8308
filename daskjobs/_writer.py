"""The one writer of a checkpoint prefix: a runner holds the prefix's lock while it writes there."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .checkpoint._lock import local_holder

if TYPE_CHECKING:
    from .checkpoint import MultiNodeCheckpointManager
    from .session import Session

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
