"""Checkpoint files on a local disk, with fsync: :class:`LocalFiles`, the :class:`~.base.LocalTree`
backend of the storage protocol (:mod:`.base`; :mod:`.remote` has the other one). Its reads are
bounded and never block (see :mod:`.local_reads`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .base import ChunkRead, ChunkResult, SizeProblem, Staged, UnsafeFileError
from .deadline import DaemonPool, Deadline
from .durable import fsync_in_background, fsync_path, fsync_soon, publish_durably, sync_paths, sync_soon
from .local_reads import check_directory, read_chunk_file, read_regular, size_problem

logger = logging.getLogger("daskjobs")

_SYNC_EARLY_FROM = 4 << 20
"""Files of at least this size are fsynced by the thread that wrote them, right away."""
_PARALLEL_FROM = 32 << 20
"""Reads of chunks of at least this many bytes together run chunk by chunk in a thread pool."""
_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Reader threads, one per core: copying from the page cache releases the GIL, so while one thread
hashes a block (from the cache, see :data:`~.local_reads.READ_BLOCK`) another copies the next
(measured on 2 cores: 0.77x the time of one thread reading 1 GiB into huge-page-aligned arrays)."""
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_OVER_FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


FILE_MODE = 0o644
"""Mode of every file daskjobs creates (less what the umask removes): never group- or world-writable."""
DIR_MODE = 0o755
"""Mode of every folder daskjobs creates (less what the umask removes)."""


def make_dirs(path: str, within: str | None = None) -> list[str]:
    """Create ``path`` and its missing parents, each with :data:`DIR_MODE` (``os.makedirs`` gives
    parents ``0o777``); an existing directory is fine. Return the folders created, top-down.

    ``within``: a folder above ``path`` that must exist already (a checkpoint prefix): if it
    vanished, :class:`FileNotFoundError` is raised instead of creating it again (a prefix on an
    unmounted disk must not come back as an empty local folder).
    """
    try:
        os.mkdir(path, DIR_MODE)  # the parent is usually there: one syscall
        return [path]
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
        return []
    except FileNotFoundError:
        pass
    made = []
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        if parent == within:
            raise FileNotFoundError(errno.ENOENT, "the checkpoint prefix vanished", within)
        made = make_dirs(parent, within)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
        return made
    return [*made, path]


def write_file(path: str, parts: Sequence[Any], *, over: int | None = None) -> int:
    """Create or truncate ``path``, write the buffers ``parts`` to it (no fsync) and return the bytes written.

    ``over``: the size of the regular file already at ``path``, written over in place instead (no
    file created or truncated: only what is past the new end is cut off).
    """
    flags = _WRITE_FLAGS if over is None else _OVER_FLAGS
    fd = os.open(path, flags, FILE_MODE)
    try:
        total = 0
        for part in parts:
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            written = os.write(fd, part) if size else 0
            if written < size:  # a short write (or a multi-byte memoryview): write on from where it stopped
                view = memoryview(part).cast("B")[written:]
                while view:
                    view = view[os.write(fd, view) :]
            total += size
        if over is not None and over > total:
            os.ftruncate(fd, total)
    finally:
        os.close(fd)
    return total


