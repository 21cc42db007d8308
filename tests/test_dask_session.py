"""DaskSession on a real process-based node cluster: placement, workspaces, errors, worker loss."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import cloudpickle
import dask.config
import numpy as np
import psutil
import pytest
from distributed import Client, Scheduler, SpecCluster, Worker, get_worker

import daskjobs as dj
from daskjobs._execution.plan import NodePlan, RunInfo
from daskjobs._execution.shipping import unpack_plan
from daskjobs.errors import NodeLostError, NodePlacementError, SessionClosedError, TaskFailedError
from daskjobs.session import as_session

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def cluster():
    with dj.node_cluster(["a", "b"]) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster, set_as_default=False) as client:
        yield client


@pytest.fixture
def dask_session(client):
    with dj.DaskSession(client) as session:
        yield session


def worker_pids(client: Client) -> dict[str, int]:
    """Worker name -> pid of its process (asked again while a worker an earlier test killed restarts)."""
    deadline = time.monotonic() + 30
    while True:
        names = {addr: info["name"] for addr, info in client.scheduler_info(n_workers=-1)["workers"].items()}
        pids = client.run(os.getpid)
        if set(pids) == set(names) or time.monotonic() > deadline:
            return {names[addr]: pid for addr, pid in pids.items()}
        time.sleep(0.1)


def worker_address(client: Client, name: str) -> str | None:
    """The address of the worker called ``name`` now (``None`` while it has none)."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return next((addr for addr, info in workers.items() if info["name"] == name), None)


def record_where(ws: dj.Workspace) -> None:
    """Store the pid of the process running the step; fail unless the worker is named after the node."""
    assert get_worker().name == ws.node, f"{ws.node} ran on worker {get_worker().name}"
    ws["pid"] = os.getpid()


def add_one(ws: dj.Workspace) -> None:
    with ws.lock:
        ws["counter"] = ws.get("counter", 0) + 1


def run_steps(session: dj.Session, node: str | dj.Node, *steps, **task_kwargs) -> dj.Task:
    """Run ``steps`` as one GLOBAL task on ``node``; return the task."""
    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    with group, node if isinstance(node, dj.Node) else dj.Node(node):
        task = dj.Task(list(steps), **task_kwargs)
    session.run(group)
    return task


def test_tasks_run_on_their_nodes_worker(dask_session, client):
    """Each node's tasks run in the process of the worker named after the node."""
    group = dj.TaskGroup()
    with group:
        for node in ("a", "b"):
            with dj.Node(node):
                dj.Task(record_where, outputs="pid", name=f"where_{node}")
    dask_session.run(group)
    pids = {task.node: int(task.outputs()[0].fetch()) for task in group.tasks()}
    assert pids == worker_pids(client)
    assert pids["a"] != pids["b"] != os.getpid()
    assert dask_session.nodes() == ["a", "b"]


def test_a_run_is_sent_to_the_scheduler_without_the_clients_batching_delay(dask_session, client):
    """distributed's client batches messages to the scheduler in 10 ms windows; a session's runs
    must not wait for the next window (a tiny checkpointed epoch took twice as long)."""
    client.scheduler_comm.interval = 0.010  # as a fresh or reconnected client has it
    run_steps(dask_session, "a", add_one)
    assert client.scheduler_comm.interval == 0
    meanwhile: list[int] = []
    dask_session.run_group(_one_task_group("a"), meanwhile=lambda: meanwhile.append(1))
    assert meanwhile == [1]


def _one_task_group(node: str) -> dj.TaskGroup:
    group = dj.TaskGroup()
    with group, dj.Node(node):
        dj.Task(add_one)
    return group


def test_empty_group_runs_at_once(dask_session):
    """A group without tasks (like a job's default download and exit groups) runs without waiting."""
    start = time.monotonic()
    dask_session.run_group(dj.TaskGroup(), job="empty")
    assert time.monotonic() - start < 1


def test_workspaces_are_isolated_per_node_and_session(dask_session, client):
    """Blobs of one node are invisible to the other node and to another session on the cluster."""
    dask_session.feed("x", np.arange(3), node="a")
    assert dask_session.blobs("a") == ["x"]
    assert dask_session.blobs("b") == []
    with pytest.raises(KeyError, match="'x'"):
        dask_session.fetch("x", node="b")
    with dj.DaskSession(client) as other:
        assert other.blobs("a") == []
    np.testing.assert_array_equal(dask_session.fetch("x", node="a"), np.arange(3))


