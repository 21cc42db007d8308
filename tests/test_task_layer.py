"""Caffe2's task layer run through every session kind: workspaces, instances, setup, reports, dataflow."""

from __future__ import annotations

import pickle
import re
import time

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import SessionClosedError, TaskFailedError

GLOBAL, PRIVATE = dj.WorkspaceType.GLOBAL, dj.WorkspaceType.PRIVATE
EMPTY = np.zeros(0, dtype=np.int64)
DEADLINE = 10.0


def append(ws, name, value):
    """Append ``value`` to the int array blob ``name`` under the node lock."""
    with ws.lock:
        ws[name] = np.append(ws[name], np.int64(value))


def wait_until(predicate, deadline=DEADLINE):
    """Spin until ``predicate()`` is true; return whether it became true before the deadline."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.002)
    return False


# -- GLOBAL and PRIVATE visibility -------------------------------------------------------------------


def test_global_group_new_blobs_persist(session):
    """New blobs of a GLOBAL run stay in the node's workspace for later runs."""

    def create(ws):
        ws["g"] = 1
        ws["h"] = np.arange(3)

    def read(ws):
        ws["sum"] = ws["g"] + ws["h"].sum()

    with dj.TaskGroup(GLOBAL) as first, dj.Node("a"):
        dj.Task(create)
    with dj.TaskGroup(GLOBAL) as second, dj.Node("a"):
        dj.Task(read)
    session.run(first)
    session.run(second)
    assert session.blobs("a") == ["g", "h", "sum"]
    assert session.fetch("h", node="a").tolist() == [0, 1, 2]
    assert session.fetch("sum", node="a") == 4


def test_private_group_new_blobs_vanish_existing_writes_persist(session):
    """A PRIVATE run's new blobs vanish, its writes to existing blobs persist, and its outputs stay fetchable."""
    session.feed("g", 1, node="a")

    def work(ws):
        ws["g"] = ws["g"] + 1
        ws["p"] = 3
        ws["q"] = ws["p"] * 10

    def check(ws):
        ws["g"] = ws["g"] * 100 + int("p" in ws) * 10 + int("q" in ws)

    with dj.TaskGroup(PRIVATE) as group, dj.Node("a"):
        task = dj.Task(work, outputs="q")
    session.run(group)
    assert session.blobs("a") == ["g"]
    assert session.fetch("g", node="a") == 2
    assert task.outputs()[0].fetch() == 30
    with dj.TaskGroup(PRIVATE) as later, dj.Node("a"):
        dj.Task(check)
    session.run(later)
    assert session.fetch("g", node="a") == 200


def test_untyped_group_runs_private(session):
    """A group with no type runs PRIVATE, so its new blobs vanish."""
    session.feed("kept", 0, node="b")

    def work(ws):
        ws["kept"] = 5
        ws["gone"] = 6

    with dj.TaskGroup() as group, dj.Node("b"):
        dj.Task(work)
    session.run(group)
    assert group.workspace_type() is PRIVATE
    assert session.blobs("b") == ["kept"]
    assert session.fetch("kept", node="b") == 5


@pytest.mark.parametrize(("workspace_type", "expected"), [(PRIVATE, 0), (GLOBAL, 1)])
def test_private_tasks_do_not_share_new_blobs(session, workspace_type, expected):
    """Two PRIVATE tasks on one node cannot see each other's new blobs; two GLOBAL tasks can."""
    session.feed("flag", 0, node="a")
    session.feed("saw", -1, node="a")

    def writer(ws):
        ws["only_writer"] = 1
        with ws.lock:
            ws["flag"] = 1

    def reader(ws):
        wait_until(lambda: int(ws["flag"]) == 1)
        ws["saw"] = int("only_writer" in ws)

    with dj.TaskGroup(workspace_type) as group, dj.Node("a"):
        dj.Task(writer)
        dj.Task(reader)
    session.run(group)
    assert session.fetch("saw", node="a") == expected


