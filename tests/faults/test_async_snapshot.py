"""Faults of asynchronous saves written by forked snapshot processes (``async_snapshot="fork"``).

* The writer killed mid-write (any signal): the epoch fails with ``CheckpointWriteError`` naming
  node and epoch (raised, or a warning and the run goes on, by ``on_save_error``); nothing
  committed changes and the killed epoch is never committed.
* The writer failing (storage refuses): its error, tried twice inside the child from the
  snapshot, surfaces naming node and epoch; nothing committed changes.
* Its parent ending in any way (killed, terminated, exiting): the writer dies with it.
* Forking where it is not safe is refused at construction.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._node.fork import in_snapshot_writer, snapshot_writers
from daskjobs.errors import CheckpointWriteError

EPOCHS = 4
VICTIM_EPOCH = 2


def define_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="fork-faults") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("w", np.zeros(1 << 12)))

                def step(ws):
                    ws["w"] += 1.0

                dj.Task(step)
    return job


class SlowStore(CheckpointStore):
    """A local store on which node a's snapshot writer of one epoch hangs (a stuck disk)."""

    pause = 60.0

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if in_snapshot_writer() and node == "a" and epoch == VICTIM_EPOCH:
            time.sleep(self.pause)
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)


class WritesOnceSignalledStore(CheckpointStore):
    """A local store on which node a's snapshot writer of one epoch writes only once the test has
    signalled it (the file :attr:`flag` exists; 60 s at most)."""

    flag: str = ""

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if in_snapshot_writer() and node == "a" and epoch == VICTIM_EPOCH:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)


class FullDiskStore(CheckpointStore):
    """A local store whose snapshot writer of one epoch finds the disk full; each try is counted."""

    tries: str = ""

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if in_snapshot_writer() and node == "a" and epoch == VICTIM_EPOCH:
            with open(self.tries, "a") as tries:
                tries.write("try\n")
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)


def committed_files(prefix: str) -> dict[str, bytes]:
    """Every file of every committed epoch's groups, and the commit records."""
    files = {}
    for info in dj.list_checkpoints(prefix):
        for node in ("a", "b"):
            root = Path(prefix, f"{node}.{info.epoch}")
            files.update({str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()})
        files[info.epoch] = Path(prefix, "__daskjobs__", "commits", f"epoch-{info.epoch:012d}.json").read_bytes()
    return files


def manager_on(store_class: type[CheckpointStore], prefix: str) -> dj.MultiNodeCheckpointManager:
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True, async_snapshot="fork")
    manager.store = store_class(prefix)
    return manager


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("policy", ["raise", "warn"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV])
def test_writer_killed_mid_write_fails_the_epoch(tmp_path, caplog, signum, policy):
    prefix = str(tmp_path / "ckpt")
    seen: dict[str, object] = {}

    def kill_the_writer(record):
        # on_epoch of an epoch comes once it is committed: at the end of the next epoch, whose
        # snapshot writer is then running
        if record.epoch != VICTIM_EPOCH - 1:
            return
        wait_for(lambda: ("a", VICTIM_EPOCH) in snapshot_writers().values())
        (pid,) = [p for p, what in snapshot_writers().items() if what == ("a", VICTIM_EPOCH)]
        seen["files"] = committed_files(prefix)
        seen["pid"] = pid
        os.kill(pid, signum)

    runner = dj.JobRunner(
        define_job(),
        manager_on(SlowStore, prefix),
        max_epochs=EPOCHS,
        progress=False,
        on_epoch=kill_the_writer,
        on_save_error=policy,
    )
    expected = rf"node 'a' at epoch {VICTIM_EPOCH} was killed by signal {int(signum)} \({signum.name}\)"
    with dj.LocalSession() as session:
        if policy == "raise":
            with pytest.raises(CheckpointWriteError, match=expected):
                runner.train(session)
        else:
            assert runner.train(session) == EPOCHS
            warned = [r.getMessage() for r in caplog.records if f"epoch {VICTIM_EPOCH}" in r.getMessage()]
            assert any(re.search(expected, message) for message in warned), warned
    epochs = [info.epoch for info in dj.list_checkpoints(prefix)]
    assert VICTIM_EPOCH not in epochs
    assert epochs == ([0, 1] if policy == "raise" else [0, 1, 3, 4])
    now = committed_files(prefix)
    assert {k: now[k] for k in seen["files"]} == seen["files"]
    wait_for(lambda: not snapshot_writers())  # the next epoch's save, abandoned when the run stopped
    assert not Path(f"/proc/{seen['pid']}").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_writer_sent_sigterm_or_sigint_finishes_its_save(tmp_path, signum):
    """SLURM's scancel and systemd signal every process of a job, a terminal's Ctrl-C its process
    group: a snapshot writer ignores SIGTERM and SIGINT (a graceful stop waits for the save), so the
    epoch whose writer got the signal is committed and the run ends as an unsignalled one."""
    prefix = str(tmp_path / "ckpt")
    signalled: list[int] = []

    def signal_the_writer(record):
        if record.epoch != VICTIM_EPOCH - 1:
            return
        wait_for(lambda: ("a", VICTIM_EPOCH) in snapshot_writers().values())
        (pid,) = [p for p, what in snapshot_writers().items() if what == ("a", VICTIM_EPOCH)]
        os.kill(pid, signum)
        signalled.append(pid)
        Path(flag).touch()  # os.kill has delivered the signal: a writer it would end is gone now

    flag = str(tmp_path / "signalled")
    manager = manager_on(WritesOnceSignalledStore, prefix)
    manager.store.flag = flag
    runner = dj.JobRunner(define_job(), manager, max_epochs=EPOCHS, progress=False, on_epoch=signal_the_writer)
    with dj.LocalSession() as session:
        assert runner.train(session) == EPOCHS
    assert len(signalled) == 1
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == list(range(EPOCHS + 1))
    assert dj.open_checkpoint(prefix, epoch=VICTIM_EPOCH).verify() > 0


