"""Durability on local disks: fsync of paths, several at once, or one ``syncfs`` for many.

The fsync threads are one pool per process, one more thread writes groups in the background
(:func:`in_background`), one deletes retired groups (:func:`deleting_in_background`), and one makes
groups durable in batches (:func:`sync_soon`: the groups of every node a process serves, made durable
by one ``syncfs`` instead of one fsync per file each).
All are made again in a forked child (a snapshot writer), whose parent's threads are gone.

All are daemon threads (:class:`DaemonPool`): whoever waits for them, the process's exit included
(it lets the write and delete threads finish what is queued there), waits at most
``daskjobs.storage-timeout`` (see :mod:`.deadline`), so one stuck in the OS on a hung mount never
keeps its process from exiting for longer.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple, TypeVar

from .deadline import DaemonPool, Deadline

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
_pool: tuple[int, DaemonPool] | None = None
_background: tuple[int, DaemonPool] | None = None
_deleter: tuple[int, DaemonPool] | None = None
_writing = 0
"""Jobs queued in or running on the background write thread."""
_syncer: _Syncer | None = None
_WRITE_THREADS = 1
"""Threads writing (and threads deleting) groups in the background, per process: one each, as
threads handing the GIL to each other cost more than the syscalls of small groups they overlap."""
_LINGER = 0.05
"""Longest a batch of syncs waits for the background write thread to finish the jobs queued there."""
_GATHER = 0.01
"""How long a batch of syncs waits at most, after its first request, for as many requests as its
largest batch had (the groups of the other nodes a process serves, whose tasks end a few
milliseconds apart): one sync for them all. A process that serves one node never waits."""


def _reset_pool_after_fork() -> None:
    """In a forked child (a snapshot writer): a fresh lock and no pools (the parent's threads are gone,
    and another thread may have held the lock at the fork)."""
    global _pool_lock, _pool, _background, _deleter, _writing, _syncer
    _pool_lock, _pool, _background, _deleter, _writing, _syncer = threading.Lock(), None, None, None, 0, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


@atexit.register
def _finish_queued_work() -> None:
    """At exit, let the background write and delete threads finish the jobs queued there (a retired
    group's deletion, a group's write), within ``daskjobs.storage-timeout``: their threads are
    daemons, which the interpreter would otherwise stop wherever they are."""
    with _pool_lock:
        pools = [made[1] for made in (_background, _deleter) if made is not None and made[0] == os.getpid()]
    deadline = Deadline()
    for pool in pools:  # one thread each: a call queued last ends after every call queued before it
        with contextlib.suppress(TimeoutError):
            deadline.result(pool.submit(lambda: None), "the background work queued at exit")


def _fsync_pool() -> DaemonPool:
    """The process's pool of fsync threads, made once (and anew in a forked child, whose threads are gone):
    starting threads for every flush costs as much as the fsyncs of a small group."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), DaemonPool(_FSYNC_THREADS, "daskjobs-fsync"))
        return _pool[1]


def in_background(job: Callable[[], T]) -> Future[T]:
    """Run ``job`` (writing a group) in this process's background write thread, one after the other.

    While jobs are queued or run there, the batches of syncs wait for them (at most :data:`_LINGER`
    seconds): the groups a process's nodes hand over at the end of an epoch are made durable together.
    """
    global _background, _writing
    with _pool_lock:
        if _background is None or _background[0] != os.getpid():
            _background = (os.getpid(), DaemonPool(_WRITE_THREADS, "daskjobs-write"))
        _writing += 1
        future = _background[1].submit(job)
    future.add_done_callback(_written)
    return future


def _written(_future: Future[Any]) -> None:
    global _writing
    with _pool_lock:
        _writing -= 1
        idle = _writing == 0
    syncer = _syncer
    if idle and syncer is not None:
        syncer.wake()


def deleting_in_background(job: Callable[[], T]) -> Future[T]:
    """Run ``job`` (deleting retired groups) in this process's deleting threads: deletions never hold
    back the writes and syncs of the groups an epoch waits for."""
    global _deleter
    with _pool_lock:
        if _deleter is None or _deleter[0] != os.getpid():
            _deleter = (os.getpid(), DaemonPool(_WRITE_THREADS, "daskjobs-delete"))
        return _deleter[1].submit(job)


def fsync_soon(fd: int) -> None:
    """fsync then close the open file ``fd`` in a background thread (nothing waits for it)."""

    def sync_and_close() -> None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    _fsync_pool().submit(sync_and_close)


