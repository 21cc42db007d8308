"""The ``daskjobs`` console script: version, help, and the ``worker`` subcommand's dask worker command."""

from __future__ import annotations

import itertools
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import daskjobs as dj
from daskjobs.cli import main

pytestmark = pytest.mark.timeout(60)


def daskjobs(*args: str) -> subprocess.CompletedProcess:
    """Run the installed ``daskjobs`` console script (next to this interpreter)."""
    script = Path(sys.executable).with_name("daskjobs")
    assert script.exists(), "install the package (pip install -e .) to get the daskjobs script"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.slow
def test_version():
    """--version prints the package version."""
    result = daskjobs("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"daskjobs {dj.__version__}"


@pytest.mark.slow
def test_help_lists_the_worker_subcommand():
    """--help describes the command and lists the worker subcommand."""
    result = daskjobs("--help")
    assert result.returncode == 0
    assert "usage: daskjobs" in result.stdout
    assert "worker" in result.stdout


@pytest.mark.slow
def test_worker_help():
    """worker --help documents the scheduler address and the node, thread and resource options."""
    result = daskjobs("worker", "--help")
    assert result.returncode == 0
    for text in ("SCHEDULER_ADDRESS", "--node NAME", "--nthreads", "--resources", "--dry-run"):
        assert text in result.stdout


@pytest.mark.slow
def test_no_subcommand_is_a_usage_error():
    """Running daskjobs without a subcommand exits with status 2 and a usage message."""
    result = daskjobs()
    assert result.returncode == 2
    assert "usage: daskjobs" in result.stderr


def test_worker_dry_run_shows_the_dask_worker_command(capsys):
    """The worker serves every --node through its resource, named after the nodes, on the given host."""
    argv = ["worker", "tcp://127.0.0.1:8786", "--node", "ps", "--node", "trainer", "--nthreads", "3"]
    assert main([*argv, "--resources", "GPU=1", "--host", "127.0.0.1", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    assert command[:4] == [sys.executable, "-m", "distributed.cli.dask_worker", "tcp://127.0.0.1:8786"]
    options = {option: command[i + 1] for i, option in enumerate(command) if option.startswith("--")}
    assert options["--name"] == "ps+trainer"
    assert options["--nthreads"] == "3"
    assert options["--nworkers"] == "1"
    assert options["--resources"] == f"{dj.node_resource('ps')}=3,{dj.node_resource('trainer')}=3,GPU=1"
    assert options["--host"] == "127.0.0.1"
    assert options["--dashboard-address"] == "127.0.0.1:0"
    assert options["--preload"] == "daskjobs.session._worker_process"
    assert "--no-dashboard" in command


def test_worker_without_nodes_is_a_pool_worker(capsys):
    """Without --node the worker provides no node resource (sessions place nodes on it) and keeps
    its extra resources; it runs daskjobs' preload, so a group signal closes it gracefully."""
    assert main(["worker", "tcp://127.0.0.1:8786", "--resources", "GPU=1", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    options = {option: value for option, value in itertools.pairwise(command) if option.startswith("--")}
    assert "--name" not in options
    assert options["--resources"] == "GPU=1"
    assert options["--preload"] == "daskjobs.session._worker_process"
    assert main(["worker", "tcp://127.0.0.1:8786", "--dry-run"]) == 0
    assert "--resources" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node", "../escape"], "invalid node name '../escape'"),
        (["--node", "a/b"], "argument --node: invalid node name 'a/b'"),
        (["--node", "a", "--node", "__x"], "invalid node name '__x'"),
        (["--node", "a", "--nthreads", "0"], "expected a positive integer"),
        (["--node", "a", "--resources", "GPU"], "expected NAME=AMOUNT"),
        (["--nthreads", "-1"], "expected a positive integer"),
    ],
)
def test_worker_rejects_bad_arguments(args, message, capsys):
    """Bad node names, thread counts and resources are usage errors (exit code 2) before any worker starts."""
    try:
        code = main(["worker", "tcp://127.0.0.1:8786", *args, "--dry-run"])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    assert message in captured.err
    assert captured.out == ""
