"""Fault catalogue, debris: whatever dies or fails during a node's save on its worker, the run (or its
resume) completes and leaves none of daskjobs' own debris behind (SPEC §3, §2.7).

The job (``jobfiles/save_faults.py``) runs nodes ``a`` and ``b`` on worker processes of their own,
with ``keep_last=2``; a step of node ``a`` arms one fault in its worker, once a run, just before
the save of the victim epoch. Classes:

* **worker SIGKILL** at a point of node ``a``'s save of epoch 5, which writes over its retired
  group of epoch 3 and is flushed in the background: during the take-over writes, after the
  manifest, before the staged rename, after it (before the commit), during the batched sync. A lost
  node: the run recovers from its last commit.
* **injected errors**: ENOSPC in the write, EIO in the sync, EIO in the rename of the staging
  folder into place, each in the hook (the last epoch's save, fsynced inside the epoch's task) and in
  the background (epoch 5). Each goes through the run's ``save_retries``: the epoch is written
  again and the run goes on without a recovery.
* **driver SIGKILL** (``os.killpg`` to the process group of ``daskjobs run``) while node ``a``'s
  worker is at one of the points above: the driver's own local cluster dies with it, or the workers
  of a scheduler it joined live on and finish the save; then a resume, ``daskjobs run`` again.

After the run, or the resume, completes: the newest two epochs are committed and verify (also with
``daskjobs checkpoints verify``), hold the values of an uninterrupted run, and their files are those
of their commit (a run of this process hears of each commit; a dead driver's commits are checked for
it); no ``*.tmp-*`` folder or file and no uncommitted group of daskjobs' own remains;
a user's file, a ``mydata.2024`` folder and a folder named like a staging folder without daskjobs'
proof are untouched.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import checkout_env, spawn, stop_group, wait_until

import daskjobs as dj
from daskjobs.checkpoint._storage.cleanup import named_by_us
from daskjobs.cli import load_job, main

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

JOBFILE = Path(__file__).parent / "jobfiles" / "save_faults.py"
NODES = ("a", "b")
EPOCHS = 8
BACKGROUND, HOOK = 5, EPOCHS
"""The victim epochs: epoch 5's save writes over the group of epoch 3 and is flushed in the
background; the last epoch's save is fsynced inside the epoch's task (the run ends with it)."""
POINTS = [
    "during-take-over-writes",
    "after-the-manifest",
    "before-the-staged-rename",
    "after-the-staged-rename",
    "during-the-batched-sync",
]
ERRORS = ["write-enospc", "sync-eio", "rename-eio"]
"""Injected into the write, the sync and the rename (see the job file)."""


def expected(epoch: int) -> np.ndarray:
    w = np.arange(6.0)
    for _ in range(epoch):
        w = w * 1.5 + 1
    return w


@pytest.fixture(scope="module")
def cluster():
    """Each node on a worker process of its own (a killed one is restarted by its nanny)."""
    with dj.node_cluster({"w0": ["a"], "w1": ["b"]}, processes=True) as made:
        yield made


def knobs(prefix: Path, fault: str, epoch: int, action: str = "kill") -> dict[str, str]:
    """The job file's knobs (see its docstring); its flags go next to the prefix."""
    flags = prefix.parent / "flags"
    flags.mkdir(exist_ok=True)
    return {
        "SAVE_FAULT": fault,
        "SAVE_FAULT_ACTION": action,
        "SAVE_FAULT_EPOCH": str(epoch),
        "SAVE_FAULT_PREFIX": str(prefix),
        "SAVE_FAULT_FLAGS": str(flags),
    }


def fault_job(monkeypatch: pytest.MonkeyPatch, settings: dict[str, str]) -> dj.Job:
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    return load_job(f"{JOBFILE}:job")


STAGING_LOOKALIKE = f"a.{BACKGROUND}.tmp-{'0' * 32}"


def foreign(prefix: Path) -> dict[str, bytes]:
    """A user's file and folders under the prefix, one named like a staging folder of node a."""
    made = {"notes.txt": b"mine", "mydata.2024/x.bin": b"\x00\x01", f"{STAGING_LOOKALIKE}/w/c.0": b"not daskjobs'"}
    for name, data in made.items():
        (prefix / name).parent.mkdir(parents=True, exist_ok=True)
        (prefix / name).write_bytes(data)
    return made


def group_files(prefix: Path, epoch: int) -> dict[str, bytes]:
    return {
        p.relative_to(prefix).as_posix(): p.read_bytes()
        for node in NODES
        for p in sorted((prefix / f"{node}.{epoch}").rglob("*"))
        if p.is_file()
    }


