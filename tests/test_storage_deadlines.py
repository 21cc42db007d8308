"""Every wait for storage has a deadline: ``daskjobs.storage-timeout``.

The storage really hangs here: ``os.fsync``, ``os.write``, ``os.open`` or ``os.unlink`` of the
paths a test names block, as on a hung NFS or Lustre mount, until the test releases them (at most
a minute). Whatever waits for that I/O — the fsyncs of a group's flush, a rename made durable, a
node's background flush, an asynchronous save in a thread or a forked child, the threads writing
and reading a big group, the retention deleter — gives up after the deadline: the save fails with
``CheckpointWriteError`` naming node, epoch and path, how long was waited and what would be right,
and the run's retry policy treats it like any failed save; a read fails with ``CheckpointError``;
retention warns. The committed checkpoints before it stay as they were and verify, and a stuck
thread keeps no process from exiting.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import dask.config
import numpy as np
import pytest

import daskjobs as dj
from daskjobs._execution.node_run import NodeState
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._node.fork import snapshot_writers
from daskjobs.checkpoint._node.save_steps import FlushFinish, SaveFinish, Unflushed
from daskjobs.checkpoint._node.slots import checkpoint_slots
from daskjobs.checkpoint._storage import files as local_files
from daskjobs.errors import CheckpointError, CheckpointWriteError

pytestmark = pytest.mark.timeout(60)

SECONDS = 0.5
"""``daskjobs.storage-timeout`` in these tests."""
TOO_SLOW = (
    f"did not finish within {SECONDS:g} s (daskjobs.storage-timeout): the storage does not answer (a hung NFS or "
    "Lustre mount, an object store that stopped answering?); check it, or raise daskjobs.storage-timeout if it is "
    "only slow"
)
SLACK = 5.0
"""What a call may take beyond the waits it makes (a loaded machine)."""
STAGING = r"\.tmp-[0-9a-f]{32}"


class HungStorage:
    """Calls of ``os`` on the paths a predicate picks block until :meth:`release` (a minute at most)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self._released = threading.Event()
        self._idle = threading.Condition()
        self._stuck = 0
        self.blocked: list[str] = []
        """The paths of the calls that blocked, in order."""

    def _block(self, path: str) -> None:
        with self._idle:
            self._stuck += 1
            self.blocked.append(path)
        try:
            self._released.wait(60)
        finally:
            with self._idle:
                self._stuck -= 1
                self._idle.notify_all()

    def _by_fd(self, name: str, where: Callable[[str], bool]) -> None:
        real = getattr(os, name)

        def call(fd: int, *args: object) -> object:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if where(path):
                self._block(path)
            return real(fd, *args)

        self._monkeypatch.setattr(os, name, call)

    def fsync(self, where: Callable[[str], bool]) -> None:
        """``os.fsync`` of a file or folder ``where`` picks hangs."""
        self._by_fd("fsync", where)

    def write(self, where: Callable[[str], bool]) -> None:
        """``os.write`` to a file ``where`` picks hangs."""
        self._by_fd("write", where)

    def _by_path(self, name: str, where: Callable[[str], bool]) -> None:
        real = getattr(os, name)

        def call(path: str, *args: object, **kwargs: object) -> object:
            if where(os.fspath(path)):
                self._block(os.fspath(path))
            return real(path, *args, **kwargs)

        self._monkeypatch.setattr(os, name, call)

    def open(self, where: Callable[[str], bool]) -> None:
        """``os.open`` of a file ``where`` picks hangs."""
        self._by_path("open", where)

    def unlink(self, where: Callable[[str], bool]) -> None:
        """``os.unlink`` of a file ``where`` picks hangs."""
        self._by_path("unlink", where)

    def release(self) -> None:
        """Let every blocked call go on, and wait until they did."""
        self._released.set()
        with self._idle:
            assert self._idle.wait_for(lambda: self._stuck == 0, 30)


@pytest.fixture
def hung(monkeypatch: pytest.MonkeyPatch) -> Iterator[HungStorage]:
    storage = HungStorage(monkeypatch)
    with dask.config.set({"daskjobs.storage-timeout": SECONDS}):
        yield storage
    storage.release()


