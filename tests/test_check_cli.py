"""``daskjobs check TARGET``: one line per run, the first divergence and its causes, ``--json``, and
exit codes 0 / 1 / 2, with ``file.py:function`` targets on ``--local``, the default ``node_cluster``
and an external ``dask scheduler`` whose ``daskjobs worker`` processes never saw the file."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_cluster import real_cluster  # noqa: F401 - the fixture

import daskjobs as dj
from daskjobs.cli import main

pytestmark = pytest.mark.timeout(180)

JOBS = Path(__file__).with_name("check_jobs.py")


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A folder holding ``check_jobs.py``; commands run there."""
    shutil.copy(JOBS, tmp_path / "check_jobs.py")
    return tmp_path


def check_here(*args: str, cwd: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``daskjobs check ARGS`` in this process (its runs still each in a new process)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        code = main(["check", *args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def daskjobs(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    """``python -m daskjobs ARGS`` in ``cwd``, this checkout first on the path."""
    root = str(Path(dj.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "daskjobs", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def squeeze(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.slow
def test_a_job_that_resumes_exactly_exits_0(jobs, monkeypatch, capsys):
    """Every run equal to A: exit 0, one line per run (stop and kill by default), the verdict."""
    result = check_here(
        "check_jobs.py:exact", "--local", "--interrupt-at", "2", cwd=jobs, monkeypatch=monkeypatch, capsys=capsys
    )
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "daskjobs check of job 'exact' (check_jobs.py:exact) on LocalSession, a new process per run: "
        "one line per run as it finishes"
    )
    assert [line.split()[0] for line in lines[1:5]] == ["A", "B", "stop@2", "kill@2"]
    assert squeeze(lines[3]).startswith("stop@2 stopped after epoch 2, resumed from 2 epochs 0-4")
    assert squeeze(lines[4]).startswith("kill@2 driver killed in epoch 3, resumed from 2 epochs 0-4")
    assert all(line.endswith("equal to A") for line in lines[2:5])
    assert " ".join(line.strip() for line in lines[5:]) == (
        "OK: job 'exact' resumes exactly: every run equals reference A in every committed epoch (every blob of "
        "every node, the stop values and the metrics)"
    )


@pytest.mark.slow
def test_a_job_that_diverges_exits_1_naming_the_first_divergence(jobs):
    """A divergence: exit 1; the first divergence (epoch, node, blob, run, kind, largest absolute
    difference) and its likely causes, through the real command line."""
    result = daskjobs("check", "check_jobs.py:global_rng", "--local", "--interrupt-at", "2", "--mode", "kill", cwd=jobs)
    assert (result.returncode, result.stderr) == (1, "")
    lines = result.stdout.splitlines()
    assert squeeze(lines[3]).startswith("kill@2 driver killed in epoch 3, resumed from 2 epochs 0-4")
    assert lines[3].endswith("2 divergences, first in epoch 3")
    assert lines[4] == "DIVERGES: job 'defects' does not resume exactly; 2 divergences in kill@2 (2)"
    assert lines[5] == "first divergence: epoch 3, node 'a', blob 'x', run kill@2 (resume)"
    assert lines[6].startswith("  float64 (3,): 3 of 3 elements differ; largest absolute difference ")
    causes = next(i for i, line in enumerate(lines) if line.startswith("likely causes"))
    assert lines[causes].startswith("likely causes (the uninterrupted runs agree, the interrupted run differs")
    assert lines[causes + 2].startswith("  - the global random generator seeded once in init")


@pytest.mark.slow
def test_json(jobs, monkeypatch, capsys):
    """``--json`` prints the report as JSON: runs, divergences, the first with its likely causes."""
    result = check_here(
        "check_jobs.py:global_rng", "--local", "--interrupt-at", "1", "--mode", "stop", "--json",
        cwd=jobs, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert (report["ok"], report["deterministic"], report["job"]) == (False, True, "defects")
    assert [run["name"] for run in report["runs"]] == ["A", "B", "stop@1"]
    assert report["runs"][2]["resumed_from"] == 1
    assert [(d["epoch"], d["node"], d["blob"], d["run"], d["kind"]) for d in report["divergences"]] == [
        (e, "a", "x", "stop@1", "resume") for e in (2, 3, 4)
    ]
    assert report["first"]["likely_causes"] == list(dj.testing.LIKELY_CAUSES["resume"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such.py:job", "--local"], "TARGET file no_such.py does not exist"),
        (["check_jobs.py", "--local"], "TARGET must be package.module:name or path/to/file.py:name"),
        pytest.param(  # run A runs in a child driver
            ["check_jobs.py:exact", "--local", "--interrupt-at", "4"],
            "reference run A ended at epoch 4",
            marks=pytest.mark.slow,
        ),
        (["check_jobs.py:exact", "--local", "--mode", "lose-node"], "it needs a cluster, not --local"),
        (["check_jobs.py:exact", "--local", "--timeout", "0"], "--timeout must be a positive number"),
        (["check_jobs.py:exact", "--mode", "pause"], "invalid choice: 'pause'"),
        (["check_jobs.py:exact", "--local", "--interrupt-at", "0"], "expected a positive integer"),
        (["check_jobs.py:not_a_job", "--local"], "is not a Job or a callable returning one"),
    ],
    ids=["no-file", "malformed", "past-the-end", "lose-node-local", "timeout", "mode", "point", "not-a-job"],
)
def test_usage_errors_exit_2(jobs, monkeypatch, capsys, args, message):
    """Bad arguments, a target that is not a job, a point past the job's end: exit 2, one message."""
    result = check_here(*args, cwd=jobs, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_failing_run_exits_1_naming_it(jobs, monkeypatch, capsys):
    """A run that fails, or a job that would never stop: exit 1 and one paragraph naming the run and
    the error."""
    result = check_here("check_jobs.py:failing", "--local", cwd=jobs, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 1
    assert result.stderr.startswith("daskjobs check: error: run A (check_jobs.py:failing) failed: TaskFailedError:")
    assert "ZeroDivisionError: division by zero on purpose" in result.stderr
    result = check_here("check_jobs.py:endless", "--local", cwd=jobs, monkeypatch=monkeypatch, capsys=capsys)
    assert result.returncode == 1
    assert "job 'endless' (check_jobs.py:endless) has no stop condition" in result.stderr


@pytest.mark.cluster
@pytest.mark.slow
def test_readme_commands_run_as_printed(tmp_path):
    """The commands of the README's "Prove it resumes exactly" section exit 0 in a copy of examples/:
    on LocalSessions, and on the default session, a new node_cluster of the job's nodes (which the
    job file never reached), where a lost node is recovered; no Dask error or traceback is printed."""
    readme = (Path(dj.__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Prove it resumes exactly\n", 1)[1].split("\n## ", 1)[0]
    commands = section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [shlex.split(line, comments=True)[-1] for line in commands] == ["--local", "--json"]
    shutil.copytree(Path(dj.__file__).resolve().parents[1] / "examples", tmp_path / "examples")
    for line in commands:
        argv = shlex.split(line, comments=True)
        assert argv[:2] == ["daskjobs", "check"]
        result = daskjobs(*argv[1:], cwd=tmp_path)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        assert "Traceback" not in result.stderr
        assert "ERROR" not in result.stderr
    report = json.loads(result.stdout)
    assert report["where"].startswith("the Dask cluster at tcp://127.0.0.1:")
    assert [run["description"] for run in report["runs"]] == [
        "reference",
        "reference, run again",
        "node 'ps' lost in epoch 6, restored from 5",
    ]


@pytest.mark.cluster
@pytest.mark.slow
def test_external_scheduler(jobs, real_cluster):  # noqa: F811 - the fixture
    """``--scheduler`` of a ``dask scheduler`` with ``daskjobs worker`` processes that never saw the
    job file: every run's steps travel by value; a killed worker is replaced and recovered from."""
    args = ["check_jobs.py:global_rng", "--scheduler", real_cluster.address, "--interrupt-at", "2"]
    result = daskjobs("check", *args, "--mode", "kill", "--mode", "lose-node", "--json", cwd=jobs)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["where"] == f"the Dask cluster at {real_cluster.address}, a new process per run"
    firsts = {run: next(d for d in report["divergences"] if d["run"] == run) for run in ("kill@2", "lose-node@2")}
    assert {run: (d["epoch"], d["node"], d["blob"], d["kind"]) for run, d in firsts.items()} == {
        "kill@2": (3, "a", "x", "resume"),
        "lose-node@2": (3, "a", "x", "resume"),
    }
    assert report["runs"][3]["description"] == "node 'a' lost in epoch 3, restored from 2"
