"""Planned departures are not failures (SPEC §4): a node's worker that leaves on purpose while the
job runs — retired by ``client.retire_workers``, its ``--lifetime`` run out (dask-jobqueue's walltime
rotation), or sent SIGTERM (a preemption or spot notice) — is replaced like a lost one: the runner
waits for the node's new worker, restores every node from the last commit and goes on, with values
equal to an uninterrupted run's. It does not count against ``max_failures`` (these runs allow
none), logs one INFO line naming the node and the reason, and no ERROR."""

from __future__ import annotations

import os
import signal

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

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

EPOCHS = 10
REASONS = {
    "retire": "it was retired",
    "lifetime": "its --lifetime ran out",
    "sigterm": "it was sent SIGTERM (a preemption or spot notice)",
}


@pytest.mark.representative("retire-async", "lifetime-sync")  # SIGTERM departs in the limits test below
@pytest.mark.parametrize("saves", [[], ["--async-save"]], ids=["sync", "async"])
@pytest.mark.parametrize("how", sorted(REASONS))
def test_a_worker_leaving_on_purpose_is_replaced_without_counting_a_failure(
    how, saves, job_dir, elsewhere, tmp_path, external_cluster, reference
):
    """The trainer's worker leaves mid-run (a new one is started for it, as a batch system would, or
    a batch system's next job after its lifetime): the run ends with exit 0 and ``--max-failures 0``,
    every committed epoch equals the uninterrupted run's, stderr holds one INFO line naming the node
    and the reason (``-v``) and no ERROR or traceback."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    cluster = external_cluster
    if how == "lifetime":  # walltime rotation: the worker leaves when its lifetime ends, a new job replaces it
        expiring = cluster.replace_with_expiring_worker("trainer")
    options = ["--scheduler", cluster.address, "--checkpoint", str(prefix), "--max-failures", "0", "-v", *saves]
    step = STEP_SECONDS_WHILE_EXPIRING if how == "lifetime" else "0.5"
    env = clean_env(JOB_MARKS=str(marks), JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS=step)
    process = start_run(job_dir, elsewhere, "train.py:job", *options, env=env)
    if how == "lifetime":
        wait_until(lambda: expiring.poll() is not None, 60, "the worker's lifetime to run out", process)
        cluster.start_worker("trainer")
    else:
        wait_until(lambda: (marks / "epoch-3").exists(), 90, "epoch 3's step", process)
    if how == "retire":
        leaving = cluster.worker_address("trainer")
        cluster.client().retire_workers([leaving])
        cluster.start_worker("trainer")
    elif how == "sigterm":
        os.kill(cluster.workers["trainer"].pid, signal.SIGTERM)
        cluster.workers["trainer"].wait(timeout=30)
        cluster.start_worker("trainer")
    code, out, err = finish(process, timeout=180)
    assert code == 0, err
    assert_quiet(err)
    departures = [line for line in err.splitlines() if "left on purpose" in line]
    assert departures, err
    assert all(line.startswith("node(s) ['trainer']") and REASONS[how] in line for line in departures), err
    assert "not counted against max_failures" in departures[0]
    assert out.strip().splitlines()[-1].startswith(f"job 'acceptance': last epoch {EPOCHS}, committed under {prefix}")
    assert_same_checkpoints(checkpoint_values(prefix), reference(EPOCHS))


@pytest.mark.parametrize("limit", ["recovery-timeout", "max-departures"])
def test_the_limits_of_recovering_from_departures_are_dask_config(
    limit, job_dir, elsewhere, tmp_path, external_cluster, reference
):
    """``daskjobs.recovery-timeout`` bounds the wait for a departed node's new worker (none comes:
    the run ends naming the node and the setting), ``daskjobs.max-departures`` the departures
    recovered between two commits (0: the departure counts against ``--max-failures 0``). Either
    way the run exits 1 with one message and no traceback, what it committed equals the
    uninterrupted run's, and running it again resumes to the uninterrupted run's end."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    cluster = external_cluster
    settings = {"recovery-timeout": ("RECOVERY_TIMEOUT", "3s"), "max-departures": ("MAX_DEPARTURES", "0")}
    key, value = settings[limit]
    options = ["--scheduler", cluster.address, "--checkpoint", str(prefix), "--max-failures", "0"]
    limited = {f"DASK_DASKJOBS__{key}": value}
    if limit == "recovery-timeout":  # no new worker comes: the watchdog notices after placement-timeout (10 s)
        limited["DASK_DASKJOBS__PLACEMENT_TIMEOUT"] = "2s"
    env = clean_env(JOB_MARKS=str(marks), JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS="0.5", **limited)
    process = start_run(job_dir, elsewhere, "train.py:job", *options, env=env)
    wait_until(lambda: (marks / "epoch-3").exists(), 90, "epoch 3's step", process)
    os.kill(cluster.workers["trainer"].pid, signal.SIGTERM)
    cluster.workers["trainer"].wait(timeout=30)
    if limit == "max-departures":
        cluster.start_worker("trainer")
    code, _out, err = finish(process, timeout=120)
    assert code == 1, err
    assert "Traceback" not in err, err
    if limit == "recovery-timeout":
        assert "'trainer'" in err, err
        assert "daskjobs.recovery-timeout (3 s)" in err, err
        cluster.start_worker("trainer")
    else:
        assert "'trainer'" in err, err
        assert "(max_failures=0); planned departures beyond daskjobs.max-departures (0)" in err, err
    committed = checkpoint_values(prefix)
    expected = reference(EPOCHS)
    assert committed, err
    assert_same_checkpoints(committed, {epoch: expected[epoch] for epoch in committed})
    cluster.wait_for_nodes("trainer")
    again = start_run(job_dir, elsewhere, "train.py:job", *options, env=clean_env(JOB_EPOCHS=str(EPOCHS)))
    code, _out, err = finish(again, timeout=120)
    assert code == 0, err
    assert_same_checkpoints(checkpoint_values(prefix), expected)