def groups(prefix: str, node: str, since: int) -> Callable[[str], bool]:
    """Picks the paths in ``node``'s groups (and their staging folders) of epochs ``since`` and later."""
    pattern = re.compile(rf"{re.escape(prefix)}/{node}\.(\d+)(\.tmp-|/|$)")

    def where(path: str) -> bool:
        found = pattern.match(path)
        return found is not None and int(found[1]) >= since

    return where


def build_job(nodes: tuple[str, ...] = ("a", "b")) -> dj.Job:
    with dj.Cluster(), dj.Job(name="hang") as job:
        for node in nodes:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("w", np.zeros(1000)))
                dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + ws.epoch))
    return job


def committed_files(prefix: str, epochs: Iterable[int]) -> dict[str, bytes]:
    """The files of the groups of ``epochs`` and of the commit records, by relative path (nothing
    else is looked at: saves of later epochs may be renaming their folders meanwhile)."""
    root, wanted = Path(prefix), {str(epoch) for epoch in epochs}
    folders = [p for p in root.iterdir() if p.name.rpartition(".")[2] in wanted]
    found = [f for folder in [*folders, root / "__daskjobs__" / "commits"] for f in folder.rglob("*") if f.is_file()]
    return {f.relative_to(root).as_posix(): f.read_bytes() for f in sorted(found) if ".tmp-" not in f.name}


def check_intact(prefix: str, epochs: list[int], before: dict[str, bytes]) -> None:
    """Exactly ``epochs`` are committed, their files are as ``before`` and every one verifies."""
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == epochs
    assert committed_files(prefix, epochs) == before
    for epoch in epochs:
        assert dj.open_checkpoint(prefix, epoch).verify() > 0


def raises_in_time(call: Callable[[], object], error: type[Exception], message: str, waits: int = 1) -> None:
    """``call()`` raises exactly ``error``, with a message that the regular expression ``message``
    matches whole, after ``waits`` waits of the deadline (and no more than :data:`SLACK` besides)."""
    started = time.monotonic()
    with pytest.raises(error) as caught:
        call()
    elapsed = time.monotonic() - started
    assert type(caught.value) is error
    assert re.fullmatch(message, str(caught.value)), str(caught.value)
    assert waits * SECONDS <= elapsed < waits * SECONDS + SLACK


def daskjobs_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "daskjobs" and r.levelno >= logging.WARNING]


# -- the fsyncs of a group's flush ----------------------------------------------------------------
def test_a_flush_whose_fsync_hangs_fails_the_save_like_any_failed_write(prefix, hung, caplog):
    """Node a's group of epoch 3 cannot be fsynced: each attempt (the first and ``save_retries`` more)
    gives up after the deadline and is retried by the run's policy, then the run raises
    CheckpointWriteError naming epoch, node, the file and the setting; epochs 0-2 are intact."""
    hung.fsync(groups(prefix, "a", since=3))
    before: dict[str, bytes] = {}
    runner = dj.JobRunner(
        build_job(),
        dj.MultiNodeCheckpointManager(prefix),
        max_epochs=6,
        progress=False,
        on_epoch=lambda record: before.update(committed_files(prefix, range(3))) if record.epoch == 2 else None,
    )
    with dj.LocalSession() as session, caplog.at_level(logging.WARNING, logger="daskjobs"):
        raises_in_time(
            lambda: runner.train(session),
            CheckpointWriteError,
            rf"could not write the checkpoint of epoch 3 under {re.escape(prefix)}: could not write the checkpoint "
            rf"of node 'a' at epoch 3 to {re.escape(prefix)}/a\.3: the fsync of {re.escape(prefix)}/a\.3{STAGING}"
            rf"(/\S+)? {re.escape(TOO_SLOW)}; the last committed checkpoint is intact",
            waits=4,  # the save in the epoch's hook, and three attempts of the policy
        )
    attempts = [w for w in daskjobs_warnings(caplog) if w.startswith("saving epoch 3 failed (attempt")]
    assert [w.split(":")[0] for w in attempts] == [f"saving epoch 3 failed (attempt {n} of 3)" for n in (1, 2, 3)]
    assert len([w for w in daskjobs_warnings(caplog) if TOO_SLOW in w]) == 4
    hung.release()
    check_intact(prefix, [0, 1, 2], before)


