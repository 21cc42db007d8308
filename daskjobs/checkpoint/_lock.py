"""The writer lock of a checkpoint prefix: who holds it, and whether that holder still lives."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any


def local_holder(job: str) -> dict[str, Any]:
    """The lock holder record of this process running ``job``."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": job,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def holder_alive(holder: Mapping[str, Any]) -> bool | None:
    """Whether the process named by a lock holder record still runs.

    ``True``: it runs on this host. ``False``: it provably does not (this host, no such
    process, or a pid that cannot exist). ``None``: unknown (another host, or an unreadable record).
    """
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int):
        return None
    if pid <= 0 or pid > 2**22:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unlock(store: Any, *, force: bool = False) -> dict[str, Any] | None:
    """Remove the writer lock of ``store``'s prefix; return the holder record removed (``None`` if unlocked).

    Refuses, with :class:`~daskjobs.errors.CheckpointLockedError`, when the holder may still run
    (:func:`holder_alive` is not ``False``) unless ``force`` is true.
    """
    from ..errors import CheckpointLockedError

    holder = store.read_lock()
    if holder is None:
        return None
    if not force and holder_alive(holder) is not False:
        raise CheckpointLockedError(
            f"the writer lock of {store.url} is held by {holder}, which may still be running; "
            "stop it first, or pass --force (force=True) if you are sure it is gone"
        )
    store.release_lock()
    return holder
