"""Losing the Dask scheduler: SessionLostError within daskjobs.connect-timeout, checkpoints intact,
and the job resumes on a new scheduler; a failed run leaves a usable session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
import pytest
from processes import spawn, start_scheduler, stop_group

import daskjobs as dj
from daskjobs.errors import NodePlacementError, SessionClosedError, SessionLostError, TaskFailedError

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]

STARTUP = 60.0
NODES = ("a", "b")


class ProcessCluster:
    """A ``dask scheduler`` process and one ``daskjobs worker`` process per node, on 127.0.0.1."""

    def __init__(self, directory: Path, tls: list[str] | None = None) -> None:
        self.directory, self.tls = directory, tls or []
        self.processes: list[subprocess.Popen] = []
        protocol = "tls" if tls else "tcp"
        self.scheduler, self.address = start_scheduler(directory, *self.tls, protocol=protocol, timeout=STARTUP)
        self.processes.append(self.scheduler)
        for node in NODES:
            argv = [sys.executable, "-m", "daskjobs.cli", "worker", self.address, "--node", node, "--host", "127.0.0.1"]
            self._start([*argv, "--local-directory", str(directory / "workers"), *self.tls], f"worker-{node}")

    def wait_ready(self, security: object = None) -> None:
        """Wait until every node's worker is registered with the scheduler."""
        from distributed import Client

        with Client(self.address, timeout=STARTUP, set_as_default=False, security=security) as client:
            deadline = time.monotonic() + STARTUP
            wanted = {dj.node_resource(n) for n in NODES}
            while True:
                workers = client.scheduler_info(n_workers=-1)["workers"].values()
                if wanted <= {r for w in workers for r in w["resources"]}:
                    return
                assert time.monotonic() < deadline, self.logs()
                time.sleep(0.1)

    def _start(self, argv: list[str], name: str) -> subprocess.Popen:
        process = spawn(argv, self.directory / f"{name}.log")
        self.processes.append(process)
        return process

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self.directory.glob("*.log"))

    def close(self) -> None:
        for process in self.processes:
            stop_group(process)


@pytest.fixture
def clusters(tmp_path):
    """Start ProcessClusters on demand; all are killed at the end."""
    made: list[ProcessCluster] = []

    def start() -> ProcessCluster:
        made.append(ProcessCluster(tmp_path))
        made[-1].wait_ready()
        return made[-1]

    yield start
    for cluster in made:
        cluster.close()


def define_job(kill_scheduler: int | None = None, marker: str = "") -> dj.Job:
    """Two nodes; node a's step kills the scheduler process ``kill_scheduler`` once, in epoch 4."""
    with dj.Cluster(), dj.Job(name="lost") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("w", np.zeros(3)))

            def step(ws):
                if kill_scheduler is not None and ws.epoch == 4 and not os.path.exists(marker):
                    Path(marker).touch()
                    os.kill(kill_scheduler, signal.SIGKILL)
                    time.sleep(1.0)
                ws["w"] = ws["w"] + ws.epoch

            dj.Task(step)
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", 0))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    return job


def test_scheduler_killed_mid_run_raises_session_lost_and_resumes(clusters, tmp_path):
    """Killing the scheduler mid-epoch raises SessionLostError naming it within the timeout;
    committed epochs verify, and re-running on a new cluster resumes and ends as uninterrupted."""
    with dj.LocalSession() as local:
        dj.JobRunner(define_job(), max_epochs=7, progress=False).train(local)
        expected = local.fetch("w", "a"), local.fetch("n", "b")
    prefix = str(tmp_path / "ckpt")
    first = clusters()
    with dask.config.set({"daskjobs.connect-timeout": "5s"}):
        session = dj.DaskSession(first.address)
        runner = dj.JobRunner(
            define_job(first.scheduler.pid, str(tmp_path / "killed")),
            dj.MultiNodeCheckpointManager(prefix),
            max_epochs=7,
            progress=False,
        )
        started = time.monotonic()
        told = r"; the last committed epoch, 3 under .*ckpt, is intact: run the job again on a working scheduler to "
        with pytest.raises(SessionLostError, match=first.address.replace(".", r"\.") + ".*" + told + "resume from it$"):
            runner.train(session)
        assert time.monotonic() - started < 5 + 15
    assert (tmp_path / "killed").exists()
    assert not session.is_open()
    with pytest.raises(SessionClosedError):
        session.fetch("w", "a")
    committed = [info.epoch for info in dj.list_checkpoints(prefix)]
    assert committed
    assert max(committed) == 3
    for epoch in committed:
        assert dj.open_checkpoint(prefix, epoch).verify() > 0
    first.close()

    second = clusters()
    with dj.DaskSession(second.address) as session:
        runner = dj.JobRunner(define_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=7, progress=False)
        assert runner.train(session) == 7
        assert [r.epoch for r in runner.history] == [4, 5, 6, 7]
        assert np.array_equal(session.fetch("w", "a"), expected[0])
        assert int(session.fetch("n", "b")) == int(expected[1])


