"""Checkpoint files on any other fsspec filesystem (object stores, ``memory://``): :class:`RemoteFiles`,
the :class:`~.base.QueuedFiles` backend of the storage protocol (:mod:`.base`), where a PUT is atomic
and durable when it returns, objects are never modified in place, and nothing is a directory or a
symlink.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import xxhash
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.implementations.local import LocalFileSystem

from .base import ChunkRead, ChunkResult, Files, SizeProblem, UnsafeFileError
from .files import LocalFiles

_BATCH_BYTES = 256 << 20
"""Remote writes and reads are batched (and run concurrently by async filesystems) up to this size."""
_COPIES_AT_ONCE = 64
"""Server-side copies in flight at once on an async filesystem."""


def copy_many(fs: AbstractFileSystem, pairs: list[tuple[str, str]]) -> list[BaseException | None]:
    """Copy each ``(source, target)`` on the server, concurrently where the filesystem is async; the
    outcome of each (``None``: copied).

    On S3 (s3fs) each is one CopyObject request: the source's size is known to be below S3's 5 GiB
    limit of a single copy (checkpoint chunks are about 64 MiB), so no HEAD asks for it, and no
    listing expands the paths (``fs.copy`` of single paths costs two listings and a HEAD per copy).
    """
    if not isinstance(fs, AsyncFileSystem):
        outcomes: list[BaseException | None] = []
        for source, target in pairs:
            try:
                fs.cp_file(source, target)
                outcomes.append(None)
            except Exception as exc:
                outcomes.append(exc)
        return outcomes
    copy = getattr(fs, "_copy_basic", None) or fs._cp_file

    async def copy_all() -> list[BaseException | None]:
        limit = asyncio.Semaphore(_COPIES_AT_ONCE)

        async def one(source: str, target: str) -> None:
            async with limit:
                await copy(source, target)

        found = await asyncio.gather(*(one(s, t) for s, t in pairs), return_exceptions=True)
        return [f if isinstance(f, BaseException) else None for f in found]

    return sync(fs.loop, copy_all)


class RemoteFiles:
    """Files on an fsspec filesystem (object store, ``memory://`` …); writes are queued until
    :meth:`settle` or :meth:`flush`, and then done together (concurrently where the filesystem is async)."""

    supports_overwrite = False
    queues_writes = True
    defers_flush = False

    def __init__(self, fs: AbstractFileSystem) -> None:
        self._fs = fs
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0
        self._copies: dict[str, tuple[str, tuple[Any, ...]]] = {}
        self._rewritten: list[str] = []

    def mkdir(self, path: str, parents: bool = False, within: str | None = None) -> None:
        """Nothing to do: objects need no directories."""

    def put_atomic(self, path: str, data: bytes) -> None:
        """Queue an object: one PUT writes it whole."""
        self.put(path, data)

    def put(self, path: str, *parts: Any) -> None:
        """Queue an object (copied now, so later changes of the source arrays do not leak in)."""
        data = b"".join(memoryview(part).cast("B") for part in parts)
        self._pending[path] = data
        self._pending_bytes += len(data)
        if self._pending_bytes >= _BATCH_BYTES:
            self._send()

    def reuse(self, source: str, target: str, parts: Sequence[Any], sealed: int | None = None) -> bool:
        """Queue a server-side copy of ``source`` to ``target`` (no download), made by :meth:`settle`
        with the others at once; if it fails there, ``parts`` (the bytes ``target`` must hold) are
        written instead. Objects are never modified in place: ``sealed`` is not needed."""
        self._copies[target] = (source, tuple(parts))
        self._pending.pop(target, None)
        return True

    def settle(self) -> list[str]:
        """Make the queued server-side copies, then upload the queued objects (a copy that failed
        among them, from the bytes it was given); return the targets of the copies that failed
        since the last call."""
        self._send()
        rewritten, self._rewritten = self._rewritten, []
        return rewritten

    def flush(self) -> None:
        """Do the queued writes (:meth:`settle`): an object is durable once its PUT returned."""
        self._send()

    def _send(self) -> None:
        if self._copies:
            copies, self._copies = self._copies, {}
            pairs = [(source, target) for target, (source, _) in copies.items()]
            for (_, target), failed in zip(pairs, copy_many(self._fs, pairs), strict=True):
                if failed is not None:
                    self._pending[target] = b"".join(memoryview(part).cast("B") for part in copies[target][1])
                    self._rewritten.append(target)
        if self._pending:
            self._fs.pipe(self._pending)
        self._pending, self._pending_bytes = {}, 0

    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """Read the first ``limit + 1`` bytes of each object (range requests); errors are returned."""
        paths = list(paths)
        results = self._fs.cat_ranges(paths, [0] * len(paths), [limit + 1] * len(paths), on_error="return")
        return [r if isinstance(r, bytes | OSError) else OSError(str(r)) for r in results]

    def check_directory(self, path: str) -> None:
        """Nothing to check: object stores have neither symlinks nor special files."""

    def sealed_at(self, group: str) -> int | None:
        """``None``: objects are replaced whole, never modified in place (see :meth:`LocalFiles.reuse`)."""
        return None

    def replace(self, path: str, data: bytes, sync_folder: bool = True, sync_file: bool = True) -> None:
        """Create or replace an object with one PUT (atomic on object stores; no rename anywhere)."""
        self._fs.pipe_file(path, data)
        self._fs.invalidate_cache(path.rsplit("/", 1)[0])

    def create(self, path: str, data: bytes, sync_soon: bool = False) -> None:
        """Create an object that must not exist yet (on S3 a PUT with ``If-None-Match: *``).

        Raises :class:`FileExistsError` if it exists.
        """
        self._fs.pipe_file(path, data, mode="create")
        self._fs.invalidate_cache(path.rsplit("/", 1)[0])

    def sync_folder(self, path: str) -> None:
        """Nothing to do: an object store's PUT or DELETE is durable when it returns."""

    def remove(self, path: str, sync_folder: bool = True) -> None:
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

    def check_sizes(self, files: Sequence[tuple[str, int]]) -> list[SizeProblem]:
        """Whether each ``(path, size)`` is an object of that size (one listing per folder; nothing is fetched)."""
        listed: dict[str, dict[str, Any]] = {}
        problems: list[SizeProblem] = []
        for path, size in files:
            folder, name = path.rsplit("/", 1)
            if folder not in listed:
                self._fs.invalidate_cache(folder)
                try:
                    found = self._fs.ls(folder, detail=True)
                except (FileNotFoundError, NotADirectoryError):
                    found = []
                listed[folder] = {f["name"].rstrip("/").rsplit("/", 1)[-1]: f.get("size") for f in found}
            actual = listed[folder].get(name, -1)
            if actual == -1:
                problems.append("is missing")
            else:
                problems.append(None if actual in (size, None) else f"has {actual} bytes, expected {size}")
        return problems

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> list[ChunkResult | UnsafeFileError]:
        """Fetch chunks with bounded range requests in concurrent batches; see :data:`~.base.ChunkResult`."""
        results: list[ChunkResult | UnsafeFileError] = []
        start = 0
        while start < len(chunks):
            end, budget = start, 0
            while end < len(chunks) and (end == start or budget + chunks[end][2] <= _BATCH_BYTES):
                budget += chunks[end][2]
                end += 1
            batch = chunks[start:end]
            datas = self._fs.cat_ranges(
                [path for path, _, _ in batch], [0] * len(batch), [size + 1 for _, _, size in batch], on_error="return"
            )
            for (_path, view, size), data in zip(batch, datas, strict=True):
                if isinstance(data, FileNotFoundError):
                    results.append((None, "is missing"))
                elif isinstance(data, BaseException):
                    raise data
                elif len(data) != size:
                    results.append(
                        (
                            None,
                            f"has {len(data) if len(data) <= size else 'more than ' + str(size)} "
                            f"bytes, expected {size}",
                        )
                    )
                else:
                    view[:] = memoryview(data)[: len(view)]
                    results.append((xxhash.xxh3_128(data).hexdigest(), None))
            start = end
        return results


def files_for(fs: AbstractFileSystem, fsync: bool) -> Files:
    """The backend of the storage protocol for ``fs``."""
    return LocalFiles(fsync) if isinstance(fs, LocalFileSystem) else RemoteFiles(fs)
