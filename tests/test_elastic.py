"""Elastic placement on real Dask clusters (SPEC §1.6a): pool workers get the nodes at run time and
give them back on close; a driver that died leaves no phantom pins; pinned and pool workers mix;
a pool shrinks under a running job down to one worker (and fails, saying so, at none); workers
that join take nodes with their workspaces; every run ends equal to an uninterrupted one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dask.config
import numpy as np
import pytest
from distributed import Client, LocalCluster, Scheduler, SpecCluster, Worker

import daskjobs as dj
from daskjobs.errors import NodeLostError, NodePlacementError
from daskjobs.session._placement import Survey

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

NODES = ("n0", "n1", "n2", "n3")


def grow(ws: dj.Workspace) -> None:
    ws["x"] = ws["x"] * 1.5 + ws.epoch
    ws["seen"] = [*ws["seen"], ws.epoch]


def define_job(epochs: int = 6, nodes=NODES, gpu: str | None = None) -> dj.Job:
    """Independent nodes, each a float vector and a JSON list that every epoch changes."""
    with dj.Cluster(), dj.Job(name="elastic") as job:
        for i, name in enumerate(nodes):
            node = dj.Node(name, GPU=1) if name == gpu else dj.Node(name)
            with node:
                with job.init_group:
                    dj.Task(lambda ws, i=i: ws.update(x=np.arange(3.0) + i, seen=[]), name="init")
                dj.Task(grow)
        with dj.Node(nodes[0]):
            dj.epoch_limiter(job, epochs)
    return job


def reference(epochs: int = 6, nodes=NODES) -> dict[str, tuple[np.ndarray, list]]:
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(epochs, nodes), progress=False).train(session)
        return {n: (session.fetch("x", n), session.fetch("seen", n)) for n in nodes}


def assert_equal_to_reference(session: dj.Session, epochs: int = 6, nodes=NODES) -> None:
    for node, (x, seen) in reference(epochs, nodes).items():
        got = session.fetch("x", node)
        assert got.tobytes() == x.tobytes(), node
        assert session.fetch("seen", node) == seen, node


def pool(n_workers: int, **kwargs) -> LocalCluster:
    """In-process pool workers (one thread each), nothing but the loopback."""
    return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False, dashboard_address=None, **kwargs)


def node_resources(client: Client) -> dict[str, dict[str, float]]:
    """Worker address -> its daskjobs node resources (given or not) with their amounts."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {a: {r: v for r, v in w["resources"].items() if r.startswith("daskjobs-node-")} for a, w in workers.items()}