def test_two_nodes_on_one_worker_have_separate_workspaces():
    """A worker serving two nodes keeps one workspace per node."""
    with dj.node_cluster({"machine": ["a", "b"]}, processes=False) as cluster, dj.DaskSession(cluster) as session:
        run_steps(session, "a", lambda ws: ws.update(x=1))
        run_steps(session, "b", lambda ws: ws.update(x=2), lambda ws: ws.update(y=get_worker().name == "machine"))
        assert (int(session.fetch("x", node="a")), int(session.fetch("x", node="b"))) == (1, 2)
        assert session.blobs("a") == ["x"]
        assert bool(session.fetch("y", node="b"))


def test_concurrent_tasks_of_a_node_share_its_workspace(dask_session):
    """Instances and tasks of one node update one counter under ws.lock without losing updates."""

    def count(ws):
        for _ in range(200):
            add_one(ws)

    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    with group, dj.Node("a"):
        dj.Task(count, num_instances=4, name="many")
        dj.Task(count, name="one")
    dask_session.run(group)
    assert int(dask_session.fetch("counter", node="a")) == 5 * 200


def test_global_and_private_visibility(dask_session):
    """PRIVATE runs write through to existing blobs but keep new ones; GLOBAL runs keep new blobs."""
    run_steps(dask_session, "a", lambda ws: ws.update(shared=1))
    private = dj.TaskGroup(dj.WorkspaceType.PRIVATE)
    with private, dj.Node("a"):
        dj.Task(lambda ws: ws.update(shared=ws["shared"] + 1, scratch=7), outputs="scratch")
    dask_session.run(private)
    assert dask_session.blobs("a") == ["shared"]
    assert int(dask_session.fetch("shared", node="a")) == 2
    assert int(private.tasks()[0].outputs()[0].fetch()) == 7
    run_steps(dask_session, "a", lambda ws: ws.update(kept=3))
    assert dask_session.blobs("a") == ["kept", "shared"]


def test_inputs_flow_between_nodes(dask_session, client):
    """An input produced on one node arrives in the consumer's workspace on the other node."""
    group = dj.TaskGroup()
    with group:
        with dj.Node("a"):
            producer = dj.Task(lambda ws: ws.update(x=np.full(4, 41.0)), outputs="x")
        with dj.Node("b"):

            def consume(ws):
                ws["y"] = ws["x_in"] + 1
                ws["pid"] = os.getpid()

            consumer = dj.Task(consume, inputs={"x_in": producer.outputs()[0]}, outputs=["y", "pid"])
    dask_session.run(group)
    y, pid = (output.fetch() for output in consumer.outputs())
    np.testing.assert_array_equal(y, np.full(4, 42.0))
    assert int(pid) == worker_pids(client)["b"]


def test_fetch_feed_blobs(dask_session):
    """feed/fetch round-trip copies; fetch needs a node when there are several; unknown blobs raise KeyError."""
    value = np.linspace(0, 1, 5, dtype=np.float32)
    dask_session.feed("w", value, node="b")
    dask_session.feed("step", 3, node=dj.Node("b"))
    assert dask_session.blobs(node="b") == ["step", "w"]
    fetched = dask_session.fetch("w", node="b")
    np.testing.assert_array_equal(fetched, value)
    assert fetched.dtype == np.float32
    assert dask_session.fetch("step", node="b").shape == ()
    with pytest.raises(ValueError, match="name the node"):
        dask_session.fetch("w")
    with pytest.raises(KeyError, match="missing"):
        dask_session.fetch("missing", node="b")


def test_task_failure_names_everything_and_chains_the_cause(dask_session):
    """A step failing on a worker raises TaskFailedError naming job, group, node, task and epoch."""

    def broken(ws):
        raise ValueError("boom on the worker")

    group = dj.TaskGroup()
    with group:
        with dj.Node("a"):
            dj.Task(add_one)
        with dj.Node("b"):
            dj.Task(broken, name="broken")
    with pytest.raises(TaskFailedError) as info:
        dask_session.run_group(group, job="train", epoch=3)
    error = info.value
    assert (error.job, error.node, error.task, error.epoch) == ("train", "b", "b/broken", 3)
    assert error.group == group.label
    assert all(word in str(error) for word in ("train", "b/broken", "epoch 3", "boom on the worker"))
    assert isinstance(error.__cause__, ValueError)
    assert "boom on the worker" in error.remote_traceback
    assert pickle.loads(pickle.dumps(error)).task == "b/broken"


