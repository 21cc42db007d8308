"""``daskjobs check`` prints one line per run as each finishes, and names the step (task and node) whose
output first diverged where it can tell (SPEC §5): a module counter read by an early task makes its
output, and a later task's, differ after a resume; the early task is named. A blob changed only in
place names no step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import daskjobs as dj

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

JOBS = textwrap.dedent(
    '''
    """Node 'center': 'prep' draws from a module counter (the bug), 'update' adds its output (an input
    edge: it runs after 'prep') to 'w'; node 'edge' copies a constant. In ``in_place`` the counter goes
    into 'w' in place."""

    import numpy as np

    import daskjobs as dj

    CALLS = {"n": 0}


    def init(ws):
        ws["w"] = np.zeros(3)
        ws["g"] = np.zeros(3)


    def prep(ws):
        CALLS["n"] += 1
        ws["g"] = np.full(3, float(CALLS["n"]))


    def update(ws):
        ws["w"] = ws["w"] + ws["g_in"]


    def bump_in_place(ws):
        CALLS["n"] += 1
        ws["w"][:] = ws["w"] + CALLS["n"]


    def _job(name, define):
        with dj.Cluster(), dj.Job(name=name) as job:
            with dj.Node("center"):
                with job.init_group:
                    dj.Task(init, name="init")
                define()
            with dj.Node("edge"):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(k=np.ones(2)), name="init")
                dj.Task(lambda ws: ws.update(k=ws["k"] * 1), name="copy", workspace_type=dj.WorkspaceType.GLOBAL)
            dj.epoch_limiter(job, 4)
        return job


    def _prep_then_update():
        made = dj.Task(prep, name="prep", outputs="g", workspace_type=dj.WorkspaceType.GLOBAL)
        dj.Task(update, name="update", inputs={"g_in": made.outputs()[0]}, workspace_type=dj.WorkspaceType.GLOBAL)


    def counter():
        return _job("counter", _prep_then_update)


    def in_place():
        return _job("in-place", lambda: dj.Task(bump_in_place, name="bump", workspace_type=dj.WorkspaceType.GLOBAL))
    '''
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "jobs.py").write_text(JOBS)
    return tmp_path


def argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "daskjobs", "check", *args]


def env() -> dict[str, str]:
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def test_lines_come_as_runs_finish_and_the_first_diverging_step_is_named(folder):
    """The A line arrives while later runs still run; the report names task 'center/prep', whose output
    'g' differs first (the later 'update' differs only because it reads 'g'); exit 1."""
    process = subprocess.Popen(
        argv("jobs.py:counter", "--local", "--interrupt-at", "2", "--mode", "stop"), cwd=folder, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    head = process.stdout.readline()
    first_run = process.stdout.readline()
    still_running = process.poll() is None
    rest, err = process.communicate(timeout=150)
    assert (process.returncode, err) == (1, "")
    assert still_running
    lines = [head.rstrip("\n"), first_run.rstrip("\n"), *rest.splitlines()]
    assert lines[0] == (
        "daskjobs check of job 'counter' (jobs.py:counter) on LocalSession, a new process per run: "
        "one line per run as it finishes"
    )
    seconds = r"\s+\d+\.\d s"
    assert re.fullmatch(rf"  A\s+reference\s+epochs 0-4{seconds}", lines[1]), lines[1]
    assert re.fullmatch(rf"  B\s+reference, run again\s+epochs 0-4{seconds}  equal to A", lines[2]), lines[2]
    assert re.fullmatch(
        rf"  stop@2\s+stopped after epoch 2, resumed from 2\s+epochs 0-4{seconds}  6 divergences, first in epoch 3",
        lines[3],
    ), lines[3]
    assert lines[4] == "DIVERGES: job 'counter' does not resume exactly; 6 divergences in stop@2 (6)"
    assert lines[5] == "first divergence: epoch 3, node 'center', blob 'g', run stop@2 (resume)"
    assert lines[6] == "  float64 (3,): 3 of 3 elements differ; largest absolute difference 2 at [0] (A 3.0, run 1.0)"
    assert lines[7] == ("first diverging step: task 'center/prep' on node 'center' (it assigned blob 'g' in epoch 3)")
    assert lines[8].startswith("likely causes (the uninterrupted runs agree, the interrupted run differs")


def test_a_change_in_place_names_no_step(folder):
    """A blob changed only in place (``ws["w"][:] = ...``) is assigned by no task, so no step is named (the
    report still names node and blob); ``--json`` says ``"step": null``."""
    unnamed = subprocess.run(
        argv("jobs.py:in_place", "--local", "--interrupt-at", "1", "--mode", "stop", "--json"), cwd=folder, env=env(),
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert unnamed.returncode == 1, unnamed.stderr
    report = json.loads(unnamed.stdout)
    assert (report["first"]["epoch"], report["first"]["node"], report["first"]["blob"]) == (2, "center", "w")
    assert report["step"] is None


def test_the_step_of_an_in_process_check(folder):
    """``check_resume`` with a callable (runs in this process) names the step too, in ``report.step`` (and
    its JSON form)."""
    from daskjobs.runner._targets import load_job

    report = dj.testing.check_resume(lambda: load_job(f"{folder / 'jobs.py'}:counter"), interrupt_at=2)
    assert report.step == dj.testing.FirstStep("center/prep", "center", "g", 3)
    assert report.to_dict()["step"] == {"task": "center/prep", "node": "center", "blob": "g", "epoch": 3}
    assert "first diverging step: task 'center/prep' on node 'center' (it assigned blob 'g' in epoch 3)" in str(report)