def test_a_default_local_cluster_runs_a_job_with_no_set_up(caplog):
    """A LocalCluster whose workers have no resources (``Client()``) runs a four-node job on two
    workers: the nodes are spread two and two, ``session.placement`` and the reprs show it, one
    INFO line logs it, and the results equal a LocalSession's."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    with pool(2) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        assert session.placement == {}
        runner = dj.JobRunner(define_job(), progress=False)
        assert runner.train(session) == 6
        placement = session.placement
        assert sorted(placement) == list(NODES)
        assert sorted(list(placement.values()).count(a) for a in set(placement.values())) == [2, 2]
        assert f"n0 -> {placement['n0']} (pool)" in repr(session)
        assert f"placement={placement}" in repr(runner)
        assert_equal_to_reference(session)
        given = node_resources(client)
        assert {r for rs in given.values() for r, v in rs.items() if v > 0} == {dj.node_resource(n) for n in NODES}
    assert sum("placement now" in r.getMessage() for r in caplog.records) == 1


def test_the_resources_a_session_gave_are_taken_back_when_it_closes():
    """After ``close`` no worker provides a node resource any more: the next session on the pool sees
    pool workers only, and a job run after it places its nodes afresh."""
    with pool(2) as cluster, Client(cluster) as client:
        with dj.DaskSession(client) as session:
            dj.JobRunner(define_job(2), progress=False).train(session)
        assert all(v == 0 for rs in node_resources(client).values() for v in rs.values())
        with dj.DaskSession(client) as session:
            dj.JobRunner(define_job(2), progress=False).train(session)
            assert sorted(session.placement) == list(NODES)


DIES = textwrap.dedent(
    """
    import os, sys
    import daskjobs as dj
    session = dj.DaskSession(sys.argv[1])
    session.check_nodes(["n0", "n1"])
    os._exit(0)  # the driver dies: it never takes the resources back
    """
)


def test_a_driver_that_died_leaves_no_phantom_pins():
    """A driver placed two nodes and died: its resources stay on the workers, told apart from
    resources given by hand (its session is gone). The next session on the pool takes those workers
    as pool workers (no "2 workers provide it"), and a worker given a node's resource by hand stays
    pinned."""
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False}}
    options = {"nthreads": 1, "host": "127.0.0.1"}
    workers = {
        "w0": {"cls": Worker, "options": options},
        "w1": {"cls": Worker, "options": options},
        "pin": {"cls": Worker, "options": {**options, "resources": {dj.node_resource("p"): 1}}},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        child = subprocess.run(
            [sys.executable, "-c", DIES, cluster.scheduler_address], capture_output=True, text=True, timeout=60
        )
        assert child.returncode == 0, child.stderr
        left = {r for rs in node_resources(client).values() for r, v in rs.items() if v > 0}
        assert left == {dj.node_resource(n) for n in ("n0", "n1", "p")}
        with dj.DaskSession(client) as session:
            deadline = time.monotonic() + 30  # until the scheduler has forgotten the dead driver's anchor
            while True:
                survey = session._placer.survey()
                kinds = {n: k for a in survey.live() for n, k in survey.held(a).items()}
                if kinds["n0"] == "stale" or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert kinds == {"n0": "stale", "n1": "stale", "p": "pinned"}
            session.check_nodes(["n0", "n1", "n2", "p"])
            pinned = session.placement["p"]
            assert client.scheduler_info(n_workers=-1)["workers"][pinned]["name"] == "pin"
            assert {session.placement[n] for n in ("n0", "n1", "n2")} <= set(session._placer.survey().pool())


def test_pinned_and_pool_workers_mix():
    """A worker pinned to ``n0`` keeps it; the pool's two workers take the other three nodes, and the
    job ends as a LocalSession's."""
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False}}
    options = {"nthreads": 1, "host": "127.0.0.1"}
    workers = {
        "pin": {"cls": Worker, "options": {**options, "resources": {dj.node_resource("n0"): 1}}},
        "a": {"cls": Worker, "options": options},
        "b": {"cls": Worker, "options": options},
    }
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, dj.DaskSession(cluster) as session:
        dj.JobRunner(define_job(), progress=False).train(session)
        names = {a: w["name"] for a, w in session.client.scheduler_info(n_workers=-1)["workers"].items()}
        where = {n: names[a] for n, a in session.placement.items()}
        assert where["n0"] == "pin"
        assert sorted(where[n] for n in ("n1", "n2", "n3")) in (["a", "a", "b"], ["a", "b", "b"])
        assert_equal_to_reference(session)


def test_a_node_no_worker_can_serve_fails_within_the_preflight_timeout():
    """A node needing ``GPU=1`` on a pool without GPUs: NodePlacementError within
    ``daskjobs.preflight-timeout``, naming the node, its demand and the workers."""
    settings = {"daskjobs.preflight-timeout": "0.5s"}
    with dask.config.set(settings), pool(1) as cluster, dj.DaskSession(cluster) as session:
        start = time.monotonic()
        with pytest.raises(NodePlacementError) as info:
            dj.JobRunner(define_job(nodes=("n0", "g"), gpu="g"), progress=False).train(session)
        assert time.monotonic() - start < 5
    assert info.value.nodes == ["g"]
    message = str(info.value)
    assert "node 'g' (needs GPU=1): no worker provides 'daskjobs-node-g', and no pool worker has GPU=1" in message
    assert "(waited 0.5 s)" in message
    assert "pool worker, nodes placed" in message