class LocalFiles:
    """Files on a local disk (a :class:`~.base.LocalTree`); :meth:`flush` makes everything written
    so far durable if ``fsync``, then puts a staged group in place."""

    supports_overwrite = True
    queues_writes = False

    def __init__(self, fsync: bool) -> None:
        self._fsync = fsync
        self._unsynced: list[str] = []
        self._staged: Staged | None = None
        self._renames: list[tuple[str, Future[None]]] = []
        """The syncs making the folders renamed so far durable under their new names (and what each does)."""

    @property
    def defers_flush(self) -> bool:
        """With fsync, writes are durable only once :meth:`flush` (or :meth:`flush_soon`) returned."""
        return self._fsync

    # -- writing ------------------------------------------------------------------------------
    def mkdir(self, path: str, parents: bool = False, within: str | None = None) -> None:
        """Create directory ``path``; with ``parents`` also missing parents below ``within`` (see :func:`make_dirs`)."""
        if not parents:
            os.mkdir(path, DIR_MODE)
            self._unsynced.append(path)
            return
        made = make_dirs(path, within)  # each folder made, and the parent of each (its entry)
        self._unsynced.extend([path, *dict.fromkeys(os.path.dirname(folder) for folder in made), *made])

    def put(self, path: str, *parts: Any) -> None:
        """Write a file from buffers; a large one is fsynced at once (see :data:`_SYNC_EARLY_FROM`).

        Its data then goes to disk while other threads still hash and write (the GIL is released
        in fsync), instead of all of it waiting for :meth:`flush`.
        """
        self._written(path, write_file(path, parts))

    def overwrite(self, path: str, *parts: Any) -> None:
        """:meth:`put` over a file of a group being written over (see
        :func:`~.cleanup.take_over_group`): a regular file with no other name is written in place
        (no file is created or deleted, the costly part of a small write on many file systems);
        one that is also another epoch's file (a hard link) only loses this name, and the bytes
        go to a new file."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None and stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            self._written(path, write_file(path, parts, over=info.st_size))
            return
        if info is not None:
            os.unlink(path)
        self.put(path, *parts)

    def _written(self, path: str, size: int) -> None:
        """A file of ``size`` bytes was written: fsync it now if it is large (:data:`_SYNC_EARLY_FROM`),
        else at :meth:`flush`."""
        if self._fsync and size >= _SYNC_EARLY_FROM:
            fsync_path(path)
        else:
            self._unsynced.append(path)

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write a file that is, at every moment, either absent, its old content or ``data`` (temp and rename).

        Durability comes with :meth:`flush`, like every other write.
        """
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        write_file(temp, [data])
        os.replace(temp, path)
        self._unsynced.append(path)

    def rename(self, path: str, target: str) -> None:
        """Rename folder ``path`` to ``target`` and start making the new name durable, in the
        background (:meth:`await_renames` waits for it)."""
        os.rename(path, target)
        self._unsynced.append(target)
        if self._fsync:
            folder = os.path.dirname(target)
            what = f"the fsync of {folder} (making {path} durable under its new name {target})"
            self._renames.append((what, fsync_in_background(folder)))

    def await_renames(self) -> None:
        """Wait until the folders renamed so far are durable under their new names, within
        ``daskjobs.storage-timeout``; raises the ``OSError`` of a sync that failed, or
        :class:`TimeoutError` naming the one still running then (see :mod:`.deadline`)."""
        renames, self._renames, deadline = self._renames, [], Deadline()
        for what, renamed in renames:
            deadline.result(renamed, what)

    def changed(self, path: str) -> None:
        """Remember folder ``path``, whose entries changed (files removed), for :meth:`flush`."""
        self._unsynced.append(path)

    def remove_folder(self, path: str) -> None:
        """Remove the empty folder ``path``; :meth:`flush` makes that durable."""
        os.rmdir(path)
        self._unsynced = [p for p in self._unsynced if p != path] + [os.path.dirname(path)]

    def publish(self, staged: Staged) -> None:
        """Put ``staged`` in place now; :meth:`flush` makes that durable (and syncs what was written
        in the staging folder under its new name)."""
        parent = staged.publish()
        inside = staged.folder + "/"
        moved = {
            path: staged.target + path[len(staged.folder) :]
            for path in self._unsynced
            if path == staged.folder or path.startswith(inside)
        }
        self._unsynced = [moved.get(p, p) for p in self._unsynced] + [staged.target, parent]

    def publish_when_durable(self, staged: Staged) -> None:
        """Put ``staged`` (a group written in a staging folder) in place once what was written is
        durable, and make that durable too (:meth:`flush`, :meth:`flush_soon`); without fsync, at
        once. The group then appears under its name only complete and durable."""
        if self._fsync:
            self._staged = staged
        else:
            staged.publish()

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
        """fsync what was written (and the parent of the first path), if syncing is on; then put a
        staged group in place (:meth:`publish_when_durable`) and sync its folders."""
        if self._fsync and self._unsynced:
            sync_paths(self._to_sync())
        self._unsynced = []
        staged, self._staged = self._staged, None
        publish_durably(staged)

    def flush_soon(self) -> Future[None]:
        """:meth:`flush` in this process's next batch of syncs (with other groups', see
        :func:`~.durable.sync_soon`); the future fails with the ``OSError`` of the sync or rename."""
        paths = self._to_sync() if self._fsync and self._unsynced else []
        self._unsynced = []
        staged, self._staged = self._staged, None
        return sync_soon(paths, staged)

    def _to_sync(self) -> list[str]:
        return list(dict.fromkeys([*self._unsynced, os.path.dirname(self._unsynced[0])]))

    # -- reusing an earlier epoch's files -----------------------------------------------------
    def sealed_at(self, group: str) -> int | None:
        """When the group at ``group`` got its entry (``zarr.json``, written after all its files),
        in ns; ``None`` if that cannot be told. See :meth:`reuse`."""
        try:
            return os.lstat(f"{group}/zarr.json").st_mtime_ns
        except OSError:
            return None

    def reuse(self, source: str, target: str, parts: Sequence[Any], sealed: int | None = None) -> bool:
        """Hard-link ``source`` (a regular file holding ``parts``) as ``target``; ``False`` if that is impossible.

        ``source`` belongs to an earlier save, made durable before that save returned: only the
        new name needs a flush, which the fsync of the target's folder gives. ``sealed``: when
        that save's group got its entry (:meth:`sealed_at`); a ``source`` modified later changed
        on disk after its save — the earlier epoch is damaged — and is not linked (a warning says
        so), so that the damage does not spread to the new epoch: the caller writes the bytes.
        """
        return self._link(source, target, _size(parts), sealed, over=False)

    def reuse_over(self, source: str, target: str, parts: Sequence[Any], sealed: int | None = None) -> bool:
        """:meth:`reuse` into a group being written over (see :meth:`overwrite`): a ``target`` that
        already is ``source`` (the same file, linked by the retired epoch too) stays; any other
        file there goes first. ``False``: the caller writes the bytes with :meth:`overwrite`."""
        return self._link(source, target, _size(parts), sealed, over=True)

    def _link(self, source: str, target: str, size: int, sealed: int | None, *, over: bool) -> bool:
        try:
            info = os.lstat(source)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                return False
            if sealed is not None and info.st_mtime_ns > sealed:
                logger.warning(
                    "checkpoint file %s was modified after its epoch was saved (or the clock went back): "
                    "not reused, written anew; check its epoch with `daskjobs checkpoints verify`",
                    source,
                )
                return False
            if over:  # a file of the retired group there: already this link, or it goes
                with contextlib.suppress(FileNotFoundError):
                    there = os.lstat(target)
                    if (there.st_dev, there.st_ino) == (info.st_dev, info.st_ino):
                        return True
                    os.unlink(target)
            os.link(source, target, follow_symlinks=False)
        except OSError:  # gone, another filesystem, no hard links here: the caller writes the bytes
            return False
        self._unsynced.append(os.path.dirname(target))
        return True

    # -- small files written durably at once ----------------------------------------------------
    def replace(self, path: str, data: bytes, sync_folder: bool = True, sync_file: bool = True) -> None:
        """Atomically create or replace a small file: temp file, fsync, ``os.replace``, fsync of the folder.

        ``sync_folder=False`` leaves the folder's fsync to a later :meth:`sync_folder` (the file is
        then complete whenever it is there, but may vanish again in a crash until then);
        ``sync_file=False`` skips the file's own fsync too (a file that need not survive a crash).
        Folders it makes are made durable first (with ``sync_file``).
        """
        made = [] if os.path.isdir(os.path.dirname(path)) else make_dirs(os.path.dirname(path))
        if made and self._fsync and sync_file:  # the folders made are durable before the file's name is
            sync_paths(list(dict.fromkeys(os.path.dirname(folder) for folder in made)))
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            write_file(temp, [data])
            if self._fsync and sync_file:
                fsync_path(temp)
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        if sync_folder:
            self.sync_folder(os.path.dirname(path))

    def sync_folder(self, path: str) -> None:
        """Make the entries of folder ``path`` (files created, renamed or removed in it) durable."""
        if self._fsync:
            fsync_path(path)

    def create(self, path: str, data: bytes, sync_soon: bool = False) -> None:
        """Create a small file that must not exist yet (``O_EXCL``); raises :class:`FileExistsError`.

        ``sync_soon``: its fsync runs in the background instead of being waited for.
        """
        make_dirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.write(fd, data)
        except BaseException:
            os.close(fd)
            raise
        if self._fsync and sync_soon:
            fsync_soon(fd)
            return
        try:
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str, sync_folder: bool = True) -> None:
        """Remove a file if it exists (``sync_folder``: see :meth:`replace`)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            if sync_folder:
                self.sync_folder(os.path.dirname(path))

    # -- reading --------------------------------------------------------------------------------
    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """Read each regular file, at most ``limit + 1`` bytes of it; errors are returned, not raised."""
        out: list[bytes | OSError] = []
        for path in paths:
            try:
                out.append(read_regular(path, limit))
            except OSError as exc:
                out.append(exc)
        return out

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> list[ChunkResult | UnsafeFileError]:
        """Read each chunk into its view and hash the whole file (see :data:`~.base.ChunkResult`);
        many bytes at once (:data:`_PARALLEL_FROM`) in a pool of :data:`_THREADS` threads, waited for
        within ``daskjobs.storage-timeout`` (then :class:`TimeoutError` names the file)."""
        if _THREADS > 1 and len(chunks) > 1 and sum(size for _, _, size in chunks) >= _PARALLEL_FROM:
            with DaemonPool(_THREADS, "daskjobs-read") as pool:
                return pool.map(_read_chunk, chunks, lambda chunk: f"the read of {chunk[0]}")
        return [_read_chunk(chunk) for chunk in chunks]

    def check_directory(self, path: str) -> None:
        """See :func:`check_directory`."""
        check_directory(path)

    def listdir(self, path: str) -> dict[str, bool]:
        """Entries directly under ``path``: name → whether it is a directory (symlinks are not); {} if absent."""
        try:
            with os.scandir(path) as entries:
                return {entry.name: entry.is_dir(follow_symlinks=False) for entry in entries}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def check_sizes(self, files: Sequence[tuple[str, int]]) -> list[SizeProblem]:
        """Whether each ``(path, size)`` is a regular file of that size (one ``lstat`` each; nothing is opened)."""
        return [size_problem(path, size) for path, size in files]


def _size(parts: Sequence[Any]) -> int:
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


def _read_chunk(chunk: ChunkRead) -> ChunkResult | UnsafeFileError:
    try:
        return read_chunk_file(*chunk)
    except UnsafeFileError as exc:
        return exc
