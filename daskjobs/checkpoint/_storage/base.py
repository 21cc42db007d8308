"""The storage protocol: what every backend of checkpoint files offers (:class:`Files`), and what
only some offer, all or nothing (:class:`LocalTree`, :class:`QueuedFiles`), told apart by their
capability flags, never by the backend's class.

Two backends implement it: :class:`~.files.LocalFiles` (a local disk, with fsync: a
:class:`LocalTree`) and :class:`~.remote.RemoteFiles` (any other fsspec filesystem — object
stores, ``memory://``: :class:`QueuedFiles`). ``tests/storage_conformance.py`` holds the tests
every backend passes, subclassed once per backend.

Paths are the filesystem's own (absolute OS paths on a local disk, fsspec paths elsewhere), with
``/`` separators. Reads are bounded and never block: no read asks for more than its limit plus
one byte (to notice a file that is too long), and a backend with special files refuses them
(:class:`UnsafeFileError`) instead of opening them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeGuard, runtime_checkable

from .durable import Staged

__all__ = [
    "ChunkRead",
    "ChunkResult",
    "Files",
    "LocalTree",
    "QueuedFiles",
    "SizeProblem",
    "Staged",
    "UnsafeFileError",
    "local_tree",
    "queued",
]


class UnsafeFileError(OSError):
    """A checkpoint path that is not what daskjobs writes there (a FIFO, device, socket, symlink …)."""


ChunkRead = tuple[str, memoryview, int]
"""A chunk to read: its path, where its valid bytes go, and the size the file must have."""
ChunkResult = tuple[str | None, str | None]
"""What reading a chunk found: ``(digest, None)`` (XXH3-128 of the whole file), or ``(None, problem)``."""
SizeProblem = str | UnsafeFileError | None
"""What checking a chunk file's size found: ``None`` (as expected), a problem as in :data:`ChunkResult`, or
an :class:`UnsafeFileError` (not a regular file)."""


@runtime_checkable
class Files(Protocol):
    """What every backend offers: files written, read, listed and removed under a prefix.

    Writes become durable with :meth:`flush` (:attr:`defers_flush`), or when they return; the
    commit protocol's small files (commit records, the lock) are written durably by
    :meth:`replace` and :meth:`create` themselves.
    """

    @property
    def supports_overwrite(self) -> bool:
        """Whether files can be written over in place and folders renamed: the backend is a
        :class:`LocalTree`, and a save may write over its node's retired group (see
        :func:`~.cleanup.take_over_group`)."""

    @property
    def queues_writes(self) -> bool:
        """Whether :meth:`put`, :meth:`put_atomic` and :meth:`reuse` only queue their writes, done
        together (concurrently) by :meth:`QueuedFiles.settle` or :meth:`flush`: the backend is a
        :class:`QueuedFiles`. Otherwise a write is done (and visible to reads) when it returns."""

    @property
    def defers_flush(self) -> bool:
        """Whether what is written becomes durable only with :meth:`flush` (a crash before it may
        lose it): a local disk with fsync. Only a :class:`LocalTree` defers its flush."""

    def mkdir(self, path: str, parents: bool = False, within: str | None = None) -> None:
        """Create the folder ``path`` where the backend has folders (nothing to do where it has none).

        ``parents``: missing parents too, below ``within`` — a folder that must exist already
        (:class:`FileNotFoundError` if it vanished, instead of creating it again); without
        ``parents``, an existing ``path`` raises :class:`FileExistsError`.
        """

    def put(self, path: str, *parts: Any) -> None:
        """Write the file ``path`` (created, or truncated) from the buffers ``parts``."""

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write ``path`` so that it is, at every moment, absent, its old content or ``data``."""

    def reuse(self, source: str, target: str, parts: Sequence[Any], sealed: int | None = None) -> bool:
        """Make ``target`` hold ``parts``, the bytes of ``source`` (a file of an earlier durable
        save), without writing them where the backend can: ``False`` if it cannot (nothing was
        done: the caller writes ``parts``).

        ``sealed``: when the group of ``source`` got its entry (:meth:`sealed_at`); a ``source``
        modified since then was damaged after its save, and is not reused.
        """

    def sealed_at(self, group: str) -> int | None:
        """When the group at ``group`` got its entry (``zarr.json``, written after all its files),
        in ns; ``None`` if that cannot be told (nor needs to be: files that cannot change in place)."""

    def flush(self) -> None:
        """Make everything written so far durable (a queuing backend does its queued writes first)."""

    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """At most ``limit + 1`` bytes of each file; a file that cannot be read gives its error
        (:class:`FileNotFoundError`: absent; :class:`UnsafeFileError`: not a regular file)."""

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> list[ChunkResult | UnsafeFileError]:
        """Read each chunk into its view (its first bytes) and hash the whole file, reading no
        more than its size plus one byte; see :data:`ChunkResult`. Raises the ``OSError`` of a
        read that failed for another reason than a missing or special file."""

    def check_sizes(self, files: Sequence[tuple[str, int]]) -> list[SizeProblem]:
        """Whether each ``(path, size)`` is a regular file of that size, nothing opened or read."""

    def check_directory(self, path: str) -> None:
        """Raise :class:`UnsafeFileError` if ``path`` is something else than a real folder (a
        symlink …), :class:`FileNotFoundError` if it is not there; a backend without folders or
        special files has nothing to refuse."""

    def listdir(self, path: str) -> dict[str, bool]:
        """Entries directly under ``path``: name → whether it is a folder (a symlink is not); ``{}`` if absent."""

    def replace(self, path: str, data: bytes, sync_folder: bool = True, sync_file: bool = True) -> None:
        """Create or replace the small file ``path`` atomically and durably, its missing folders too.

        ``sync_folder=False``: the name may vanish again in a crash until :meth:`sync_folder`;
        ``sync_file=False``: the file need not survive a crash at all (a probe).
        """

    def create(self, path: str, data: bytes, sync_soon: bool = False) -> None:
        """Create the small file ``path`` (its missing folders too) exclusively against any other
        writer: :class:`FileExistsError` if it exists. Its bytes are durable when it returns
        (``sync_soon``: a little later, not waited for), its name need not be (a lock)."""

    def remove(self, path: str, sync_folder: bool = True) -> None:
        """Remove the file ``path`` if it is there (``sync_folder``: as in :meth:`replace`)."""

    def sync_folder(self, path: str) -> None:
        """Make the entries of folder ``path`` (files created, replaced or removed) durable."""


