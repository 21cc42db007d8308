"""Plain file access for checkpoint groups: a local disk (with fsync) or any fsspec filesystem.

Both backends offer the same small interface, used by :mod:`._zarr` to write and read the raw
chunk files and JSON documents of a node's Zarr group, and by :mod:`._store` for commit
records, listings and the lock. Paths are the filesystem's own paths (absolute OS paths for
the local backend). :class:`Checksums` computes the CRC-32C of what is read.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import queue
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import crc32c
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

ChunkRead = tuple[str, memoryview, int]
"""A chunk to read: its path, where its valid bytes go, and the size the file must have."""
ChunkEvent = tuple[int, memoryview | None, str | None]
"""Progress of reading chunk ``i``: ``(i, block, None)`` after each block of its valid bytes was read
into place, then ``(i, None, problem)`` once the chunk is done, ``problem`` being ``None`` if it
is intact, else what is wrong (missing, wrong size, corrupt padding)."""

_BATCH_BYTES = 256 << 20
"""Remote writes and reads are batched (and run concurrently by async filesystems) up to this size."""
_READ_BLOCK = 4 << 20
_FSYNC_EACH_UP_TO = 8
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


@cache
def _libc_syncfs() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux: fall back to one fsync per file
        return None


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_paths(paths: Sequence[str]) -> None:
    """Make ``paths`` (files and directories of one filesystem) durable.

    A few paths are fsynced one by one. For more, on Linux, one ``syncfs`` flushes the whole
    filesystem: it costs a few fsyncs, far less than hundreds of them for many small blobs.
    """
    if not paths:
        return
    syncfs = _libc_syncfs() if len(paths) > _FSYNC_EACH_UP_TO else None
    if syncfs is not None:
        fd = os.open(paths[0], os.O_RDONLY)
        try:
            if syncfs(fd) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"syncfs failed: {os.strerror(errno)}", paths[0])
        finally:
            os.close(fd)
        return
    for path in paths:
        fsync_path(path)


FILE_MODE = 0o644
"""Mode of every file daskjobs creates (less what the umask removes): never group- or world-writable."""
DIR_MODE = 0o755
"""Mode of every folder daskjobs creates (less what the umask removes)."""


def make_dirs(path: str) -> None:
    """Create ``path`` and its missing parents, each with :data:`DIR_MODE` (``os.makedirs`` gives
    parents ``0o777``); an existing directory is fine."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        make_dirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None


def write_file(path: str, parts: Sequence[Any]) -> None:
    """Create or truncate ``path`` and write the buffers ``parts`` to it (no fsync)."""
    fd = os.open(path, _WRITE_FLAGS, FILE_MODE)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def zero_padding(data: Any) -> bool:
    """Whether a chunk's padding (past the array's last row) is all zero bytes."""
    return bytes(data).count(0) == len(data)