def test_nodes_have_separate_workspaces(session):
    """A blob created on one node is not visible on another."""
    session.feed("x", 1, node="a")
    session.feed("seen", -1, node="b")

    def look(ws):
        ws["seen"] = int("x" in ws)

    with dj.Node("b"):
        session.run(look)
    assert session.fetch("seen", node="b") == 0
    assert session.blobs("a") == ["x"]
    assert session.blobs("b") == ["seen"]


def test_output_is_snapshot_at_task_end(session):
    """A TaskOutput keeps the value captured when its task finished, even after the blob changes."""

    def set_one(ws):
        ws["x"] = np.array([1, 1])

    def set_two(ws):
        ws["x"] = np.array([2, 2])

    with dj.TaskGroup(GLOBAL) as group, dj.Node("a"):
        task = dj.Task(set_one, outputs="x")
    session.run(group)
    with dj.Node("a"):
        session.run(set_two)
    assert task.outputs()[0].fetch().tolist() == [1, 1]
    assert session.fetch("x", node="a").tolist() == [2, 2]
    fetched = task.outputs()[0].fetch()
    fetched[0] = 7  # a copy: the snapshot stays as captured
    assert task.outputs()[0].fetch().tolist() == [1, 1]


def test_outputs_and_output_list_after_run(session):
    """Single-name outputs fetch one array, multi-name outputs a list, and output_list flattens them."""

    def work(ws):
        ws["a"] = 1
        ws["b"] = 2.5
        ws["c"] = np.array([True, False])

    with dj.TaskGroup() as group, dj.Node("trainer_0"):
        task = dj.Task(work, outputs="a")
        pair = task.add_output(["b", "c"])
    session.run(group)
    single = task.outputs()[0].fetch()
    assert isinstance(single, np.ndarray)
    assert single == 1
    first, second = pair.fetch()
    assert (float(first), second.tolist()) == (2.5, [True, False])
    flat = task.output_list().fetch()
    assert [v.tolist() for v in flat] == [1, 2.5, [True, False]]


def test_missing_output_blob_fails_task(session):
    """A task whose declared output does not exist when it finishes fails naming the blob."""
    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(lambda ws: None, outputs="never", name="lazy")
    with pytest.raises(TaskFailedError, match="'never'") as info:
        session.run(group)
    assert info.value.task == "a/lazy"
    assert isinstance(info.value.__cause__, KeyError)


# -- multiple instances --------------------------------------------------------------------------------


def counter_init(ws):
    ws["n"] = 0
    ws["ids"] = EMPTY


def count(ws):
    with ws.lock:
        ws["n"] = ws["n"] + 1
        ws["ids"] = np.append(ws["ids"], np.int64(ws.instance_id))


@pytest.mark.parametrize("workspace_type", [PRIVATE, GLOBAL])
@pytest.mark.parametrize("num_instances", [1, 3, 8])
def test_instances_share_task_counter(session, num_instances, workspace_type):
    """N instances incrementing a task-level counter under the lock give exactly N, with ids 0..N-1."""
    with dj.TaskGroup(workspace_type) as group, dj.Node("a"):
        task = dj.Task(count, num_instances=num_instances, task_init=counter_init, outputs=["n", "ids"])
    session.run(group)
    n, ids = (o.fetch() for o in task.outputs())
    assert int(n) == num_instances
    assert sorted(ids.tolist()) == list(range(num_instances))


def test_instance_workspaces_are_separate(session):
    """Each instance has its own workspace: a name set by every instance keeps each instance's value."""
    instances = 4

    def task_init(ws):
        ws["arrived"] = 0
        ws["ok"] = EMPTY
        ws["leaked"] = -1

    def instance_init(ws):
        ws["mine"] = ws.instance_id

    def step(ws):
        with ws.lock:
            ws["arrived"] = ws["arrived"] + 1
        all_arrived = wait_until(lambda: int(ws["arrived"]) == instances)
        append(ws, "ok", int(all_arrived and int(ws["mine"]) == ws.instance_id))

    def task_exit(ws):
        ws["leaked"] = int("mine" in ws)

    with dj.TaskGroup(GLOBAL) as group, dj.Node("b"):
        task = dj.Task(
            step,
            num_instances=instances,
            task_init=task_init,
            instance_init=instance_init,
            task_exit=task_exit,
            outputs=["ok", "leaked"],
        )
    session.run(group)
    ok, leaked = (o.fetch() for o in task.outputs())
    assert ok.tolist() == [1] * instances
    assert leaked == 0
    assert "mine" not in session.blobs("b")
    assert session.blobs("b") == ["arrived", "leaked", "ok"]


