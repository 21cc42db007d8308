"""The bundled demo end to end (embedded cluster, interrupt and resume) and the checkpoints CLI."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from processes import stop_group

import daskjobs as dj
from daskjobs.demo import DemoConfig, build_demo_job

DASKJOBS = [sys.executable, "-m", "daskjobs.cli"]


def daskjobs(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*DASKJOBS, *args], capture_output=True, text=True, timeout=timeout)


def epochs_printed(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^epoch\s+(\d+)\s+loss", text, re.M)]


def test_demo_job_converges_in_process():
    """The demo's training converges: the loss falls and test accuracy beats chance by far."""
    demo = build_demo_job(DemoConfig(samples=1000))
    runner = dj.JobRunner(demo.job, progress=False)
    last = runner.train(None)
    assert 10 < last < DemoConfig.max_epochs
    assert runner.history[-1].stop_values[demo.job.stop_conditions[0].names[0]] is True
    assert float(demo.loss.fetch()) < 0.4
    assert float(demo.test_accuracy.fetch()) > 0.8
    losses = [record.metrics["loss"] for record in runner.history]  # what `daskjobs demo` prints per epoch
    assert losses[-1] == float(demo.loss.fetch()) < DemoConfig.target_loss <= min(losses[:-1])


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_demo_command_interrupted_and_resumed(tmp_path):
    """`daskjobs demo` on its embedded cluster survives Ctrl-C and resumes from its checkpoints."""
    checkpoints = str(tmp_path / "demo")
    process = subprocess.Popen(
        [*DASKJOBS, "demo", "--checkpoint-dir", checkpoints, "--samples", "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            seen.append(line)
            if re.match(r"epoch\s+4\s+loss", line):
                break
        else:
            pytest.fail(f"the demo printed no epoch 4 in time: {''.join(seen)}")
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    finally:
        stop_group(process)
    committed = [i.epoch for i in dj.list_checkpoints(checkpoints)]
    assert committed
    assert max(committed) >= 4
    resumed = daskjobs("demo", "--checkpoint-dir", checkpoints, "--samples", "400", timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    epochs = epochs_printed(resumed.stdout)
    assert epochs[0] == max(committed) + 1
    assert "resumed from epoch" in resumed.stdout
    final = dj.open_checkpoint(checkpoints)
    assert final.epoch == epochs[-1]
    assert final.record["stop_values"]
    assert any(final.record["stop_values"].values())
    assert [i.epoch for i in dj.list_checkpoints(checkpoints)] == [final.epoch - 2, final.epoch - 1, final.epoch]
    again = daskjobs("demo", "--checkpoint-dir", checkpoints, "--samples", "400", "--local")
    assert again.returncode == 0
    assert "already finished" in again.stdout


@pytest.mark.slow
def test_checkpoints_cli(tmp_path):
    """`daskjobs checkpoints list|show|verify|prune|unlock` work on a demo prefix."""
    checkpoints = str(tmp_path / "demo")
    run = daskjobs(
        "demo", "--local", "--checkpoint-dir", checkpoints, "--samples", "200", "--max-epochs", "5", "--keep-last", "10"
    )
    assert run.returncode == 0, run.stderr
    assert epochs_printed(run.stdout) == [1, 2, 3, 4, 5]
    listed = daskjobs("checkpoints", "list", checkpoints)
    assert [int(line.split()[0]) for line in listed.stdout.splitlines()] == [0, 1, 2, 3, 4, 5]
    shown = daskjobs("checkpoints", "show", checkpoints, "--json")
    assert json.loads(shown.stdout)["epoch"] == 5
    assert "ps/weights: <f8 (17,)" in daskjobs("checkpoints", "show", checkpoints, "--epoch", "2").stdout
    verified = daskjobs("checkpoints", "verify", checkpoints)
    assert verified.returncode == 0
    assert verified.stdout.count(": OK") == 6
    pruned = daskjobs("checkpoints", "prune", checkpoints, "--keep-last", "2")
    assert pruned.returncode == 0, pruned.stderr
    assert [i.epoch for i in dj.list_checkpoints(checkpoints)] == [4, 5]
    (chunk_path,) = glob.glob(os.path.join(checkpoints, "ps.5", "weights", "c*"))
    with open(chunk_path, "r+b") as chunk:
        chunk.seek(3)
        byte = chunk.read(1)
        chunk.seek(3)
        chunk.write(bytes([byte[0] ^ 0xFF]))
    broken = daskjobs("checkpoints", "verify", checkpoints, "--epoch", "5")
    assert broken.returncode == 1
    assert "epoch 5, node 'ps', blob 'weights': checksum mismatch" in broken.stderr
    dj.MultiNodeCheckpointManager(checkpoints).store.acquire_lock({"host": "h", "pid": 1, "job": "j", "started": ""})
    assert "removed lock" in daskjobs("checkpoints", "unlock", checkpoints, "--force").stdout
    missing = daskjobs("checkpoints", "show", str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainers", "0"], "argument --trainers: expected a positive integer, got 0"),
        (["--trainers", "-1"], "argument --trainers: expected a positive integer, got -1"),
        (["--samples", "0"], "argument --samples: expected a positive integer, got 0"),
        (["--max-epochs", "0"], "argument --max-epochs: expected a positive integer, got 0"),
        (["--keep-last", "-3"], "argument --keep-last: expected a positive integer, got -3"),
    ],
)
@pytest.mark.slow
def test_demo_with_a_count_below_one_is_a_usage_error(tmp_path, args, message):
    """`daskjobs demo --trainers 0` (and other counts below one): exit 2, one line on stderr, no
    checkpoint folder created, and with --fresh an existing one is not deleted."""
    fresh = daskjobs("demo", "--checkpoint-dir", str(tmp_path / "new"), "--local", *args)
    assert (fresh.returncode, fresh.stderr, fresh.stdout) == (2, f"daskjobs demo: error: {message}\n", "")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("not the demo's")
    again = daskjobs("demo", "--checkpoint-dir", str(kept), "--fresh", "--local", *args)
    assert (again.returncode, again.stderr) == (2, f"daskjobs demo: error: {message}\n")
    assert (kept / "mine.txt").read_text() == "not the demo's"


@pytest.mark.parametrize("field", ["trainers", "samples", "features", "batch_size", "batches_per_epoch", "passes"])
@pytest.mark.parametrize("value", [0, -1])
def test_demo_config_refuses_counts_below_one(field, value):
    """DemoConfig names the field that cannot be a count, when it is made."""
    with pytest.raises(dj.errors.JobDefinitionError, match=rf"^DemoConfig\.{field} must be >= 1, got {value}$"):
        DemoConfig(**{field: value})
