"""``daskjobs run TARGET`` (and ``python -m daskjobs run``) in subprocesses: targets, sessions,
checkpoints and resume, storage options, failures and signals, with their exit codes."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from processes import stop_group

import daskjobs as dj
from daskjobs.cli import main

pytestmark = pytest.mark.timeout(90)

JOBS = textwrap.dedent(
    '''
    """Jobs for the command-line tests: node 'a' counts epochs."""

    import os
    import time

    import numpy as np

    import daskjobs as dj


    def counter(stop_at=5, fail_at=None, sleep=0.0, stop=True, name="counter", resources=None):
        def init(ws):
            ws["count"] = np.int64(0)

        def step(ws):
            count = int(ws["count"]) + 1
            if count == fail_at:
                raise ZeroDivisionError("division by zero on purpose")
            time.sleep(sleep)
            ws["count"] = np.int64(count)
            ws["done"] = np.bool_(count >= stop_at)

        with dj.Cluster(), dj.Job(name=name) as job:
            with job.init_group, dj.Node("a", **(resources or {})):
                dj.Task(init)
            with dj.Node("a"):
                done = dj.Task(step, outputs="done").outputs()[0]
            if stop:
                job.add_stop_condition(done)
        return job


    job = counter()


    def gpu():
        return counter(resources={"GPU": 1})


    def failing():
        return counter(fail_at=3, name="failing")


    def endless():
        return counter(stop=False, name="endless")


    def slow():
        return counter(stop_at=10**6, sleep=0.05, name="slow")


    not_a_job = 42


    class Settings:
        """A class that is not a Job: never instantiated by `daskjobs run`."""

        def __init__(self):
            raise AssertionError("instantiated")


    def needs_arguments(stop_at, fail_at=None):
        return counter(stop_at, fail_at)


    class SubJob(dj.Job):
        """A Job subclass: calling it gives a (stepless) Job."""


    def returns_int():
        return 3


    def raises():
        raise RuntimeError("cannot build the job")
    '''
)


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A folder holding ``jobs.py``; commands run there."""
    (tmp_path / "jobs.py").write_text(JOBS)
    return tmp_path


def env() -> dict[str, str]:
    """This checkout first on the path of every subprocess."""
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def daskjobs(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m daskjobs ARGS`` in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "daskjobs", *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def run_here(*args: str, cwd: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``daskjobs ARGS`` in this process (fast: no interpreter start), as a CompletedProcess."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.fixture
def run_cli(
    jobs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> Callable[..., subprocess.CompletedProcess]:
    """``run_cli(*args)``: ``daskjobs ARGS`` in this process (:func:`run_here`), in the folder of ``jobs``."""
    return functools.partial(run_here, cwd=jobs, monkeypatch=monkeypatch, capsys=capsys)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


def epochs(prefix: str | Path, **options) -> list[int]:
    return [info.epoch for info in dj.list_checkpoints(str(prefix), **options)]


@pytest.mark.slow
def test_version_through_python_m(jobs):
    """``python -m daskjobs --version`` prints the version."""
    result = daskjobs("--version", cwd=jobs)
    assert (result.returncode, result.stdout.strip()) == (0, f"daskjobs {dj.__version__}")


@pytest.mark.parametrize("target", ["jobs.py:job", "jobs.py:counter", "{path}:job"])
def test_run_local_every_target_form(jobs, target, run_cli):
    """A Job or a callable returning one, by module or file path (relative or absolute)."""
    result = run_cli("run", target.format(path=jobs / "jobs.py"), "--local", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert last_line(result) == (
        "job 'counter': last epoch 5, no checkpoint (pass --checkpoint PREFIX to keep one); ran epochs 1-5"
    )
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["jobs:job", "--local"], 0, "job 'counter': last epoch 5, no checkpoint"),
        (["jobs.py:failing", "--local"], 1, "error: task 'a/step' failed in the epoch group of job 'failing'"),
        (["jobs.py:not_a_job"], 2, "jobs.py:not_a_job is not a Job or a callable returning one"),
    ],
)
@pytest.mark.slow
def test_run_exit_codes_of_the_real_command(jobs, args, code, message):
    """The real command's exit codes, with a module target (from the current folder) too."""
    result = daskjobs("run", *args, cwd=jobs)
    assert result.returncode == code, result.stderr
    assert message in (result.stdout if code == 0 else result.stderr)


def test_checkpoint_then_rerun_resumes_then_finished(jobs, run_cli):
    """--max-epochs stops early with a commit; a re-run resumes; a third run runs nothing."""
    prefix = jobs / "ckpt"
    first = run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix), "--max-epochs", "2")
    assert first.returncode == 0, first.stderr
    assert last_line(first) == f"job 'counter': last epoch 2, committed under {prefix}; ran epochs 1-2"
    second = run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix))
    assert last_line(second) == f"job 'counter': last epoch 5, committed under {prefix}; ran epochs 3-5"
    assert epochs(prefix) == [0, 1, 2, 3, 4, 5]
    third = run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix), "--keep-last", "2")
    assert third.returncode == 0, third.stderr
    assert "last epoch 5" in last_line(third)
    assert "no epoch ran" in last_line(third)


