"""A worker that serves several nodes is lost (SPEC §4): the :class:`NodeLostError` names every node
that shared it, on every path that raises it (a run, ``fetch``/``feed``/``blobs``, the watchdog of
a node left without a worker, ``KilledWorker``), and is reported once: the next run or call on any
of those nodes uses the node's new, empty workspace instead of reporting the old loss again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
import numpy as np
import pytest
from distributed import Client
from processes import spawn, start_scheduler, stop_group

import daskjobs as dj
from daskjobs.errors import NodeLostError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

STARTUP = 60.0


def add_one(ws: dj.Workspace) -> None:
    ws["counter"] = np.int64(int(ws.get("counter", 0)) + 1)


def run_on(session: dj.Session, node: str, step=add_one) -> None:
    with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        dj.Task(step, node=node)
    session.run(group)


def served(client: Client) -> dict[str, str]:
    """Node -> address of the worker serving it."""
    table = client.scheduler_info(n_workers=-1)["workers"]
    prefix = dj.node_resource("x")[:-1]
    return {r.removeprefix(prefix): addr for addr, info in table.items() for r in info["resources"] if prefix in r}


def kill_worker_of(session: dj.DaskSession, node: str) -> None:
    """SIGKILL the worker process serving ``node`` (its nanny starts a new one) and wait for it."""
    client = session.client
    old = served(client)[node]
    pid = client.run(os.getpid, workers=[old])[old]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STARTUP
    while served(client).get(node) in (None, old):
        assert time.monotonic() < deadline, f"no new worker for node {node!r}: {served(client)}"
        time.sleep(0.1)


@pytest.fixture
def shared(fresh_cluster):
    """A DaskSession on a node_cluster whose worker m0 serves nodes a and b, and m1 node c; each
    node has run once (counter 1)."""
    with dj.node_cluster({"m0": ["a", "b"], "m1": ["c"]}, nthreads=2) as cluster, dj.DaskSession(cluster) as session:
        for node in ("a", "b", "c"):
            run_on(session, node)
        yield session


def assert_reported_once(session: dj.DaskSession) -> None:
    """After the loss was reported: a and b are empty, c untouched, every node runs again."""
    assert session.blobs("a") == []
    assert session.blobs("b") == []
    assert int(session.fetch("counter", "c")) == 1
    for node, expected in (("a", 1), ("b", 1), ("c", 2)):
        run_on(session, node)
        assert int(session.fetch("counter", node)) == expected


CALLS = {
    "fetch": lambda session: session.fetch("counter", "a"),
    "feed": lambda session: session.feed("counter", 7, "a"),
    "blobs": lambda session: session.blobs("a"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_workspace_call_reports_a_restarted_worker_once_naming_all_its_nodes(shared, call):
    """fetch/feed/blobs on node a after its worker (also b's) restarted: NodeLostError naming a and
    b, nothing fed; then both nodes have their new, empty workspaces (no second report)."""
    kill_worker_of(shared, "a")
    with pytest.raises(NodeLostError) as caught:
        CALLS[call](shared)
    assert caught.value.nodes == ["a", "b"]
    assert str(caught.value).startswith("node 'a' lost its workspace: its worker restarted (expected ")
    assert str(caught.value).endswith(" Node(s) ['b'] shared that worker: their workspaces are gone too.")
    assert_reported_once(shared)


def test_a_run_on_one_node_names_every_node_of_its_restarted_worker(shared):
    """A run on node a only, after its worker restarted: NodeLostError naming a and b."""
    kill_worker_of(shared, "a")
    with pytest.raises(NodeLostError) as caught:
        run_on(shared, "a")
    assert caught.value.nodes == ["a", "b"]
    assert str(caught.value).startswith("node 'a' lost its workspace (expected generation ")
    assert str(caught.value).endswith(" Node(s) ['b'] shared that worker: their workspaces are gone too.")
    assert_reported_once(shared)


def test_a_feed_then_a_restart_is_reported_not_run_on_an_emptied_workspace(fresh_cluster):
    """A node that only ever got a feed: its worker restarts; the next call reports the loss
    instead of running on the emptied workspace."""
    with dj.node_cluster({"m0": ["a", "b"]}, nthreads=2) as cluster, dj.DaskSession(cluster) as session:
        session.feed("counter", 5, "a")
        session.feed("counter", 6, "b")
        kill_worker_of(session, "a")
        with pytest.raises(NodeLostError) as caught:
            run_on(session, "a")
        assert caught.value.nodes == ["a", "b"]
        assert session.blobs("b") == []


def kill_own_worker(ws: dj.Workspace) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_worker_names_every_node_of_the_dead_worker(shared):
    """A step on node a kills its worker (Dask gives up on the task: KilledWorker, allowed-failures
    0): NodeLostError naming a and b."""
    shared.client.run_on_scheduler(_no_retries)
    with pytest.raises(NodeLostError) as caught:
        run_on(shared, "a", kill_own_worker)
    assert caught.value.nodes == ["a", "b"]
    assert str(caught.value).startswith("the worker of node 'a' (tcp://127.0.0.1:")
    assert " died while running " in str(caught.value)
    assert str(caught.value).endswith(" Node(s) ['b'] shared that worker: their workspaces are gone too.")
    shared.wait_for_nodes(["a", "b"], timeout=STARTUP)
    assert_reported_once(shared)


def _no_retries(dask_scheduler) -> None:
    """On the scheduler: a task whose worker dies once is KilledWorker (no retry elsewhere)."""
    dask_scheduler.allowed_failures = 0


# -- the watchdog: `daskjobs worker --node a --node b` gone for good --------------------------------
@pytest.fixture
def real_cluster(tmp_path: Path) -> Iterator[tuple[str, dict[str, subprocess.Popen], Callable]]:
    """A ``dask scheduler`` process and ``daskjobs worker`` processes; yields ``(address, workers by
    name, start(name, nodes))``; everything is killed afterwards."""
    scheduler, address = start_scheduler(tmp_path, timeout=STARTUP)
    processes = {"scheduler": scheduler}
    workers: dict[str, subprocess.Popen] = {}
    client = None
    try:
        client = Client(address, timeout=STARTUP, set_as_default=False)

        def start(name: str, nodes: list[str]) -> None:
            old = set(served(client).values())
            argv = [sys.executable, "-m", "daskjobs", "worker", address, "--host", "127.0.0.1", "--nthreads", "2"]
            argv += [arg for node in nodes for arg in ("--node", node)]
            workers[name] = spawn([*argv, "--local-directory", str(tmp_path / "w")], tmp_path / f"{name}.log")
            started = time.monotonic()
            while not all(served(client).get(n) not in (None, *old) for n in nodes):
                assert time.monotonic() < started + STARTUP, served(client)
                time.sleep(0.1)

        yield address, workers, start
    finally:
        if client is not None:
            client.close()
        for process in [*workers.values(), *processes.values()]:
            stop_group(process)


def test_the_watchdog_names_every_node_of_a_worker_gone_for_good(real_cluster, fresh_cluster):
    """``daskjobs worker --node a --node b`` is SIGKILLed (nanny and all) while node a runs a step:
    after daskjobs.placement-timeout the watchdog's NodeLostError names a and b; a new worker for
    them then serves empty workspaces, without a second report."""
    address, workers, start = real_cluster
    start("ab", ["a", "b"])
    start("c", ["c"])
    with dask.config.set({"daskjobs.placement-timeout": "2s"}), dj.DaskSession(address) as session:
        for node in ("a", "b", "c"):
            run_on(session, node)
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(lambda ws: time.sleep(60), node="a")
        killer = _killer(workers["ab"])
        with pytest.raises(NodeLostError) as caught:
            session.run(group)
        killer.join()
        assert caught.value.nodes == ["a", "b"]
        assert str(caught.value).startswith("node(s) ['a'] had no worker for 2 s while running.")
        assert str(caught.value).endswith(" Node(s) ['b'] shared that worker: their workspaces are gone too.")
        start("ab2", ["a", "b"])
        assert_reported_once(session)


def _killer(process: subprocess.Popen) -> threading.Thread:
    def kill_soon() -> None:
        time.sleep(1.5)
        stop_group(process)

    thread = threading.Thread(target=kill_soon, daemon=True)
    thread.start()
    return thread
