"""Durability on local disks: fsync of paths, several at once, or one ``syncfs`` for many.

The fsync threads are one pool per process, and one more thread writes groups and makes them
durable in the background (:func:`in_background`); both are made again in a forked child (a snapshot writer),
whose parent's threads are gone.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")

FSYNC_EACH_UP_TO = 64
"""Up to this many paths are fsynced each (only our own data); more are flushed with one ``syncfs``."""
_FSYNC_THREADS = 8


@cache
def _libc_syncfs() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux: fall back to one fsync per file
        return None


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None
_background: tuple[int, ThreadPoolExecutor] | None = None


def _reset_pool_after_fork() -> None:
    """In a forked child (a snapshot writer): a fresh lock and no pools (the parent's threads are gone,
    and another thread may have held the lock at the fork)."""
    global _pool_lock, _pool, _background
    _pool_lock, _pool, _background = threading.Lock(), None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def _fsync_pool() -> ThreadPoolExecutor:
    """The process's pool of fsync threads, made once (and anew in a forked child, whose threads are gone):
    starting threads for every flush costs as much as the fsyncs of a small group."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_FSYNC_THREADS, thread_name_prefix="daskjobs-fsync"))
        return _pool[1]


def in_background(job: Callable[[], T]) -> Future[T]:
    """Run ``job`` (writing a group, making one durable, deleting retired ones) in this process's
    one background thread.

    Jobs run one after the other, in the order given: a group is durable only after every group
    submitted before it (whose files a later group may hard-link) is.
    """
    global _background
    with _pool_lock:
        if _background is None or _background[0] != os.getpid():
            _background = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="daskjobs-flush"))
        return _background[1].submit(job)


def fsync_soon(fd: int) -> None:
    """fsync then close the open file ``fd`` in a background thread (nothing waits for it)."""

    def sync_and_close() -> None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    _fsync_pool().submit(sync_and_close)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_paths(paths: Sequence[str]) -> None:
    """Make ``paths`` (files and directories of one filesystem) durable.

    Up to :data:`FSYNC_EACH_UP_TO` paths (a few big blobs) are fsynced each, several at once:
    that flushes only our own data. For more, on Linux, one ``syncfs`` flushes the whole
    filesystem: it costs a few fsyncs, far less than hundreds of them for many small blobs.
    """
    if not paths:
        return
    syncfs = _libc_syncfs() if len(paths) > FSYNC_EACH_UP_TO else None
    if syncfs is not None:
        fd = os.open(paths[0], os.O_RDONLY)
        try:
            if syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"syncfs failed: {os.strerror(code)}", paths[0])
        finally:
            os.close(fd)
        return
    if len(paths) == 1:
        fsync_path(paths[0])
        return
    list(_fsync_pool().map(fsync_path, paths))