def order_task_init(ws):
    ws["order"] = np.array([1])


def order_instance_init(ws):
    append(ws, "order", 20 + ws.instance_id)


def order_step(ws):
    append(ws, "order", 30 + ws.instance_id)


def order_instance_exit(ws):
    append(ws, "order", 40 + ws.instance_id)


def order_task_exit(ws):
    append(ws, "order", 5)


def ordered_task(num_instances):
    return dj.Task(
        order_step,
        num_instances=num_instances,
        task_init=order_task_init,
        instance_init=order_instance_init,
        instance_exit=order_instance_exit,
        task_exit=order_task_exit,
        outputs="order",
    )


def test_setup_order_single_instance(session):
    """One instance runs task_init, instance_init, step, instance_exit, task_exit in that order."""
    with dj.TaskGroup() as group, dj.Node("a"):
        task = ordered_task(None)
    session.run(group)
    assert task.outputs()[0].fetch().tolist() == [1, 20, 30, 40, 5]


def test_setup_order_many_instances(session):
    """task_init runs once before all instances, task_exit once after all, and instances run their layers in order."""
    with dj.TaskGroup() as group, dj.Node("a"):
        task = ordered_task(3)
    session.run(group)
    order = task.outputs()[0].fetch().tolist()
    assert len(order) == 11
    assert order[0] == 1
    assert order[-1] == 5
    assert sorted(order[1:-1]) == [20, 21, 22, 30, 31, 32, 40, 41, 42]
    for i in range(3):
        positions = [order.index(layer + i) for layer in (20, 30, 40)]
        assert positions == sorted(positions)


def test_local_setup_runs_once_per_node_per_run(session):
    """Node-local setup runs once per node before and after all of that node's tasks, in every run."""
    for node in ("a", "b"):
        session.feed("log", EMPTY, node=node)

    def local_init(ws):
        append(ws, "log", 1)

    def local_exit(ws):
        append(ws, "log", 9)

    def slow(ws):
        time.sleep(0.05)
        append(ws, "log", 5)

    def fast(ws):
        append(ws, "log", 5)

    with dj.TaskGroup() as group:
        with dj.Node("a"):
            dj.Task(slow)
            dj.Task(fast)
        with dj.Node("b"):
            dj.Task(fast)
    setup = dj.SetupNets(local_init, [local_exit])
    group.add_local_setup(setup, node="a")
    group.add_local_setup(setup, node="b")
    session.run(group)
    session.run(group)
    assert session.fetch("log", node="a").tolist() == [1, 5, 5, 9, 1, 5, 5, 9]
    assert session.fetch("log", node="b").tolist() == [1, 5, 9, 1, 5, 9]


def test_local_setup_blobs_shared_by_private_tasks(session):
    """Blobs created by node-local init are seen by every PRIVATE task of that node and vanish after the run."""
    session.feed("seen", EMPTY, node="a")

    def local_init(ws):
        ws["shared"] = 7

    def use(ws):
        append(ws, "seen", ws["shared"])

    def local_exit(ws):
        append(ws, "seen", ws["shared"] * 10)

    with dj.TaskGroup(PRIVATE) as group, dj.Node("a"):
        dj.Task(use)
        dj.Task(use)
    group.add_local_setup(dj.SetupNets(local_init, local_exit), node="a")
    session.run(group)
    assert session.fetch("seen", node="a").tolist() == [7, 7, 70]
    assert session.blobs("a") == ["seen"]


# -- report steps ----------------------------------------------------------------------------------------


def report_done(ws):
    append(ws, "reports", ws["done"])


