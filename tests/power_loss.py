"""A power loss, modelled in the test process: the disk under a folder as it would be after the
machine stopped at a chosen moment.

While a :class:`PowerLoss` is active, the durability points of this process — ``os.fsync`` and
the ``syncfs`` of :mod:`daskjobs.checkpoint._storage.durable` — are recorded instead of done,
for everything under its root (paths elsewhere are synced as usual). The model is a strict
reading of POSIX, tracked per inode:

* a file's bytes are durable as of its last fsync (or a ``syncfs``);
* a folder's entries (name → inode) are durable as of its last fsync (or a ``syncfs``): a file
  created, renamed or removed in it since is not — renames of two folders are undone or kept
  independently of each other;
* everything under the root is durable when the model starts.

:meth:`PowerLoss.crash_when` chooses the moment: the first event (a write, rename, fsync …, see
:class:`Event`) it matches freezes the durable state, and what happens after it does not count.
:meth:`PowerLoss.restore` (after the work stopped) replaces the tree under the root by the frozen
state. A file whose bytes changed since they were last durable (or never were) is *torn*:
``tear="nul"`` keeps its durable bytes and pads them with NUL bytes to the size it had (its size
reached the disk, its new blocks did not: the torn manifests of a real power loss), ``tear="old"``
keeps its durable bytes only (an empty file if it never was synced).

Files created by ``os.open`` and folders by ``os.mkdir`` get a new generation of their inode
number, so that a number the file system hands out again is never mistaken for the file it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from daskjobs.checkpoint._storage import durable as _durable

Key = tuple[int, int]
"""An inode: its number and the generation of that number (see the module)."""


class Event(NamedTuple):
    """Something done to a path under the root, seen ``before`` it is done and again after."""

    kind: str
    """``"write"``, ``"rename"`` (``os.rename`` and ``os.replace``), ``"fsync"``, ``"syncfs"``,
    ``"mkdir"``, ``"link"``, ``"unlink"``, ``"rmdir"``, ``"truncate"``."""
    path: str
    target: str | None
    before: bool
    thread: str


@dataclass
class _Entry:
    kind: str  # "file", "dir", "link", "fifo"
    key: Key
    link: str | None = None


@dataclass
class _State:
    files: dict[Key, tuple[bytes, int]] = field(default_factory=dict)
    """Durable bytes and mtime (ns) of each file."""
    folders: dict[Key, dict[str, _Entry]] = field(default_factory=dict)
    """Durable entries of each folder."""


class PowerLoss:
    """Record what is durable under ``root`` from now on; see the module.

    Use as a context manager (the recording ends with it), then call :meth:`restore`.
    """

    def __init__(self, root: str, *, tear: str = "nul") -> None:
        if tear not in ("nul", "old"):
            raise ValueError(f"tear must be 'nul' or 'old', not {tear!r}")
        self.root = os.path.realpath(root)
        self.tear = tear
        self.events: list[Event] = []
        self.crashed: Event | None = None
        self._lock = threading.RLock()
        self._generation: dict[int, int] = {}
        self._durable = _State()
        self._current: dict[Key, tuple[int, bytes, int]] = {}
        """At the crash: each file's size, bytes and mtime (ns)."""
        self._when: Callable[[Event], bool] | None = None
        self._patches: list[tuple[Any, str, Any]] = []
        self.torn: list[str] = []
        """Files :meth:`restore` tore (relative to the root), for messages."""

    # -- choosing the moment ------------------------------------------------------------------
    def crash_when(self, when: Callable[[Event], bool]) -> None:
        """Stop the machine at the first event ``when`` returns True for (before or after it is done)."""
        self._when = when

    def crash_now(self) -> None:
        """Stop the machine now."""
        with self._lock:
            if self.crashed is None:
                self._freeze(Event("now", self.root, None, True, threading.current_thread().name))

    # -- recording ----------------------------------------------------------------------------
    def __enter__(self) -> PowerLoss:
        with self._lock:
            self._sync_everything()
        real = {name: getattr(os, name) for name in ("open", "mkdir", "write", "fsync", "rename", "replace")}
        real.update({name: getattr(os, name) for name in ("link", "unlink", "rmdir", "ftruncate")})
        loss = self

        def opened(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            new = bool(flags & os.O_CREAT) and loss._mine(path, dir_fd) and not os.path.lexists(path)
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if new:
                loss._born(os.fstat(fd).st_ino)
            return fd

        def made(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
            loss._event("mkdir", path, None, True, dir_fd)
            real["mkdir"](path, mode, dir_fd=dir_fd)
            if loss._mine(path, dir_fd):
                loss._born(os.lstat(path, dir_fd=dir_fd).st_ino)
            loss._event("mkdir", path, None, False, dir_fd)

        def written(fd: int, data: Any) -> int:
            path = loss._fd_path(fd)
            if path is None:
                return real["write"](fd, data)
            loss._event("write", path, None, True)
            count = real["write"](fd, data)
            loss._event("write", path, None, False)
            return count

        def synced(fd: int) -> None:
            path = loss._fd_path(fd)
            if path is None:
                real["fsync"](fd)
                return
            loss._event("fsync", path, None, True)
            loss._record_fsync(fd, path)
            loss._event("fsync", path, None, False)

        def two_paths(name: str, kind: str) -> Callable[..., None]:
            def call(source: Any, target: Any, **kwargs: Any) -> None:
                loss._event(kind, source, target, True, kwargs.get("src_dir_fd"))
                real[name](source, target, **kwargs)
                loss._event(kind, source, target, False, kwargs.get("src_dir_fd"))

            return call

        def one_path(name: str, kind: str) -> Callable[..., None]:
            def call(path: Any, *args: Any, **kwargs: Any) -> None:
                loss._event(kind, path, None, True, kwargs.get("dir_fd"))
                real[name](path, *args, **kwargs)
                loss._event(kind, path, None, False, kwargs.get("dir_fd"))

            return call

        def truncated(fd: int, length: int) -> None:
            path = loss._fd_path(fd)
            if path is not None:
                loss._event("truncate", path, None, True)
            real["ftruncate"](fd, length)
            if path is not None:
                loss._event("truncate", path, None, False)

        def syncfs_of() -> Callable[[int], int]:
            def syncfs(fd: int) -> int:
                path = loss._fd_path(fd)
                if path is None:  # another file system than the one modelled
                    return 0 if real_syncfs is None else real_syncfs(fd)
                loss._event("syncfs", path, None, True)
                with loss._lock:
                    if loss.crashed is None:
                        loss._sync_everything()
                loss._event("syncfs", path, None, False)
                return 0

            return syncfs

        real_syncfs = _durable._libc_syncfs()
        fake_syncfs = syncfs_of()
        replacements = {
            "open": opened,
            "mkdir": made,
            "write": written,
            "fsync": synced,
            "rename": two_paths("rename", "rename"),
            "replace": two_paths("replace", "rename"),
            "link": two_paths("link", "link"),
            "unlink": one_path("unlink", "unlink"),
            "rmdir": one_path("rmdir", "rmdir"),
            "ftruncate": truncated,
        }
        for name, function in replacements.items():
            self._patch(os, name, function)
        self._patch(_durable, "_libc_syncfs", lambda: fake_syncfs)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in reversed(self._patches):
            setattr(owner, name, value)
        self._patches = []
        if self.crashed is None:
            self.crash_now()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _mine(self, path: Any, dir_fd: int | None = None) -> bool:
        if dir_fd is not None:
            with contextlib.suppress(OSError):
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))
        try:
            full = os.path.abspath(os.fsdecode(path))
        except TypeError:  # a file descriptor
            return False
        return full == self.root or full.startswith(self.root + os.sep)

    def _fd_path(self, fd: int) -> str | None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        return path if self._mine(path) else None

    def _born(self, inode: int) -> None:
        with self._lock:
            self._generation[inode] = self._generation.get(inode, 0) + 1

    def _key(self, info: os.stat_result) -> Key:
        return info.st_ino, self._generation.get(info.st_ino, 0)

    def _event(self, kind: str, path: Any, target: Any, before: bool, dir_fd: int | None = None) -> None:
        if not self._mine(path, dir_fd) and not (target is not None and self._mine(target)):
            return
        event = Event(kind, os.fsdecode(path), None if target is None else os.fsdecode(target), before, _thread())
        with self._lock:
            self.events.append(event)
            if self.crashed is None and self._when is not None and self._when(event):
                self._freeze(event)

    def _record_fsync(self, fd: int, path: str) -> None:
        with self._lock:
            if self.crashed is not None:
                return
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                self._durable.folders[self._key(info)] = self._entries(path)
            elif stat.S_ISREG(info.st_mode):
                with open(f"/proc/self/fd/{fd}", "rb") as file:
                    self._durable.files[self._key(info)] = (file.read(), info.st_mtime_ns)

    def _entries(self, folder: str) -> dict[str, _Entry]:
        found = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                with contextlib.suppress(FileNotFoundError):
                    info = os.lstat(path)
                    kind = _kind(info.st_mode)
                    found[name] = _Entry(kind, self._key(info), os.readlink(path) if kind == "link" else None)
        return found

    def _walk(self) -> Iterator[tuple[str, os.stat_result]]:
        for folder, _dirs, names in os.walk(self.root):
            yield folder, os.lstat(folder)
            for name in names:
                path = os.path.join(folder, name)
                with contextlib.suppress(FileNotFoundError):
                    yield path, os.lstat(path)

    def _sync_everything(self) -> None:
        for path, info in self._walk():
            if stat.S_ISDIR(info.st_mode):
                self._durable.folders[self._key(info)] = self._entries(path)
            elif stat.S_ISREG(info.st_mode):
                with contextlib.suppress(FileNotFoundError), open(path, "rb") as file:
                    self._durable.files[self._key(info)] = (file.read(), info.st_mtime_ns)

    def _freeze(self, event: Event) -> None:
        self.crashed = event
        for path, info in self._walk():
            if stat.S_ISREG(info.st_mode):
                with contextlib.suppress(FileNotFoundError), open(path, "rb") as file:
                    self._current[self._key(info)] = (info.st_size, file.read(), info.st_mtime_ns)

    # -- after the crash ----------------------------------------------------------------------
    def restore(self) -> None:
        """Replace the tree under the root by what was durable at the crash (call it once the work stopped)."""
        if self._patches:
            raise RuntimeError("restore() after the PowerLoss context ended")
        with self._lock:
            root_key = self._key(os.lstat(self.root))
            shutil.rmtree(self.root)
            os.mkdir(self.root)
            self._build(self.root, root_key, {})

    def _build(self, folder: str, key: Key, made: dict[Key, str]) -> None:
        for name, entry in sorted(self._durable.folders.get(key, {}).items()):
            path = os.path.join(folder, name)
            if entry.kind == "dir":
                os.mkdir(path)
                self._build(path, entry.key, made)
            elif entry.kind == "link":
                os.symlink(entry.link or "", path)
            elif entry.kind == "fifo":
                os.mkfifo(path)
            elif entry.key in made:  # another name of a file already made: a hard link
                os.link(made[entry.key], path)
            else:
                data, mtime = self._bytes(entry.key)
                if data != self._current.get(entry.key, (0, data, 0))[1]:
                    self.torn.append(os.path.relpath(path, self.root))
                with open(path, "wb") as file:
                    file.write(data)
                os.utime(path, ns=(mtime, mtime))
                made[entry.key] = path

    def _bytes(self, key: Key) -> tuple[bytes, int]:
        durable, mtime = self._durable.files.get(key, (b"", 0))
        size, now, now_mtime = self._current.get(key, (len(durable), durable, mtime))
        if now == durable and key in self._durable.files:
            return durable, mtime
        if self.tear == "old":
            return durable, mtime or now_mtime
        return durable[:size] + b"\0" * (size - len(durable)), now_mtime


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISFIFO(mode):
        return "fifo"
    return "file"


def _thread() -> str:
    return threading.current_thread().name
