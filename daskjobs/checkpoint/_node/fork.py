"""Copy-on-write snapshots for asynchronous saves: a forked child process writes the node's workspace.

At the snapshot point the node's process forks. The child holds a page-level copy-on-write image
of the workspace as it was at that instant; it writes it to the store, sends the node's entry
(JSON) or its error (type name and message) back through a pipe and leaves with ``os._exit``.
The parent goes on at once: a snapshot costs one ``fork`` (about a millisecond for hundreds of
MiB) instead of a copy of every array, and memory only for the pages the parent changes while
the child still writes (arrays replaced by new ones cost nothing; arrays changed in place cost a
page copy each, on first write).

Forking is safe only where nothing the write needs lives outside the process's memory image and
the child can be tied to its parent: ``os.fork`` on Linux and a store on a local disk
(:func:`fork_unsafe_reason`). Elsewhere the managers copy the arrays instead.

Child hygiene:

* Every fork is made by one long-lived daemon thread per process (:class:`_Forker`). The child
  asks for ``SIGKILL`` when its parent *thread* ends (``prctl(PR_SET_PDEATHSIG)``), then checks
  that its parent is still the process that forked it: a writer never outlives its worker.
* It freezes the garbage collector's view of inherited objects (a finaliser of an inherited
  socket must never close a descriptor number the child reuses), closes every inherited
  descriptor except its pipe and 0-2 (a dead worker's sockets close at once), and ignores
  ``SIGINT`` and ``SIGTERM``: a Ctrl-C or ``scancel`` reaching every process of the job is a
  graceful stop, which waits for the save (``SIGKILL``, and its parent's death, still end it).
  Both are blocked in the forking thread, so a child starts with them blocked and unblocks them
  only then: a signal sent at once never meets the parent's graceful-stop handler.
* It never logs, prints or runs ``atexit`` handlers (their locks may be held by threads that
  do not exist in the child), and uses no thread pool or lock of the parent (daskjobs' module
  pools and locks are replaced in a child by ``os.register_at_fork`` hooks in :mod:`.._storage.durable`
  and :mod:`.._storage.zarr_groups`).
* A failed write is tried once more inside the child, from the snapshot that still exists there.
  A child that dies (killed) takes its snapshot with it: the save fails with
  :class:`~daskjobs.errors.CheckpointWriteError` naming node and epoch, and is not retried.
* A child that has not reported after ``daskjobs.storage-timeout`` (its storage hangs) is killed,
  and the save fails the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ... import errors
from ...errors import BlobTypeError, CheckpointError, CheckpointWriteError, DaskJobsError, JobDefinitionError
from .._storage.deadline import Deadline

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import NodeEntry
    from .._protocol.store import CheckpointStore

SNAPSHOT_MODES = ("auto", "fork", "copy")
"""Values of the managers' ``async_snapshot`` option."""

FORK_FROM = 16 << 20
"""With ``async_snapshot="auto"`` a save forks when the node's arrays hold at least this many
bytes: a fork, its hand-over and the child's exit cost a few milliseconds, as much as copying
this much memory."""

_PR_SET_PDEATHSIG = 1
_BLOCKED = {signal.SIGINT, signal.SIGTERM}
"""Signals the forking thread blocks, so that its children start with them blocked."""
_FORK_SECONDS = 60.0
"""Deadline for the forking thread to answer a request (a fork takes milliseconds)."""
_FAILED = 70
"""Exit status of a child that could not report (``EX_SOFTWARE``)."""
_KILLED_SECONDS = 1.0
"""How long a save whose child was killed at its deadline waits for the child's end (one stuck in
an uninterruptible system call ends only when that returns)."""

_REPORTED = (CheckpointError, BlobTypeError, JobDefinitionError)
"""Error types a child's report is raised as again (others become :class:`CheckpointWriteError`)."""

_in_child = False
_writers: dict[int, tuple[str, int]] = {}
"""Snapshot writer processes of this process still running: ``{pid: (node, epoch)}``."""


def fork_unsafe_reason(store: CheckpointStore) -> str | None:
    """Why ``store`` cannot be written from a forked snapshot in this process; ``None`` if it can."""
    if not hasattr(os, "fork"):
        return f"os.fork is not available on {sys.platform}"
    if not sys.platform.startswith("linux"):
        return f"tying a forked writer to its parent (prctl PR_SET_PDEATHSIG) needs Linux, not {sys.platform}"
    if not isinstance(store.fs, LocalFileSystem):
        return (
            f"{store.url} is not on a local disk (a forked writer would write an in-memory store into its own "
            "memory, and object-store clients keep connections and event loops that must not cross a fork)"
        )
    return None