@pytest.mark.representative("memory-only")
@pytest.mark.parametrize(
    ("kind", "told"),
    [
        (
            "memory-only",
            "; the run's checkpoints were in cluster memory only and went with it (db_prefix=None): run the job "
            "again on a working scheduler to start over",
        ),
        (
            "none",
            "; nothing was checkpointed (no checkpoint manager): run the job again on a working scheduler to "
            "start over",
        ),
    ],
    ids=["memory-only", "none"],
)
def test_a_scheduler_lost_under_a_run_with_nothing_durable_says_a_new_run_starts_over(clusters, tmp_path, kind, told):
    """Without a prefix (checkpoints in cluster memory only, or none) the error of a lost scheduler
    says that nothing survives it, not that a re-run resumes."""
    first = clusters()
    manager = dj.MultiNodeCheckpointManager(None, in_memory=True) if kind == "memory-only" else None
    with dask.config.set({"daskjobs.connect-timeout": "3s"}):
        session = dj.DaskSession(first.address)
        runner = dj.JobRunner(
            define_job(first.scheduler.pid, str(tmp_path / "killed")), manager, max_epochs=7, progress=False
        )
        with pytest.raises(SessionLostError) as raised:
            runner.train(session)
    assert str(raised.value).startswith(f"lost the Dask scheduler at {first.address}: ")
    assert str(raised.value).endswith(
        f"DaskSession {session.session_id} is closed and its node workspaces are gone{told}"
    )
    assert not session.is_open()


def test_unreachable_scheduler_is_session_lost_within_timeout():
    """Connecting to an address where no scheduler listens fails within the timeout."""
    with dask.config.set({"daskjobs.connect-timeout": "2s"}):
        started = time.monotonic()
        with pytest.raises(SessionLostError, match=r"127\.0\.0\.1:9"):
            dj.DaskSession("tcp://127.0.0.1:9")
        assert time.monotonic() - started < 15


def _fail(ws: dj.Workspace) -> None:
    raise ValueError("boom")


@pytest.fixture(scope="module")
def node_cluster():
    with dj.node_cluster(["a", "b"]) as cluster:
        yield cluster


def _counter(ws: dj.Workspace) -> None:
    ws["count"] = ws.get("count", 0) + 1


@pytest.mark.parametrize("failure", ["task_failure", "node_lost", "placement"])
def test_session_is_usable_after_a_failed_run(node_cluster, failure):
    """After a failed run of each kind the same session runs the next group correctly."""
    with dj.DaskSession(node_cluster) as session:
        with dj.Node("a"):
            session.run(_counter)
        if failure == "task_failure":
            with dj.Node("a"), pytest.raises(TaskFailedError):
                session.run(_fail)
        elif failure == "placement":
            with dj.Node("nowhere"), pytest.raises(NodePlacementError):
                session.run(_counter)
        else:
            addr = next(a for a, w in session.client.scheduler_info()["workers"].items() if w["name"] == "b")
            pid = session.client.run(os.getpid, workers=[addr])[addr]
            with dj.Node("b"):
                session.run(_counter)
            os.kill(pid, signal.SIGKILL)
            with dj.Node("b"), pytest.raises(dj.errors.NodeLostError):
                session.run(_counter)
            session.wait_for_nodes(["b"], timeout=30)
            session.forget_tokens(["b"])
        assert session.is_open()
        with dj.Node("a"):
            session.run(_counter)
        assert int(session.fetch("count", "a")) == 2
        with dj.Node("b"):
            session.run(_counter)
        assert int(session.fetch("count", "b")) == 1
