"""Plain file access for checkpoint groups on a local disk (with fsync); :mod:`.remote` has the
same interface for any fsspec filesystem.

Both backends offer the same small interface, used by :mod:`.zarr_groups` to write and read the raw
chunk files and JSON documents of a node's Zarr group, and by :mod:`.._protocol.store` for commit
records, listings and the lock. Paths are the filesystem's own paths (absolute OS paths for
the local backend).

Reads are bounded and never block: local files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and
read only if ``fstat`` says they are regular files (a FIFO, device, socket, directory or
symbolic link raises :class:`UnsafeFileError`), and no read asks for more than the expected
size plus one byte (to notice a file that is too long).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import xxhash

from .durable import fsync_path, fsync_soon, rename_durably, sync_paths, sync_soon

logger = logging.getLogger("daskjobs")

ChunkRead = tuple[str, memoryview, int]
"""A chunk to read: its path, where its valid bytes go, and the size the file must have."""
ChunkResult = tuple[str | None, str | None]
"""What reading a chunk found: ``(digest, None)`` (XXH3-128 of the whole file), or ``(None, problem)``."""

_READ_BLOCK = 1 << 20
"""Chunk files are read in blocks of this size, each hashed at once while it is still in the CPU's cache."""
_SEQUENTIAL_FROM = 16 << 20
_SYNC_EARLY_FROM = 4 << 20
"""Files of at least this size are fsynced by the thread that wrote them, right away."""
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_OVER_FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = {
    stat.S_IFREG: "a regular file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


class UnsafeFileError(OSError):
    """A checkpoint path that is not what daskjobs writes there (a FIFO, device, socket, symlink …)."""


SizeProblem = str | UnsafeFileError | None
"""What checking a chunk file's size found: ``None`` (as expected), a problem as in :data:`ChunkResult`, or
an :class:`UnsafeFileError` (not a regular file)."""


def _unsafe(path: str, mode: int, expected: str, refusal: str = "daskjobs does not read it") -> UnsafeFileError:
    found = _KINDS.get(stat.S_IFMT(mode), "an unknown kind of file")
    return UnsafeFileError(f"{path} is {found}, not {expected}; {refusal}")


def open_regular(path: str) -> tuple[int, int]:
    """Open a regular file for reading without following a final symlink or blocking; return ``(fd, size)``.

    Raises
    ------
    UnsafeFileError
        ``path`` is a symbolic link, FIFO, device, socket or directory (a socket cannot be
        opened: an open that fails for another reason than a missing file looks at what is there).
    FileNotFoundError
        It does not exist.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link, not a regular file; daskjobs does not read it") from None
        if exc.errno != errno.ENOENT:  # a socket cannot be opened at all (ENXIO): say what is there instead
            _refuse_special(path)
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _unsafe(path, info.st_mode, "a regular file")
    return fd, info.st_size


def _refuse_special(path: str) -> None:
    """Raise :class:`UnsafeFileError` if ``path`` exists and is not a regular file (``lstat``: links not followed)."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise _unsafe(path, info.st_mode, "a regular file") from None


def check_directory(path: str) -> None:
    """Raise :class:`UnsafeFileError` unless ``path`` is a real directory (not a symlink); or ``FileNotFoundError``."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise _unsafe(path, info.st_mode, "a directory", "daskjobs neither reads nor writes through it")


FILE_MODE = 0o644
"""Mode of every file daskjobs creates (less what the umask removes): never group- or world-writable."""
DIR_MODE = 0o755
"""Mode of every folder daskjobs creates (less what the umask removes)."""


def make_dirs(path: str, within: str | None = None) -> None:
    """Create ``path`` and its missing parents, each with :data:`DIR_MODE` (``os.makedirs`` gives
    parents ``0o777``); an existing directory is fine.

    ``within``: a folder above ``path`` that must exist already (a checkpoint prefix): if it
    vanished, :class:`FileNotFoundError` is raised instead of creating it again (a prefix on an
    unmounted disk must not come back as an empty local folder).
    """
    try:
        os.mkdir(path, DIR_MODE)  # the parent is usually there: one syscall
        return
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
        return
    except FileNotFoundError:
        pass
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        if parent == within:
            raise FileNotFoundError(errno.ENOENT, "the checkpoint prefix vanished", within)
        make_dirs(parent, within)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None


def write_file(path: str, parts: Sequence[Any], *, over: int | None = None) -> None:
    """Create or truncate ``path`` and write the buffers ``parts`` to it (no fsync).

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


def read_regular(path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a regular file (see :func:`open_regular`)."""
    fd, size = open_regular(path)
    try:
        want = min(size, limit) + 1  # the size it has (no buffer of ``limit`` bytes), one more to see growth
        data = os.read(fd, want)
        while len(data) < want:
            more = os.read(fd, want - len(data))
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def read_chunk_file(path: str, out: memoryview, size: int) -> ChunkResult:
    """Read a chunk file of ``size`` bytes: its first ``len(out)`` bytes into ``out``, the rest hashed too."""
    try:
        fd, found = open_regular(path)
    except FileNotFoundError:
        return None, "is missing"
    with open(fd, "rb", buffering=0) as file:
        if found != size:
            return None, f"has {found} bytes, expected {size}"
        if size >= _SEQUENTIAL_FROM and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        hasher = xxhash.xxh3_128()
        for start in range(0, len(out), _READ_BLOCK):
            block = out[start : start + _READ_BLOCK]
            if file.readinto(block) != len(block):
                return None, "shrank while being read"
            hasher.update(block)
        rest = file.read(size - len(out) + 1)
        if len(rest) != size - len(out):
            return None, "changed size while being read"
        hasher.update(rest)
    return hasher.hexdigest(), None


def size_problem(path: str, size: int) -> SizeProblem:
    """Whether ``path`` is a regular file of ``size`` bytes, looked at with ``lstat`` only (see :data:`SizeProblem`)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    if not stat.S_ISREG(info.st_mode):
        return _unsafe(path, info.st_mode, "a regular file")
    return None if info.st_size == size else f"has {info.st_size} bytes, expected {size}"


class LocalFiles:
    """Files on a local disk; :meth:`flush` makes everything written so far durable if ``fsync``."""

    def __init__(self, fsync: bool) -> None:
        self._fsync = fsync
        self._unsynced: list[str] = []
        self._rename: tuple[str, str] | None = None

    def clear(self, path: str) -> None:
        """Remove the tree at ``path`` if it exists."""
        if os.path.lexists(path):
            shutil.rmtree(path)

    def mkdir(self, path: str, parents: bool = False, within: str | None = None) -> None:
        """Create directory ``path``; with ``parents`` also missing parents below ``within`` (see :func:`make_dirs`)."""
        if parents:
            make_dirs(path, within)
        else:
            os.mkdir(path, DIR_MODE)
        self._unsynced.append(path)

    def put(self, path: str, *parts: Any) -> None:
        """Write a file from buffers; a large one is fsynced at once (see :data:`_SYNC_EARLY_FROM`).

        Its data then goes to disk while other threads still hash and write (the GIL is released
        in fsync), instead of all of it waiting for :meth:`flush`.
        """
        write_file(path, parts)
        self._written(path, parts)

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
            write_file(path, parts, over=info.st_size)
            self._written(path, parts)
            return
        if info is not None:
            os.unlink(path)
        self.put(path, *parts)

    def _written(self, path: str, parts: Sequence[Any]) -> None:
        """A file was written: fsync it now if it is large (:data:`_SYNC_EARLY_FROM`), else at :meth:`flush`."""
        if self._fsync and sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts) >= _SYNC_EARLY_FROM:
            fsync_path(path)
        else:
            self._unsynced.append(path)

    def changed(self, path: str) -> None:
        """Remember folder ``path``, whose entries changed (renamed into place, files removed), for :meth:`flush`."""
        self._unsynced.append(path)

    def rename_when_durable(self, path: str, target: str) -> None:
        """Rename folder ``path`` (a group written in a staging folder) to ``target`` once what was
        written is durable, and make the rename durable too (:meth:`flush`, :meth:`flush_soon`);
        without fsync, at once. The group then appears under its name only complete and durable."""
        if self._fsync:
            self._rename = (path, target)
        else:
            os.rename(path, target)

    def remove_folder(self, path: str) -> None:
        """Remove the empty folder ``path``; :meth:`flush` makes that durable."""
        os.rmdir(path)
        self._unsynced.append(os.path.dirname(path))

    def put_atomic(self, path: str, data: bytes) -> None:
        """Write a file that is, at every moment, either absent, its old content or ``data`` (temp and rename).

        Durability comes with :meth:`flush`, like every other write.
        """
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        write_file(temp, [data])
        os.replace(temp, path)
        self._unsynced.append(path)

    def flush_pending(self) -> None:
        """Nothing to do: local writes are not queued."""

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
        """fsync what was written (and the parent of the first path), if syncing is on; then do a
        rename asked for (:meth:`rename_when_durable`) and sync its folder."""
        if self._fsync and self._unsynced:
            sync_paths(self._to_sync())
        self._unsynced = []
        rename, self._rename = self._rename, None
        rename_durably(rename)

    def flush_soon(self) -> Future[None]:
        """:meth:`flush` in this process's next batch of syncs (with other groups', see
        :func:`~.durable.sync_soon`); the future fails with the ``OSError`` of the sync or rename."""
        paths = self._to_sync() if self._fsync and self._unsynced else []
        self._unsynced = []
        rename, self._rename = self._rename, None
        return sync_soon(paths, rename)

    def _to_sync(self) -> list[str]:
        return list(dict.fromkeys([*self._unsynced, os.path.dirname(self._unsynced[0])]))

    def read_small(self, paths: Sequence[str], limit: int) -> list[bytes | OSError]:
        """Read each regular file, at most ``limit + 1`` bytes of it; errors are returned, not raised."""
        out: list[bytes | OSError] = []
        for path in paths:
            try:
                out.append(read_regular(path, limit))
            except OSError as exc:
                out.append(exc)
        return out

    def check_directory(self, path: str) -> None:
        """See :func:`check_directory`."""
        check_directory(path)

    def sealed_at(self, group: str) -> int | None:
        """When the group at ``group`` got its entry (``zarr.json``, written after all its files),
        in ns; ``None`` if that cannot be told. See :meth:`reuse`."""
        try:
            return os.lstat(f"{group}/zarr.json").st_mtime_ns
        except OSError:
            return None

    def reuse(
        self,
        source: str,
        target: str,
        size: int,
        sealed: int | None = None,
        parts: Sequence[Any] = (),
        counted: int = 0,
    ) -> bool:
        """Hard-link ``source`` (a regular file of ``size`` bytes) as ``target``; ``False`` if that is impossible.

        ``source`` belongs to an earlier save, made durable before that save returned: only the
        new name needs a flush, which the fsync of the target's folder gives. ``sealed``: when
        that save's group got its entry (:meth:`sealed_at`); a ``source`` modified later changed
        on disk after its save — the earlier epoch is damaged — and is not linked (a warning says
        so), so that the damage does not spread to the new epoch: the caller writes the bytes.
        ``parts`` and ``counted`` (see :meth:`RemoteFiles.reuse`) are not needed here.
        """
        return self._link(source, target, size, sealed, over=False)

    def reuse_over(
        self,
        source: str,
        target: str,
        size: int,
        sealed: int | None = None,
        parts: Sequence[Any] = (),
        counted: int = 0,
    ) -> bool:
        """:meth:`reuse` into a group being written over (see :meth:`overwrite`): a ``target`` that
        already is ``source`` (the same file, linked by the retired epoch too) stays; any other
        file there goes first. ``False``: the caller writes the bytes with :meth:`overwrite`."""
        return self._link(source, target, size, sealed, over=True)

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

    def replace(self, path: str, data: bytes, sync_folder: bool = True, sync_file: bool = True) -> None:
        """Atomically create or replace a small file: temp file, fsync, ``os.replace``, fsync of the folder.

        ``sync_folder=False`` leaves the folder's fsync to a later :meth:`sync_folder` (the file is
        then complete whenever it is there, but may vanish again in a crash until then);
        ``sync_file=False`` skips the file's own fsync too (a file that need not survive a crash).
        """
        if not os.path.isdir(os.path.dirname(path)):
            make_dirs(os.path.dirname(path))
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

    def list_tree(self, path: str) -> set[str]:
        """Paths of the files under ``path``, relative to it, with ``/`` separators."""
        found = set()
        for root, _dirs, files in os.walk(path):
            relative = os.path.relpath(root, path)
            found.update(name if relative == "." else f"{relative}/{name}".replace(os.sep, "/") for name in files)
        return found

    def take_rewritten(self) -> int:
        """Always 0: a hard link that fails is written by the caller at once (see :meth:`reuse`)."""
        return 0

    def read_chunks(self, chunks: Sequence[ChunkRead]) -> list[ChunkResult]:
        """Read each chunk into its view and hash the whole file; see :data:`ChunkResult`."""
        return [read_chunk_file(*chunk) for chunk in chunks]
