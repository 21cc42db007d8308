"""Session faults: a node's worker killed again and again comes back every time (Nanny), and the
session recovers the node each time."""

from __future__ import annotations

import os
import signal
import time

import pytest

import daskjobs as dj
from daskjobs.errors import NodeLostError

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]

RESTART_DEADLINE = 20.0
"""Seconds a killed worker may take to be back (a Nanny restart takes about one on this box)."""


def _counter(ws: dj.Workspace) -> None:
    ws["count"] = ws.get("count", 0) + 1


def _worker_of(session: dj.DaskSession, name: str) -> tuple[str, int]:
    workers = session.client.scheduler_info(n_workers=-1)["workers"]
    address = next(a for a, w in workers.items() if w["name"] == name)
    return address, session.client.run(os.getpid, workers=[address])[address]


@pytest.mark.representative("9")  # SIGKILL; SIGSEGV: -m matrix
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_node_cluster_restarts_a_killed_worker_every_time(sig):
    """The same node's worker killed 3 times in a row is back within seconds each time, in a new
    process; each loss is reported as NodeLostError and the node works again afterwards."""
    with dj.node_cluster(["a", "b"]) as cluster, dj.DaskSession(cluster) as session:
        seen = set()
        for _ in range(3):
            with dj.Node("b"):
                session.run(_counter)
            address, pid = _worker_of(session, "b")
            seen.add(pid)
            os.kill(pid, sig)
            started = time.monotonic()
            while True:
                workers = session.client.scheduler_info(n_workers=-1)["workers"]
                back = [a for a, w in workers.items() if w["name"] == "b" and a != address]
                if back:
                    break
                assert time.monotonic() - started < RESTART_DEADLINE, f"worker b not back after kill {len(seen)}"
                time.sleep(0.05)
            with dj.Node("b"), pytest.raises(NodeLostError):
                session.run(_counter)
            session.wait_for_nodes(["b"], timeout=RESTART_DEADLINE)
            session.forget_tokens(["b"])
            with dj.Node("b"):
                session.run(_counter)
            assert int(session.fetch("count", "b")) == 1
        assert len(seen) == 3
        assert len(cluster.workers) == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_node_cluster_workers_outlive_the_signals_a_batch_system_sends_the_whole_job(sig):
    """SIGTERM and SIGINT reach every process of a job (scancel, systemd, a terminal's Ctrl-C): a
    node_cluster's worker process ignores them (its driver stops the job and closes it), so the
    node keeps its worker and its workspace."""
    with dj.node_cluster(["a", "b"]) as cluster, dj.DaskSession(cluster) as session:
        with dj.Node("b"):
            session.run(_counter)
        address, pid = _worker_of(session, "b")
        os.kill(pid, sig)
        time.sleep(1.0)
        assert _worker_of(session, "b") == (address, pid)
        with dj.Node("b"):
            session.run(_counter)
        assert int(session.fetch("count", "b")) == 2
        assert len(cluster.workers) == 2