class Commits(dj.RunnerHooks):
    """Each epoch committed, in order, and the files of its groups when it was committed."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.committed: list[int] = []
        self.files: dict[int, dict[str, bytes]] = {}

    def epoch_committed(self, epoch: int) -> None:
        self.committed.append(epoch)
        self.files[epoch] = group_files(self.prefix, epoch)


def check_committed(prefix: Path, epochs: list[int]) -> None:
    """``epochs`` are exactly the commits, each verified and holding an uninterrupted run's values."""
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == epochs
    for epoch in epochs:
        view = dj.open_checkpoint(str(prefix), epoch)
        assert view.verify() == len(NODES) * 6 * 8  # bytes verified: every chunk of every node
        for node in NODES:
            np.testing.assert_array_equal(view[node]["w"], expected(epoch))


def check_no_debris(prefix: Path, users: dict[str, bytes], commits: Commits | None = None) -> None:
    """The run completed: the last two epochs committed and exact (and, with ``commits``, their
    files those of their commit); nothing of daskjobs' own left but them; the user's files as made."""
    kept = [EPOCHS - 1, EPOCHS]
    check_committed(prefix, kept)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["checkpoints", "verify", str(prefix)]) == 0
    if commits is not None:
        for epoch in kept:
            assert group_files(prefix, epoch) == commits.files[epoch]
    tops = {name.split("/")[0] for name in users}
    ours = sorted(p.name for p in prefix.iterdir() if p.name not in tops)
    assert ours == sorted(["__daskjobs__", *(f"{node}.{epoch}" for node in NODES for epoch in kept)])
    temps = [p for p in prefix.rglob("*.tmp-*") if not p.relative_to(prefix).as_posix().startswith(STAGING_LOOKALIKE)]
    assert temps == []
    assert {name: (prefix / name).read_bytes() for name in users} == users


def train(session: dj.Session, job: dj.Job, prefix: Path, commits: Commits) -> dj.JobRunner:
    manager = dj.MultiNodeCheckpointManager(str(prefix), keep_last=2)
    runner = dj.JobRunner(job, manager, max_epochs=EPOCHS, progress=False, hooks=commits)
    assert runner.train(session) == EPOCHS
    return runner


@pytest.mark.representative("during-take-over-writes", "after-the-staged-rename")
# The points differ in what the dead worker leaves: a staging folder holding the retired group
# (take-over writes), with the new manifest over the old one (after the manifest, before the
# rename, during the sync), or the new group in place, uncommitted (after the rename). One of each
# kind of staging folder, and the group in place, stay in the default lane.
@pytest.mark.parametrize("point", POINTS)
def test_a_worker_killed_during_its_save_leaves_a_complete_run_and_no_debris(cluster, tmp_path, monkeypatch, point):
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    users = foreign(prefix)
    job = fault_job(monkeypatch, knobs(prefix, point, BACKGROUND))
    commits = Commits(prefix)
    with dj.DaskSession(cluster) as session:
        runner = train(session, job, prefix, commits)

    assert (tmp_path / "flags" / "at-point").exists()  # the worker was killed there
    check_no_debris(prefix, users, commits)
    assert commits.committed == list(range(EPOCHS + 1))  # each epoch once, in order, the victim too
    assert [r.epoch for r in runner.history] == list(range(1, EPOCHS + 1))
    # A lost node: every node restored from the epoch before the victim, which runs again; or, when
    # the loss is noticed while the next epoch runs and node a's group was written whole, the driver
    # makes it durable itself (``make_durable``), commits the victim and restores from it.
    recoveries = [r.recoveries for r in runner.history]
    rerun = [[0] * (BACKGROUND - 1) + [1] * (EPOCHS - BACKGROUND + 1)]
    salvaged = [[0] * BACKGROUND + [1] * (EPOCHS - BACKGROUND)]
    assert recoveries in (rerun if point == "during-take-over-writes" else rerun + salvaged)


ERROR_CASES = [
    *(pytest.param(error, where, id=f"{error}-{where}") for error in ERRORS for where in ("hook", "background")),
    pytest.param("sync-eio-stuck", "hook", id="sync-eio-stuck-hook"),
]
"""Each error in each place; and, in the hook, a sync error after which the worker cannot remove the
failed attempt's files either (in the background nothing removes them there: the run does, at its end)."""


@pytest.mark.representative("write-enospc-hook", "sync-eio-stuck-hook", "rename-eio-background")
# Each error and each place once: the write in the hook; the sync in the hook, where the worker cannot
# remove what it wrote either (the run's end does); the rename, whose failure leaves a whole group in
# its staging folder, in the background.
@pytest.mark.parametrize(("error", "where"), ERROR_CASES)
def test_an_error_in_a_workers_save_is_retried_and_leaves_no_debris(
    cluster, tmp_path, monkeypatch, caplog, error, where
):
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    users = foreign(prefix)
    victim = HOOK if where == "hook" else BACKGROUND
    job = fault_job(monkeypatch, knobs(prefix, error, victim))
    commits = Commits(prefix)
    with caplog.at_level(logging.WARNING, logger="daskjobs"), dj.DaskSession(cluster) as session:
        runner = train(session, job, prefix, commits)

    check_no_debris(prefix, users, commits)
    assert commits.committed == list(range(EPOCHS + 1))
    assert [r.recoveries for r in runner.history] == [0] * EPOCHS  # written again by the node: no recovery
    assert "(injected)" in caplog.text  # the fault struck, and was retried
    if where == "background":
        assert f"could not make the checkpoint of epoch {victim} durable" in caplog.text
        assert "writing it again" in caplog.text
    else:
        assert f"saving epoch {victim} failed" in caplog.text
        assert "saving it again" in caplog.text


