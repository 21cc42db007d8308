"""Signals as batch systems send them (SPEC §4): SIGINT or SIGTERM to the whole process group of
``daskjobs run`` — a terminal's Ctrl-C, SLURM's ``scancel``, Kubernetes, systemd, ``timeout`` — is a
graceful stop on every session kind, with synchronous and asynchronous saves: the running epoch is
committed, the exit code is 130 / 143, stderr holds a short message and no traceback, ERROR or
recovery, and running the same command again resumes to the values of an uninterrupted run. After
a second signal the process is gone within 2 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from acceptance.harness import (
    SESSIONS,
    assert_quiet,
    assert_same_checkpoints,
    checkpoint_values,
    clean_env,
    finish,
    session_args,
    start_run,
    stop_group,
    wait_until,
)
from processes import start_scheduler

import daskjobs as dj

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
SIGNALS = [pytest.param(signal.SIGINT, id="SIGINT"), pytest.param(signal.SIGTERM, id="SIGTERM")]
SAVES = [
    pytest.param(["--checkpoint"], id="sync"),
    pytest.param(["--checkpoint", "--async-save"], id="async"),
    pytest.param([], id="no-checkpoint"),
]
BALLAST_MB = 17
"""With asynchronous saves the trainer holds this much more (constant) data: its saves fork a writer
process (from 16 MiB on, see ``daskjobs.checkpoint._node.fork.FORK_FROM``), which the signals reach too."""
FIRST_LINE = "received: the job stops once the running epoch is done (and committed, with checkpoints)"


def checkpoint_options(saves: list[str], prefix) -> list[str]:
    """``--checkpoint PREFIX`` (and ``--async-save``) when ``saves`` asks for checkpoints."""
    if not saves:
        return []
    return ["--checkpoint", str(prefix), *saves[1:]]


@pytest.mark.representative(  # every session kind, signal and save mode once (SIGINT to `run --local`: test_cli_run)
    "local-SIGTERM-sync", "cluster-SIGINT-async", "scheduler-SIGINT-no-checkpoint"
)
@pytest.mark.parametrize("saves", SAVES)
@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("kind", SESSIONS)
def test_a_signal_to_the_process_group_stops_gracefully_and_the_job_resumes_exactly(
    kind, sig, saves, job_dir, elsewhere, tmp_path, reference, request
):
    """One signal to the whole group mid-run: exit 130/143; stderr is the signal's line and the
    runner's line naming the committed epoch (or that nothing is checkpointed), nothing else; the
    committed epochs verify and include every epoch whose step had finished; the same command run
    again resumes, and every committed epoch equals an uninterrupted run's."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    options = [*session_args(kind, request), *checkpoint_options(saves, prefix)]
    ballast = BALLAST_MB if "--async-save" in saves else 0
    knobs = {"JOB_BALLAST_MB": str(ballast)}
    process = start_run(job_dir, elsewhere, "train.py:job", *options, env=clean_env(JOB_MARKS=str(marks), **knobs))
    wait_until(lambda: (marks / "epoch-3").exists(), 90, "epoch 3's step", process)
    os.killpg(process.pid, sig)
    code, _out, err = finish(process, timeout=60)
    assert code == EXIT[sig], err
    assert_quiet(err)
    name = signal.Signals(sig).name
    lines = err.strip().splitlines()
    assert lines[0] == f"{name} {FIRST_LINE}; send it again to abandon that epoch", err
    assert len(lines) == 2, err
    if not saves:
        assert (
            lines[1] == f"job 'acceptance' interrupted by {name}: stopped after the running epoch; nothing is committed"
        )
        return
    committed = [info.epoch for info in dj.list_checkpoints(str(prefix))]
    finished = max(int(mark.name.partition("-")[2]) for mark in marks.iterdir())
    assert committed == list(range(committed[-1] + 1)), committed
    assert committed[-1] >= finished
    assert lines[1] == (
        f"job 'acceptance' interrupted by {name}: stopped after the running epoch; epoch {committed[-1]} is committed "
        f"under {prefix}; run the job again with the same checkpoint prefix to resume from it"
    )
    assert dj.open_checkpoint(str(prefix)).verify() > 0
    again, out, err = finish(start_run(job_dir, elsewhere, "train.py:job", *options, env=clean_env(**knobs)))
    assert again == 0, err
    assert_quiet(err)
    assert out.strip().splitlines()[-1] == (
        f"job 'acceptance': last epoch 8, committed under {prefix}; ran epochs {committed[-1] + 1}-8"
        if committed[-1] < 7
        else f"job 'acceptance': last epoch 8, committed under {prefix}; ran epoch 8"
    )
    assert_same_checkpoints(checkpoint_values(prefix), reference(8, ballast))


