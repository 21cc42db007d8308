"""The command line where users meet it (SPEC §5): job files that do not import (exit 2 naming file and
line), output piped into a command that closes early (a quiet end), ``daskjobs run`` without a
terminal (one line per committed epoch) and on one (log lines and the last message on lines of
their own, the dashboard link once), and the whole job's placement checked before init runs.

Every command runs as a subprocess in a fresh folder holding a job file; the terminal is a real
pseudo-terminal whose output is replayed as a terminal shows it.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import spawn, start_scheduler, stop_group

import daskjobs as dj

pytestmark = pytest.mark.timeout(120)

JOB = textwrap.dedent(
    '''
    """Node 'a' counts epochs; stops at STOP_AT (an environment variable, default 3)."""

    import os
    import time

    import numpy as np

    import daskjobs as dj

    STOP_AT = int(os.environ.get("STOP_AT", "3"))
    SLEEP = float(os.environ.get("SLEEP", "0"))


    def init(ws):
        ws["count"] = np.int64(0)


    def step(ws):
        time.sleep(SLEEP)
        ws["count"] = ws["count"] + 1
        ws["done"] = np.bool_(ws["count"] >= STOP_AT)
        ws.log("loss", 1.0 / float(ws["count"]))


    def split():
        """Init on node 'a', the epoch on node 'b'."""
        with dj.Cluster(), dj.Job(name="split") as job:
            with job.init_group, dj.Node("a"):
                dj.Task(init)
            with dj.Node("b"):
                dj.Task(lambda ws: ws.update(seen=np.int64(1)))
        return job


    with dj.Cluster(), dj.Job(name="counter") as job:
        with job.init_group, dj.Node("a"):
            dj.Task(init)
        with dj.Node("a"):
            done = dj.Task(step, outputs="done").outputs()[0]
        job.add_stop_condition(done)
    '''
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A fresh folder holding ``job.py``; commands run there."""
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def env(**extra: str) -> dict[str, str]:
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), **extra}


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "daskjobs", *args]


def daskjobs(*args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=100)


# -- job files that do not import --------------------------------------------------------------------
IMPORT_FAILURES = {
    "syntax-error": (
        {"job.py": "import numpy\n\nweights = (1, 2\njob = None\n"},
        "job.py does not import: {cwd}/job.py, line 3: SyntaxError: '(' was never closed",
    ),
    "missing-module-in-a-helper": (
        {"job.py": "import os\nimport helpers\n", "helpers.py": "import numpy\nimport sklearnx_missing\n"},
        "job.py does not import: {cwd}/helpers.py, line 2: ModuleNotFoundError: No module named 'sklearnx_missing'",
    ),
    "import-error": (
        {"job.py": "import numpy\nfrom daskjobs import no_such_name\n"},
        "job.py does not import: {cwd}/job.py, line 2: ImportError: cannot import name 'no_such_name' from 'daskjobs'",
    ),
}
IMPORT_CASES = [
    pytest.param(
        subcommand,
        *case,
        id=f"{subcommand}-{name}",
        marks=[pytest.mark.matrix]
        if name == "import-error" or (subcommand == "check" and name != "syntax-error")
        else [],
    )
    for subcommand in ("run", "check")
    for name, case in IMPORT_FAILURES.items()
]