def test_steps_pickled_by_value_keep_their_source_file():
    """A step sent to a worker by value keeps its file, whatever the cloudpickle version, and so do
    a lambda inside it and a function it closes over (for a helper it calls through its module's
    globals, see the next test): a worker's traceback shows the lines that raised."""

    def closed_over(ws):
        return ws

    def outer(ws):
        return (lambda: closed_over(ws))()

    plan = NodePlan("job", "g", "a", dj.WorkspaceType.GLOBAL, (), local_setups=(dj.SetupNets([outer]),))
    (step,) = unpack_plan(cloudpickle.loads(cloudpickle.dumps(plan)), RunInfo("k", None)).local_setups[0].init_nets
    assert step is not outer
    inner = next(c for c in step.__code__.co_consts if isinstance(c, types.CodeType))
    (cell,) = step.__closure__
    assert step.__code__.co_filename == inner.co_filename == cell.cell_contents.__code__.co_filename == __file__


def test_functions_a_notebook_step_calls_keep_their_source_file(tmp_path):
    """Like a notebook's cells: a step and the helper it calls live in a module no worker can import
    (both are pickled by value); both keep their file, so a worker's traceback shows both lines."""
    source = tmp_path / "cell.py"
    source.write_text("def helper(ws):\n    raise ValueError(ws)\n\ndef step(ws):\n    helper(ws)\n")
    namespace = {"__name__": "a_notebook_kernel"}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    plan = NodePlan("job", "g", "a", dj.WorkspaceType.GLOBAL, (), local_setups=(dj.SetupNets([namespace["step"]]),))
    (step,) = unpack_plan(cloudpickle.loads(cloudpickle.dumps(plan)), RunInfo("k", None)).local_setups[0].init_nets
    assert step is not namespace["step"]
    assert step.__code__.co_filename == step.__globals__["helper"].__code__.co_filename == str(source)


def test_failed_run_with_edges_cleans_up_and_the_next_run_works(dask_session):
    """A consumer failing after a cross-node input leaves no open node runs behind."""
    group = dj.TaskGroup()
    with group:
        with dj.Node("a"):
            producer = dj.Task(lambda ws: ws.update(x=1), outputs="x")
        with dj.Node("b"):
            dj.Task(lambda ws: 1 / 0, inputs={"x_in": producer.outputs()[0]}, name="divide")
    with pytest.raises(TaskFailedError, match="ZeroDivisionError") as info:
        dask_session.run(group)
    assert info.value.task == "b/divide"
    for node in ("a", "b"):
        assert dask_session._call_on_node(node, lambda state: list(state.runs)) == []
    run_steps(dask_session, "b", add_one)
    assert int(dask_session.fetch("counter", node="b")) == 1


def test_cluster_listens_on_loopback_only(cluster):
    """The scheduler, dashboard, nannies and workers of node_cluster listen on 127.0.0.1 only."""
    me = psutil.Process()
    addresses = {
        conn.laddr.ip
        for process in [me, *me.children(recursive=True)]
        for conn in process.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }
    assert addresses == {"127.0.0.1"}


def test_closed_session_refuses_use_and_leaves_the_client_open(client):
    """After close() every call raises SessionClosedError, the workspaces are freed, the client stays usable."""
    session = dj.DaskSession(client)
    session.feed("x", 1, node="a")
    assert session_states(client, session.session_id) == ["a"]
    session.close()
    assert not session.is_open()
    for call in (lambda: session.fetch("x", node="a"), lambda: session.run(add_one), lambda: session.blobs("a")):
        with pytest.raises(SessionClosedError):
            call()
    assert client.status == "running"
    assert "closed" in repr(session)
    assert session_states(client, session.session_id) == []


def session_states(client: Client, session_id: str) -> list[str]:
    """Nodes with a workspace of ``session_id`` on any worker."""

    def nodes(dask_worker):
        return [node for (sid, node) in dask_worker.plugins["daskjobs-workspaces"]._states if sid == session_id]

    return sorted(node for found in client.run(nodes).values() for node in found)