class Checksums:
    """Running CRC-32C per blob; for big reads computed in a helper thread, overlapping the next read."""

    def __init__(self, background: bool) -> None:
        self._values: dict[str, int] = {}
        self._queue: queue.SimpleQueue[tuple[str, memoryview] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="daskjobs-crc32c", daemon=True) if background else None
        if self._thread is not None:
            self._thread.start()

    def add(self, name: str, block: memoryview) -> None:
        """Extend blob ``name``'s checksum by ``block`` (which must not change until :meth:`close`)."""
        if self._thread is None:
            self._update(name, block)
        else:
            self._queue.put((name, block))

    def _update(self, name: str, block: memoryview) -> None:
        self._values[name] = crc32c.crc32c(block, self._values.get(name, 0))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._update(*item)

    def close(self) -> dict[str, int]:
        """Wait for the pending blocks; return the checksums by blob."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        return self._values


class LocalFiles:
    """Files on a local disk; :meth:`flush` makes everything written so far durable if ``fsync``."""

    def __init__(self, fsync: bool) -> None:
        self._fsync = fsync
        self._unsynced: list[str] = []

    def clear(self, path: str) -> None:
        """Remove the tree at ``path`` if it exists."""
        if os.path.lexists(path):
            shutil.rmtree(path)

    def mkdir(self, path: str, parents: bool = False) -> None:
        """Create directory ``path`` (and, with ``parents``, missing parents)."""
        if parents:
            make_dirs(path)
        else:
            os.mkdir(path, DIR_MODE)
        self._unsynced.append(path)

    def put(self, path: str, *parts: Any) -> None:
        """Write a file from buffers."""
        write_file(path, parts)
        self._unsynced.append(path)

    def track_tree(self, path: str) -> None:
        """Remember every file and directory under ``path`` (written by someone else) for :meth:`flush`,
        taking group and world write permission away from them (others ignore :data:`FILE_MODE`)."""
        for root, _dirs, files in os.walk(path):
            self._unsynced.append(root)
            self._unsynced.extend(os.path.join(root, name) for name in files)
            for name in [root, *(os.path.join(root, f) for f in files)]:
                mode = os.lstat(name).st_mode
                if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & 0o022:
                    os.chmod(name, stat.S_IMODE(mode) & ~0o022)

    def flush(self) -> None:
        """fsync what was written (and the parent of the first path), if syncing is on."""
        if self._fsync and self._unsynced:
            sync_paths([*self._unsynced, os.path.dirname(self._unsynced[0])])
        self._unsynced = []

    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """Read each file, at most ``limit + 1`` bytes of it; errors are returned, not raised."""
        out: list[bytes | OSError] = []
        for path in paths:
            try:
                with open(path, "rb") as file:
                    out.append(file.read(limit + 1))
            except OSError as exc:
                out.append(exc)
        return out

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return os.path.exists(path)

    def replace(self, path: str, data: bytes) -> None:
        """Atomically create or replace a small file: temp file, fsync, ``os.replace``, fsync of the folder."""
        make_dirs(os.path.dirname(path))
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            write_file(temp, [data])
            if self._fsync:
                fsync_path(temp)
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        if self._fsync:
            fsync_path(os.path.dirname(path))

    def create(self, path: str, data: bytes) -> None:
        """Create a small file that must not exist yet (``O_EXCL``); raises :class:`FileExistsError`."""
        make_dirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.write(fd, data)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        """Remove a file if it exists."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            if self._fsync:
                fsync_path(os.path.dirname(path))

    def listdir(self, path: str) -> dict[str, bool]:
        """Entries directly under ``path``: name → whether it is a directory (symlinks are not); {} if absent."""
        try:
            with os.scandir(path) as entries:
                return {entry.name: entry.is_dir(follow_symlinks=False) for entry in entries}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def list_tree(self, path: str) -> set[str]:
        """Paths of the files under ``path``, relative to it, with ``/`` separators."""
        found = set()
        for root, _dirs, files in os.walk(path):
            relative = os.path.relpath(root, path)
            found.update(name if relative == "." else f"{relative}/{name}".replace(os.sep, "/") for name in files)
        return found

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> Iterator[ChunkEvent]:
        """Read each chunk into its view, block by block; see :data:`ChunkEvent`."""
        for index, (path, view, size) in enumerate(chunks):
            try:
                with open(path, "rb", buffering=0) as file:
                    found = os.fstat(file.fileno()).st_size
                    if found != size:
                        yield index, None, f"has {found} bytes, expected {size}"
                        continue
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    for start in range(0, len(view), _READ_BLOCK):
                        block = view[start : start + _READ_BLOCK]
                        if file.readinto(block) != len(block):
                            raise OSError(f"{path} shrank while being read")
                        yield index, block, None
                    padding = file.read(size - len(view) + 1)
            except FileNotFoundError:
                yield index, None, "is missing"
                continue
            intact = len(padding) == size - len(view) and zero_padding(padding)
            yield index, None, None if intact else "has corrupt padding"