def test_resume_from_an_older_epoch_and_a_missing_one(jobs, run_cli):
    """--resume-from N re-runs from N; an epoch that is not committed is a usage error listing the committed."""
    prefix = jobs / "ckpt"
    assert run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix)).returncode == 0
    again = run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix), "--resume-from", "3")
    assert again.returncode == 0, again.stderr
    assert last_line(again).endswith("ran epochs 4-5")
    before = epochs(prefix)
    missing = run_cli("run", "jobs.py:job", "--local", "--checkpoint", str(prefix), "--resume-from", "9")
    assert missing.returncode == 2
    assert f"epoch 9 is not committed under {prefix}; committed: 0, 1, 2, 3, 4, 5" in missing.stderr
    assert epochs(prefix) == before


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["jobs.py:failing"],
            1,
            "error: task 'a/step' failed in the epoch group of job 'failing' on node 'a', "
            "epoch 3: ZeroDivisionError: division by zero on purpose (run with -v for the traceback)",
        ),
        (["jobs.py:endless"], 1, "job 'endless' (jobs.py:endless) has no stop condition"),
        (["jobs.py:raises"], 1, "building the job with jobs.py:raises() failed: RuntimeError: cannot build the job"),
        (["jobs.py:not_a_job"], 2, "jobs.py:not_a_job is not a Job or a callable returning one: it is int 42"),
        (["jobs.py:returns_int"], 2, "jobs.py:returns_int() returned int 3, not a Job"),
        (["jobs.py:nothing"], 2, "jobs.py has no attribute 'nothing'"),
        (["missing.py:job"], 2, "TARGET file missing.py does not exist"),
        (["no_such_module:job"], 2, "cannot import 'no_such_module'"),
        (["jobs.py"], 2, "TARGET must be package.module:name or path/to/file.py:name"),
        (["jobs.py:job", "--keep-last", "2"], 2, "--keep-last needs a checkpoint prefix: add --checkpoint PREFIX"),
        (["jobs.py:job", "--max-epochs", "0"], 2, "expected a positive integer"),
        (["jobs.py:job", "--local", "--scheduler", "tcp://127.0.0.1:1"], 2, "not allowed with argument"),
    ],
)
def test_run_errors_are_one_paragraph_with_exit_code(jobs, args, code, message, run_cli):
    """Failures exit 1, usage errors 2; one paragraph on stderr, no traceback, nothing created."""
    result = run_cli("run", *args, "--local" if "--scheduler" not in args else "-v")
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    if "-v" not in args and "--scheduler" not in args:
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 or code == 2
    assert sorted(p.name for p in jobs.iterdir() if p.name != "__pycache__") == ["jobs.py"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("jobs.py:not_a_job", "jobs.py:not_a_job is not a Job or a callable returning one: it is int 42"),
        ("jobs.py:np", "jobs.py:np is not a Job or a callable returning one: it is module <module 'numpy' from "),
        ("jobs.py:dj.Node", "jobs.py:dj.Node is not a Job or a callable returning one: it is the class Node"),
        ("jobs.py:Settings", "jobs.py:Settings is not a Job or a callable returning one: it is the class Settings"),
        (
            "jobs.py:needs_arguments",
            "jobs.py:needs_arguments is not a Job or a callable returning one without arguments: "
            "needs_arguments needs stop_at",
        ),
        ("jobs.py:returns_int", "jobs.py:returns_int() returned int 3, not a Job"),
        ("jobs.py:missing", "jobs.py has no attribute 'missing'; it has e.g. "),
        ("jobs.py:job.missing", "jobs.py has no attribute 'job.missing'; it has e.g. "),
    ],
)
@pytest.mark.slow
def test_a_target_that_is_no_job_is_a_one_line_usage_error(jobs, target, message):
    """``daskjobs run file.py:X`` where X is missing, an int, a module, a class that is not a Job
    or a function that needs arguments: exit 2, one line on stderr, nothing created (not even
    the --checkpoint prefix), nothing instantiated or called."""
    result = daskjobs("run", target, "--checkpoint", str(jobs / "ckpt"), "--no-progress", cwd=jobs)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"daskjobs run: error: {message}"), lines[0]
    assert result.stdout == ""
    assert sorted(p.name for p in jobs.iterdir() if p.name != "__pycache__") == ["jobs.py"]