# -- a rename made durable --------------------------------------------------------------------------
def test_a_rename_whose_fsync_hangs_fails_the_write_over_a_retired_group(prefix, hung):
    """Node a's save of epoch 3 writes over its retired group of epoch 1, renamed to a staging folder;
    the fsync of the prefix that makes the new name durable hangs: the write fails after the
    deadline naming the rename; the committed epochs 0 and 2 are intact."""
    dj.JobRunner(build_job(("a",)), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(
        dj.LocalSession()
    )
    store = CheckpointStore(prefix)
    retired = store.retire_epoch(1, ["a"])
    before = committed_files(prefix, [0, 2])
    hung.fsync(lambda path: path == prefix)
    raises_in_time(
        lambda: store.write_node_unsynced("a", 3, {"w": np.ones(1000)}, save_id="s3", retired=retired),
        CheckpointWriteError,
        rf"could not write the checkpoint of node 'a' at epoch 3 to {re.escape(prefix)}/a\.3: the fsync of "
        rf"{re.escape(prefix)} \(making {re.escape(prefix)}/a\.1 durable under its new name "
        rf"{re.escape(prefix)}/a\.3{STAGING}\) {re.escape(TOO_SLOW)}",
    )
    assert hung.blocked == [prefix]
    hung.release()
    check_intact(prefix, [0, 2], before)


# -- a node's background flush ------------------------------------------------------------------------
@pytest.mark.parametrize("elements", [1000, 1 << 18], ids=["written-later", "flushed-later"])
def test_a_background_flush_that_hangs_is_reported_failed_after_the_deadline(prefix, hung, elements):
    """A node's group of epoch 3 is written (a small workspace: by the background write thread) and
    handed to the batches of syncs, whose fsyncs hang: the hook that waits for the flush reports
    it failed after the deadline, naming node, epoch and path, and keeps the save to be written
    again; the committed epochs 0-2 are intact."""
    dj.JobRunner(build_job(("a",)), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(
        dj.LocalSession()
    )
    before = committed_files(prefix, range(3))
    store = CheckpointStore(prefix)
    state = NodeState("a")
    state.scope.blobs = {"w": np.full(elements, 3.0)}
    hung.fsync(groups(prefix, "a", since=3))
    saved = SaveFinish(store, "a", 3, "s3", flush_later=True)(state)
    assert (saved.error, saved.later) == (None, True)
    started = time.monotonic()
    flushed = FlushFinish()(state).flushed
    elapsed = time.monotonic() - started
    assert flushed is not None
    assert (flushed.save_id, type(flushed.error)) == ("s3", CheckpointWriteError)
    assert str(flushed.error) == f"making the checkpoint of node 'a' at epoch 3 durable at {prefix}/a.3 {TOO_SLOW}"
    assert SECONDS <= elapsed < SECONDS + SLACK
    kept = checkpoint_slots(state).unflushed
    assert isinstance(kept, Unflushed)
    assert (kept.save_id, kept.epoch) == ("s3", 3)
    if elements == 1000:  # written in the background from a copy: kept, to be written again from it
        assert list(kept.copies) == ["w"]
        assert np.array_equal(kept.copies["w"], np.full(elements, 3.0))
    else:
        assert kept.copies is None
    assert hung.blocked
    assert all(re.fullmatch(rf"{re.escape(prefix)}/a\.3{STAGING}(/.*)?", path) for path in hung.blocked)
    hung.release()
    check_intact(prefix, [0, 1, 2], before)


# -- asynchronous saves ---------------------------------------------------------------------------------
@pytest.mark.parametrize("epoch", [3, 6], ids=["next-hook", "run-end"])
@pytest.mark.parametrize("snapshot", ["copy", "fork"])
def test_an_asynchronous_save_that_hangs_fails_after_the_deadline(prefix, hung, snapshot, epoch):
    """Node a's asynchronous save of ``epoch`` hangs — in its thread, writing a file; in its forked
    child, at an fsync: what waits for it — the hook of the next epoch, or the end of the run
    (epoch 6 is the last) — gives up after the deadline (a forked writer is killed), and the run
    raises CheckpointWriteError naming node, epoch and path, once the retries looked again (they
    wait no more: no save of the node starts while a stuck one runs); the epochs before are intact."""
    (hung.write if snapshot == "copy" else hung.fsync)(groups(prefix, "a", since=epoch))
    before: dict[str, bytes] = {}
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True, async_snapshot=snapshot)
    runner = dj.JobRunner(
        build_job(),
        manager,
        max_epochs=6,
        progress=False,
        on_epoch=lambda record: (
            before.update(committed_files(prefix, range(epoch))) if record.epoch == epoch - 1 else None
        ),
    )
    path = re.escape(f"{prefix}/a.{epoch}")
    if snapshot == "copy":  # the thread is left to itself
        writer = rf"the asynchronous save of node 'a' at epoch {epoch} to {path} {re.escape(TOO_SLOW)}"
    else:
        writer = (
            rf"the snapshot process \(pid \d+\) writing node 'a' at epoch {epoch} to {path} {re.escape(TOO_SLOW)}; "
            rf"it was killed: epoch {epoch} is not committed"
        )
    failed = rf"saving epoch {epoch} failed on 1 node\(s\): node 'a': " if epoch == 3 else ""
    with dj.LocalSession() as session:
        raises_in_time(
            lambda: runner.train(session),
            CheckpointWriteError,
            rf"could not write the checkpoint of epoch {epoch} under {re.escape(prefix)}: {failed}{writer}; the "
            r"last committed checkpoint is intact",
        )
    assert snapshot_writers() == {}  # the forked writer is gone
    hung.release()
    check_intact(prefix, list(range(epoch)), before)


# -- the threads that write and read big groups ----------------------------------------------------------
BIG = 1 << 21
"""Elements of each blob of a big group: two of them are written (and read) by several threads."""


def big_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="big") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(w0=np.zeros(BIG), w1=np.ones(BIG)))
        dj.Task(lambda ws: ws.__setitem__("w0", ws["w0"] + 1))
    return job


