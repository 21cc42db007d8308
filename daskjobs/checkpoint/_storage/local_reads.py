"""Reading local checkpoint files safely: bounded, never blocking, never through a symlink.

Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and read only if ``fstat`` says they are regular
files (a FIFO, device, socket, directory or symbolic link raises :class:`~.base.UnsafeFileError`),
and no read asks for more than the expected size plus one byte (to notice a file that is too long).
"""

from __future__ import annotations

import errno
import os
import stat

import xxhash

from .base import ChunkResult, SizeProblem, UnsafeFileError

READ_BLOCK = 1 << 20
"""Chunk files are read in blocks of this size, each hashed at once while it is still in the CPU's cache."""
_SEQUENTIAL_FROM = 16 << 20
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
        for start in range(0, len(out), READ_BLOCK):
            block = out[start : start + READ_BLOCK]
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
