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
from daskjobs.checkpoint import CheckpointStore
from daskjobs.errors import CheckpointCorruptError, CheckpointFormatError

from .test_corruption import NODE, READ_PATHS, build_job, commit_record, committed, group, snapshot  # noqa: F401

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
    return CheckpointCorruptError  # a file daskjobs wrote, damaged (metadata too: refused before decoding)


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


# -- daskjobs' own folders replaced by symlinks ----------------------------------------------------


def tree(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` (symlinks not followed), by relative path."""
    files = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as file:
                files[os.path.relpath(os.path.join(root, name), folder)] = file.read()
    return files


def move_outside(prefix: str, folder: str) -> str:
    """Move ``prefix/folder`` out of the prefix and leave a symlink to it in its place; return where it went."""
    target = os.path.join(os.path.dirname(prefix), "outside")
    os.rename(os.path.join(prefix, folder), target)
    os.symlink(target, os.path.join(prefix, folder))
    return target


def train_more(prefix: str) -> object:
    manager = dj.MultiNodeCheckpointManager(prefix)
    with dj.LocalSession() as session:
        return dj.JobRunner(build_job(), manager, resume_from_epoch=2, max_epochs=4, progress=False).train(session)


def take_lock(prefix: str) -> object:
    store = CheckpointStore(prefix)
    store.acquire_lock({"host": "here", "pid": 1, "job": "faults"})
    return store.release_lock()


def commit_again(prefix: str) -> object:
    store = CheckpointStore(prefix)
    return store.commit(store.read_commit(1) | {"epoch": 3})


OWN_FOLDER_USES: dict[str, Callable[[str], object]] = {
    **READ_PATHS,
    "list": dj.list_checkpoints,
    "resume_from_epoch": train_more,
    "lock": take_lock,
    "commit": commit_again,
}


OWN_FOLDER_CASES = [
    pytest.param(folder, use, id=f"{folder}-{use}")
    for folder in ("__daskjobs__", "__daskjobs__/commits")
    for use in sorted(OWN_FOLDER_USES)
    if not (use == "lock" and folder.endswith("commits"))  # the lock lives outside the commits folder
]


@pytest.mark.parametrize(("folder", "use"), OWN_FOLDER_CASES)
def test_symlinked_own_folder_is_neither_read_nor_written(committed, folder, use):  # noqa: F811
    """A symlink in place of ``__daskjobs__`` or its ``commits`` folder is refused with CheckpointFormatError
    naming it, by every read and write path; nothing is read, written or deleted through it."""
    target = move_outside(committed, folder)
    before, outside_before = snapshot(committed), tree(target)
    with pytest.raises(CheckpointFormatError) as caught:
        OWN_FOLDER_USES[use](committed)
    assert f"{os.path.join(committed, folder)} is a symbolic link, not a directory" in str(caught.value)
    assert "replace the link" in str(caught.value)
    assert snapshot(committed) == before
    assert tree(target) == outside_before


def test_symlinked_own_folder_of_a_new_prefix_gets_nothing(prefix, tmp_path):
    """A run on a prefix whose empty ``__daskjobs__`` is a symlink refuses to start; nothing is written through it."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.makedirs(prefix)
    os.symlink(target, os.path.join(prefix, "__daskjobs__"))
    runner = dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=1, progress=False)
    with pytest.raises(CheckpointFormatError, match="__daskjobs__ is a symbolic link"):
        runner.train(dj.LocalSession())
    assert os.listdir(target) == []
    assert os.listdir(prefix) == ["__daskjobs__"]