def resolve_snapshot(mode: str, store: CheckpointStore) -> str:
    """How asynchronous saves to ``store`` take their snapshot: ``"fork"``, ``"copy"``, or
    ``"auto"`` (each save forks when its workspace is big enough, see :func:`forks`).

    Raises
    ------
    JobDefinitionError
        A ``ValueError``: ``mode`` is not one of :data:`SNAPSHOT_MODES`, or it is ``"fork"``
        where forking is not safe (the message says why).
    """
    if mode not in SNAPSHOT_MODES:
        raise JobDefinitionError(f"async_snapshot must be one of {list(SNAPSHOT_MODES)}, not {mode!r}")
    reason = fork_unsafe_reason(store)
    if mode == "fork" and reason is not None:
        raise JobDefinitionError(f"async_snapshot='fork' is not possible: {reason}; use 'copy' or 'auto'")
    return "copy" if reason is not None else mode


def forks(mode: str, blobs: Mapping[str, Any]) -> bool:
    """Whether a save of ``blobs`` forks: always with ``"fork"``; with ``"auto"``, when the arrays
    hold at least :data:`FORK_FROM` bytes (a smaller copy costs less than forking)."""
    if mode != "auto":
        return mode == "fork"
    return sum(value.nbytes for value in blobs.values() if isinstance(value, np.ndarray)) >= FORK_FROM


def in_snapshot_writer() -> bool:
    """Whether this process is a snapshot writer forked by :class:`ForkedSave`."""
    return _in_child


def snapshot_writers() -> dict[int, tuple[str, int]]:
    """The snapshot writer processes this process forked that are still running: ``{pid: (node, epoch)}``."""
    return dict(_writers)


# -- the child ------------------------------------------------------------------------------------
def _payload(write: Callable[[], NodeEntry]) -> bytes:
    """Run ``write`` (twice at most) and encode its entry, or the last error, as JSON."""
    error: Exception | None = None
    for _ in range(2):
        try:
            return json.dumps({"entry": write()}).encode()
        except Exception as exc:
            error = exc
    assert error is not None
    return json.dumps({"error": [type(error).__name__, str(error)]}).encode()


def _child(make_payload: Callable[[], bytes], pipe: int, parent: int, prctl: Any, max_fd: int) -> None:
    """Body of a forked writer: never returns, never raises."""
    global _in_child
    _in_child = True
    status = _FAILED
    try:
        gc.freeze()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _BLOCKED)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(_FAILED)
        os.closerange(3, pipe)
        os.closerange(pipe + 1, max_fd)
        payload = make_payload()
        data = memoryview(len(payload).to_bytes(8, "little") + payload)
        while data:
            data = data[os.write(pipe, data) :]
        status = 0
    finally:
        os._exit(status)


class _Forker:
    """The one thread of a process that forks snapshot writers (a child's death signal follows its
    parent *thread*, so that thread lives as long as the process)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        try:
            self._prctl: Any = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: never dlopen in a child
        except (OSError, AttributeError):
            self._prctl = None
        self._max_fd = max(os.sysconf("SC_OPEN_MAX"), 256)
        self._requests: queue.SimpleQueue[tuple[Callable[[], bytes], queue.SimpleQueue[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="daskjobs-snapshot-forker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Children inherit this thread's mask: a signal reaching a child before it dropped the
        # parent's handlers (a graceful stop's SIGTERM handler would let it live) waits until then.
        signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        while True:
            make_payload, reply = self._requests.get()
            try:
                reply.put(self._fork(make_payload))
            except Exception as exc:  # this thread must outlive any failure: it is every child's parent
                reply.put(exc)
            del make_payload, reply  # the parent keeps no reference to the snapshot

    def _fork(self, make_payload: Callable[[], bytes]) -> tuple[int, int] | OSError:
        try:
            read, write = os.pipe()
        except OSError as exc:
            return exc
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(read)
            os.close(write)
            return exc
        if pid == 0:
            _child(make_payload, write, self.pid, self._prctl, self._max_fd)
        os.close(write)
        return pid, read

    def fork(self, make_payload: Callable[[], bytes], what: str) -> tuple[int, int]:
        """Fork a child running ``make_payload``; return its pid and the read end of its pipe."""
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests.put((make_payload, reply))
        try:
            outcome = reply.get(timeout=_FORK_SECONDS)
        except queue.Empty:
            raise CheckpointWriteError(f"{what}: no snapshot process forked within {_FORK_SECONDS:.0f} s") from None
        if isinstance(outcome, Exception):
            raise CheckpointWriteError(f"{what}: could not fork a snapshot process: {outcome}") from outcome
        return outcome


_forker: _Forker | None = None
_forker_lock = threading.Lock()


def _the_forker() -> _Forker:
    """This process's forking thread (a new one in a process forked from one that had it)."""
    global _forker
    with _forker_lock:
        if _forker is None or _forker.pid != os.getpid():
            _forker = _Forker()
        return _forker


