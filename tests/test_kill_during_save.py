"""A training process SIGKILLed at random moments (often mid-save) resumes from its last commit, equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj

EPOCHS = 30
BLOB = 1 << 19
"""float64 elements per blob: 4 MiB, so every save writes 32 MiB and takes a noticeable time."""


def define_job() -> dj.Job:
    """Two nodes, four 4 MiB blobs each, growing deterministically every epoch."""
    with dj.Cluster(), dj.Job(name="kill-during-save") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update({f"w{i}": np.full(BLOB, float(i)) for i in range(4)}))

                def grow(ws):
                    for i in range(4):
                        ws[f"w{i}"] = ws[f"w{i}"] + ws.epoch

                dj.Task(grow)
    return job


def expected(epoch: int, blob: int) -> float:
    return blob + epoch * (epoch + 1) / 2


def child_main(prefix: str) -> None:
    """Train in this process, printing each finished epoch (run in a subprocess that gets killed)."""
    runner = dj.JobRunner(
        define_job(),
        dj.MultiNodeCheckpointManager(prefix),
        max_epochs=EPOCHS,
        progress=False,
        on_epoch=lambda record: print(f"epoch {record.epoch}", flush=True),
    )
    runner.train(None)


def start_child(prefix: str) -> subprocess.Popen:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {Path(__file__).stem} as t; "
        f"t.child_main({prefix!r})"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.representative("0-0.0", "15-0.05")  # the other moments: -m matrix
@pytest.mark.parametrize(("after_epoch", "delay"), [(0, 0.0), (3, 0.01), (9, 0.03), (15, 0.05), (21, 0.07)])
def test_sigkill_then_resume(tmp_path, after_epoch, delay):
    """Wherever the kill lands, the latest commit verifies and equals the reference; resume ends equal."""
    prefix = str(tmp_path / "ckpt")
    child = start_child(prefix)
    try:
        deadline = time.monotonic() + 60
        while after_epoch and time.monotonic() < deadline:
            line = child.stdout.readline()
            if line.strip() == f"epoch {after_epoch}" or not line:
                break
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    committed = [info.epoch for info in dj.list_checkpoints(prefix)]
    assert committed == list(range(len(committed)))
    if committed:
        view = dj.open_checkpoint(prefix)
        assert view.verify() == 2 * 4 * BLOB * 8
        assert [float(view[node][f"w{i}"][-1]) for node in "ab" for i in range(4)] == [
            expected(view.epoch, i) for _ in "ab" for i in range(4)
        ]
    runner = dj.JobRunner(define_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=EPOCHS, progress=False)
    with dj.LocalSession() as session:
        assert runner.train(session) == EPOCHS
        for node in "ab":
            for i in range(4):
                assert np.array_equal(session.fetch(f"w{i}", node), np.full(BLOB, expected(EPOCHS, i)))
    first = committed[-1] + 1 if committed else 1
    assert [r.epoch for r in runner.history] == list(range(first, EPOCHS + 1))
    leftovers = [
        n
        for n in os.listdir(prefix)
        if n.rsplit(".", 1)[-1].isdigit() and int(n.rsplit(".", 1)[1]) not in range(EPOCHS + 1)
    ]
    assert leftovers == []
    assert dj.open_checkpoint(prefix).verify() > 0
