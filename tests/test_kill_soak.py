"""A kill soak (SPEC §6 Scale c, §4): worker processes SIGKILLed at random while a checkpointed job
runs, every kill recovered from, the end equal to an uninterrupted run.

Both tests run ``benchmarks/kill_soak.py`` as its users do (a subprocess of this worktree's code)
and check its report: the final workspaces and the commits both runs still hold are bit-equal to
those of the run without kills, ``daskjobs checkpoints verify`` passed, one recovery per kill,
one history record per epoch, the driver's open files and threads (but those started lazily up
to a bound) the same at the first and the last sample. They also check, without the script's
help, every blob of the last commit it left against the values the job's steps compute
(computed here). The small test (4 nodes, a kill every ~2 s) runs by default; the soak
(``-m soak``) at the size of SPEC §6: 16 nodes x 20 blobs x 200 epochs, one worker process per
node, a kill every ~10 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import stop_group

import daskjobs as dj

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kill_soak.py"

pytestmark = pytest.mark.cluster


def expected_blob(node: int, blob: int, epochs: int, size: int) -> np.ndarray:
    """Blob ``blob`` of node ``node`` after ``epochs`` epochs of the script's job (its init, then its
    step ``w * 0.5 + epoch + node + blob`` in epochs 1 to ``epochs``)."""
    w = np.arange(size, dtype=np.float64) * (node + 1) + blob
    for epoch in range(1, epochs + 1):
        w = w * 0.5 + (epoch + node + blob)
    return w


def kill_soak(tmp_path: Path, timeout: float, *options: str) -> dict:
    """Run the script with ``options`` (its prefixes kept under ``tmp_path``); its JSON report."""
    report, kept = tmp_path / "report.json", tmp_path / "prefixes"
    kept.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(SCRIPT), *options, "--keep-prefixes", str(kept), "--json", str(report)]
    pipes = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True, **pipes)
    try:
        _, stderr = process.communicate(timeout=timeout)
    finally:
        stop_group(process, timeout=60)
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(report.read_text())


LAZY_THREADS = re.compile(r"(daskjobs-fsync|Dask-Callback-Thread)_\d+|daskjobs-retention")
"""Threads that start when first needed, up to a bound (the fsync pool's, started as saves and
recoveries need them; Dask's callback thread), or come and go (retention's)."""


def steady(threads: dict[str, int]) -> dict[str, int]:
    """Thread names and counts, but those of :data:`LAZY_THREADS`."""
    return {name: count for name, count in threads.items() if not LAZY_THREADS.fullmatch(name)}


def check(result: dict, tmp_path: Path, *, nodes: int, blobs: int, epochs: int, size: int, min_kills: int) -> None:
    assert result["ok"] is True
    assert result["epochs"] == epochs
    assert result["history_epochs_in_order"] is True
    assert result["kills"] >= min_kills
    assert result["recoveries"] == result["kills"]
    assert all(kill["next_step_s"] is not None and kill["next_commit_s"] is not None for kill in result["kill_log"])
    assert result["workspace_differences"] == []
    assert result["workspace_blobs_compared"] == nodes * blobs
    assert result["commit_differences"] == []
    retained = list(range(epochs - 4, epochs + 1))  # keep_last=5
    assert result["commit_epochs_compared"] == retained
    assert result["verify"]["returncode"] == 0
    assert result["verify"]["epochs_ok"] == retained
    driver = result["driver"]
    assert driver["open_files_last"] == driver["open_files_first"]
    assert steady(driver["thread_names_last"]) == steady(driver["thread_names_first"])
    view = dj.open_checkpoint(str(tmp_path / "prefixes" / "killed"))
    assert view.epoch == epochs
    for index in range(nodes):
        stored = view[f"n{index:02d}"].read()
        assert sorted(stored) == [f"w{b:02d}" for b in range(blobs)]
        for b in range(blobs):
            assert stored[f"w{b:02d}"].tobytes() == expected_blob(index, b, epochs, size).tobytes()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_random_worker_kills_end_equal_to_an_uninterrupted_run(tmp_path):
    """4 nodes x 5 blobs x 30 epochs, a worker process SIGKILLed every ~2 s (steps of 0.1 s)."""
    options = ["--nodes", "4", "--blobs", "5", "--epochs", "30", "--workers", "4", "--kill-every", "2"]
    options += ["--pause", "0.1", "--warmup", "5", "--every", "2"]
    result = kill_soak(tmp_path, 150, *options)
    check(result, tmp_path, nodes=4, blobs=5, epochs=30, size=1000, min_kills=2)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_soak_at_size(tmp_path):
    """SPEC §6 Scale (c): 16 nodes x 20 blobs x 200 epochs, one worker process per node, a random
    worker SIGKILLed every ~10 s."""
    result = kill_soak(tmp_path, 3300)
    check(result, tmp_path, nodes=16, blobs=20, epochs=200, size=1000, min_kills=5)
