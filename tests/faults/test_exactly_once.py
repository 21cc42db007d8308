"""Exactly once: a job killed anywhere (driver mid-epoch, worker mid-epoch, during a save) and resumed
processes, epoch by epoch, the same records as an uninterrupted run (the same sequence with one thread).

The job records every record id it processes, with the epoch, into checkpointed blobs; every committed
epoch is compared with the uninterrupted run's state after that epoch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from processes import stop_group

import daskjobs as dj

RECORDS = 60
"""Record ids 0..59; 5 per batch, 2 shuffled passes: 24 batches, 4 per epoch, 6 epochs."""


def init_seen(ws):
    ws["seen"] = np.zeros(0, dtype=np.int64)
    ws["seen_epoch"] = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Ballast:
    """A blob created in the init group and rewritten every epoch, so that each save takes a while."""

    megabytes: int

    def __call__(self, ws):
        if self.megabytes:
            ws["ballast"] = np.full(self.megabytes * 131072, float(ws.epoch or 0))


@dataclass(frozen=True)
class Record:
    """Processor: append the batch's ids and the epoch; with ``kill``, SIGKILL this process once."""

    delay: float = 0.0
    kill_marker: str | None = None
    kill_epoch: int = 3

    def __call__(self, ws, batch):
        ids, _ = batch
        time.sleep(self.delay)
        if self.kill_marker and ws.epoch == self.kill_epoch and not os.path.exists(self.kill_marker):
            Path(self.kill_marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        with ws.lock:
            ws["seen"] = np.append(ws["seen"], ids)
            ws["seen_epoch"] = np.append(ws["seen_epoch"], np.full(len(ids), ws.epoch, dtype=np.int64))


def build_job(num_threads: int, record: Record | None = None, ballast_mb: int = 0) -> dj.Job:
    ids = np.arange(RECORDS, dtype=np.int64)
    features = np.random.default_rng(0).normal(size=(RECORDS, 4))
    with dj.Cluster(), dj.Job(name="exactly-once") as job, dj.Node("a"):
        with job.init_group:
            reader = dj.ArrayReader(ids, features, batch_size=5, shuffle=True, seed=11, num_passes=2, name="ids")
            dj.Task(init_seen)
            dj.Task(Ballast(ballast_mb), name="ballast")
        limited = dj.ReaderWithLimit(reader, num_iter=4)
        dj.pipe(limited, record or Record(), num_threads=num_threads)
        dj.Task(Ballast(ballast_mb), name="ballast")
        job.add_stop_condition(limited.data_finished())
    return job


def main(prefix: str, num_threads: int, delay: float, ballast_mb: int, async_save: bool = False) -> None:
    """Run the job in this process (the subprocess of the driver-kill tests)."""
    job = build_job(num_threads, Record(delay), ballast_mb)
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix, async_save=async_save), progress=False)
    last = runner.train(None)
    print("epochs", *[r.epoch for r in runner.history], "last", last, flush=True)


_reference: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}


def reference(num_threads: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The uninterrupted run's ``(seen, seen_epoch)`` after each epoch."""
    if num_threads not in _reference:
        states = {}
        with dj.LocalSession() as session:

            def snapshot(record):
                states[record.epoch] = (session.fetch("seen", "a"), session.fetch("seen_epoch", "a"))

            runner = dj.JobRunner(build_job(num_threads), progress=False, on_epoch=snapshot)
            assert runner.train(session) == 6
        _reference[num_threads] = states
    return _reference[num_threads]


def assert_same_records(prefix: str, num_threads: int) -> None:
    """Every committed epoch 1..6 holds exactly the reference's records, epoch by epoch."""
    expected = reference(num_threads)
    committed = [info.epoch for info in dj.list_checkpoints(prefix)]
    assert committed == list(range(7))
    for epoch in range(1, 7):
        view = dj.open_checkpoint(prefix, epoch)["a"]
        seen, seen_epoch = view["seen"], view["seen_epoch"]
        want, want_epoch = expected[epoch]
        assert np.array_equal(seen_epoch, want_epoch), f"epoch {epoch}"
        for e in range(1, epoch + 1):
            assert sorted(seen[seen_epoch == e]) == sorted(want[want_epoch == e]), f"epoch {e} in {epoch}"
        if num_threads == 1:
            assert np.array_equal(seen, want), f"epoch {epoch}"
    final = dj.open_checkpoint(prefix)["a"]
    assert sorted(final["seen"]) == sorted(np.tile(np.arange(RECORDS), 2))


def start_driver(
    prefix: str, num_threads: int, delay: float, ballast_mb: int = 0, async_save: bool = False
) -> subprocess.Popen:
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})\n"  # tests/: the helpers this file imports
        f"spec = importlib.util.spec_from_file_location('exactly_once_job', {__file__!r})\n"
        "module = sys.modules['exactly_once_job'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.main({prefix!r}, {num_threads}, {delay}, {ballast_mb}, {async_save})\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out