def finish_after(seconds):
    def finish(ws):
        time.sleep(seconds)
        with ws.lock:
            ws["done"] = ws["done"] + 1

    return finish


def feed_report_blobs(session, node):
    session.feed("reports", EMPTY, node=node)
    session.feed("done", 0, node=node)


def test_report_step_short_run_runs_once_at_end(session):
    """A run shorter than the report interval sees exactly one report, after the node's tasks."""
    feed_report_blobs(session, "a")
    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(finish_after(0.02))
    group.report_step(report_done, node=dj.Node("a"), interval_ms=10_000)
    session.run(group)
    assert session.fetch("reports", node="a").tolist() == [1]


def test_report_step_long_run_runs_periodically(session):
    """A run longer than the report interval sees several reports, the last one after the tasks finished."""
    feed_report_blobs(session, "a")
    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(finish_after(0.4))
    group.report_step(report_done, node="a", interval_ms=20)
    session.run(group)
    reports = session.fetch("reports", node="a").tolist()
    assert len(reports) >= 3
    assert reports[0] == 0
    assert reports[-1] == 1


def test_report_step_waits_for_all_tasks_of_its_node(session):
    """The final report of a node runs after every task of that node finished, and once per node."""
    for node in ("a", "b"):
        feed_report_blobs(session, node)
    with dj.TaskGroup() as group:
        with dj.Node("a"):
            dj.Task(finish_after(0.01))
            dj.Task(finish_after(0.15))
        with dj.Node("b"):
            dj.Task(finish_after(0.0))
    group.report_step(report_done, node="a", interval_ms=10_000)
    group.report_step(report_done, node="b", interval_ms=10_000)
    session.run(group)
    assert session.fetch("reports", node="a").tolist() == [2]
    assert session.fetch("reports", node="b").tolist() == [1]


# -- concurrency -------------------------------------------------------------------------------------


@pytest.mark.parametrize("workspace_type", [PRIVATE, GLOBAL])
def test_tasks_of_one_node_run_concurrently(session, workspace_type):
    """Two tasks on one node that each wait for the other's flag both see it, so they run at the same time."""
    for name in ("flag_first", "flag_second", "saw_first", "saw_second"):
        session.feed(name, 0, node="a")

    def meet(me, other):
        def step(ws):
            with ws.lock:
                ws[f"flag_{me}"] = 1
            ws[f"saw_{me}"] = int(wait_until(lambda: int(ws[f"flag_{other}"]) == 1))

        return step

    with dj.TaskGroup(workspace_type) as group, dj.Node("a"):
        dj.Task(meet("first", "second"), name="first")
        dj.Task(meet("second", "first"), name="second")
    session.run(group)
    assert session.fetch("saw_first", node="a") == 1
    assert session.fetch("saw_second", node="a") == 1


@pytest.mark.parametrize("edge", ["same-node", "other-node"])
def test_tasks_of_one_node_run_concurrently_in_a_group_with_edges(session, edge):
    """Five tasks on node a meet (each waits for all five) in a group with a dataflow edge: an edge
    into one of them, or between two tasks of node b. More tasks than the worker has threads."""

    def arrive(ws):
        with ws.lock:
            ws["arrived"] = ws["arrived"] + 1
        if wait_until(lambda: int(ws["arrived"]) == 5):
            with ws.lock:
                ws["met"] = ws["met"] + 1

    session.feed("arrived", 0, node="a")
    session.feed("met", 0, node="a")
    with dj.TaskGroup(GLOBAL) as group:
        with dj.Node("b"):
            produced = dj.Task(lambda ws: ws.__setitem__("x", 1), outputs="x").outputs()[0]
            if edge == "other-node":
                dj.Task(lambda ws: None, inputs={"x": produced})
        with dj.Node("a"):
            for i in range(5):
                dj.Task(arrive, name=f"arrive{i}", inputs={"x": produced} if edge == "same-node" and i == 0 else None)
    session.run(group)
    assert session.fetch("met", node="a") == 5


