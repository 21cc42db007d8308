"""Checkpoints in cluster memory (tier 0, SPEC §3) as users meet them: ``daskjobs run ... --in-memory
--durable-every N`` of a job file, on a real ``dask scheduler`` with ``daskjobs worker`` processes
that never saw the file, their process groups killed (``killpg``), sent SIGTERM, and restarted as a
batch system restarts them; the driver killed and run again; ``daskjobs check --in-memory``. Every
case ends with exit 0, no traceback or ERROR, and every durable commit equal to an uninterrupted
run's, the last epoch among them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from acceptance.harness import (
    STEP_SECONDS_WHILE_EXPIRING,
    assert_quiet,
    assert_same_checkpoints,
    checkpoint_values,
    clean_env,
    finish,
    start_run,
    wait_until,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

EPOCHS = 10
DURABLE_EVERY = 4


def assert_durable_commits_equal(prefix, expected: dict) -> list[int]:
    """The durable commits (the last epoch among them) equal the uninterrupted run's; their epochs."""
    committed = checkpoint_values(prefix)
    assert EPOCHS in committed, sorted(committed)
    assert_same_checkpoints(committed, {epoch: expected[epoch] for epoch in committed})
    return sorted(committed)


def run_in_memory(cluster, job_dir, elsewhere, marks, prefix, *extra: str, step: str = "0.4"):
    options = ["--scheduler", cluster.address, "--checkpoint", str(prefix), "--in-memory"]
    options += ["--durable-every", str(DURABLE_EVERY), "-v", *extra]
    env = clean_env(JOB_MARKS=str(marks), JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS=step)
    return start_run(job_dir, elsewhere, "train.py:job", *options, env=env)


@pytest.mark.parametrize("how", ["killpg", "sigterm", "lifetime"])
def test_a_lost_worker_comes_back_from_the_cluster_memory(
    how, job_dir, elsewhere, tmp_path, external_cluster, reference
):
    """The trainer's ``daskjobs worker`` is killed with its whole process group (or sent SIGTERM: a
    preemption, a planned departure) in epoch 4, or its ``--lifetime`` runs out (a batch system's
    walltime), and a new one is started: every node is restored from the epoch committed in the
    workers' memory (the ps worker holds the trainer's replica; a departing worker's snapshots are
    moved by Dask), no epoch before the running one runs again, and the run ends equal to an
    uninterrupted one; a departure on purpose counts no failure."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    cluster = external_cluster
    if how == "lifetime":  # walltime rotation: the worker leaves when its lifetime ends, a new job replaces it
        expiring = cluster.replace_with_expiring_worker("trainer")
    failures = "1" if how == "killpg" else "0"
    step = STEP_SECONDS_WHILE_EXPIRING if how == "lifetime" else "0.4"
    process = run_in_memory(cluster, job_dir, elsewhere, marks, prefix, "--max-failures", failures, step=step)
    if how == "lifetime":
        wait_until(lambda: expiring.poll() is not None, 60, "the worker's lifetime to run out", process)
    else:
        wait_until(lambda: (marks / "epoch-4").exists(), 120, "epoch 4's step", process)
        worker = cluster.workers["trainer"]
        if how == "killpg":
            os.killpg(worker.pid, signal.SIGKILL)
        else:
            os.kill(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
    cluster.start_worker("trainer")
    code, out, err = finish(process, timeout=240)
    assert code == 0, err
    assert_quiet(err)
    restoring = [line for line in err.splitlines() if "restoring all nodes from epoch" in line]
    assert len(restoring) == 1, err
    assert "in cluster memory" in restoring[0], err
    restored = int(restoring[0].split("from epoch ")[1].split()[0])
    if how != "lifetime":  # (the lifetime runs out whenever it does)
        assert restored >= 3, err  # committed in memory before the loss struck in epoch 4 (or 5): only it runs again
    if how == "sigterm":
        assert "left on purpose (it was sent SIGTERM" in restoring[0], err
    if how == "lifetime":
        assert "left on purpose (its --lifetime ran out)" in restoring[0], err
    assert out.strip().splitlines()[-1].startswith(f"job 'acceptance': last epoch {EPOCHS}, committed under {prefix}")
    assert assert_durable_commits_equal(prefix, reference(EPOCHS))[0] == 0


@pytest.mark.matrix
def test_a_worker_and_its_replica_holder_lost_fall_back_to_the_durable_commit(
    job_dir, elsewhere, tmp_path, external_cluster, reference
):
    """Both workers' process groups are killed in epoch 6 (each held the other's replicas): no
    snapshot of the epochs in memory survives, every node comes back from the newest durable commit
    (epoch 4), and the run ends equal."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    cluster = external_cluster
    process = run_in_memory(cluster, job_dir, elsewhere, marks, prefix, "--max-failures", "1")
    wait_until(lambda: (marks / "epoch-6").exists(), 120, "epoch 6's step", process)
    for node in ("ps", "trainer"):
        os.killpg(cluster.workers[node].pid, signal.SIGKILL)
        cluster.workers[node].wait(timeout=30)
        cluster.start_worker(node)
    code, _out, err = finish(process, timeout=240)
    assert code == 0, err
    assert_quiet(err)
    restoring = [line for line in err.splitlines() if "restoring all nodes from epoch" in line]
    assert len(restoring) == 1, err
    assert "restoring all nodes from epoch 4 (recovery 1 of 1)" in restoring[0], err
    assert_durable_commits_equal(prefix, reference(EPOCHS))


def test_a_killed_driver_resumes_from_the_newest_durable_commit(job_dir, elsewhere, tmp_path, reference):
    """``daskjobs run --local --in-memory --durable-every 4``, its process group SIGKILLed in epoch 7:
    the memory is gone with it; the same command run again resumes from the newest durable commit
    (epoch 4: fewer than 2 x 4 epochs run again) and ends equal to an uninterrupted run."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    options = ["--local", "--checkpoint", str(prefix), "--in-memory", "--durable-every", str(DURABLE_EVERY)]
    env = clean_env(JOB_MARKS=str(marks), JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS="0.3")
    process = start_run(job_dir, elsewhere, "train.py:job", *options, env=env)
    wait_until(lambda: (marks / "epoch-7").exists(), 120, "epoch 7's step", process)
    os.killpg(process.pid, signal.SIGKILL)
    finish(process)
    assert sorted(checkpoint_values(prefix)) == [0, 4]
    again = start_run(job_dir, elsewhere, "train.py:job", *options, env=clean_env(JOB_EPOCHS=str(EPOCHS)))
    code, out, err = finish(again, timeout=120)
    assert code == 0, err
    assert f"ran epochs 5-{EPOCHS}" in out.strip().splitlines()[-1], out
    assert assert_durable_commits_equal(prefix, reference(EPOCHS)) == [0, 4, 8, EPOCHS]


def test_check_in_memory_restores_lost_nodes_from_memory(job_dir, elsewhere):
    """``daskjobs check --in-memory --mode lose-node``: the run that loses a node's worker is restored
    from the snapshots in memory, and every epoch of every run equals reference A (exit 0)."""
    env = clean_env(JOB_EPOCHS="5", JOB_STEP_SECONDS="0.2")
    args = [str(job_dir / "train.py:job"), "--in-memory", "--mode", "lose-node", "--interrupt-at", "2", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "daskjobs", "check", *args],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    lost = next(run for run in report["runs"] if run["name"] == "lose-node@2")
    assert lost["description"] == "node 'ps' lost in epoch 3, restored from 2", lost
