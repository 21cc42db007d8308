"""DaskSession on a real cluster: a ``dask scheduler`` process and ``daskjobs worker`` processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from distributed import Client, get_worker
from processes import logs, served, spawn, start_scheduler, stop_group

import daskjobs as dj
from daskjobs.errors import NodeLostError

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(120)]

WORKERS = {"a": ["a", "ps"], "b": ["b", "c", "trainer_0", "trainer_1"]}
"""Worker process -> the nodes it serves (``daskjobs worker ... --node b --node c``)."""

STARTUP_TIMEOUT = 60.0


class RealCluster(NamedTuple):
    """A running scheduler process and its ``daskjobs worker`` processes."""

    address: str
    restart_workers: Callable[[], None]
    """SIGKILL every worker process tree, start new ones, and wait until every node is served again."""


def daskjobs_command() -> list[str]:
    """The installed ``daskjobs`` console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("daskjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "daskjobs.cli"]


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    """A ``dask scheduler`` plus one ``daskjobs worker`` per entry of WORKERS, shared by the module's
    tests (a DaskSession's workspaces are its own; tests that restart the workers wait for the new
    ones); all killed afterwards."""
    tmp_path = tmp_path_factory.mktemp("real_cluster")
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT": "5s"}
    processes: dict[str, subprocess.Popen] = {}
    scheduler, address = start_scheduler(tmp_path, env=env, timeout=STARTUP_TIMEOUT)
    client = None
    try:
        assert address.startswith("tcp://127.0.0.1:")
        client = Client(address, timeout=STARTUP_TIMEOUT, set_as_default=False)

        def start_workers() -> None:
            old = set(served(client).values())
            for name, nodes in WORKERS.items():
                argv = [*daskjobs_command(), "worker", address, "--host", "127.0.0.1", "--nthreads", "2"]
                argv += [arg for node in nodes for arg in ("--node", node)]
                argv += ["--local-directory", str(tmp_path / "workers")]
                processes[name] = spawn(argv, tmp_path / f"worker-{name}.log", env=env)
            wanted = {node for nodes in WORKERS.values() for node in nodes}
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while True:
                now = served(client)
                if set(now) >= wanted and not old & set(now.values()):
                    return
                assert time.monotonic() < deadline, f"workers did not register: {now}\n{logs(tmp_path)}"
                time.sleep(0.1)

        def restart_workers() -> None:
            for process in processes.values():
                stop_group(process)
            start_workers()

        start_workers()
        yield RealCluster(address, restart_workers)
    finally:
        if client is not None:
            client.close()
        for process in [*processes.values(), scheduler]:
            stop_group(process, signal.SIGTERM)


def where(ws: dj.Workspace) -> None:
    ws["pid"] = os.getpid()
    ws["served_by_b"] = get_worker().name == "+".join(WORKERS["b"])


def pipeline() -> tuple[dj.TaskGroup, dict[str, dj.TaskOutput]]:
    """Node a produces data, node b consumes it; every node reports its process."""
    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    outputs = {}
    with group:
        for node in ("a", "b", "c"):
            with dj.Node(node):
                outputs[f"pid_{node}"] = dj.Task(where, outputs="pid", name="where").outputs()[0]
        with dj.Node("a"):
            data = dj.Task(lambda ws: ws.update(data=np.arange(5.0)), outputs="data").outputs()[0]
        with dj.Node("b"):
            total = dj.Task(lambda ws: ws.update(total=ws["data_in"].sum()), inputs={"data_in": data}, outputs="total")
            outputs["total"] = total.outputs()[0]
    return group, outputs


def test_group_runs_on_daskjobs_worker_processes(real_cluster):
    """Tasks run in the worker processes serving their nodes; data flows between them."""
    with dj.DaskSession(real_cluster.address) as session:
        assert session.nodes() == ["a", "b", "c", "ps", "trainer_0", "trainer_1"]
        group, outputs = pipeline()
        session.run(group)
        pids = {node: int(outputs[f"pid_{node}"].fetch()) for node in "abc"}
        assert float(outputs["total"].fetch()) == 10.0
        assert pids["b"] == pids["c"] != pids["a"]
        assert os.getpid() not in pids.values()
        assert bool(session.fetch("served_by_b", node="c"))
        assert session.blobs("a") == ["data", "pid", "served_by_b"]


def test_restarted_workers_are_detected(real_cluster):
    """After the worker processes are replaced, the next run raises NodeLostError, never runs on empty state."""
    with dj.DaskSession(real_cluster.address) as session:
        session.feed("weights", np.ones(3), node="a")
        session.run(pipeline()[0])
        real_cluster.restart_workers()
        with pytest.raises(NodeLostError) as info:
            session.run(pipeline()[0])
        assert set(info.value.nodes) <= {"a", "b", "c"}
        assert info.value.nodes
        session.wait_for_nodes(["a", "b", "c"], timeout=30)
        session.forget_tokens()
        group, outputs = pipeline()
        session.run(group)
        assert float(outputs["total"].fetch()) == 10.0
        assert "weights" not in session.blobs("a")


def test_checkpointed_job_resumes_after_workers_restart(real_cluster, tmp_path):
    """The demo job on a real cluster ends as on LocalSession; after a restart of every worker it resumes."""
    from daskjobs.demo import DemoConfig, build_demo_job

    config = DemoConfig(trainers=2, samples=300, max_epochs=12)
    reference = build_demo_job(config)
    with dj.LocalSession() as local:
        assert dj.JobRunner(reference.job, progress=False).train(local) == 12
        expected = local.fetch("weights", "ps")

    prefix = str(tmp_path / "ckpt")
    first = build_demo_job(DemoConfig(trainers=2, samples=300, max_epochs=12))
    with dj.DaskSession(real_cluster.address) as session:
        runner = dj.JobRunner(first.job, dj.MultiNodeCheckpointManager(prefix), max_epochs=7, progress=False)
        assert runner.train(session) == 7
    real_cluster.restart_workers()
    second = build_demo_job(DemoConfig(trainers=2, samples=300, max_epochs=12))
    with dj.DaskSession(real_cluster.address) as session:
        runner = dj.JobRunner(second.job, dj.MultiNodeCheckpointManager(prefix), progress=False)
        assert runner.train(session) == 12
        assert [r.epoch for r in runner.history] == [8, 9, 10, 11, 12]
        assert np.array_equal(session.fetch("weights", "ps"), expected)
    assert np.array_equal(dj.open_checkpoint(prefix)["ps"]["weights"], expected)