def test_instances_run_concurrently(session):
    """All instances of a task run at the same time: each sees every instance arrive."""

    def task_init(ws):
        ws["arrived"] = 0
        ws["met"] = 0

    def step(ws):
        with ws.lock:
            ws["arrived"] = ws["arrived"] + 1
        if wait_until(lambda: int(ws["arrived"]) == 5):
            with ws.lock:
                ws["met"] = ws["met"] + 1

    with dj.TaskGroup() as group, dj.Node("c"):
        task = dj.Task(step, num_instances=5, task_init=task_init, outputs="met")
    session.run(group)
    assert task.outputs()[0].fetch() == 5


# -- dataflow inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workspace_type", [PRIVATE, GLOBAL])
def test_inputs_across_nodes(session, workspace_type):
    """A consumer finds a producer's output from another node under its local name, after the producer ran."""

    def produce(ws):
        time.sleep(0.05)
        ws["x"] = np.arange(4) * 3

    def consume(ws):
        ws["y"] = ws["x_in"] + 1

    with dj.TaskGroup(workspace_type) as group:
        producer = dj.Task(produce, node="a", outputs="x")
        consumer = dj.Task(consume, node="b", outputs="y", inputs={"x_in": producer.outputs()[0]})
    session.run(group)
    assert consumer.outputs()[0].fetch().tolist() == [1, 4, 7, 10]
    assert producer.outputs()[0].fetch().tolist() == [0, 3, 6, 9]


def test_inputs_chain_back_to_first_node(session):
    """A chain a -> b -> a carries values through both nodes in order, alongside an unrelated task."""

    def start(ws):
        ws["x"] = 2

    def times_ten(ws):
        ws["y"] = ws["x_in"] * 10

    def plus_one(ws):
        ws["z"] = ws["y_in"] + 1

    def unrelated(ws):
        ws["u"] = 5

    with dj.TaskGroup(GLOBAL) as group:
        first = dj.Task(start, node="a", outputs="x")
        middle = dj.Task(times_ten, node="b", outputs="y", inputs={"x_in": first.outputs()[0]})
        last = dj.Task(plus_one, node="a", outputs="z", inputs={"y_in": middle.outputs()[0]})
        dj.Task(unrelated, node="c")
    session.run(group)
    assert [int(t.outputs()[0].fetch()) for t in (first, middle, last)] == [2, 20, 21]
    assert session.fetch("u", node="c") == 5
    assert session.fetch("z", node="a") == 21


def test_inputs_group_runs_again(session):
    """A group with inputs can run several times, each run carrying fresh values."""
    session.feed("count", 0, node="a")

    def produce(ws):
        ws["count"] = ws["count"] + 1
        ws["v"] = ws["count"] * 1

    def consume(ws):
        ws["w"] = ws["v_in"] * 100

    with dj.TaskGroup() as group:
        producer = dj.Task(produce, node="a", outputs="v")
        consumer = dj.Task(consume, node="b", outputs="w", inputs={"v_in": producer.outputs()[0]})
    values = []
    for _ in range(3):
        session.run(group)
        values.append(int(consumer.outputs()[0].fetch()))
    assert values == [100, 200, 300]


# -- step-less output tasks ---------------------------------------------------------------------------


@pytest.mark.parametrize("workspace_type", [PRIVATE, GLOBAL])
def test_stepless_output_reads_after_other_tasks(session, workspace_type):
    """A step-less output task reads its blob from the node workspace after the node's other tasks finished."""

    def late(ws):
        time.sleep(0.1)
        ws["late"] = 7

    def early(ws):
        ws["early"] = 1

    with dj.TaskGroup(workspace_type) as group, dj.Node("a"):
        dj.Task(late)
        output = dj.final_output("late")
        dj.Task(early)
    session.run(group)
    assert output.fetch() == 7


def test_stepless_output_reads_existing_global_blob(session):
    """A step-less output task returns a blob already in the node's GLOBAL workspace."""
    session.feed("existing", np.array([4, 5]), node="ps")
    with dj.TaskGroup() as group, dj.Node("ps"):
        output = dj.final_output("existing")
    session.run(group)
    assert output.fetch().tolist() == [4, 5]