@pytest.mark.parametrize(("subcommand", "files", "message"), IMPORT_CASES)
@pytest.mark.slow
def test_a_job_file_that_does_not_import_is_a_usage_error_naming_file_and_line(tmp_path, subcommand, files, message):
    """Exit 2, one line on stderr naming the file (and line) where the import failed; nothing created."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = daskjobs(subcommand, "job.py:job", "--local", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"daskjobs {subcommand}: error: {message.format(cwd=tmp_path)}"), line
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == sorted(files)


# -- pipes that close early --------------------------------------------------------------------------
def committed(folder: Path, epochs: int) -> Path:
    """A prefix with epochs 0..``epochs`` of the counter job (trained in this process)."""
    from daskjobs.runner._targets import load_job

    prefix = folder / "ck"
    job = load_job(f"{folder / 'job.py'}:job")
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=epochs, progress=False).train(None)
    return prefix


@pytest.mark.parametrize("action", ["verify", pytest.param("list", marks=pytest.mark.matrix)])
@pytest.mark.slow
def test_a_reader_that_went_away_ends_quietly(folder, action):
    """stdout closed before the command prints (``| head`` that has read enough): exit 0, stderr empty."""
    prefix = committed(folder, 2)
    process = subprocess.Popen(
        command("checkpoints", action, str(prefix)), cwd=folder, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err.decode()) == (0, "")


@pytest.mark.slow
def test_head_of_a_long_listing_ends_quietly(folder):
    """``daskjobs checkpoints list ck | head -1`` with ``pipefail``: the first line, exit 0, nothing on stderr."""
    prefix = committed(folder, 300)  # about 40 KB of lines: more than the pipe and stdout's buffer hold
    script = f"set -o pipefail; {' '.join(command('checkpoints', 'list', str(prefix)))} | head -1"
    result = subprocess.run(["bash", "-c", script], cwd=folder, env=env(), capture_output=True, text=True, timeout=90)
    assert (result.returncode, result.stderr) == (0, "")
    assert re.fullmatch(r"       0  counter  nodes=a  8 bytes  \S+  stopped=-\n", result.stdout), result.stdout


@pytest.mark.slow
def test_run_goes_on_when_its_reader_went_away(folder):
    """``daskjobs run ... | head -1``: the job runs to its end and commits every epoch; exit 0, no error."""
    process = subprocess.Popen(
        command("run", "job.py:job", "--checkpoint", "ck", "--local"), cwd=folder, env=env(STOP_AT="4"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    process.stdout.close()
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err.decode()) == (0, "")
    assert [info.epoch for info in dj.list_checkpoints(str(folder / "ck"))] == [0, 1, 2, 3, 4]


# -- without a terminal ------------------------------------------------------------------------------
@pytest.mark.slow
def test_without_a_terminal_run_prints_a_line_per_committed_epoch(folder):
    """CI, a batch log: no bar, no ANSI; one line per committed epoch (time, checkpoint, metrics, stop
    values), then the final line; ``--no-progress`` leaves only the final line."""
    result = daskjobs("run", "job.py:job", "--checkpoint", "ck", "--local", cwd=folder)
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    seconds = r"\d+\.\d\d s"
    expected = [
        rf"epoch 1 committed: {seconds}, checkpoint {seconds} \(8 bytes written, 0 reused\), loss=1, done=0",
        rf"epoch 2 committed: {seconds}, checkpoint {seconds} \(8 bytes written, 0 reused\), loss=0\.5, done=0",
        rf"epoch 3 committed: {seconds}, checkpoint {seconds} \(8 bytes written, 0 reused\), loss=0\.3333, done=1",
    ]
    assert len(lines) == 4, result.stdout
    for pattern, line in zip(expected, lines, strict=False):
        assert re.fullmatch(pattern, line), line
    assert lines[3] == f"job 'counter': last epoch 3, committed under {folder / 'ck'}; ran epochs 1-3"
    again = daskjobs("run", "job.py:job", "--local", "--no-progress", cwd=folder, STOP_AT="2")
    assert again.stdout.splitlines() == [
        "job 'counter': last epoch 2, no checkpoint (pass --checkpoint PREFIX to keep one); ran epochs 1-2"
    ]


# -- on a terminal -----------------------------------------------------------------------------------
def in_terminal(argv: list[str], cwd: Path, *, interrupt_after: float | None = None, **extra: str) -> tuple[str, int]:
    """Run ``argv`` on a pseudo-terminal (stdout and stderr both on it); SIGINT it after
    ``interrupt_after`` seconds if given. Returns what the terminal shows at the end and the exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a new session whose controlling terminal is the pty
        os.chdir(cwd)
        os.execve(argv[0], argv, env(**extra))
    output, started, sent = b"", time.monotonic(), False
    while True:
        if interrupt_after is not None and not sent and time.monotonic() - started > interrupt_after:
            os.kill(pid, signal.SIGINT)
            sent = True
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        output += data
    _, status = os.waitpid(pid, 0)
    return screen(output.decode(errors="replace")), os.waitstatus_to_exitcode(status)


def screen(text: str) -> str:
    """What a terminal shows after ``text``: carriage returns overwrite the current line."""
    lines, current, column = [], [], 0
    for char in text:
        if char == "\n":
            lines.append("".join(current).rstrip())
            current, column = [], 0
        elif char == "\r":
            column = 0
        else:
            if column < len(current):
                current[column] = char
            else:
                current.append(char)
            column += 1
    if "".join(current).strip():
        lines.append("".join(current).rstrip())
    return "\n".join(lines)