def test_session_owns_the_client_it_makes(cluster):
    """A session made from a cluster or an address closes its own client; as_session wraps raw objects."""
    with dj.DaskSession(cluster) as by_cluster:
        assert by_cluster.nodes() == ["a", "b"]
    assert by_cluster.client.status == "closed"
    session = as_session(cluster.scheduler_address)
    try:
        assert isinstance(session, dj.DaskSession)
        run_steps(session, "b", add_one)
        assert int(session.fetch("counter", node="b")) == 1
    finally:
        session.close()
    assert session.client.status == "closed"
    assert isinstance(as_session(None), dj.LocalSession)
    assert as_session(session) is session
    with pytest.raises(TypeError, match="scheduler address"):
        dj.DaskSession(42)


def test_missing_node_fails_placement_quickly(dask_session):
    """A group on a node no worker serves raises NodePlacementError listing the workers, within seconds."""
    start = time.monotonic()
    with pytest.raises(NodePlacementError) as info:
        run_steps(dask_session, "c", add_one)
    assert time.monotonic() - start < 10
    assert info.value.nodes == ["c"]
    message = str(info.value)
    assert "no worker provides 'daskjobs-node-c'" in message
    assert "'a' at tcp://127.0.0.1:" in message
    assert "daskjobs worker SCHEDULER_ADDRESS --node c" in message


def test_check_nodes_reports_at_once(dask_session):
    """check_nodes passes for served nodes and raises at once for a missing node or resource."""
    dask_session.check_nodes(["a", dj.Node("b")])
    start = time.monotonic()
    with pytest.raises(NodePlacementError) as info:
        dask_session.check_nodes(["a", "b", "c"], {"b": {"GPU": 1}})
    assert time.monotonic() - start < 1
    assert info.value.nodes == ["b", "c"]
    assert "lacks GPU=1" in str(info.value)


def test_missing_node_with_edges_fails_placement_quickly(dask_session):
    """A group with dataflow edges into an unserved node fails placement just as fast."""
    group = dj.TaskGroup()
    with group:
        producer = dj.Task(lambda ws: ws.update(x=1), outputs="x", node="a")
        dj.Task(add_one, inputs={"x_in": producer.outputs()[0]}, node="c")
    start = time.monotonic()
    with pytest.raises(NodePlacementError, match="'c'"):
        dask_session.run(group)
    assert time.monotonic() - start < 4


def test_missing_extra_resource_fails_placement_quickly(dask_session):
    """A node needing a resource its worker lacks raises NodePlacementError naming the resource."""
    start = time.monotonic()
    with pytest.raises(NodePlacementError, match="lacks GPU=1"):
        run_steps(dask_session, dj.Node("a", GPU=1), add_one)
    assert time.monotonic() - start < 10


def test_extra_resources_are_provided_by_node_cluster():
    """node_cluster gives a Node's worker its extra resources, and tasks on that node run there."""
    with dj.node_cluster([dj.Node("t", GPU=1)], processes=False) as cluster, dj.DaskSession(cluster) as session:
        run_steps(session, dj.Node("t", GPU=1), add_one)
        assert int(session.fetch("counter")) == 1


def test_node_cluster_of_a_job_gives_its_nodes_their_resources():
    """node_cluster(job) starts one worker per node of the job, with its Nodes' extra resources."""
    global_type = dj.WorkspaceType.GLOBAL
    with dj.Cluster(), dj.Job(name="gpu", epoch_group=dj.TaskGroup(global_type)) as job:
        with job.init_group, dj.Node("t", GPU=2):
            dj.Task(lambda ws: ws.update(counter=np.int64(0)), workspace_type=global_type)
        with dj.Node("t"):
            dj.Task(add_one)
        with dj.Node("a"):
            dj.Task(add_one)
            dj.epoch_limiter(job, 2)
    assert job.node_resources() == {"t": {"GPU": 2}, "a": {}}
    with dj.node_cluster(job, processes=False) as cluster, dj.DaskSession(cluster) as session:
        assert dj.JobRunner(job, progress=False).train(session) == 2
        assert int(session.fetch("counter", node="t")) == 2


def test_node_served_by_two_workers_fails_placement_quickly(tmp_path):
    """Two workers providing one node's resource raise NodePlacementError naming both."""
    options = {
        "nthreads": 1,
        "host": "127.0.0.1",
        "resources": {dj.node_resource("a"): 1},
        "local_directory": str(tmp_path),
    }
    workers = {name: {"cls": Worker, "options": options} for name in ("w1", "w2")}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, "dashboard": False}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, dj.DaskSession(cluster) as session:
        start = time.monotonic()
        with pytest.raises(NodePlacementError, match=r"2 workers provide it \('w1', 'w2'\)"):
            run_steps(session, "a", add_one)
        assert time.monotonic() - start < 10