def fsync_in_background(path: str) -> Future[None]:
    """fsync a file or directory by path in a background thread; the future fails with its ``OSError``."""
    return _fsync_pool().submit(fsync_path, path)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_paths(paths: Sequence[str], *, many: bool = False) -> None:
    """Make ``paths`` (files and directories of one filesystem) durable.

    Up to :data:`FSYNC_EACH_UP_TO` paths (a few big blobs) are fsynced each, several at once:
    that flushes only our own data. For more, or with ``many`` (the groups of several nodes), on
    Linux, one ``syncfs`` flushes the whole filesystem: it costs a few fsyncs, far less than
    hundreds of them for many small blobs.
    """
    if not paths:
        return
    syncfs = _libc_syncfs() if many or len(paths) > FSYNC_EACH_UP_TO else None
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
    _fsync_pool().map(fsync_path, paths, lambda path: f"the fsync of {path}")


@dataclass(frozen=True)
class Staged:
    """A group written in a staging folder, put in place once all of it is durable: ``folder`` is
    renamed to ``target``, whose parent folder then needs a sync."""

    folder: str
    target: str

    def publish(self) -> str:
        """Do the rename; return the folder whose entries changed (to be synced)."""
        os.rename(self.folder, self.target)
        return os.path.dirname(self.target)


class _Request(NamedTuple):
    paths: list[str]
    staged: Staged | None
    future: Future[None]


class _Syncer:
    """One thread of a process that makes groups durable in batches.

    Requests that arrive while a batch is being synced wait for the next batch, which syncs the
    union of their paths at once (per filesystem): when a process serves many nodes, their groups
    of one epoch cost one ``syncfs`` instead of an fsync of every file of every group. Then the
    batch's renames (groups written in a staging folder) are done, and their parent folder synced once.
    A batch that fails is synced again request by request, so that each request gets its own outcome.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._wake = threading.Condition(threading.Lock())
        self._pending: list[_Request] = []
        self._expected = 1
        """The largest batch so far: how many requests a batch gathers before it goes."""
        threading.Thread(target=self._serve, name="daskjobs-sync", daemon=True).start()

    def wake(self) -> None:
        """The background writes are done: a batch waiting for them goes on."""
        with self._wake:
            self._wake.notify()

    def request(self, paths: list[str], staged: Staged | None = None) -> Future[None]:
        future: Future[None] = Future()
        with self._wake:
            self._pending.append(_Request(paths, staged, future))
            if len(self._pending) in (1, self._expected):  # the others join the batch it gathers
                self._wake.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._pending:
                    self._wake.wait()
            started = time.monotonic()
            with self._wake:  # groups being written, and those of nodes finishing now, join this batch
                while (now := time.monotonic()) < started + _LINGER and (
                    _writing or (now < started + _GATHER and len(self._pending) < self._expected)
                ):
                    self._wake.wait(started + (_LINGER if _writing else _GATHER) - now)
                batch, self._pending = self._pending, []
                self._expected = max(self._expected, len(batch))
            try:
                self._sync_batch(batch)
            except BaseException as exc:  # this thread must outlive anything: every request gets an outcome
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)

    def _sync_batch(self, batch: list[_Request]) -> None:
        by_device: dict[int, list[_Request]] = {}
        for request in batch:
            try:
                device = os.lstat(request.paths[0]).st_dev
            except OSError as exc:
                request.future.set_exception(exc)
                continue
            by_device.setdefault(device, []).append(request)
        for requests in by_device.values():
            self._sync(requests)

    @staticmethod
    def _sync(requests: list[_Request]) -> None:
        union = list(dict.fromkeys(path for paths, _, _ in requests for path in paths))
        try:
            if len(requests) > 1:  # one syncfs for several groups, once every path is still there
                for path in union:
                    os.lstat(path)
            sync_paths(union, many=len(requests) > 1)
        except BaseException:
            for paths, staged, future in requests:
                try:
                    sync_paths(paths)
                    publish_durably(staged)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(None)
            return
        published: list[Future[None]] = []
        folders: list[str] = []
        for _paths, staged, future in requests:
            try:
                folders.extend([staged.publish()] if staged is not None else [])
            except OSError as exc:
                future.set_exception(exc)
            else:
                published.append(future)
        try:
            if folders:
                sync_paths(list(dict.fromkeys(folders)))
        except OSError as exc:
            for future in published:
                future.set_exception(exc)
            return
        for future in published:
            future.set_result(None)


def publish_durably(staged: Staged | None) -> None:
    """Put ``staged`` in place (``None``: nothing), and make that durable."""
    if staged is not None:
        sync_paths([staged.publish()])


def sync_soon(paths: Sequence[str], staged: Staged | None = None) -> Future[None]:
    """Make ``paths`` (of one filesystem) durable in this process's next batch of syncs (see
    :class:`_Syncer`), then put ``staged`` in place and make that durable; the future fails with
    the ``OSError`` of the sync or rename."""
    global _syncer
    if not paths:
        if staged is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        paths = [os.path.dirname(staged.target)]
    with _pool_lock:
        if _syncer is None or _syncer.pid != os.getpid():
            _syncer = _Syncer()
        syncer = _syncer
    return syncer.request(list(paths), staged)