@pytest.mark.parametrize("fault", ["full-disk", "foreign-folder"])
def test_writer_error_names_node_and_epoch(tmp_path, fault):
    prefix = str(tmp_path / "ckpt")
    store_class: type[CheckpointStore] = CheckpointStore
    foreign = Path(prefix, f"a.{VICTIM_EPOCH}")
    if fault == "full-disk":
        store_class = FullDiskStore
        FullDiskStore.tries = str(tmp_path / "tries")
    else:  # a user's folder where the group would go: never overwritten, never deleted
        foreign.mkdir(parents=True)
        (foreign / "notes.txt").write_text("mine")
    seen: dict[str, dict] = {}

    def remember(record):  # once the epoch before the victim is committed (the victim's save is running)
        if record.epoch == VICTIM_EPOCH - 1:
            seen["files"] = committed_files(prefix)

    runner = dj.JobRunner(
        define_job(), manager_on(store_class, prefix), max_epochs=EPOCHS, progress=False, on_epoch=remember
    )
    with dj.LocalSession() as session, pytest.raises(CheckpointWriteError) as raised:
        runner.train(session)
    chain = []
    error: BaseException | None = raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    root = chain[-1]
    assert isinstance(root, CheckpointWriteError)
    assert f"node 'a' at epoch {VICTIM_EPOCH} failed in its snapshot process" in str(root)
    if fault == "full-disk":
        assert "No space left on device" in str(root)
        assert Path(FullDiskStore.tries).read_text().count("try") == 2  # retried once, from the snapshot
    else:
        assert (foreign / "notes.txt").read_text() == "mine"
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 1]
    now = committed_files(prefix)
    assert {k: now[k] for k in seen["files"]} == seen["files"]


PARENT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from daskjobs.checkpoint import CheckpointStore
    from daskjobs.checkpoint._node.fork import ForkedSave, in_snapshot_writer

    class Stuck(CheckpointStore):
        def write_node(self, *args, **kwargs):
            if in_snapshot_writer():
                time.sleep(60)
            return super().write_node(*args, **kwargs)

    saver = ForkedSave(Stuck(sys.argv[1]), "a", 0, "s0", {"w": np.zeros(1 << 16)})
    print(saver.pid, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)
    time.sleep(60)
    """
)


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("ending", ["SIGKILL", "SIGTERM", "exit"])
@pytest.mark.slow
def test_writer_dies_with_its_parent(tmp_path, ending):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "ckpt"), ending],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        child = int(parent.stdout.readline())
        if ending != "exit":
            time.sleep(0.2)
            assert running(child)
            parent.send_signal(getattr(signal, ending))
        parent.wait(timeout=30)
        wait_for(lambda: not running(child), seconds=5)
    finally:
        parent.kill()
        parent.wait(timeout=30)
        parent.stdout.close()
    assert not Path(tmp_path, "ckpt", "__daskjobs__", "commits").exists()


def test_fork_on_an_object_store_is_refused(s3_prefix):
    url, options = s3_prefix
    with pytest.raises(ValueError, match=r"async_snapshot='fork' is not possible: s3://.* is not on a local disk"):
        dj.MultiNodeCheckpointManager(url, storage_options=options, async_save=True, async_snapshot="fork")
    assert dj.MultiNodeCheckpointManager(url, storage_options=options, async_save=True).async_snapshot == "copy"


class FailThenHangStore(CheckpointStore):
    """Node a's save of the victim epoch fails (disk full); its save of the next epoch hangs."""

    hang_seconds: float = 60.0

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if node == "a" and epoch == VICTIM_EPOCH:
            raise OSError(errno.ENOSPC, "No space left on device")
        if node == "a" and epoch == VICTIM_EPOCH + 1:
            time.sleep(self.hang_seconds)
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)


def save_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("daskjobs-save-a-") and t.is_alive()]


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_a_run_that_fails_stops_its_writers_before_it_releases_the_lock(tmp_path, snapshot):
    """A failed save raises while the next epoch's save (started by the same hooks) still writes:
    train() ends that writer (a forked one is killed, a thread waited for) before the lock goes,
    so no writer of this run touches the prefix once another runner may own it."""
    prefix = str(tmp_path / "ckpt")
    store = FailThenHangStore(prefix)
    store.hang_seconds = 60.0 if snapshot == "fork" else 1.0
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True, async_snapshot=snapshot)
    manager.store = store
    runner = dj.JobRunner(define_job(), manager, max_epochs=EPOCHS, progress=False, save_retries=0)
    started = time.monotonic()
    with dj.LocalSession() as session, pytest.raises(CheckpointWriteError, match=rf"epoch {VICTIM_EPOCH}"):
        runner.train(session)
    assert time.monotonic() - started < 30  # a forked writer was killed, not waited for
    assert not snapshot_writers()
    assert not save_threads()
    assert CheckpointStore(prefix).read_lock() is None
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == list(range(VICTIM_EPOCH))