# -- workspace attributes ---------------------------------------------------------------------------


def test_ws_node_and_epoch_outside_epochs(session):
    """A step sees its node's name as ws.node and None as ws.epoch outside epoch runs."""

    def record(ws):
        ws["is_b"] = ws.node == "b"
        ws["epoch"] = -1 if ws.epoch is None else ws.epoch
        ws["instance"] = ws.instance_id

    with dj.Node("b"):
        session.run(record)
    assert session.fetch("is_b", node="b") == np.True_
    assert session.fetch("epoch", node="b") == -1
    assert session.fetch("instance", node="b") == 0


# -- session API ---------------------------------------------------------------------------------------


def test_run_callable_list_and_task(session):
    """session.run accepts a callable, a list of callables run in order, and a Task, all GLOBAL."""

    def one(ws):
        ws["x"] = 1

    def times_ten(ws):
        ws["x"] = ws["x"] * 10

    def plus_two(ws):
        ws["x"] = ws["x"] + 2

    with dj.Node("trainer_1"):
        session.run(one)
        session.run([times_ten, plus_two])
        task = dj.Task(times_ten, outputs="x")
    session.run(task)
    assert session.fetch("x", node="trainer_1") == 120
    assert task.outputs()[0].fetch() == 120
    assert task.workspace_type() is GLOBAL


def test_run_rejects_non_runnables(session):
    """session.run with None or a non-callable raises ValueError."""
    with pytest.raises(ValueError, match="None"):
        session.run(None)
    with pytest.raises(ValueError, match="cannot run"):
        session.run(42)


def test_feed_fetch_blobs(session):
    """feed stores a copy, fetch returns a copy, and blobs lists sorted names per node."""
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    session.feed("w", value, node="a")
    session.feed("s", 3, node="a")
    session.feed("other", True, node="b")
    value[0, 0] = 99
    fetched = session.fetch("w", node="a")
    assert fetched.dtype == np.float32
    assert fetched.tolist() == [[0, 1, 2], [3, 4, 5]]
    fetched[0, 0] = -1
    assert session.fetch("w", node="a")[0, 0] == 0
    scalar = session.fetch("s", node="a")
    assert (scalar.shape, scalar.dtype, int(scalar)) == ((), np.dtype(np.int64), 3)
    assert session.blobs("a") == ["s", "w"]
    assert session.blobs(dj.Node("b")) == ["other"]


def test_feed_fetch_errors(session):
    """Feeding a bad dtype or name and fetching a missing blob raise TypeError, ValueError and KeyError."""
    with pytest.raises(TypeError, match="'t'"):
        session.feed("t", {"text"}, node="a")
    with pytest.raises(ValueError, match="'a/b'"):
        session.feed("a/b", 1, node="a")
    with pytest.raises(ValueError, match=re.escape("'../n'")):
        session.feed("x", 1, node="../n")
    session.feed("x", 1, node="a")
    with pytest.raises(KeyError, match="'missing'"):
        session.fetch("missing", node="a")
    assert session.blobs("a") == ["x"]


def test_fetch_without_node_needs_one_node(session):
    """fetch, feed and blobs without a node raise ValueError when the session has several nodes."""
    session.feed("x", 1, node="a")
    session.feed("x", 2, node="b")
    with pytest.raises(ValueError, match="name the node"):
        session.fetch("x")
    with pytest.raises(ValueError, match="name the node"):
        session.blobs()
    with pytest.raises(ValueError, match="name the node"):
        session.feed("y", 1)


def test_fetch_without_node_single_node_local_session():
    """A LocalSession that has used one node lets fetch, feed and blobs omit it."""
    with dj.LocalSession() as session:
        with dj.Node("trainer_2"):
            session.run(lambda ws: ws.__setitem__("x", 5))
        assert session.nodes() == ["trainer_2"]
        assert session.fetch("x") == 5
        session.feed("y", 6)
        assert session.blobs() == ["x", "y"]
        assert session.fetch("y", node="trainer_2") == 6