def _child_error(node: str, epoch: int, name: str, message: str) -> DaskJobsError:
    """The error a child reported, as that daskjobs error type where there is one, naming node and epoch."""
    text = f"writing the checkpoint of node {node!r} at epoch {epoch} failed in its snapshot process: {message}"
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, _REPORTED):
        return kind(text)
    return CheckpointWriteError(f"{text} ({name})")


class ForkedSave:
    """One node's checkpoint write in a forked child; the contract of a background save.

    :meth:`done`, :meth:`join` and :meth:`result` behave like those of a write in a thread;
    :attr:`pid` is the child's process id, :attr:`path` where the group goes.
    """

    def __init__(
        self,
        store: CheckpointStore,
        node: str,
        epoch: int,
        save_id: str,
        blobs: Mapping[str, Value],
        previous: NodeEntry | None = None,
    ) -> None:
        self.node, self.epoch, self.save_id = node, epoch, save_id
        self.path = store.db_name(node, epoch)
        self.overdue: Deadline | None = None
        """The first wait for the write that ran out, if one did: later waits only look (see :meth:`join`)."""

        def write() -> NodeEntry:
            return store.write_node(node, epoch, blobs, save_id=save_id, previous=previous)

        what = f"saving node {node!r} at epoch {epoch}"
        self.pid, pipe = _the_forker().fork(lambda: _payload(write), what)
        _writers[self.pid] = (node, epoch)
        self._report = b""
        self._status: int | None = None
        self._reported = threading.Event()
        self._thread = threading.Thread(
            target=self._wait, args=(pipe,), name=f"daskjobs-save-{node}-{epoch}", daemon=True
        )
        self._thread.start()

    def _wait(self, pipe: int) -> None:
        """Read the child's report (its last act before ``os._exit``), then reap the child.

        The write counts as finished once the whole report arrived: the child's exit (tearing
        down its copy of the address space) is not waited for.
        """
        try:
            with open(pipe, "rb") as reader:
                header = reader.read(8)
                size = int.from_bytes(header, "little")
                report = reader.read(size) if len(header) == 8 else b""
                if report and len(report) == size:
                    self._report = report
                    self._reported.set()
        finally:
            try:
                self._status = os.waitpid(self.pid, 0)[1]
            except ChildProcessError:  # reaped by someone else: the report alone tells
                self._status = None
            _writers.pop(self.pid, None)
            self._reported.set()

    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return self._reported.is_set()

    def join(self, deadline: Deadline) -> bool:
        """Wait for the write to end, successfully or not, until ``deadline``; whether it did. Once a
        wait ran out, only look."""
        if self.overdue is None and not deadline.waited(self._reported):
            self.overdue = deadline
        return self.done()

    def result(self) -> NodeEntry:
        """Wait for the write and return the node's entry.

        Raises
        ------
        CheckpointWriteError
            The child died before it reported (its snapshot is gone, so nothing can be retried),
            or it failed twice with an error that is no daskjobs error, or it did not report within
            ``daskjobs.storage-timeout`` (it is killed: its storage hangs).
        DaskJobsError
            The daskjobs error the child's write raised twice, naming node and epoch.
        """
        deadline = Deadline()
        if not self.join(deadline):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._thread.join(_KILLED_SECONDS)  # reaped, unless stuck where SIGKILL waits
            raise self._killed()
        try:
            report = json.loads(self._report) if self._report else {}
        except ValueError:
            report = {}
        if isinstance(report, dict) and isinstance(report.get("entry"), dict):
            entry: NodeEntry = report["entry"]  # what the child's write_node returned, as JSON
            return entry
        if isinstance(report, dict) and isinstance(report.get("error"), list) and len(report["error"]) == 2:
            raise _child_error(self.node, self.epoch, *map(str, report["error"]))
        if self.overdue is not None:  # killed at its deadline (by an earlier wait)
            raise self._killed()
        deadline.joined(self._thread)  # reaped: how it ended
        raise CheckpointWriteError(
            f"the snapshot process (pid {self.pid}) writing node {self.node!r} at epoch {self.epoch} "
            f"{_ended(self._status)} before it reported; its copy-on-write snapshot went with it, so the write "
            f"cannot be retried: epoch {self.epoch} is not committed"
        )

    def _killed(self) -> CheckpointWriteError:
        """The error of a write whose child was killed when a wait for it ran out (:attr:`overdue`)."""
        what = f"the snapshot process (pid {self.pid}) writing node {self.node!r} at epoch {self.epoch} to {self.path}"
        message = (self.overdue or Deadline()).message(what)
        return CheckpointWriteError(f"{message}; it was killed: epoch {self.epoch} is not committed")


def _ended(status: int | None) -> str:
    """How a child ended, from its wait status."""
    if status is None:
        return "ended"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"was killed by signal {number} ({signal.Signals(number).name})"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