def retire_at(client: Client, epochs: dict[int, int]):
    """``on_epoch``: at each epoch of ``epochs``, retire that many workers serving nodes (once each)."""
    retired: set[str] = set()

    def on_epoch(record) -> None:
        for _ in range(epochs.get(record.epoch, 0)):
            serving = [
                a for a, rs in node_resources(client).items() if any(v > 0 for v in rs.values()) and a not in retired
            ]
            retired.add(serving[0])
            client.retire_workers(serving[:1])

    return on_epoch


def test_a_pool_shrinks_under_the_job_down_to_one_worker(tmp_path, caplog):
    """Three pool workers, two retired while the job runs: their nodes go to the workers left at once
    (down to one serving all four), every node restores from the last commit without counting a
    failure, and the results equal a LocalSession's."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    with pool(3) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        # on_epoch hears of an epoch once it is committed, which on a busy machine may be while a
        # later epoch runs: epochs 7 and 8 leave room for the second retirement to be noticed
        runner = dj.JobRunner(
            define_job(8), manager, max_failures=0, progress=False, on_epoch=retire_at(client, {2: 1, 4: 1})
        )
        assert runner.train(session) == 8
        assert len(set(session.placement.values())) == 1
        assert_equal_to_reference(session, 8)
    departures = [r.getMessage() for r in caplog.records if "left on purpose (it was retired)" in r.getMessage()]
    assert 1 <= len(departures) <= 2  # two retirements noticed by one failed run are one recovery
    assert not any("lost; restoring" in r.getMessage() for r in caplog.records)


def close_one_at(cluster: LocalCluster, client: Client, epoch: int):
    """``on_epoch``: at ``epoch``, close a worker serving nodes for a reason that is no departure (a crash)."""

    def on_epoch(record) -> None:
        if record.epoch == epoch:
            serving = max(node_resources(client).items(), key=lambda item: sum(v > 0 for v in item[1].values()))[0]
            worker = next(w for w in cluster.workers.values() if w.address == serving)
            cluster.sync(worker.close, reason="crashed")

    return on_epoch


def test_an_empty_cluster_fails_saying_no_worker_is_left(tmp_path):
    """The pool's last worker is lost: the recovery waits ``daskjobs.recovery-timeout`` and raises
    NodePlacementError saying that no worker is left."""
    settings = {"daskjobs.recovery-timeout": "1s"}
    with dask.config.set(settings), pool(1) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        runner = dj.JobRunner(define_job(), manager, progress=False, on_epoch=close_one_at(cluster, client, 2))
        with pytest.raises(NodePlacementError) as info:
            runner.train(session)
    assert "no worker is left on the cluster" in str(info.value)
    assert "daskjobs.recovery-timeout (1 s)" in str(info.value)
    assert [e.epoch for e in dj.list_checkpoints(str(tmp_path / "ckpt"))][:3] == [0, 1, 2]


def test_a_lost_worker_counts_as_one_failure_however_many_nodes_it_served(tmp_path):
    """A worker serving two nodes is lost: one recovery (``max_failures=1`` suffices), its nodes go to
    the worker left, and the results equal a LocalSession's; without a checkpoint manager the lost
    nodes' state is gone: NodeLostError."""
    with pool(2) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        runner = dj.JobRunner(
            define_job(), manager, max_failures=1, progress=False, on_epoch=close_one_at(cluster, client, 2)
        )
        assert runner.train(session) == 6
        assert runner.history[-1].recoveries == 1
        assert_equal_to_reference(session)
    with pool(2) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        runner = dj.JobRunner(define_job(), progress=False, on_epoch=close_one_at(cluster, client, 2))
        with pytest.raises(NodeLostError, match="no checkpoint manager") as info:
            runner.train(session)
        assert len(info.value.nodes) == 2


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpointed", "no-checkpoint"])
def test_workers_that_join_take_nodes_with_their_workspaces(tmp_path, caplog, checkpoints):
    """One pool worker serves four nodes; three join after epoch 2: at an epoch boundary three nodes move
    to them with their workspaces (nothing restored, no epoch repeated, with or without a checkpoint
    manager), the old worker no longer serves them nor holds their workspaces, and the results equal a
    LocalSession's."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    with pool(1) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:

        def scale_up(record) -> None:
            if record.epoch == 2:
                cluster.scale(4)
                client.wait_for_workers(4, timeout=30)

        manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt")) if checkpoints else None
        runner = dj.JobRunner(define_job(10), manager, max_failures=0, progress=False, on_epoch=scale_up)
        assert runner.train(session) == 10
        assert [r.epoch for r in runner.history] == list(range(1, 11))
        assert len(set(session.placement.values())) == 4
        held = {a: sorted(n for n, v in rs.items() if v > 0) for a, rs in node_resources(client).items()}
        assert sorted(len(nodes) for nodes in held.values()) == [1, 1, 1, 1]
        states = client.run(
            lambda dask_worker: sorted(k[1] for k in dask_worker.plugins["daskjobs-workspaces"]._states)
        )
        assert sorted(len(s) for s in states.values()) == [1, 1, 1, 1]
        assert_equal_to_reference(session, 10)
    messages = [r.getMessage() for r in caplog.records]
    assert any("moved node(s)" in m for m in messages)
    assert not any("restoring" in m for m in messages)


def test_rebalance_never_keeps_the_nodes_where_they_are():
    """With ``daskjobs.rebalance`` ``"never"`` workers that join take no node."""
    settings = {"daskjobs.rebalance": "never"}
    with dask.config.set(settings), pool(1) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:

        def scale_up(record) -> None:
            if record.epoch == 2:
                cluster.scale(2)
                client.wait_for_workers(2, timeout=30)

        dj.JobRunner(define_job(), progress=False, on_epoch=scale_up).train(session)
        assert len(set(session.placement.values())) == 1
        assert_equal_to_reference(session)


def test_a_survey_sees_who_gave_each_resource():
    """The workspace plugin records which session gave each node resource it holds."""
    with pool(1) as cluster, dj.DaskSession(cluster) as session:
        session.check_nodes(["n0"])
        survey = session._placer.survey()
        assert isinstance(survey, Survey)
        (address,) = survey.live()
        assert survey.held(address) == {"n0": "given"}
        assert survey.owners(address, "n0") == {session.session_id}


JOB_FILE = textwrap.dedent(
    """
    import numpy as np
    import daskjobs as dj

    def init(ws):
        ws["x"] = np.arange(3.0)

    def step(ws):
        ws["x"] = ws["x"] * 2 + ws.epoch

    with dj.Job(name="cli") as job:
        for name in ("a", "b", "c"):
            with dj.Node(name):
                with job.init_group:
                    dj.Task(init)
                dj.Task(step)
        dj.epoch_limiter(job, 3)
    """
)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--workers", "0"], "--workers 0: a pool needs at least one worker (N >= 1)"),
        (["--workers", "2", "--local"], "--workers starts a local pool cluster: it cannot be combined with --local"),
        (
            ["--workers", "2", "--scheduler", "tcp://127.0.0.1:1"],
            "--workers starts a local pool cluster: it cannot be combined with --scheduler",
        ),
    ],
    ids=["zero", "local", "scheduler"],
)
def test_workers_option_usage_errors(tmp_path, capsys, options, message):
    """``--workers N`` with N < 1, ``--local`` or ``--scheduler`` is a usage error (exit 2, one line)
    before anything is loaded or started."""
    from daskjobs.cli import main

    code = main(["run", str(tmp_path / "missing.py:job"), *options])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"daskjobs run: error: {message}"]


def test_run_on_a_local_pool_of_workers(tmp_path):
    """``daskjobs run FILE:job --workers 2`` runs three nodes on a local pool of two worker processes
    and commits what a LocalSession computes."""
    (tmp_path / "job.py").write_text(JOB_FILE)
    root = str(Path(dj.__file__).resolve().parents[1])
    command = [sys.executable, "-m", "daskjobs", "run", "job.py:job", "--workers", "2", "--no-progress"]
    result = subprocess.run(
        [*command, "--checkpoint", "ckpt"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "starting a local Dask cluster of 2 pool worker processes"
    view = dj.open_checkpoint(str(tmp_path / "ckpt"))
    assert view.epoch == 3
    expected = np.arange(3.0)
    for epoch in (1, 2, 3):
        expected = expected * 2 + epoch
    for node in ("a", "b", "c"):
        assert view[node]["x"].tobytes() == expected.tobytes()


@pytest.mark.slow
@pytest.mark.matrix  # two pool clusters and four runs (about 10-20 s): the elastic modes' own tests cover the rest
def test_check_proves_a_job_exact_when_its_pool_shrinks_and_grows():
    """``check_resume(modes=("shrink", "grow"))`` runs the job on local pools it starts: two workers,
    one killed for good mid-epoch (the run restores every node on the other), and one worker that a
    second joins (nodes move onto it); both runs equal reference A."""
    report = dj.testing.check_resume(lambda: define_job(4, ("n0", "n1")), modes=("shrink", "grow"), interrupt_at=[2])
    assert report.ok, str(report)
    runs = {run.name: run for run in report.runs}
    assert sorted(runs) == ["A", "B", "grow@2", "shrink@2"]
    assert runs["shrink@2"].resumed_from in (2, 3)
    assert runs["shrink@2"].describe().startswith("the worker of node 'n0' killed for good in epoch 3")
    assert runs["grow@2"].describe() == "a worker joined after epoch 2: nodes moved onto it with their workspaces"


@pytest.mark.parametrize("mode", ["shrink", "grow"])
def test_elastic_check_modes_start_their_own_pools(mode, capsys):
    """``daskjobs check --mode shrink|grow --scheduler ADDRESS`` is a usage error (exit 2, one line),
    and ``check_resume`` refuses a session for them."""
    from daskjobs.cli import main

    code = main(["check", "missing.py:job", "--mode", mode, "--scheduler", "tcp://127.0.0.1:1"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"daskjobs check: error: --mode {mode} runs on local pool clusters that the check starts: "
        "it cannot be combined with --scheduler"
    )
    with pool(1) as cluster, pytest.raises(dj.errors.JobDefinitionError, match="leave session= out"):
        dj.testing.check_resume(define_job, modes=mode, session=cluster)


def test_a_node_whose_demand_no_remaining_worker_meets_waits_then_names_it(tmp_path):
    """The only worker with a GPU is lost: node ``g`` (``GPU=1``) waits ``daskjobs.recovery-timeout``
    for a fitting worker like a pinned node, then NodePlacementError names it and its demand."""
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False}}
    options = {"nthreads": 1, "host": "127.0.0.1"}
    workers = {
        "cpu": {"cls": Worker, "options": options},
        "gpu": {"cls": Worker, "options": {**options, "resources": {"GPU": 1}}},
    }
    settings = {"daskjobs.recovery-timeout": "1s"}
    with (
        dask.config.set(settings),
        SpecCluster(workers=workers, scheduler=scheduler) as cluster,
        Client(cluster) as client,
        dj.DaskSession(client) as session,
    ):

        def lose_the_gpu(record) -> None:
            if record.epoch == 2:
                cluster.sync(cluster.workers["gpu"].close, reason="crashed")

        manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"))
        runner = dj.JobRunner(define_job(nodes=("n0", "g"), gpu="g"), manager, progress=False, on_epoch=lose_the_gpu)
        with pytest.raises(NodePlacementError) as info:
            runner.train(session)
    assert info.value.nodes == ["g"]
    assert "node 'g' (needs GPU=1): no worker provides 'daskjobs-node-g', and no pool worker has GPU=1" in str(
        info.value
    )
    assert "daskjobs.recovery-timeout (1 s)" in str(info.value)