def test_closed_session_raises(session):
    """Every use of a closed session raises SessionClosedError; closing twice is fine."""
    session.feed("x", 1, node="a")
    assert session.is_open() is True
    session.close()
    assert session.is_open() is False
    session.close()
    with pytest.raises(SessionClosedError):
        session.run(lambda ws: None)
    with pytest.raises(SessionClosedError):
        session.fetch("x", node="a")
    with pytest.raises(SessionClosedError):
        session.feed("x", 2, node="a")
    with pytest.raises(SessionClosedError):
        session.blobs("a")
    with pytest.raises(SessionClosedError), session:
        pass


def test_session_context_manager_closes():
    """Leaving a session's with block closes it."""
    with dj.LocalSession() as session:
        assert session.is_open()
    assert session.is_open() is False


# -- failures ---------------------------------------------------------------------------------------------


def explode(ws):
    value = 42
    raise ValueError(f"kaboom {value}")  # the line the traceback must show


def test_task_failed_error_names_everything(session):
    """A raising step gives TaskFailedError naming job, group, node and task, chaining the user's exception."""
    with dj.TaskGroup() as group:
        dj.Task(explode, node="b")
        dj.Task(lambda ws: None, node="a")
    with pytest.raises(TaskFailedError) as info:
        session.run(group)
    error = info.value
    where = (error.job, error.group, error.node, error.task, error.epoch)
    assert where == ("session", group.label, "b", "b/explode", None)
    assert str(error) == (
        f"task 'b/explode' failed in the {group.label} group of job 'session' on node 'b': ValueError: kaboom 42"
    )
    assert isinstance(error.__cause__, ValueError)
    assert type(error) is TaskFailedError  # a user's own ValueError: never caught by `except ValueError`
    assert str(error.__cause__) == "kaboom 42"
    assert 'raise ValueError(f"kaboom {value}")  # the line the traceback must show' in error.remote_traceback
    assert "in explode" in error.remote_traceback


def test_task_failed_error_pickles(session):
    """A TaskFailedError from a run survives pickling with its fields, cause and traceback."""
    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(explode)
    with pytest.raises(TaskFailedError) as info:
        session.run(group)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is TaskFailedError
    assert str(copy) == str(info.value)
    assert (copy.job, copy.group, copy.node, copy.task, copy.epoch) == ("session", group.label, "a", "a/explode", None)
    assert copy.remote_traceback == info.value.remote_traceback
    assert type(copy.__cause__) is ValueError
    assert str(copy.__cause__) == "kaboom 42"


def raise_in(where):
    def fail(ws):
        raise RuntimeError(f"failed in {where}")

    return fail


@pytest.mark.parametrize(
    ("where", "task_name"),
    [
        ("task_init", "a/work"),
        ("instance_init", "a/work"),
        ("step", "a/work"),
        ("instance_exit", "a/work"),
        ("task_exit", "a/work"),
        ("local_init", "a/local_init"),
        ("local_exit", "a/local_exit"),
        ("report", "a/report_step"),
    ],
)
@pytest.mark.parametrize("num_instances", [1, 2])
def test_failure_anywhere_raises_task_failed_error(session, where, task_name, num_instances):
    """A raising task layer, node-local setup or report step raises TaskFailedError naming where it failed."""
    hooks = {key: raise_in(where) if key == where else None for key in ("task_init", "instance_init", "task_exit")}
    hooks["instance_exit"] = raise_in(where) if where == "instance_exit" else None

    def work(ws):
        if where == "step":
            raise RuntimeError("failed in step")

    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(work, num_instances=num_instances, **hooks)
    if where in ("local_init", "local_exit"):
        setup = dj.SetupNets(raise_in(where)) if where == "local_init" else dj.SetupNets(exit_nets=raise_in(where))
        group.add_local_setup(setup, node="a")
    if where == "report":
        group.report_step(raise_in(where), node="a", interval_ms=10_000)
    with pytest.raises(TaskFailedError, match=f"failed in {where}") as info:
        session.run(group)
    assert info.value.task == task_name
    assert info.value.node == "a"
    assert str(info.value.__cause__) == f"failed in {where}"