def run_cli(cwd: Path, prefix: Path, settings: dict[str, str], log: str, *options: str) -> subprocess.Popen:
    """``daskjobs run save_faults.py:job OPTIONS`` with retention, from ``cwd``, in a process group of
    its own; without a terminal it prints a line per epoch (``epoch N committed: ...``) to ``log``."""
    argv = [sys.executable, "-m", "daskjobs", "run", f"{JOBFILE}:job", "--checkpoint", str(prefix)]
    argv += ["--keep-last", "2", "--max-epochs", str(EPOCHS), *options]
    return spawn(argv, cwd / log, env=checkout_env(**settings), cwd=cwd)


def busy(dask_worker) -> bool:
    """Whether this worker still runs a task, or has a group to write or sync in the background."""
    from daskjobs.checkpoint._storage import durable

    syncer = durable._syncer
    return bool(dask_worker.state.executing_count or durable._writing or (syncer is not None and syncer._pending))


def quiet(cluster, prefix: Path) -> bool:
    """Whether the workers of ``cluster`` are done with what a dead driver asked of them: node a's
    paused save of the victim epoch, and whatever task of its was still running (a later epoch's
    save waiting for that one), no staging folder of daskjobs' left to put in place."""
    from distributed import Client

    with Client(cluster.scheduler_address, set_as_default=False) as client:
        if any(client.run(busy).values()):
            return False
    return (prefix / f"a.{BACKGROUND}").is_dir() and not any(named_by_us(p.name) for p in prefix.iterdir())


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.representative("after-the-manifest-end-with-it")
# One case: the other points as in the worker's class. A driver with a local cluster of its own,
# killed with it, leaves the prefix as a worker's SIGKILL does, for the resume to clean up; the
# workers of a scheduler it joined live on and finish its save (the matrix).
@pytest.mark.parametrize("workers", ["live-on", "end-with-it"])
@pytest.mark.parametrize("point", POINTS)
def test_a_driver_killed_while_a_worker_saves_resumes_and_leaves_no_debris(cluster, tmp_path, point, workers):
    """SIGKILL to the process group of ``daskjobs run`` while node a's worker is at the point: the
    local cluster the driver started ends with it; the workers of a cluster it joined
    (``--scheduler``) live on and finish the save, without touching a commit. The commits left
    verify, and a resume (``daskjobs run`` again) completes with no debris left."""
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    users = foreign(prefix)
    settings = knobs(prefix, point, BACKGROUND, action="pause")
    flags = tmp_path / "flags"
    options = ["--scheduler", cluster.scheduler_address] if workers == "live-on" else []
    driver = run_cli(tmp_path, prefix, settings, "driver.log", *options)
    try:
        wait_until(lambda: (flags / "at-point").exists(), 90, f"node a's worker at {point}", driver)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        committed = [info.epoch for info in dj.list_checkpoints(str(prefix))]
        assert committed, (tmp_path / "driver.log").read_text()[-3000:]
        before = {epoch: group_files(prefix, epoch) for epoch in committed}
        if workers == "live-on":
            (flags / "go").touch()
            wait_until(lambda: quiet(cluster, prefix), 30, "the dead driver's saves to end on the workers")
        else:
            wait_until(lambda: not group_alive(driver.pid), 30, "the driver's workers to end with it")
    finally:
        stop_group(driver)
    assert committed[-1] < BACKGROUND  # the victim epoch never committed
    victim = [p.name for p in prefix.iterdir() if p.name.startswith(f"a.{BACKGROUND}") and p.name != STAGING_LOOKALIKE]
    assert victim  # for the resume to remove: the victim group, in its staging folder or in place
    assert {epoch: group_files(prefix, epoch) for epoch in committed} == before
    check_committed(prefix, committed)

    resume = run_cli(tmp_path, prefix, settings, "resume.log", *options)
    try:
        resume.wait(timeout=120)
    finally:
        stop_group(resume)
    out = (tmp_path / "resume.log").read_text()
    assert resume.returncode == 0, out[-3000:]
    check_no_debris(prefix, users)
    rerun = list(range(committed[-1] + 1, EPOCHS + 1))
    lines = re.findall(r"^epoch (\d+) committed: (.*)$", out, re.MULTILINE)
    assert [int(epoch) for epoch, _ in lines] == rerun, out[-3000:]  # each epoch once, in order
    assert not [rest for _, rest in lines if "recoveries=" in rest]  # resumed, not recovered
    assert f"last epoch {EPOCHS}, committed under" in out
    assert f"ran epochs {rerun[0]}-{EPOCHS}" in out