@pytest.mark.slow
def test_a_job_subclass_is_a_target(jobs):
    """A Job subclass is a callable returning a Job: it is called (a Job without steps needs --max-epochs)."""
    result = daskjobs("run", "jobs.py:SubJob", "--local", "--no-progress", "--max-epochs", "1", cwd=jobs)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_verbose_shows_the_traceback_of_the_step(jobs):
    """-v adds the traceback, including the one from the node."""
    result = daskjobs("run", "jobs.py:failing", "--local", "-v", cwd=jobs)
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert "division by zero on purpose" in result.stderr


def test_storage_option_reaches_s3(jobs, s3_prefix, run_cli):
    """--storage-option KEY=VALUE (JSON when it parses) configures the checkpoint filesystem."""
    url, options = s3_prefix
    flags = [arg for key, value in options.items() for arg in ("--storage-option", f"{key}={value}")]
    flags = [flag.replace("=False", "=false") for flag in flags]
    result = run_cli("run", "jobs.py:job", "--local", "--checkpoint", url, *flags, "--max-epochs", "2")
    assert result.returncode == 0, result.stderr
    assert last_line(result).startswith(f"job 'counter': last epoch 2, committed under {url}")
    assert epochs(url, storage_options=options) == [0, 1, 2]


@pytest.mark.cluster
@pytest.mark.slow
def test_default_session_is_a_node_cluster_with_a_dashboard(jobs):
    """Without --local/--scheduler the job runs on a node_cluster of its nodes, whose workers have the
    resources of the job's Nodes (node 'a' needs GPU=1); the dashboard link is printed."""
    prefix = jobs / "ckpt"
    result = daskjobs("run", "jobs.py:gpu", "--checkpoint", str(prefix), "--async-save", cwd=jobs, timeout=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "starting a local Dask cluster with one worker per node: a"
    assert lines[1].startswith("dashboard: http://127.0.0.1:")
    assert lines[-1] == f"job 'counter': last epoch 5, committed under {prefix}; ran epochs 1-5"
    assert epochs(prefix) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("sig", "code", "where"),
    [
        (signal.SIGINT, 130, ["--local"]),
        (signal.SIGTERM, 143, ["--local"]),
        pytest.param(signal.SIGINT, 130, [], marks=[pytest.mark.cluster, pytest.mark.slow], id="node_cluster-SIGINT"),
    ],
)
@pytest.mark.representative("once-2-130-where0", "twice-15-143-where1", "once-node_cluster-SIGINT")
@pytest.mark.parametrize("times", [1, 2], ids=["once", "twice"])
@pytest.mark.slow
def test_signal_stops_with_exit_code_and_commits_intact(jobs, sig, code, where, times):
    """SIGINT exits 130, SIGTERM 143 (also when a second signal follows), with one line and no traceback;
    what is committed verifies. The signal goes to the whole process group, as a terminal's Ctrl-C
    does: a node_cluster's worker processes get it too (and ignore it)."""
    prefix = jobs / "ckpt"
    process = subprocess.Popen(
        [sys.executable, "-m", "daskjobs", "run", "jobs.py:slow", *where, "--checkpoint", str(prefix)],
        cwd=jobs,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (prefix.exists() and len(epochs(prefix)) >= 3):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no epoch committed in time"
            time.sleep(0.05)
        for _ in range(times):
            with contextlib.suppress(ProcessLookupError):  # stopped already (gracefully, after the first)
                os.killpg(process.pid, sig)
            time.sleep(0.6)  # a second signal, not the first one delivered again
        _out, err = process.communicate(timeout=30)
    finally:
        stop_group(process)
    assert process.returncode == code, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err
    assert epochs(prefix)[:3] == [0, 1, 2]
    assert dj.open_checkpoint(str(prefix)).verify() > 0
    again = daskjobs("checkpoints", "verify", str(prefix), cwd=jobs)
    assert again.returncode == 0, again.stderr


def readme_commands() -> list[str]:
    """The commands of the first ``bash`` block under ``## From the command line`` in
    docs/getting-started.md (where the README's command-line section moved; none if absent)."""
    text = (Path(dj.__file__).resolve().parents[1] / "docs" / "getting-started.md").read_text()
    _, found, section = text.partition("\n## From the command line\n")
    if not found or "```bash\n" not in section:
        return []
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_command_line_section_runs_as_printed(tmp_path):
    """Every command of Getting started's command-line block exits 0, run in order in a copy of examples/."""
    import shlex
    import shutil

    commands = readme_commands()
    assert len(commands) >= 10
    shutil.copytree(Path(dj.__file__).resolve().parents[1] / "examples", tmp_path / "examples")
    for line in commands:
        argv = shlex.split(line, comments=True)
        argv = argv[3:] if argv[:3] == ["python", "-m", "daskjobs"] else argv[1:]
        result = daskjobs(*argv, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"


def test_the_getting_started_checkpoints_stay_out_of_git():
    """The command-line block of Getting started, run from the repository's root, writes its checkpoints
    where git does not see them: ``git status`` stays clean (the repository's .gitignore lists them)."""
    import shlex

    root = Path(dj.__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    prefixes = {
        argv[argv.index("--checkpoint") + 1] if "--checkpoint" in argv else argv[argv.index("checkpoints") + 2]
        for argv in (shlex.split(line, comments=True) for line in readme_commands())
        if "--checkpoint" in argv or "checkpoints" in argv
    }
    assert prefixes == {"ckpt-demo"}
    for prefix in prefixes:
        ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f"{prefix}/ps.0/zarr.json"])
        assert ignored.returncode == 0, f"{prefix}/ is not in .gitignore"


def test_daskjobs_own_modules_are_never_shipped_by_value(monkeypatch):
    """``daskjobs.demo:demo_job`` loaded in a daskjobs checkout: daskjobs' modules stay pickled by
    reference (every worker imports daskjobs; by value, an ArrayReader's thread-local fails)."""
    import cloudpickle

    from daskjobs.cli import load_job

    monkeypatch.chdir(Path(dj.__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert load_job("daskjobs.demo:demo_job").name == "ps-logistic-regression"
    assert len(cloudpickle.dumps(dj.ArrayReader)) < 200  # a module and a name, not the class


@pytest.mark.slow
def test_unreachable_scheduler_is_a_one_paragraph_failure(jobs):
    """--scheduler at an address nobody listens on: exit 1 naming the address, within the connect timeout."""
    result = subprocess.run(
        [sys.executable, "-m", "daskjobs", "run", "jobs.py:job", "--scheduler", "tcp://127.0.0.1:1"],
        cwd=jobs,
        env={**env(), "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "1s", "DASK_DASKJOBS__CONNECT_TIMEOUT": "3s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith(
        "daskjobs run: error: cannot connect to the Dask scheduler at tcp://127.0.0.1:1: the connection was refused"
    )
    assert len(result.stderr.strip().splitlines()) == 1
