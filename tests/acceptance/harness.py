"""The acceptance layer's harness: daskjobs run the way users run it.

Job files of plain top-level functions (``jobfiles/``) are copied to a fresh folder that no worker
has on its path; ``daskjobs run`` runs them as a subprocess in its own process group, from yet
another folder; clusters are real ``dask scheduler`` and ``daskjobs worker`` processes started from
a folder of their own; signals go to the whole process group (``killpg``), as a terminal, SLURM,
Kubernetes or systemd deliver them. Every case checks the exit code, that stderr holds no traceback
and no ERROR, that what is committed verifies, and that the values equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj

ROOT = Path(dj.__file__).resolve().parents[1]
JOBFILES = Path(__file__).parent / "jobfiles"
SESSIONS = ("local", "cluster", "scheduler")
"""How ``daskjobs run`` runs a job: ``--local``, the default node_cluster, ``--scheduler`` of real processes."""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: this checkout's daskjobs on the path, nothing of the job's folder."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JOB_", "PYTHONPATH"))}
    return {**base, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen | None = None
) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` s (or if ``process`` ended)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def stop_group(process: subprocess.Popen) -> None:
    """Kill ``process`` and its process group if still running (test teardown)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ExternalCluster:
    """A ``dask scheduler`` and ``daskjobs worker`` processes on 127.0.0.1, started from their own folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.pool: list[subprocess.Popen] = []
        port = self.address.rpartition(":")[2]
        scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", port]
        self._start([*scheduler, "--no-dashboard"], "scheduler")
        self._client = None

    def _start(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}-{len(self.processes)}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            argv, cwd=self.folder, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.processes.append(process)
        return process

    def start_worker(self, node: str, *options: str) -> subprocess.Popen:
        """``daskjobs worker ADDRESS --node NODE OPTIONS`` (its process group is its own)."""
        argv = [sys.executable, "-m", "daskjobs", "worker", self.address, "--node", node, "--nthreads", "2", *options]
        self.workers[node] = process = self._start(argv, f"worker-{node}")
        return process

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
        from distributed import Client

        if self._client is None:
            self._client = Client(self.address, timeout=30, set_as_default=False)
        return self._client

    def worker_address(self, node: str) -> str:
        """The address of the worker serving ``node`` now."""
        for address, info in self.client().scheduler_info(n_workers=-1)["workers"].items():
            if dj.node_resource(node) in info.get("resources", {}):
                return address
        raise LookupError(node)

    def wait_for_nodes(self, *nodes: str, timeout: float = 60) -> None:
        def served() -> bool:
            workers = self.client().scheduler_info(n_workers=-1)["workers"].values()
            have = {r for info in workers for r in info.get("resources", {})}
            return all(dj.node_resource(n) in have for n in nodes)

        wait_until(served, timeout, f"workers for nodes {nodes}")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        for process in reversed(self.processes):
            stop_group(process)


def session_args(kind: str, request: pytest.FixtureRequest) -> list[str]:
    """The ``daskjobs run`` options of a session kind (starting the external cluster it needs)."""
    if kind == "local":
        return ["--local"]
    if kind == "scheduler":
        return ["--scheduler", request.getfixturevalue("external_cluster").address]
    return []


def start_run(
    job_dir: Path, cwd: Path, target: str, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``daskjobs run JOB_DIR/TARGET OPTIONS`` in ``cwd``, in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "daskjobs", "run", str(job_dir / target), "--no-progress", *options],
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """Wait for ``process``; its exit code, stdout and stderr."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop_group(process)
    return process.returncode, out, err


def assert_quiet(err: str) -> None:
    """No traceback and no ERROR (daskjobs' or Dask's) on stderr."""
    assert "Traceback" not in err, err
    assert "ERROR" not in err, err
    assert "CRITICAL" not in err, err


def checkpoint_values(prefix: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every committed epoch under ``prefix``: node -> blob -> value (verified reads)."""
    found = {}
    for info in dj.list_checkpoints(str(prefix)):
        view = dj.open_checkpoint(str(prefix), epoch=info.epoch)
        found[info.epoch] = {node: view[node].read() for node in view.nodes}
    return found


def assert_same_checkpoints(actual: dict, expected: dict) -> None:
    """The same epochs, nodes and blobs, bit for bit (JSON values equal)."""
    assert sorted(actual) == sorted(expected)
    for epoch, nodes in expected.items():
        assert sorted(actual[epoch]) == sorted(nodes), epoch
        for node, blobs in nodes.items():
            assert sorted(actual[epoch][node]) == sorted(blobs), (epoch, node)
            for blob, value in blobs.items():
                got = actual[epoch][node][blob]
                if isinstance(value, np.ndarray):
                    assert (got.dtype, got.shape) == (value.dtype, value.shape), (epoch, node, blob)
                    assert got.tobytes() == value.tobytes(), (epoch, node, blob)
                else:
                    assert got == value, (epoch, node, blob)
