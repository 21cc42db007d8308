"""Counting what processes read under a checkpoint prefix (tests of recovery from cluster memory).

An audit hook (:func:`sys.addaudithook`, which sees every ``open`` and directory listing of the
process) counts the files opened for reading and the folders listed under a watched prefix. It is
installed in the test process and, through ``client.run``, in every worker process; the counts are
read (and reset) the same way. Writes are not counted: a recovery from memory may go on writing
durable epochs, but it reads nothing.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

_LOCK = threading.Lock()
_WATCHED: set[str] = set()
_READS: list[str] = []
_INSTALLED = False
_SCRATCH = f"{os.sep}dask-scratch-space"


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _WATCHED:
        return
    if event == "open":
        path, mode, flags = [*args, None, None, None][:3]
        if isinstance(mode, str):
            reading = "r" in mode and "+" not in mode
        else:
            reading = isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_CREAT
        what = f"open {path}"
    elif event in ("os.listdir", "os.scandir"):
        path, reading, what = args[0], True, f"list {args[0]}"
    else:
        return
    if reading and isinstance(path, str | bytes):
        text = os.fsdecode(path)
        if _SCRATCH in text:  # Dask's own scratch space (a restarted worker purges a dead one's), no checkpoint
            return
        if any(text.startswith(prefix) for prefix in _WATCHED):
            with _LOCK:
                _READS.append(what)


def watch(prefix: str) -> bool:
    """Count reads under ``prefix`` in this process from now on (``client.run`` target too)."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            sys.addaudithook(_audit)
            _INSTALLED = True
        _WATCHED.add(os.path.abspath(prefix))
        _READS.clear()
    return True


def take() -> list[str]:
    """The reads counted since the last call, then forgotten (``client.run`` target too)."""
    with _LOCK:
        found = list(_READS)
        _READS.clear()
    return found


def reads_everywhere(client: Any) -> dict[str, list[str]]:
    """The reads counted in this process (``"driver"``) and in every worker since the last call."""
    found = {"driver": take()}
    found.update(client.run(take))
    return {where: reads for where, reads in found.items() if reads}


def watch_everywhere(client: Any, prefix: str) -> None:
    """Count reads under ``prefix`` in this process and in every worker (call again after a worker
    restarted: a new process has no hook)."""
    watch(prefix)
    client.run(watch, prefix)


ROOT_VARIABLE = "DASKJOBS_TEST_WATCH"
"""The environment variable naming the folder a worker process counts reads under from its start."""


def dask_setup(worker: Any) -> None:
    """As a Dask worker preload (``distributed.worker.preload``): count reads under the folder that
    :data:`ROOT_VARIABLE` names from the process's start, a restarted worker's included."""
    root = os.environ.get(ROOT_VARIABLE)
    if root:
        watch(root)