@pytest.mark.representative("local-SIGTERM-sync", "cluster-SIGINT-async", "scheduler-SIGTERM-async")
@pytest.mark.parametrize("saves", SAVES[:2])
@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("kind", SESSIONS)
def test_a_second_signal_ends_the_process_within_two_seconds(kind, sig, saves, job_dir, elsewhere, tmp_path, request):
    """Two signals to the group while a long step runs: the process is gone within 2 s of the second,
    with exit 130/143 and no traceback or ERROR; what is committed verifies and nothing of the
    abandoned epoch is committed."""
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    options = [*session_args(kind, request), *checkpoint_options(saves, prefix)]
    ballast = BALLAST_MB if "--async-save" in saves else 0
    env = clean_env(JOB_MARKS=str(marks), JOB_STEP_SECONDS="0.3", JOB_BALLAST_MB=str(ballast))
    process = start_run(job_dir, elsewhere, "train.py:job", *options, env=env)
    wait_until(lambda: (marks / "epoch-2").exists(), 90, "epoch 2's step", process)
    os.killpg(process.pid, sig)
    time.sleep(0.6)  # more than half a second later: a second request (sooner, it is the same one)
    os.killpg(process.pid, sig)
    second = time.monotonic()
    code, _out, err = finish(process, timeout=30)
    assert time.monotonic() - second < 2.0
    assert code == EXIT[sig], err
    assert_quiet(err)
    committed = [info.epoch for info in dj.list_checkpoints(str(prefix))]
    assert committed == list(range(len(committed))), committed
    if committed:
        assert dj.open_checkpoint(str(prefix)).verify() > 0


BATCH_SCRIPT = """\
if [ -z "$SCHEDULER_ADDRESS" ]; then
    dask scheduler --host 127.0.0.1 --port 0 --dashboard-address 127.0.0.1:0 --scheduler-file scheduler.json \\
        > scheduler.log 2>&1 &
    for _ in $(seq 600); do [ -s scheduler.json ] && break; sleep 0.1; done
    SCHEDULER_ADDRESS=$(python -c "import json; print(json.load(open('scheduler.json'))['address'])")
fi
for worker in 1 2; do
    dask worker "$SCHEDULER_ADDRESS" --host 127.0.0.1 --no-dashboard > "worker-$worker.log" 2>&1 &
done
exec python -m daskjobs run "$@" --scheduler "$SCHEDULER_ADDRESS"
"""
"""A batch job's script: a ``dask scheduler`` (unless ``SCHEDULER_ADDRESS`` names one elsewhere), two
plain ``dask worker``s and ``daskjobs run``, all in the script's process group."""


@pytest.mark.representative("scheduler-and-workers-SIGTERM", "workers-SIGINT")
@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("holds", ["scheduler-and-workers", "workers"])
def test_a_signal_to_a_batch_job_that_holds_its_cluster_too_stops_it_at_once(
    holds, sig, job_dir, elsewhere, tmp_path, reference
):
    """A batch script starts two plain ``dask worker``s (and a ``dask scheduler``, or uses one
    elsewhere) and ``daskjobs run`` in one process group, which gets one signal (``scancel``): the
    workers (and the scheduler) go at once, so the running epoch may not finish; the driver still
    exits 130/143 within a few seconds (not after ``daskjobs.connect-timeout`` or
    ``daskjobs.recovery-timeout``), naming the epoch committed, quietly; the committed epochs verify,
    and running the job again resumes from there to the values of an uninterrupted run."""
    marks, prefix, batch = tmp_path / "marks", elsewhere / "ckpt", tmp_path / "batch"
    marks.mkdir()
    batch.mkdir()
    (batch / "job.sh").write_text(BATCH_SCRIPT)
    scheduler = None
    if holds == "workers":
        scheduler, address = start_scheduler(tmp_path, env=clean_env())
    argv = ["bash", "job.sh", str(job_dir / "train.py:job"), "--no-progress", "--checkpoint", str(prefix)]
    env = clean_env(JOB_MARKS=str(marks), **({"SCHEDULER_ADDRESS": address} if scheduler else {}))
    process = subprocess.Popen(
        argv, cwd=batch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_until(lambda: (marks / "epoch-3").exists(), 90, "epoch 3's step", process)
        os.killpg(process.pid, sig)
        signalled = time.monotonic()
        code, _out, err = finish(process, timeout=60)
    finally:
        stop_group(process)  # the script's scheduler and workers too, however the test ended
        if scheduler is not None:
            stop_group(scheduler)
    assert time.monotonic() - signalled < 10, err
    assert code == EXIT[sig], err
    assert_quiet(err)
    name = signal.Signals(sig).name
    lines = err.strip().splitlines()
    assert lines[0] == f"{name} {FIRST_LINE}; send it again to abandon that epoch", err
    committed = [info.epoch for info in dj.list_checkpoints(str(prefix))]
    assert committed == list(range(committed[-1] + 1)), committed
    assert committed[-1] >= 2
    how = "abandoned" if ": abandoned the running epoch;" in lines[-1] else "stopped after"  # as the scheduler went
    assert lines[1:] == [
        f"job 'acceptance' interrupted by {name}: {how} the running epoch; epoch {committed[-1]} is committed "
        f"under {prefix}; run the job again with the same checkpoint prefix to resume from it"
    ], err
    assert dj.open_checkpoint(str(prefix)).verify() > 0
    again, out, err = finish(start_run(job_dir, elsewhere, "train.py:job", "--local", "--checkpoint", str(prefix)))
    assert again == 0, err
    assert (
        out.strip().splitlines()[-1]
        == f"job 'acceptance': last epoch 8, committed under {prefix}; ran epochs {committed[-1] + 1}-8"
    )
    assert_same_checkpoints(checkpoint_values(prefix), reference(8))