def test_node_cluster_rejects_a_node_on_two_workers():
    """node_cluster refuses a node listed for two workers, before starting anything."""
    with pytest.raises(ValueError, match="one per node"):
        dj.node_cluster({"w1": ["a"], "w2": ["a", "b"]})


def scheduler_tasks(client: Client) -> dict[str, str]:
    """Key -> state of every task the scheduler still knows, but the sessions' anchor tasks."""
    tasks = client.run_on_scheduler(lambda dask_scheduler: {k: t.state for k, t in dask_scheduler.tasks.items()})
    return {k: state for k, state in tasks.items() if not str(k).endswith("-anchor")}


def test_futures_are_released_after_each_run(dask_session, client):
    """Repeated epoch runs and failures (whose tracebacks are still held) leave no tasks on the scheduler."""
    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    with group:
        for node in ("a", "b"):
            with dj.Node(node):
                dj.Task(add_one, outputs="counter")
    for epoch in range(1, 21):
        dask_session.run_group(group, job="flat", epoch=epoch)
    assert int(group.tasks()[0].outputs()[0].fetch()) == 20
    with pytest.raises(TaskFailedError) as failed_run:
        run_steps(dask_session, "a", lambda ws: ws["missing"])
    with pytest.raises(KeyError) as failed_fetch:
        dask_session.fetch("missing", node="b")
    assert failed_run.value.__traceback__ is not None
    assert failed_fetch.value.__traceback__ is not None
    deadline = time.monotonic() + 5
    while scheduler_tasks(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler_tasks(client) == {}


def same_work_group() -> dj.TaskGroup:
    """Instances, task/instance setup, a report step and local setup on two nodes."""
    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    with group:
        for node in ("a", "b"):
            with dj.Node(node):
                dj.Task(
                    add_one,
                    num_instances=3,
                    task_init=lambda ws: ws.update(inits=ws.get("inits", 0) + 1),
                    instance_init=lambda ws: ws.update(mine=ws.instance_id),
                    outputs="counter",
                )
            group.report_step(lambda ws: ws.update(reports=ws.get("reports", 0) + 1), node=node, interval_ms=10_000)
            group.add_local_setup(dj.SetupNets(init_nets=[lambda ws: ws.update(local=1)]), node=node)
    return group


def test_same_results_as_local_session(dask_session):
    """Running the same group twice gives the same workspaces in DaskSession and LocalSession."""
    results = {}
    for name, session in (("dask", dask_session), ("local", dj.LocalSession())):
        group = same_work_group()
        session.run(group)
        session.run(group)
        results[name] = {
            node: {blob: session.fetch(blob, node=node).tolist() for blob in session.blobs(node)} for node in "ab"
        }
    assert results["dask"] == results["local"]
    assert results["dask"]["a"] == {"counter": 6, "inits": 2, "local": 1, "reports": 2}


def test_worker_killed_between_runs_raises_node_lost(dask_session, client):
    """A restarted worker's emptied workspace is detected: NodeLostError from the next run (once: the
    session then takes the new, empty workspace) or from a fetch (until a run or forget_tokens)."""
    run_steps(dask_session, "a", add_one)
    os.kill(worker_pids(client)["a"], signal.SIGKILL)
    with pytest.raises(NodeLostError) as info:
        run_steps(dask_session, "a", add_one)
    assert info.value.nodes == ["a"]
    assert "'a'" in str(info.value)
    dask_session.wait_for_nodes(["a", "b"], timeout=20)
    assert dask_session.blobs("a") == []
    run_steps(dask_session, "a", add_one)
    assert int(dask_session.fetch("counter", node="a")) == 1
    killed = worker_pids(client)["a"]
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while client.run(os.getpid, on_error="ignore").get(worker_address(client, "a")) in (killed, None):
        assert time.monotonic() < deadline, "node a's worker did not come back"  # the new one, not the dying one
        time.sleep(0.1)
    dask_session.wait_for_nodes(["a", "b"], timeout=20)
    with pytest.raises(NodeLostError, match="restarted"):
        dask_session.fetch("counter", node="a")
    dask_session.forget_tokens(["a"])
    assert dask_session.blobs("a") == []


def test_worker_killed_mid_run_raises_node_lost(dask_session, client):
    """A worker dying while it runs a task fails the run at once with NodeLostError naming the node."""
    pid = worker_pids(client)["b"]
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(NodeLostError, match="died") as info:
        run_steps(dask_session, "b", lambda ws: time.sleep(5))
    assert time.monotonic() - start < 4
    assert info.value.nodes == ["b"]
    dask_session.wait_for_nodes(timeout=20)
    assert worker_pids(client)["b"] != pid


def test_node_left_without_worker_mid_run_raises_node_lost():
    """A run whose node loses its only worker (no restart) fails after daskjobs.placement-timeout."""
    with (
        dask.config.set({"daskjobs.placement-timeout": "1s"}),
        dj.node_cluster(["a", "b"], processes=False) as cluster,
        dj.DaskSession(cluster) as session,
    ):
        address = next(a for a, w in session.client.scheduler_info()["workers"].items() if w["name"] == "b")

        async def remove(dask_scheduler):
            await dask_scheduler.remove_worker(address, stimulus_id="test-remove", expected=True)

        threading.Timer(0.3, session.client.run_on_scheduler, (remove,)).start()
        start = time.monotonic()
        with pytest.raises(NodeLostError, match="had no worker for 1 s") as info:
            run_steps(session, "b", lambda ws: time.sleep(3))
        assert time.monotonic() - start < 5
        assert info.value.nodes == ["b"]


def test_job_runner_trains_on_a_raw_client(client):
    """JobRunner.train accepts a distributed.Client, runs on its workers, and leaves the client open."""
    with dj.Cluster(), dj.Job(name="count") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(n=np.int64(0)), name="init")
        dj.Task(lambda ws: ws.update(n=ws["n"] + 1, pid=os.getpid()), name="count")
        counted = dj.final_output(["n", "pid"])
        dj.epoch_limiter(job, 3)
    assert dj.JobRunner(job, progress=False).train(client) == 3
    n, pid = counted.fetch()
    assert (int(n), int(pid)) == (3, worker_pids(client)["a"])
    assert client.status == "running"