@runtime_checkable
class LocalTree(Files, Protocol):
    """A file tree on one machine: files written over in place, folders renamed, durability in batches.

    Writes are remembered for :meth:`~Files.flush` (or :meth:`flush_soon`), which makes them
    durable, then puts a staged group in place (:meth:`publish_when_durable`).
    """

    def overwrite(self, path: str, *parts: Any) -> None:
        """:meth:`~Files.put` over a file of a group being written over: a regular file with no
        other name is written in place (no file created or deleted); one that is also another
        epoch's file (a hard link) only loses this name, and the bytes go to a new file."""

    def reuse_over(self, source: str, target: str, parts: Sequence[Any], sealed: int | None = None) -> bool:
        """:meth:`~Files.reuse` into a group being written over: a ``target`` that already is
        ``source`` (the same file) stays; any other file there goes first."""

    def rename(self, path: str, target: str) -> None:
        """Rename the folder ``path`` to ``target`` (a missing ``target``) and start making the new
        name durable (:meth:`await_renames`)."""

    def await_renames(self) -> None:
        """Wait until the folders renamed so far are durable under their new names: at most
        ``daskjobs.storage-timeout``, then :class:`TimeoutError` (an ``OSError``) names the folder."""

    def changed(self, path: str) -> None:
        """Remember folder ``path``, whose entries changed (files removed), for the flush."""

    def remove_folder(self, path: str) -> None:
        """Remove the empty folder ``path``; durable with the flush."""

    def publish(self, staged: Staged) -> None:
        """Put ``staged`` in place now (see :class:`~.durable.Staged`); durable with the flush."""

    def publish_when_durable(self, staged: Staged) -> None:
        """Put ``staged`` in place once everything written is durable, by the flush, which makes
        the renames durable too (at once if the backend does not defer its flush): the group then
        appears under its name only complete and durable."""

    def track_tree(self, path: str) -> None:
        """Remember every file and folder under ``path`` (written by someone else) for the flush."""

    def flush_soon(self) -> Future[None]:
        """:meth:`~Files.flush` in this process's next batch of syncs, with other groups'; the
        future fails with the ``OSError`` of the sync or rename."""


@runtime_checkable
class QueuedFiles(Files, Protocol):
    """A backend whose writes wait in a queue, done together (an object store's requests, concurrently)."""

    def settle(self) -> list[str]:
        """Do the queued writes and copies now (not waiting for :meth:`~Files.flush`); return the
        targets of queued :meth:`~Files.reuse` calls that were written from their bytes instead
        (the copy failed)."""


def local_tree(files: Files) -> TypeGuard[LocalTree]:
    """Whether ``files`` is a :class:`LocalTree` (:attr:`Files.supports_overwrite`)."""
    return files.supports_overwrite


def queued(files: Files) -> TypeGuard[QueuedFiles]:
    """Whether ``files`` is a :class:`QueuedFiles` (:attr:`Files.queues_writes`)."""
    return files.queues_writes
