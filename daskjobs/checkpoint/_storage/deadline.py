"""The deadline of every wait for storage: ``daskjobs.storage-timeout`` (10 minutes by default).

A thread that waits for another thread's storage I/O to finish — an fsync thread, the background
write or sync thread, a node's save in flight, a forked snapshot writer, the retention deleter —
waits at most this long, then fails with a message saying what did not finish, how long it was
waited for and what would be right (check the storage, or raise the setting if it is only slow).
The thread stuck in the OS (a hung NFS or Lustre mount, an object store that stopped answering)
cannot be stopped: it is a daemon thread, left to finish or to end with its process, which waits
for it no longer than that either (at exit, for the work queued in the background write and delete
threads; nothing that closes waits longer).

I/O a thread does itself (a write, a rename, the fsync of one file) is not a wait for another
thread and has no deadline of its own.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from ..._config import config_timeout

T = TypeVar("T")
R = TypeVar("R")

SETTING = "storage-timeout"
"""The ``daskjobs.*`` key of the deadline."""


def storage_timeout() -> float:
    """``daskjobs.storage-timeout`` in seconds, read from this process's Dask config (the driver's, or a
    node's worker's: workers a local cluster or ``node_cluster`` starts inherit the driver's)."""
    return config_timeout(SETTING)


def too_slow(what: str, seconds: float) -> str:
    """The message of a wait for storage that ran out: ``what`` did not finish within ``seconds``."""
    return (
        f"{what} did not finish within {seconds:g} s (daskjobs.{SETTING}): the storage does not answer "
        f"(a hung NFS or Lustre mount, an object store that stopped answering?); check it, or raise "
        f"daskjobs.{SETTING} if it is only slow"
    )


class Deadline:
    """A wait for storage that started now and ends ``daskjobs.storage-timeout`` later (``seconds``:
    another length); several waits may share it."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = storage_timeout() if seconds is None else seconds
        self.ends = time.monotonic() + self.seconds

    def left(self) -> float:
        """The seconds left (0 once it passed)."""
        return max(self.ends - time.monotonic(), 0.0)

    def message(self, what: str) -> str:
        """:func:`too_slow`: ``what`` did not finish within this deadline."""
        return too_slow(what, self.seconds)

    def result(self, future: Future[T], what: str, error: type[OSError] = TimeoutError) -> T:
        """``future``'s result, once it is done within this deadline.

        Raises
        ------
        TimeoutError
            (or ``error``, another ``OSError``): ``future`` is still running at the deadline (the
            message says ``what``, see :func:`too_slow`). Else whatever ``future`` raised (a
            ``TimeoutError`` of its own too).
        """
        try:
            return future.result(self.left())
        except TimeoutError:
            if future.done():  # its own error
                raise
            raise error(self.message(what)) from None

    def joined(self, thread: threading.Thread) -> bool:
        """Wait for ``thread`` to end, within this deadline; whether it did."""
        thread.join(self.left())
        return not thread.is_alive()

    def waited(self, event: threading.Event) -> bool:
        """Wait for ``event`` to be set, within this deadline; whether it is."""
        return event.wait(self.left())


class DaemonPool:
    """Up to ``size`` daemon threads (``name_0``, ``name_1``, ... as a ``ThreadPoolExecutor`` names
    them) running the calls submitted, in order; a ``with`` block ends them (:meth:`shutdown`).

    Unlike a ``ThreadPoolExecutor``, whose threads the interpreter joins at exit (and a ``with``
    block at its end), a thread stuck in the OS (an fsync on a hung mount) never holds up its
    process's exit, and :meth:`map` waits for the calls within ``daskjobs.storage-timeout``.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size, self._name = size, name
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None]
        self._calls = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._deadline: Deadline | None = None
        """The deadline of the last :meth:`map`, which :meth:`shutdown` waits for the threads' end until."""

    def __enter__(self) -> DaemonPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def submit(self, call: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``call(*args)`` in a thread of the pool; the future holds its result or error."""
        future: Future[T] = Future()
        self._calls.put((future, call, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if len(self._threads) < self._size:
                    thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}")
                    thread.daemon = True
                    self._threads.append(thread)
                    thread.start()
        return future

    def map(self, call: Callable[[T], R], items: Sequence[T], what: Callable[[T], str]) -> list[R]:
        """``[call(item) for item in items]``, run in the pool's threads, within ``daskjobs.storage-timeout``.

        Raises
        ------
        TimeoutError
            A call is still running at the deadline (``what(item)`` says which, see :func:`too_slow`).
        Exception
            The first call's error in the order of ``items``, once the other calls ended (or the deadline passed).
        """
        deadline = self._deadline = Deadline()
        futures = [self.submit(call, item) for item in items]
        try:
            return [deadline.result(future, what(item)) for item, future in zip(items, futures, strict=True)]
        except BaseException:
            for future in futures:
                future.cancel()  # those not started
            concurrent.futures.wait(futures, deadline.left())  # the others end first, as in a ThreadPoolExecutor
            raise

    def shutdown(self) -> None:
        """End the threads once they are done with the calls submitted (a stuck one: once its call
        returns), waiting for that until the deadline of the last :meth:`map` (if any)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._calls.put(None)
        if self._deadline is not None:
            for thread in threads:
                self._deadline.joined(thread)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call(*args))
                except BaseException as exc:  # the thread outlives any call: its future holds the error
                    future.set_exception(exc)
            del item, future, call, args  # nothing of a call is kept while the thread idles
            self._idle.release()