def test_a_big_group_whose_write_hangs_fails_after_the_deadline(prefix, hung):
    """The blobs of a big group are written by several threads; writing blob w0 of epoch 3 hangs:
    the write fails after the deadline naming node, epoch and the blob's path; epochs 0-2 are intact."""
    dj.JobRunner(big_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(
        dj.LocalSession()
    )
    before = committed_files(prefix, range(3))
    hung.write(lambda path: re.fullmatch(rf"{re.escape(prefix)}/a\.3{STAGING}/w0/c\.\d+", path) is not None)
    raises_in_time(
        lambda: CheckpointStore(prefix).write_node("a", 3, {"w0": np.full(BIG, 3.0), "w1": np.ones(BIG)}, save_id="s3"),
        CheckpointWriteError,
        rf"could not write the checkpoint of node 'a' at epoch 3 to {re.escape(prefix)}/a\.3: the write of "
        rf"{re.escape(prefix)}/a\.3{STAGING}/w0 {re.escape(TOO_SLOW)}",
    )
    hung.release()
    check_intact(prefix, [0, 1, 2], before)


def test_a_big_group_whose_read_hangs_fails_after_the_deadline(prefix, hung, monkeypatch):
    """Verifying a big group reads its chunks in several threads; opening blob w0's chunk hangs:
    the read fails after the deadline with CheckpointError naming epoch, node and the file."""
    monkeypatch.setattr(local_files, "_THREADS", 2)  # one reader thread per core: two on one core too
    dj.JobRunner(big_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(
        dj.LocalSession()
    )
    before = committed_files(prefix, range(3))
    hung.open(lambda path: re.fullmatch(rf"{re.escape(prefix)}/a\.2/w0/c\.\d+", path) is not None)
    raises_in_time(
        dj.open_checkpoint(prefix, 2).verify,
        CheckpointError,
        re.escape(f"epoch 2, node 'a': reading {prefix}/a.2 failed: the read of {prefix}/a.2/w0/c.0 {TOO_SLOW}"),
    )
    hung.release()
    check_intact(prefix, [0, 1, 2], before)


# -- retention's deletions ------------------------------------------------------------------------------
def test_a_retention_deletion_that_hangs_ends_the_run_with_a_warning(prefix, hung, caplog):
    """Retention (``keep_last=1``) deletes un-committed groups in a background thread while the
    next epoch runs; deleting epoch 1's hangs: the end of the run waits for it no longer than the
    deadline, warns naming epoch and prefix, and returns; the committed epoch is intact, and what
    was left is uncommitted debris that a cleanup removes."""
    hung.unlink(groups(prefix, "a", since=1))
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1)
    runner = dj.JobRunner(build_job(), manager, max_epochs=3, progress=False)
    started = time.monotonic()
    with dj.LocalSession() as session, caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert runner.train(session) == 3
    elapsed = time.monotonic() - started
    assert daskjobs_warnings(caplog) == [
        f"retention: deleting the groups of epoch 1 (un-committed) under {prefix} {TOO_SLOW}; they are left to "
        "the next run's cleanup"
    ]
    assert SECONDS <= elapsed < SECONDS + SLACK
    before = committed_files(prefix, [3])
    hung.release()
    deleter = [t for t in threading.enumerate() if t.name == "daskjobs-retention"]
    for thread in deleter:
        thread.join(30)
    check_intact(prefix, [3], before)
    store = CheckpointStore(prefix)
    removed = store.cleanup_uncommitted()
    assert sorted(Path(p).name for p in removed) == ["a.2", "b.2"]
    assert sorted(p.name for p in Path(prefix).iterdir()) == ["__daskjobs__", "a.3", "b.3"]


# -- teardown -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_thread_stuck_in_an_fsync_does_not_keep_the_process_from_exiting(tmp_path):
    """The fsync threads are daemons: a process whose flush gave up on an fsync that hangs for ever
    exits at once (Python joins a ThreadPoolExecutor's threads at exit, and would hang)."""
    (tmp_path / "x").write_bytes(b"x")
    (tmp_path / "y").write_bytes(b"y")
    code = f"""
import os, threading, dask.config
from daskjobs.checkpoint._storage.durable import sync_paths
os.fsync = lambda fd: threading.Event().wait()  # hangs for ever
with dask.config.set({{"daskjobs.storage-timeout": 0.2}}):
    try:
        sync_paths([{str(tmp_path / "x")!r}, {str(tmp_path / "y")!r}])
    except TimeoutError as exc:
        print(exc)
"""
    root = str(Path(__file__).resolve().parents[1])
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"the fsync of {tmp_path / 'x'} {TOO_SLOW.replace('0.5 s', '0.2 s')}\n"
    assert time.monotonic() - started < 30


@pytest.mark.slow
@pytest.mark.parametrize("queue", ["in_background", "deleting_in_background"])
def test_work_queued_in_the_background_threads_is_finished_at_exit(tmp_path, queue):
    """A group's write or a retired group's deletion still queued when the process ends is finished
    first (the threads are daemons, which the interpreter alone would stop wherever they are)."""
    done = tmp_path / "done"
    code = f"""
import pathlib, time
from daskjobs.checkpoint._storage import durable
durable.{queue}(lambda: time.sleep(0.5))
durable.{queue}(lambda: pathlib.Path({str(done)!r}).write_text("finished"))
"""
    root = str(Path(__file__).resolve().parents[1])
    ran = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env={**os.environ, "PYTHONPATH": root}
    )
    assert (ran.returncode, ran.stderr) == (0, "")
    assert done.read_text() == "finished"
