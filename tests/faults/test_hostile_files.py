"""Hostile files in place of checkpoint files x every read path: refused in bounded time and memory.

A FIFO, a UNIX socket, a symlink to ``/dev/zero``, a symlink leading outside the prefix, a directory, an oversized
(sparse) and a truncated file take the place of a chunk, an array's ``zarr.json``, the group's
``zarr.json`` or the commit record of epoch 2. Every read path must raise the exact error within a
deadline (a FIFO must not block, ``/dev/zero`` must not be read to exhaustion) and leave every
committed byte unchanged.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable

import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointCorruptError, CheckpointFormatError

from .test_corruption import NODE, READ_PATHS, commit_record, committed, group, snapshot  # noqa: F401

DEADLINE = 30.0

LOCATIONS: dict[str, Callable[[str], str]] = {
    "chunk": lambda p: os.path.join(group(p), "w", "c.1.0"),
    "array_metadata": lambda p: os.path.join(group(p), "w", "zarr.json"),
    "group_metadata": lambda p: os.path.join(group(p), "zarr.json"),
    "commit_record": commit_record,
}


def replace_with(path: str, make: Callable[[str], None]) -> None:
    os.unlink(path)
    make(path)


def bind_socket(path: str) -> None:
    """A UNIX socket at ``path``: ``open()`` fails on it with ENXIO before anything can be checked.

    Bound by a relative name: a socket's address has at most 107 bytes, less than ``tmp_path`` paths may need.
    """
    with contextlib.chdir(os.path.dirname(path)), socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.basename(path))


def outside(path: str) -> None:
    target = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(path)))), "outside.bin")
    with open(target, "wb") as file:
        file.write(b"{}" * 64)
    os.symlink(target, path)


def resize(delta: int) -> Callable[[str], None]:
    def apply(path: str) -> None:
        size = os.path.getsize(path)
        os.unlink(path)  # never write through a hard link shared with another epoch
        with open(path, "wb") as file:
            file.truncate(max(0, size + delta))  # sparse: costs no disk or memory

    return apply


HOSTILE: dict[str, Callable[[str], None]] = {
    "fifo": lambda p: replace_with(p, os.mkfifo),
    "socket": lambda p: replace_with(p, bind_socket),
    "symlink_dev_zero": lambda p: replace_with(p, lambda q: os.symlink("/dev/zero", q)),
    "symlink_outside": lambda p: replace_with(p, outside),
    "directory": lambda p: replace_with(p, os.mkdir),
    "oversized": resize(1 << 20),
    "truncated": resize(-1),
}
SPECIAL = ("fifo", "socket", "symlink_dev_zero", "symlink_outside", "directory")


def expected(location: str, hostile: str) -> type[Exception]:
    if hostile in SPECIAL:
        return CheckpointFormatError
    if location in ("chunk", "commit_record"):
        return CheckpointCorruptError
    return CheckpointFormatError  # metadata that no longer parses is refused before decoding


def cases() -> list[object]:
    out = []
    for location in sorted(LOCATIONS):
        for hostile in sorted(HOSTILE):
            for path in sorted(READ_PATHS):
                out.append(pytest.param(location, hostile, path, id=f"{location}-{hostile}-{path}"))
    return out


def within_deadline(function: Callable[[], object]) -> BaseException | None:
    """Run ``function`` in a thread; fail if it is still running after :data:`DEADLINE` seconds."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            function()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"the read still runs after {DEADLINE} s (blocked on a hostile file?)"
    return outcome[0]


@pytest.mark.parametrize(("location", "hostile", "path"), cases())
def test_hostile_file_is_refused(committed, location, hostile, path):  # noqa: F811
    HOSTILE[hostile](LOCATIONS[location](committed))
    before = snapshot(committed)
    listed = dj.list_checkpoints(committed)
    error = within_deadline(lambda: READ_PATHS[path](committed))
    assert type(error) is expected(location, hostile), repr(error)
    assert "epoch 2" in str(error)
    if location in ("chunk", "array_metadata"):
        assert f"node '{NODE}', blob 'w'" in str(error)
    assert snapshot(committed) == before
    assert dj.list_checkpoints(committed) == listed