def test_session_usable_after_failure(session):
    """After a failed run the session runs further groups and keeps earlier blobs."""
    session.feed("x", 1, node="a")
    with dj.TaskGroup() as group:
        producer = dj.Task(explode, node="a", outputs="never")
        dj.Task(lambda ws: None, node="b", inputs={"v": producer.outputs()[0]})
    with pytest.raises(TaskFailedError):
        session.run(group)

    def bump(ws):
        ws["x"] = ws["x"] + 1

    with dj.Node("a"):
        session.run(bump)
    assert session.fetch("x", node="a") == 2


def test_failing_report_step_stops_other_report_steps(session):
    """When a report step fails, every report step of the run stops with it."""
    session.feed("ticks", EMPTY, node="a")

    def tick(ws):
        append(ws, "ticks", 1)

    def slow(ws):
        time.sleep(0.1)

    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(slow)
    group.report_step(raise_in("report"), node="a", interval_ms=10)
    group.report_step(tick, node="a", interval_ms=10)
    with pytest.raises(TaskFailedError, match="failed in report"):
        session.run(group)
    after_run = session.fetch("ticks", node="a").size
    time.sleep(0.15)
    assert session.fetch("ticks", node="a").size == after_run


def test_task_failure_wins_over_report_failure(session):
    """When both a task and a report step fail, the error names the task."""

    def work(ws):
        time.sleep(0.1)
        raise RuntimeError("failed in work")

    with dj.TaskGroup() as group, dj.Node("a"):
        dj.Task(work)
    group.report_step(raise_in("report"), node="a", interval_ms=10)
    with pytest.raises(TaskFailedError, match="failed in work") as info:
        session.run(group)
    assert info.value.task == "a/work"


def test_inputs_are_private_copies(session):
    """Consumers modifying an input in place affect neither the producer's output nor each other."""

    def produce(ws):
        ws["x"] = np.arange(3)

    def consume(ws):
        time.sleep(0.02)
        x = ws["x_in"]
        x += 1
        ws["x_in"] = x

    with dj.TaskGroup() as group:
        producer = dj.Task(produce, node="a", outputs="x")
        consumers = [
            dj.Task(consume, node="b", outputs="x_in", inputs={"x_in": producer.outputs()[0]}) for _ in range(2)
        ]
    session.run(group)
    assert producer.outputs()[0].fetch().tolist() == [0, 1, 2]
    assert [c.outputs()[0].fetch().tolist() for c in consumers] == [[1, 2, 3], [1, 2, 3]]


@pytest.mark.parametrize("workspace_type", [PRIVATE, GLOBAL])
def test_instance_creates_output_blob(session, workspace_type):
    """An output blob first created inside one instance is captured as the task's output."""

    def step(ws):
        if ws.instance_id == 1:
            ws["result"] = np.array([ws.instance_id, 10])

    with dj.TaskGroup(workspace_type) as group, dj.Node("a"):
        task = dj.Task(step, num_instances=3, outputs="result")
    session.run(group)
    assert task.outputs()[0].fetch().tolist() == [1, 10]


def test_to_task_runs_every_task_on_one_node(session):
    """The task from to_task runs all of the group's tasks on the chosen node and captures all outputs."""

    def make_u(ws):
        ws["u"] = 1

    def make_v(ws):
        ws["v"] = 2

    with dj.TaskGroup(GLOBAL) as group:
        dj.Task(make_u, node="a", outputs="u")
        dj.Task(make_v, node="b", outputs="v")
    merged = group.to_task("c")
    session.run(merged)
    assert session.blobs("c") == ["u", "v"]
    assert [int(o.fetch()) for o in merged.outputs()] == [1, 2]


def test_to_task_of_only_stepless_tasks_reads_the_node_workspace(session):
    """A merged task whose tasks are all step-less captures their blobs from the node workspace."""
    session.feed("u", 5, node="c")
    with dj.TaskGroup(GLOBAL) as group:
        dj.final_output("u")
    merged = group.to_task("c")
    session.run(merged)
    assert [int(o.fetch()) for o in merged.outputs()] == [5]