@pytest.mark.cluster
@pytest.mark.slow
def test_on_a_terminal_the_last_line_is_its_own_and_the_dashboard_is_shown_once(folder):
    """The default local cluster on a terminal: the dashboard link once, the bar, and the final message on
    a line of its own after it."""
    shown, code = in_terminal(command("run", "job.py:job", "--checkpoint", "ck"), folder)
    assert code == 0, shown
    lines = shown.splitlines()
    assert lines[0] == "starting a local Dask cluster with one worker per node: a"
    assert re.fullmatch(r"dashboard: http://127\.0\.0\.1:\d+/status", lines[1]), shown
    assert shown.count("/status") == 1, shown
    assert re.match(r"job counter: 3epoch \[", lines[-2]), shown
    assert lines[-1] == f"job 'counter': last epoch 3, committed under {folder / 'ck'}; ran epochs 1-3"


def test_on_a_terminal_a_graceful_stop_says_so_on_lines_of_their_own(folder):
    """Ctrl-C while the bar runs: the stop notice and the final message each on a line of their own, the
    last line of the terminal the final message (the bar is not drawn again after it); exit 130."""
    shown, code = in_terminal(
        command("run", "job.py:job", "--checkpoint", "ck", "--local"), folder, interrupt_after=4.0,
        STOP_AT="1000", SLEEP="0.2",
    )  # fmt: skip
    assert code == 130, shown
    lines = shown.splitlines()
    notice = "SIGINT received: the job stops once the running epoch is done (and committed, with checkpoints); " \
        "send it again to abandon that epoch"  # fmt: skip
    assert notice in lines, shown
    last = dj.list_checkpoints(str(folder / "ck"))[-1].epoch
    assert lines[-1] == (
        f"job 'counter' interrupted by SIGINT: stopped after the running epoch; epoch {last} is committed under "
        f"{folder / 'ck'}; run the job again with the same checkpoint prefix to resume from it"
    )
    assert not any(line.startswith("job counter:") for line in lines[lines.index(notice) :][1:-1] if "SIGINT" in line)


# -- the whole job's placement before init -----------------------------------------------------------
@pytest.mark.cluster
def test_a_node_without_a_worker_fails_before_init_runs(folder):
    """A cluster serving node 'a' only, a job whose epoch group runs on 'b': exit 1 naming 'b' before the
    init group ran; nothing is committed."""
    with dj.node_cluster(["a"], processes=False) as cluster:
        result = daskjobs(
            "run", "job.py:split", "--checkpoint", "ck", "--max-epochs", "2", "--scheduler", cluster.scheduler_address,
            cwd=folder,
        )  # fmt: skip
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()[:1]
    assert line.startswith(
        "daskjobs run: error: job 'split' cannot start, nothing ran: cannot place node(s) ['b'] on the Dask cluster "
        "(waited 2 s):"
    ), result.stderr
    assert result.stderr.splitlines()[-1] == (
        "Workers still starting (a batch queue, an adaptive cluster)? Wait longer for them: the Dask config value "
        "daskjobs.preflight-timeout (2 s; e.g. DASK_DASKJOBS__PREFLIGHT_TIMEOUT=10m in the environment), or "
        "session.wait_for_nodes(job.nodes(), timeout=...) before train(). (run with -v for the traceback)"
    )
    assert [p.relative_to(folder / "ck") for p in (folder / "ck").rglob("*")] == [Path("__daskjobs__")]


@pytest.mark.cluster
@pytest.mark.slow
def test_a_driver_started_before_its_workers_waits_for_them_as_the_config_says(folder):
    """A batch queue's order: `daskjobs run --scheduler` on a scheduler without workers, told by the
    environment to wait up to a minute; a plain `dask worker` joins after the default 2 s: the job runs."""
    scheduler, address = start_scheduler(folder)
    started = []
    try:
        run = subprocess.Popen(
            command("run", "job.py:split", "--checkpoint", "ck", "--max-epochs", "2", "--scheduler", address),
            cwd=folder, env=env(DASK_DASKJOBS__PREFLIGHT_TIMEOUT="60s"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        started.append(run)
        time.sleep(3.0)
        assert run.poll() is None, run.communicate()
        worker = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--no-dashboard"]
        started.append(spawn(worker, folder / "worker.log", cwd=folder))
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, err
        assert out.splitlines()[-1] == f"job 'split': last epoch 2, committed under {folder / 'ck'}; ran epochs 1-2"
    finally:
        for process in [*started, scheduler]:
            stop_group(process)