def test_dashboard_link_is_logged_shown_and_serves_the_status_page(cluster, caplog):
    """Every session start logs the dashboard link (INFO, logger daskjobs); repr and _repr_html_
    show it; the link serves Dask's real status page (bokeh installed), not "Dask needs bokeh"."""
    import urllib.request

    with caplog.at_level("INFO", logger="daskjobs"), dj.DaskSession(cluster) as session:
        link = session.dashboard_link
        assert link is not None
        assert link.startswith("http://127.0.0.1:")
        assert any(link in record.getMessage() for record in caplog.records if record.name == "daskjobs")
        assert link in repr(session)
        assert f'href="{link}"' in session._repr_html_()
    with urllib.request.urlopen(link, timeout=30) as response:
        assert response.status == 200
        page = response.read().decode(errors="replace")
    assert "Dask" in page
    assert "needs bokeh" not in page.lower()


def test_timeouts_survive_a_config_block_that_created_their_section():
    """A ``dask.config.set`` block entered before daskjobs' sessions were imported creates the
    ``daskjobs`` section and removes it on exit: the timeouts then fall back to their defaults
    instead of failing every later session with ``KeyError``."""
    script = textwrap.dedent(
        """
        import dask
        with dask.config.set({"daskjobs.connect-timeout": "5s"}):
            import daskjobs
            from daskjobs._config import config_timeout
            inside = config_timeout("connect-timeout")
        print(inside, config_timeout("connect-timeout"), config_timeout("straggler-timeout"))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [float(x) for x in done.stdout.split()] == [5, 30, 60]


def test_a_lost_worker_of_several_nodes_is_reported_once_for_all_of_them(tmp_path):
    """One worker serves nodes a and b and dies in a run: NodeLostError, after which both nodes run
    on their new, empty workspaces (the loss of b, which shared the worker, is not reported again)."""
    marker = tmp_path / "killed"

    def die_once(ws):
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    with dj.node_cluster({"m0": ["a", "b"]}, nthreads=2) as cluster, dj.DaskSession(cluster) as session:
        for node in ("a", "b"):
            run_steps(session, node, add_one)
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(die_once, node="a")
            dj.Task(lambda ws: time.sleep(1.0), node="b")
        with pytest.raises(NodeLostError, match="'a'"):
            session.run(group)
        session.wait_for_nodes(["a", "b"], timeout=30)
        for node in ("a", "b"):
            assert session.blobs(node) == []
            run_steps(session, node, add_one)
            assert int(session.fetch("counter", node=node)) == 1
