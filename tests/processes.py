"""Processes of the tests: started in process groups of their own, signalled and reaped as a whole
group (``os.killpg``, as a terminal, SLURM or Kubernetes signals a job), a ``dask scheduler``
started from a scheduler file, and waits that always have a deadline.

Tests that use these start processes: mark them ``slow`` or ``cluster`` (tests/README.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import daskjobs as dj

ROOT = Path(dj.__file__).resolve().parents[1]
"""The checkout whose daskjobs the tests import (a worktree's, not the installed one's)."""


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment with :data:`ROOT` first on ``PYTHONPATH`` (and ``extra``): a
    subprocess imports the daskjobs under test."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def spawn(
    argv: list[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start ``argv`` in a process group of its own, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)


def stop_group(process: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 10) -> None:
    """Send ``sig`` to ``process``'s whole group (a nanny and its worker, a driver and its
    cluster: what is left of it, even after ``process`` itself ended), reap ``process`` (SIGKILL
    to the group if it outlives ``timeout`` seconds), close its pipes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen | None = None
) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` s (or at once if
    ``process`` ended, with its output)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            out, err = process.communicate() if process.stdout or process.stderr else ("", "")
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def dead_pid() -> int:
    """The pid of a process of this host that has ended and been reaped (``true``: no Python starts)."""
    process = subprocess.Popen(["true"])
    process.wait(timeout=30)
    return process.pid


def logs(folder: Path, pattern: str = "*.log", tail: int = 3000) -> str:
    """The last ``tail`` characters of every log in ``folder``, each under its name (for failures)."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(folder.glob(pattern)))


def start_scheduler(
    folder: Path, *options: str, protocol: str = "tcp", env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[subprocess.Popen, str]:
    """A ``dask scheduler`` on 127.0.0.1 (a free port, a dashboard on one too, ``options`` added),
    logging to ``folder/scheduler.log``; returns it and its address, read from its scheduler file."""
    scheduler_file = folder / f"scheduler-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", f"{protocol}://127.0.0.1", "--port", "0"]
    argv += ["--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file), *options]
    process = spawn(argv, folder / "scheduler.log", env=env, cwd=folder)
    deadline = time.monotonic() + timeout
    while not scheduler_file.exists() or not scheduler_file.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_group(process)
            pytest.fail(f"the scheduler wrote no scheduler file in {timeout:g} s:\n{logs(folder)}")
        time.sleep(0.05)
    return process, json.loads(scheduler_file.read_text())["address"]


def served(client) -> dict[str, str]:
    """Node -> the address of the live worker serving it, as the scheduler of ``client`` sees it."""
    found = {}
    for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
        for resource in info.get("resources", {}):
            if resource.startswith("daskjobs-node-"):
                found[resource.removeprefix("daskjobs-node-")] = address
    return found


EXPIRING_LIFETIME = "5s"
"""The ``--lifetime`` of the worker :meth:`ExternalCluster.replace_with_expiring_worker` starts."""
STEP_SECONDS_WHILE_EXPIRING = "0.8"
"""A step's seconds in a run of 10 epochs whose worker's :data:`EXPIRING_LIFETIME` is to run out well
inside the run, not near its end (with 0.4 or 0.5 s steps a run could end first: seen in CI)."""


class ExternalCluster:
    """A ``dask scheduler`` and ``daskjobs worker`` processes on 127.0.0.1, started from their own
    folder (so no worker has the job's folder on its path), each in a process group of its own."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.pool: list[subprocess.Popen] = []
        port = self.address.rpartition(":")[2]
        scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", port]
        self._start([*scheduler, "--no-dashboard"], "scheduler")
        self._client = None

    def _start(self, argv: list[str], name: str) -> subprocess.Popen:
        process = spawn(argv, self.folder / f"{name}-{len(self.processes)}.log", env=self.env, cwd=self.folder)
        self.processes.append(process)
        return process

    def start_worker(self, node: str, *options: str) -> subprocess.Popen:
        """``daskjobs worker ADDRESS --node NODE OPTIONS`` (its process group is its own)."""
        argv = [sys.executable, "-m", "daskjobs", "worker", self.address, "--node", node, "--nthreads", "2", *options]
        self.workers[node] = process = self._start(argv, f"worker-{node}")
        return process

    def replace_with_expiring_worker(self, node: str, lifetime: str = EXPIRING_LIFETIME) -> subprocess.Popen:
        """Kill ``node``'s worker (its process group) and start one whose ``--lifetime`` runs out after
        ``lifetime`` (a batch system's walltime rotation); wait until every node has a worker again."""
        os.killpg(self.workers[node].pid, signal.SIGKILL)
        self.workers[node].wait(timeout=10)
        expiring = self.start_worker(node, "--lifetime", lifetime, "--lifetime-stagger", "0s")
        self.wait_for_nodes(*self.workers)
        return expiring

    def start_pool_worker(self, *options: str, plain: bool = True) -> subprocess.Popen:
        """A pool worker (its process group is its own): a plain ``dask worker ADDRESS`` without any
        resource, or (``plain=False``) ``daskjobs worker ADDRESS``."""
        if plain:
            argv = [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--no-dashboard"]
        else:
            argv = [sys.executable, "-m", "daskjobs", "worker", self.address]
        process = self._start([*argv, "--nthreads", "2", *options], "pool-worker")
        self.pool.append(process)
        return process

    def wait_for_workers(self, count: int, timeout: float = 60) -> None:
        """Wait until exactly ``count`` workers are connected."""
        wait_until(
            lambda: len(self.client().scheduler_info(n_workers=-1)["workers"]) == count, timeout, f"{count} workers"
        )

    def client(self):
        """A client of the scheduler (made once, closed by :meth:`close`)."""
        from distributed import Client

        if self._client is None:
            self._client = Client(self.address, timeout=30, set_as_default=False)
        return self._client

    def worker_address(self, node: str) -> str:
        """The address of the worker serving ``node`` now."""
        address = served(self.client()).get(node)
        if address is None:
            raise LookupError(node)
        return address

    def wait_for_nodes(self, *nodes: str, timeout: float = 60) -> None:
        """Wait until every node of ``nodes`` has a worker."""
        wait_until(lambda: set(nodes) <= set(served(self.client())), timeout, f"workers for nodes {nodes}")

    def close(self) -> None:
        """Close the client and kill every process group, the newest first."""
        if self._client is not None:
            self._client.close()
        for process in reversed(self.processes):
            stop_group(process)