def wait_for_commit(prefix: str, epoch: int, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(prefix) and any(i.epoch >= epoch for i in dj.list_checkpoints(prefix)):
            return
        if process.poll() is not None:
            pytest.fail(f"the driver ended before epoch {epoch} was committed: {process.stderr.read()}")
        time.sleep(0.02)
    pytest.fail(f"epoch {epoch} was not committed within {timeout} s")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.representative("3-False", "1-True")
@pytest.mark.parametrize(("num_threads", "async_save"), [(1, False), (3, False), (1, True)])
def test_driver_killed_mid_epoch_resumes_exactly(prefix, num_threads, async_save):
    """SIGKILL of the driver inside epoch 3; the re-run resumes after the last commit and ends with the
    same records (also with asynchronous saves)."""
    process = start_driver(prefix, num_threads, delay=0.1, async_save=async_save)
    try:
        wait_for_commit(prefix, 2, process)
        time.sleep(0.15)  # inside epoch 3: 4 batches of 0.1 s each
    finally:
        stop_group(process)
    committed = max(i.epoch for i in dj.list_checkpoints(prefix))
    assert committed < 6
    out = finish(start_driver(prefix, num_threads, delay=0.0, async_save=async_save))
    assert out.split()[1] == str(committed + 1)
    assert_same_records(prefix, num_threads)


def uncommitted_groups(prefix: str) -> list[str]:
    """Node groups on disk of epochs that have no commit record: a save was cut short."""
    committed = {info.epoch for info in dj.list_checkpoints(prefix)}
    return [name for name in os.listdir(prefix) if name.startswith("a.") and int(name[2:]) not in committed]


def fresh(path: str, since_ns: int) -> bool:
    """Whether ``path`` exists and was created after ``since_ns`` (not debris of an earlier run)."""
    try:
        return os.stat(path).st_mtime_ns >= since_ns
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_driver_killed_while_saving_resumes_exactly(prefix):
    """Each run commits one more epoch, then is SIGKILLed as soon as the following epoch's node group
    appears on disk (its save is being written: a 32 MB blob rewritten per epoch keeps it busy). Every
    re-run resumes from the last commit, and the records match the uninterrupted run."""
    kills, cut_saves = 0, 0
    for round_ in range(10):
        committed = [i.epoch for i in dj.list_checkpoints(prefix)] if os.path.exists(prefix) else []
        target = max(committed, default=-1) + 1
        started = time.time_ns()
        process = start_driver(prefix, 1, delay=0.0, ballast_mb=32)
        if round_ > 0:  # the first run dies inside the save of epoch 0; later ones commit one more first
            wait_for_commit(prefix, target, process)
        following = os.path.join(prefix, f"a.{target + 1 if round_ > 0 else 0}")
        deadline = time.monotonic() + 90
        while process.poll() is None and not fresh(following, started) and time.monotonic() < deadline:
            time.sleep(0.0005)
        if process.poll() is not None:
            finish(process)
            break
        stop_group(process)
        kills += 1
        cut_saves += bool(uncommitted_groups(prefix))
    assert kills >= 3
    assert cut_saves >= 2
    assert_same_records(prefix, 1)


@pytest.fixture(scope="module")
def cluster():
    with dj.node_cluster(["a"], nthreads=4) as made:
        yield made


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.representative("3")
@pytest.mark.parametrize("num_threads", [1, 3])
def test_worker_killed_mid_epoch_is_recovered_exactly(cluster, prefix, tmp_path, num_threads):
    """The node's worker dies inside epoch 3; the runner restores epoch 2 (data and position) on the
    restarted worker and the run ends with the same records."""
    marker = str(tmp_path / "killed")
    job = build_job(num_threads, Record(kill_marker=marker))
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_failures=2, progress=False)
    with dj.DaskSession(cluster) as session:
        assert runner.train(session) == 6
    assert os.path.exists(marker)
    assert [r.recoveries for r in runner.history] == [0, 0, 1, 1, 1, 1]
    assert_same_records(prefix, num_threads)
