"""Our own jobs resume exactly: ``daskjobs check`` with the stop and kill modes passes for the demo,
every example and the job of every notebook (its cells tagged ``job``, written to a job file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOK_JOBS = {
    # notebook: the expression (over its cells tagged "job") that makes its job, and its middle epoch
    "01_quickstart": ("job", 15),
    "02_checkpoint_and_resume": ("define_job()", 4),
    "03_local_cluster": ("define_job()[0]", 4),
    "04_readers": ("define_job(sgd_step)[0]", 6),
    "05_prove_resume": ("define_job(noisy_step_fixed)", 5),
    "06_elastic": ("define_job()", 6),
}


def check(target: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m daskjobs check TARGET --local --mode stop --mode kill ARGS`` in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "daskjobs", "check", target, "--local", "--mode", "stop", "--mode", "kill", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=200)


def passed(result: subprocess.CompletedProcess, runs: int) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": one line per run as it finishes")
    assert [line.split()[0] for line in lines[1 : runs + 1]][:2] == ["A", "B"]
    assert lines[runs + 1].startswith("OK: job ")


def test_the_demo_resumes_exactly():
    """The demo (from a daskjobs checkout: daskjobs itself is never shipped by value), at the default
    interruption points."""
    passed(check("daskjobs.demo:demo_job", ROOT), 8)


def test_every_example_resumes_exactly():
    """Every example that defines a job (``examples/*.py`` with a module-level ``job``)."""
    examples = sorted(p for p in (ROOT / "examples").rglob("*.py") if "\njob = " in p.read_text())
    assert [str(p.relative_to(ROOT / "examples")) for p in examples] == ["quickstart/job.py", "train.py"]
    for example in examples:
        passed(check(f"{example}:job", example.parent, "--interrupt-at", "5"), 4)


def notebook_job(notebook: Path, expression: str, folder: Path) -> Path:
    """A job file of the notebook's code cells tagged ``job``, with ``check_job()`` returning ``expression``."""
    cells = json.loads(notebook.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and "job" in c["metadata"].get("tags", [])]
    assert code, f"{notebook.name} has no code cell tagged 'job'"
    source = "\n\n".join(
        ["import numpy as np\nimport daskjobs as dj", *code, f"def check_job():\n    return {expression}\n"]
    )
    path = folder / f"nb_{notebook.stem}.py"
    path.write_text(source)
    return path


@pytest.mark.representative("01_quickstart", "05_prove_resume")  # the others (and their runs): -m matrix
@pytest.mark.parametrize("notebook", sorted(NOTEBOOK_JOBS))
def test_every_notebooks_job_resumes_exactly(notebook, tmp_path):
    """The job each notebook defines, interrupted after its middle epoch."""
    expression, middle = NOTEBOOK_JOBS[notebook]
    path = notebook_job(ROOT / "notebooks" / f"{notebook}.ipynb", expression, tmp_path)
    passed(check(f"{path.name}:check_job", tmp_path, "--interrupt-at", str(middle)), 4)


def test_every_notebook_is_checked():
    """Every notebook has its job listed above."""
    assert sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb")) == sorted(NOTEBOOK_JOBS)