class RemoteFiles:
    """Files on an fsspec filesystem (object store, ``memory://`` …); writes are batched until :meth:`flush`."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self._fs = fs
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0

    def clear(self, path: str) -> None:
        """Remove every object under ``path``."""
        self._fs.invalidate_cache(path)
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(path, recursive=True)
        self._fs.invalidate_cache(path)

    def mkdir(self, path: str, parents: bool = False) -> None:
        """Nothing to do: objects need no directories."""

    def put(self, path: str, *parts: Any) -> None:
        """Queue an object (copied now, so later changes of the source arrays do not leak in)."""
        data = b"".join(memoryview(part).cast("B") for part in parts)
        self._pending[path] = data
        self._pending_bytes += len(data)
        if self._pending_bytes >= _BATCH_BYTES:
            self.flush()

    def track_tree(self, path: str) -> None:
        """Nothing to do: object stores have no fsync."""

    def flush(self) -> None:
        """Upload the queued objects."""
        if self._pending:
            self._fs.pipe(self._pending)
        self._pending, self._pending_bytes = {}, 0

    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """Read each object (all of it: object stores cannot cheaply stop early); errors are returned."""
        results = self._fs.cat_ranges(list(paths), None, None, on_error="return")
        return [r if isinstance(r, bytes | OSError) else OSError(str(r)) for r in results]

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self._fs.exists(path))

    def replace(self, path: str, data: bytes) -> None:
        """Create or replace an object with one PUT (atomic on object stores; no rename anywhere)."""
        self._fs.pipe_file(path, data)
        self._fs.invalidate_cache(path.rsplit("/", 1)[0])

    def create(self, path: str, data: bytes) -> None:
        """Create an object that must not exist yet (on S3 a PUT with ``If-None-Match: *``).

        Raises :class:`FileExistsError` if it exists.
        """
        self._fs.pipe_file(path, data, mode="create")
        self._fs.invalidate_cache(path.rsplit("/", 1)[0])

    def remove(self, path: str) -> None:
        """Remove an object if it exists."""
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(path)
        self._fs.invalidate_cache(path.rsplit("/", 1)[0])

    def listdir(self, path: str) -> dict[str, bool]:
        """Entries directly under ``path``, listed afresh: name → whether it is a "directory"; {} if absent."""
        self._fs.invalidate_cache(path)
        try:
            return {
                found["name"].rstrip("/").rsplit("/", 1)[-1]: found["type"] == "directory"
                for found in self._fs.ls(path, detail=True)
            }
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def list_tree(self, path: str) -> set[str]:
        """Paths of the objects under ``path``, relative to it."""
        self._fs.invalidate_cache(path)
        root = path.rstrip("/") + "/"
        return {found[len(root) :] for found in self._fs.find(path) if found.startswith(root)}

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> Iterator[ChunkEvent]:
        """Fetch chunks in concurrent batches and copy each into its view; see :data:`ChunkEvent`."""
        start = 0
        while start < len(chunks):
            end, budget = start, 0
            while end < len(chunks) and (end == start or budget + chunks[end][2] <= _BATCH_BYTES):
                budget += chunks[end][2]
                end += 1
            datas = self._fs.cat_ranges([path for path, _, _ in chunks[start:end]], None, None, on_error="return")
            for index, data in enumerate(datas, start):
                _path, view, size = chunks[index]
                if isinstance(data, FileNotFoundError):
                    yield index, None, "is missing"
                elif isinstance(data, BaseException):
                    raise data
                elif len(data) != size:
                    yield index, None, f"has {len(data)} bytes, expected {size}"
                else:
                    view[:] = memoryview(data)[: len(view)]
                    yield index, view, None
                    yield index, None, None if zero_padding(memoryview(data)[len(view) :]) else "has corrupt padding"
            start = end


def files_for(fs: AbstractFileSystem, fsync: bool) -> LocalFiles | RemoteFiles:
    """The backend for ``fs``."""
    return LocalFiles(fsync) if isinstance(fs, LocalFileSystem) else RemoteFiles(fs)
