"""The pure job model: contexts, nodes, names, tasks, outputs, groups and jobs (no session)."""

from __future__ import annotations

import re
import threading

import pytest

import daskjobs as dj
from daskjobs._model.context import Managed
from daskjobs.errors import InvalidStateError, JobDefinitionError, OutputNotReadyError

BAD_NAMES = ["", "../x", "..", ".", "/abs", "a/b", "a\\b", "__x", "x" * 129, "a\x00b", "a b", "a,b", "a=b"]
GOOD_NAMES = ["a", "Z", "0", "trainer_0", "a-b.c:d", "a.b", "x__", "_x", "x" * 128, "a.", ".a"]


def noop(ws):
    """A step that does nothing."""


def other_step(ws):
    """Another step that does nothing."""


def bad_name_error(name: str) -> str:
    return re.escape(repr(name))


# -- context machinery -------------------------------------------------------------------------


class Ctx(Managed):
    """A managed class without a default, for context tests."""

    def __init__(self, label: object = None) -> None:
        self.label = label


class SubCtx(Ctx):
    """A subclass of Ctx, for hierarchy tests."""


class OtherCtx(Managed):
    """A managed class unrelated to Ctx."""


class DefaultCtx(Managed):
    """A default-managed class, for default-on-demand tests."""

    _managed_default = True


def test_context_threads_do_not_interfere():
    """Eight threads enter and exit their own contexts many times without seeing each other's."""
    errors: list[str] = []
    start = threading.Barrier(8)

    def worker(i: int) -> None:
        start.wait(timeout=30)
        for outer in range(100):
            with Ctx((i, outer)) as mine:
                for inner in range(30):
                    with Ctx((i, outer, inner)) as nested:
                        if Ctx.current() is not nested:
                            errors.append(f"thread {i}: inner context lost")
                    if Ctx.current() is not mine:
                        errors.append(f"thread {i}: outer context lost")
        if Ctx.current(required=False) is not None:
            errors.append(f"thread {i}: stack not empty at the end")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert Ctx.current(required=False) is None


def test_context_current_without_default():
    """A class without a default raises RuntimeError when none is active, or returns None when not required."""
    with pytest.raises(RuntimeError, match="no active Ctx"):
        Ctx.current()
    assert Ctx.current(required=False) is None
    with Ctx("x") as ctx:
        assert Ctx.current() is ctx
    assert Ctx.current(required=False) is None


def test_context_default_created_on_demand_and_kept():
    """A default-managed class creates one default instance on demand and keeps returning it."""
    first = DefaultCtx.current()
    assert isinstance(first, DefaultCtx)
    assert DefaultCtx.current() is first
    with DefaultCtx() as explicit:
        assert DefaultCtx.current() is explicit
    assert DefaultCtx.current() is first


def test_context_nested_classes_are_independent():
    """Contexts of unrelated classes nest without affecting each other."""
    with Ctx("a") as a:
        with OtherCtx() as o:
            assert Ctx.current() is a
            assert OtherCtx.current() is o
            with Ctx("b") as b:
                assert Ctx.current() is b
                assert OtherCtx.current() is o
            assert Ctx.current() is a
        assert OtherCtx.current(required=False) is None


def test_context_subclass_counts_as_parent():
    """An entered subclass instance is current for its base class too."""
    with SubCtx("s") as sub:
        assert Ctx.current() is sub
        assert SubCtx.current() is sub
        with Ctx("base") as base:
            assert Ctx.current() is base
            assert SubCtx.current() is sub
    assert Ctx.current(required=False) is None


def test_context_current_with_value_checks_type():
    """current(value) returns a value of the right class and raises TypeError otherwise."""
    ctx = Ctx()
    assert Ctx.current(ctx) is ctx
    assert Ctx.current(SubCtx()) is not None
    with pytest.raises(TypeError, match="expected a Ctx, got OtherCtx"):
        Ctx.current(OtherCtx())


def test_context_exit_out_of_order_raises():
    """Exiting a context that is not the innermost one raises RuntimeError."""
    caught: list[BaseException] = []

    def corrupt() -> None:  # in its own thread, so the damaged stack is thrown away with it
        outer, inner = Ctx("outer"), Ctx("inner")
        outer.__enter__()
        inner.__enter__()
        try:
            outer.__exit__(None, None, None)
        except RuntimeError as exc:
            caught.append(exc)

    thread = threading.Thread(target=corrupt)
    thread.start()
    thread.join(timeout=10)
    assert len(caught) == 1
    assert "context stack of Ctx corrupted" in str(caught[0])


# -- Cluster and Node --------------------------------------------------------------------------


def test_cluster_records_nodes_in_first_use_order():
    """A cluster records node names once each, in first-use order."""
    with dj.Cluster() as cluster:
        dj.Node("b")
        dj.Node("a")
        dj.Node("b")
        dj.Node("c")
    assert cluster.nodes() == ["b", "a", "c"]
    assert cluster.node_kwargs() == {"b": {}, "a": {}, "c": {}}


def test_cluster_kwargs_merge_earlier_wins():
    """On a repeated node name the earlier keyword arguments win and new keys are added."""
    with dj.Cluster() as cluster:
        dj.Node("trainer_0", GPU=1)
        dj.Node("trainer_0", GPU=2, CPU=4)
    assert cluster.node_kwargs() == {"trainer_0": {"GPU": 1, "CPU": 4}}
    assert repr(cluster) == "Cluster(nodes=['trainer_0'], node_kwargs={'trainer_0': {'GPU': 1, 'CPU': 4}})"


def test_cluster_node_kwargs_returns_copies():
    """Mutating the result of node_kwargs does not change the cluster."""
    with dj.Cluster() as cluster:
        dj.Node("a", GPU=1)
    cluster.node_kwargs()["a"]["GPU"] = 5
    assert cluster.node_kwargs() == {"a": {"GPU": 1}}


def test_node_identity_is_its_name():
    """A node's str is its name and its kwargs are the extra resources."""
    node = dj.Node("trainer_1", GPU=2)
    assert str(node) == "trainer_1"
    assert node.name == "trainer_1"
    assert node.kwargs() == {"GPU": 2}
    assert repr(node) == "Node('trainer_1', GPU=2)"
    assert str(dj.Node()) == "local"


def test_nodes_with_the_same_name_are_equal():
    """Nodes are equal (and hash alike) by name only, also to their name as a str, and differ otherwise."""
    first, second = dj.Node("a"), dj.Node("a", GPU=1)
    assert first == second
    assert hash(first) == hash(second) == hash("a")
    assert len({first, second}) == 1
    assert first == "a"
    assert "a" in [first]
    assert first in ["a"]
    assert {"a": 1}[second] == 1
    assert first != dj.Node("b")
    assert first != "b"
    assert first != 1
    assert dj.Node() == dj.Node.current() == "local"


def test_node_registers_with_current_cluster(fresh_cluster):
    """Constructing a node registers it with the current cluster."""
    dj.Node("ps")
    assert fresh_cluster.nodes() == ["ps"]


def test_node_current_default_is_local():
    """Node.current() is the innermost active node, and a node named local when none is active."""
    assert str(dj.Node.current()) == "local"
    with dj.Node("a") as a:
        assert dj.Node.current() is a
        with dj.Node("b"):
            assert str(dj.Node.current()) == "b"
        assert dj.Node.current() is a
    assert str(dj.Node.current()) == "local"


@pytest.mark.parametrize("value", [0, -1, "1", True, None])
def test_node_rejects_bad_resources(value):
    """A node resource that is not a positive number raises ValueError naming it."""
    with pytest.raises(ValueError, match="GPU"):
        dj.Node("a", GPU=value)


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_node_name(bad):
    """A bad node name raises ValueError naming it, and the node is not registered."""
    with dj.Cluster() as cluster, pytest.raises(ValueError, match=bad_name_error(bad)):
        dj.Node(bad)
    assert cluster.nodes() == []


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_output_blob_name(bad):
    """A bad blob name in a task's outputs raises ValueError naming it at construction, registering nothing."""
    with dj.TaskGroup() as group, pytest.raises(ValueError, match=bad_name_error(bad)):
        dj.Task(noop, outputs=["ok", bad])
    assert group.num_registered_tasks() == 0


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_blob_name_in_add_output_and_final_output(bad):
    """add_output, TaskOutput and final_output reject a bad blob name with ValueError naming it."""
    with dj.TaskGroup():
        task = dj.Task(noop)
        with pytest.raises(ValueError, match=bad_name_error(bad)):
            task.add_output(bad)
        with pytest.raises(ValueError, match=bad_name_error(bad)):
            dj.TaskOutput(bad)
        with task, pytest.raises(ValueError, match=bad_name_error(bad)):
            dj.final_output(bad)
    assert task.outputs() == []
    with dj.TaskGroup() as group, pytest.raises(ValueError, match=bad_name_error(bad)):
        dj.final_output(bad)
    assert group.num_registered_tasks() == 0


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_job_name(bad):
    """A bad job name raises ValueError naming it."""
    with pytest.raises(ValueError, match=bad_name_error(bad)):
        dj.Job(name=bad)


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_names_elsewhere(bad):
    """Bad names in inputs, nodes_to_checkpoint and Task(node=...) raise ValueError naming them."""
    with dj.TaskGroup():
        producer = dj.Task(noop, outputs="x")
        with pytest.raises(ValueError, match=bad_name_error(bad)):
            dj.Task(noop, inputs={bad: producer.outputs()[0]})
        with pytest.raises(ValueError, match=bad_name_error(bad)):
            dj.Task(noop, node=bad)
    with pytest.raises(ValueError, match=bad_name_error(bad)):
        dj.Job(nodes_to_checkpoint=["a", bad])


@pytest.mark.parametrize("good", GOOD_NAMES)
def test_good_names_accepted(good):
    """Names made of allowed characters, 1 to 128 long, are accepted everywhere."""
    assert str(dj.Node(good)) == good
    assert dj.TaskOutput(good).names == [good]
    assert dj.Job(name=good).name == good


def test_bad_name_errors_are_job_definition_errors():
    """Name errors are JobDefinitionError, a DaskJobsError and a ValueError."""
    with pytest.raises(JobDefinitionError) as info:
        dj.Node("a/b")
    assert isinstance(info.value, dj.errors.DaskJobsError)
    assert isinstance(info.value, ValueError)


# -- Task ----------------------------------------------------------------------------------------


def test_task_default_names():
    """A task is named after its single step (a lambda's ``__name__`` too), else task, under its node."""
    with dj.TaskGroup() as group:
        with dj.Node("a"):
            named = dj.Task(noop)
            lam = dj.Task(lambda ws: None)
            many = dj.Task([noop, other_step])
            stepless = dj.Task()
        explicit = dj.Task(noop, name="custom", node="b")
    assert [named.name, lam.name, many.name, stepless.name, explicit.name] == [
        "a/noop",
        "a/<lambda>",
        "a/task",
        "a/task:1",
        "b/custom",
    ]
    assert [t.node for t in group.tasks()] == ["a", "a", "a", "a", "b"]


def test_task_names_made_unique_within_group():
    """Repeated task names in one group get :1, :2 suffixes, per node."""
    with dj.TaskGroup() as group:
        with dj.Node("a"):
            names = [dj.Task(noop, name="t").name for _ in range(3)]
        with dj.Node("b"):
            other = dj.Task(noop, name="t").name
    assert names == ["a/t", "a/t:1", "a/t:2"]
    assert other == "b/t"
    with dj.TaskGroup():
        assert dj.Task(noop, name="t", node="a").name == "a/t"
    assert len(group.tasks()) == 4


def test_task_names_outside_group_are_not_made_unique():
    """Tasks outside any group keep their plain names, as in Caffe2."""
    first, second = dj.Task(), dj.Task()
    assert first.name == second.name == "local/task"


def test_task_registers_in_current_group_and_node():
    """A task joins the current group on the current node, or the explicit ones."""
    group, other = dj.TaskGroup(), dj.TaskGroup()
    with group, dj.Node("ps"):
        implicit = dj.Task(noop)
        explicit = dj.Task(noop, group=other, node=dj.Node("trainer_0"))
    assert group.tasks() == [implicit]
    assert other.tasks() == [explicit]
    assert (implicit.node, explicit.node) == ("ps", "trainer_0")


def test_task_explicit_node_is_registered(fresh_cluster):
    """A task's node is registered with the current cluster."""
    dj.Task(noop, node="trainer_2")
    with dj.Node("ps"):
        dj.Task(noop)
    assert fresh_cluster.nodes() == ["trainer_2", "ps"]


def test_task_outputs_and_output_list():
    """outputs, add_output, add_outputs and output_list keep declaration order and flatten names."""
    task = dj.Task(noop, outputs=["x", "y"])
    pair = task.add_output(["p", "q"])
    more = task.add_outputs(["r", "s"])
    single = task.add_output("t")
    outputs = task.outputs()
    assert [o.names for o in outputs] == [["x"], ["y"], ["p", "q"], ["r"], ["s"], ["t"]]
    assert outputs[2] is pair
    assert outputs[3:5] == more
    assert outputs[5] is single
    assert all(o.task is task for o in outputs)
    listed = task.output_list()
    assert isinstance(listed, dj.TaskOutputList)
    assert listed.names() == ["x", "y", "p", "q", "r", "s", "t"]
    assert repr(listed) == "TaskOutputList(names=['x', 'y', 'p', 'q', 'r', 's', 't'])"
    assert dj.Task(noop, outputs="z").outputs()[0].names == ["z"]


def test_task_outputs_returns_a_copy():
    """Mutating the list returned by outputs() does not change the task."""
    task = dj.Task(noop, outputs="x")
    task.outputs().clear()
    assert [o.names for o in task.outputs()] == [["x"]]


def test_task_output_fetch_before_run():
    """Fetching a TaskOutput before its task ran raises OutputNotReadyError naming blob and task."""
    task = dj.Task(noop, outputs="x", node="a", name="producer")
    output = task.outputs()[0]
    assert output.is_ready() is False
    assert repr(output) == "TaskOutput(names=['x'], ready=False)"
    with pytest.raises(OutputNotReadyError, match=r"\['x'\] of task 'a/producer'"):
        output.fetch()
    with pytest.raises(OutputNotReadyError):
        task.output_list().fetch()
    with pytest.raises(RuntimeError):
        dj.TaskOutput("free").fetch()


def test_task_output_needs_a_name():
    """A TaskOutput with no names raises ValueError."""
    with pytest.raises(ValueError, match="at least one"):
        dj.TaskOutput([])


def test_task_rejects_bad_arguments():
    """Non-callable steps, bad workspace types and bad instance counts raise ValueError."""
    with pytest.raises(ValueError, match="callables"):
        dj.Task("not callable")
    with pytest.raises(ValueError, match="callables"):
        dj.Task([noop, 3])
    with pytest.raises(ValueError, match="task_init"):
        dj.Task(noop, task_init=[1])
    with pytest.raises(ValueError, match="WorkspaceType"):
        dj.Task(noop, workspace_type="globl")
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="num_instances"):
            dj.Task(noop, num_instances=bad)
    with pytest.raises(ValueError, match="TaskOutput"):
        dj.Task(noop, inputs={"x": "y"})
    with pytest.raises(ValueError, match="single-blob"):
        dj.Task(noop, inputs={"x": dj.TaskOutput(["p", "q"])})


def test_task_accessors():
    """A task reports its steps, instance count, workspace type and whether it has work."""
    task = dj.Task([noop, other_step], num_instances=3, workspace_type=dj.WorkspaceType.GLOBAL)
    assert task.steps == [noop, other_step]
    assert task.num_instances == 3
    assert task.workspace_type() is dj.WorkspaceType.GLOBAL
    assert task.has_work() is True
    assert dj.Task().has_work() is False
    assert dj.Task(task_exit=noop).has_work() is True
    assert dj.Task(noop).num_instances == 1
    assert dj.Task(noop).workspace_type() is None


def test_task_context_reorders_inner_tasks_first():
    """A task used as a context is moved after the tasks created inside it."""
    with dj.TaskGroup() as group:
        with dj.Task(noop, name="outer") as outer:
            inner = dj.Task(noop, name="inner")
            assert dj.Task.current() is outer
        last = dj.Task(noop, name="last")
    assert group.tasks() == [inner, outer, last]


def test_final_output_with_active_task():
    """final_output adds an output to the active Task."""
    with dj.TaskGroup() as group, dj.Task(noop, outputs="x") as task:
        output = dj.final_output("y")
    assert output.task is task
    assert [o.names for o in task.outputs()] == [["x"], ["y"]]
    assert group.tasks() == [task]


def test_final_output_without_active_task():
    """final_output without an active Task creates a step-less task on the current node in the current group."""
    with dj.TaskGroup() as group, dj.Node("ps"):
        output = dj.final_output(["loss", "acc"])
    (task,) = group.tasks()
    assert output.names == ["loss", "acc"]
    assert output.task is task
    assert task.name == "ps/task"
    assert task.steps == []
    assert task.has_work() is False


def test_final_output_without_group():
    """final_output with no Task and no group returns the output of a new group-less step-less task."""
    output = dj.final_output("x")
    assert output.names == ["x"]
    assert output.task is not None
    assert output.task.name == "local/task"


# -- TaskGroup -------------------------------------------------------------------------------------


def test_group_type_given_by_group():
    """A typed group gives its type to untyped tasks."""
    with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        task = dj.Task(noop)
    assert task.workspace_type() is None
    group.tasks()
    assert task.workspace_type() is dj.WorkspaceType.GLOBAL
    assert group.workspace_type() is dj.WorkspaceType.GLOBAL


def test_group_type_from_first_task():
    """An untyped group takes its first task's type."""
    with dj.TaskGroup() as group:
        first = dj.Task(noop, workspace_type=dj.WorkspaceType.GLOBAL)
        second = dj.Task(noop)
    group.tasks()
    assert group.workspace_type() is dj.WorkspaceType.GLOBAL
    assert first.workspace_type() is second.workspace_type() is dj.WorkspaceType.GLOBAL


def test_group_type_defaults_to_private():
    """An untyped group whose first task is untyped is PRIVATE."""
    with dj.TaskGroup() as group:
        tasks = [dj.Task(noop), dj.Task(noop, workspace_type=dj.WorkspaceType.PRIVATE)]
    assert group.workspace_type() is None
    group.tasks()
    assert group.workspace_type() is dj.WorkspaceType.PRIVATE
    assert [t.workspace_type() for t in tasks] == [dj.WorkspaceType.PRIVATE] * 2


def test_group_type_conflict_with_group():
    """A task whose type conflicts with its group's raises ValueError naming the task."""
    with dj.TaskGroup(dj.WorkspaceType.PRIVATE) as group:
        dj.Task(noop, workspace_type=dj.WorkspaceType.GLOBAL, name="g", node="a")
    with pytest.raises(ValueError, match="'a/g' is GLOBAL but its group is PRIVATE"):
        group.tasks()


def test_group_type_conflict_with_first_task():
    """A task whose type conflicts with the type the group took from its first task raises ValueError."""
    with dj.TaskGroup() as group:
        dj.Task(noop, workspace_type=dj.WorkspaceType.PRIVATE)
        dj.Task(noop, workspace_type=dj.WorkspaceType.GLOBAL, name="g", node="a")
    with pytest.raises(ValueError, match="'a/g' is GLOBAL but its group is PRIVATE"):
        group.tasks()


def test_group_type_conflict_after_untyped_first_task():
    """An untyped first task makes the group PRIVATE, so a later GLOBAL task conflicts, as in Caffe2."""
    with dj.TaskGroup() as group:
        dj.Task(noop)
        dj.Task(noop, workspace_type=dj.WorkspaceType.GLOBAL, name="g", node="a")
    with pytest.raises(ValueError, match="'a/g' is GLOBAL but its group is PRIVATE"):
        group.tasks()


def test_group_rejects_bad_workspace_type():
    """A TaskGroup with a workspace type that names no WorkspaceType raises ValueError (TypeError too for a non-str)."""
    with pytest.raises(JobDefinitionError, match="'shared' is no WorkspaceType"):
        dj.TaskGroup("shared")
    with pytest.raises(TypeError, match="WorkspaceType"):
        dj.TaskGroup(1)


def test_workspace_type_is_a_str_enum():
    """WorkspaceType members equal Caffe2's string constants, and those strings are accepted as types."""
    assert dj.WorkspaceType.GLOBAL == "global"
    assert dj.WorkspaceType.PRIVATE == "private"
    assert dj.TaskGroup("global").workspace_type() is dj.WorkspaceType.GLOBAL
    assert dj.TaskGroup("PRIVATE").workspace_type() is dj.WorkspaceType.PRIVATE
    assert dj.Task(noop, workspace_type="global").workspace_type() is dj.WorkspaceType.GLOBAL
    with dj.TaskGroup("private") as group:
        dj.Task(noop, workspace_type="global", name="g", node="a")
    with pytest.raises(ValueError, match="'a/g' is GLOBAL but its group is PRIVATE"):
        group.tasks()


def test_session_run_takes_a_workspace_type_string():
    """session.run(..., workspace_type="private") runs a callable in a PRIVATE group, so its blob vanishes."""
    with dj.LocalSession() as session:
        session.run(lambda ws: ws.__setitem__("kept", 1))
        session.run(lambda ws: ws.__setitem__("gone", 1), workspace_type="private")
        assert session.blobs() == ["kept"]
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(noop)
        with pytest.raises(ValueError, match="GLOBAL, cannot run it as PRIVATE"):
            session.run(group, workspace_type="private")


def test_group_add_and_counts():
    """add() moves a task into the group; num_registered_tasks counts pending and added tasks."""
    group = dj.TaskGroup()
    outside = dj.Task(noop, name="outside")
    with group:
        pending = dj.Task(noop, name="pending")
    assert group.num_registered_tasks() == 1
    group.add(outside)
    group.add(outside)
    assert group.num_registered_tasks() == 2
    assert group.tasks() == [outside, pending]


def run_group(group: dj.TaskGroup) -> None:
    """Run ``group`` once in a fresh LocalSession."""
    with dj.LocalSession() as session:
        session.run(group)


def test_adding_to_group_after_it_ran_raises():
    """Adding tasks, report steps or setups to a group that has run raises InvalidStateError (a RuntimeError)."""
    with dj.TaskGroup() as group:
        dj.Task(noop)
    run_group(group)
    with pytest.raises(InvalidStateError, match="already run"):
        dj.Task(noop, group=group)
    with pytest.raises(RuntimeError, match="already run"), group:
        dj.Task(noop)
    with pytest.raises(RuntimeError, match="already run"):
        group.add(dj.Task(noop))
    with pytest.raises(RuntimeError, match="already run"):
        group.report_step(noop)
    with pytest.raises(RuntimeError, match="already run"):
        group.add_local_setup(dj.SetupNets(noop))
    assert group.num_registered_tasks() == 1


def test_reading_tasks_does_not_freeze_the_group():
    """tasks() adds pending tasks but leaves the group open: tasks and outputs can still be added."""
    with dj.TaskGroup() as group:
        first = dj.Task(noop, name="first", node="a")
    assert len(group.tasks()) == 1
    assert group.workspace_type() is dj.WorkspaceType.PRIVATE
    with group:
        second = dj.Task(other_step, name="second", node="a")
    first.add_output("x")
    second.add_input("x_in", first.outputs()[0])
    group.report_step(noop, node="a")
    assert [t.name for t in group.tasks()] == ["a/first", "a/second"]
    assert group.num_registered_tasks() == 2


def test_reading_job_groups_does_not_freeze_them():
    """Listing a job's epoch tasks before adding an epoch_limiter does not stop the limiter from joining."""
    with dj.Job() as job:
        dj.Task(noop)
    assert len(job.epoch_group.tasks()) == 1
    assert len(job.init_group.tasks()) == 0
    dj.epoch_limiter(job, 2)
    assert job.epoch_group.num_registered_tasks() == 2
    assert len(job.init_group.tasks()) == 1


def test_tasks_by_node_freezes_the_group():
    """tasks_by_node holds the group's tasks, so afterwards the group cannot change."""
    with dj.TaskGroup() as group:
        task = dj.Task(noop, node="a", name="t")
    group.tasks_by_node()
    with pytest.raises(InvalidStateError, match="regrouped by tasks_by_node"):
        dj.Task(noop, group=group)
    with pytest.raises(InvalidStateError, match="'a/t'"):
        task.add_output("x")


def test_modifying_task_after_its_group_ran_raises():
    """Adding outputs or inputs to a task whose group has run raises InvalidStateError (a RuntimeError)."""
    with dj.TaskGroup() as group:
        producer = dj.Task(lambda ws: ws.__setitem__("x", 1), outputs="x")
        task = dj.Task(noop, name="t", node="a")
    run_group(group)
    with pytest.raises(InvalidStateError, match="'a/t': its group has already run"):
        task.add_output("y")
    with pytest.raises(RuntimeError, match="'a/t'"):
        task.add_outputs(["y", "z"])
    with pytest.raises(RuntimeError, match="'a/t'"):
        task.add_input("x", producer.outputs()[0])
    with pytest.raises(RuntimeError), task:
        dj.final_output("y")
    assert task.outputs() == []


def test_used_nodes_first_use_order():
    """used_nodes lists task, report-step and local-setup nodes once each in first-use order."""
    with dj.TaskGroup() as group:
        dj.Task(noop, node="b")
        dj.Task(noop, node="a")
        dj.Task(noop, node="b")
    group.report_step(noop, node="c")
    group.add_local_setup(dj.SetupNets(noop), node="ps")
    group.add_local_setup(dj.SetupNets(noop), node="a")
    assert group.used_nodes() == ["b", "a", "c", "ps"]


def test_report_step_validation():
    """report_step records node and interval, and rejects a missing step or a non-positive interval."""
    group = dj.TaskGroup()
    group.report_step(noop, node="a", interval_ms=250)
    with dj.Node("b"):
        group.report_step(other_step)
    assert [(r.step, r.node, r.interval_ms) for r in group.report_steps()] == [
        (noop, "a", 250),
        (other_step, "b", 1000),
    ]
    with pytest.raises(ValueError, match="needs a step"):
        group.report_step(None)
    with pytest.raises(ValueError, match="interval_ms"):
        group.report_step(noop, interval_ms=0)


def test_local_setup_validation():
    """add_local_setup keeps SetupNets per node and rejects anything else."""
    group = dj.TaskGroup()
    setup = dj.SetupNets(noop, [other_step])
    group.add_local_setup(setup, node="a")
    assert group.local_setups("a") == [setup]
    assert group.local_setups("b") == []
    assert setup.init_nets == [noop]
    assert setup.exit_nets == [other_step]
    assert repr(dj.SetupNets()) == "SetupNets(init_nets=None, exit_nets=None)"
    with pytest.raises(ValueError, match="SetupNets"):
        group.add_local_setup([noop])
    with pytest.raises(ValueError, match="callables"):
        dj.SetupNets(init_nets=["x"])


def test_tasks_by_node_groups_and_caches():
    """tasks_by_node builds one grouped task per node with concatenated outputs, and caches the result."""
    with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        a1 = dj.Task(noop, node="a", outputs="x")
        b1 = dj.Task(noop, node="b", outputs=["y", "z"])
        a2 = dj.Task(noop, node="a", outputs="w")
    grouped = group.tasks_by_node()
    merged = grouped.tasks()
    assert [t.name for t in merged] == ["a/grouped_by_node", "b/grouped_by_node"]
    assert [o.names for o in merged[0].outputs()] == [["x"], ["w"]]
    assert merged[0].outputs() == a1.outputs() + a2.outputs()
    assert merged[1].outputs() == b1.outputs()
    assert grouped.workspace_type() is dj.WorkspaceType.GLOBAL
    assert group.tasks_by_node() is grouped
    assert group.tasks_by_node({"a": "a", "b": "b"}) is grouped


def test_tasks_by_node_remap_and_different_map_error():
    """tasks_by_node merges remapped nodes and refuses a second, different mapping."""
    with dj.TaskGroup() as group:
        dj.Task(noop, node="a", outputs="x")
        dj.Task(noop, node="b", outputs="y")
        dj.Task(noop, node="c", outputs="z")
    group.report_step(noop, node="b", interval_ms=5)
    group.add_local_setup(dj.SetupNets(noop), node="c")
    grouped = group.tasks_by_node({"b": "a", "c": "ps"})
    merged = grouped.tasks()
    assert [t.name for t in merged] == ["a/grouped_by_node", "ps/grouped_by_node"]
    assert [o.names for t in merged for o in t.outputs()] == [["x"], ["y"], ["z"]]
    assert [(r.node, r.interval_ms) for r in grouped.report_steps()] == [("a", 5)]
    assert len(grouped.local_setups("ps")) == 1
    with pytest.raises(RuntimeError, match="different node mapping"):
        group.tasks_by_node()
    assert group.tasks_by_node({"b": "a", "c": "ps"}) is grouped


def test_to_task_merges_everything():
    """to_task returns one task on the given node holding every output."""
    with dj.TaskGroup() as group:
        dj.Task(noop, node="a", outputs="x")
        dj.Task(noop, node="b", outputs="y")
    task = group.to_task("ps")
    assert task.name == "ps/grouped_by_node"
    assert task.node == "ps"
    assert [o.names for o in task.outputs()] == [["x"], ["y"]]


def test_to_task_of_empty_group():
    """to_task of an empty group is an empty task on the current node."""
    with dj.Node("trainer_0"):
        task = dj.TaskGroup().to_task()
    assert task.name == "trainer_0/task"
    assert task.outputs() == []
    assert task.has_work() is False


def test_remote_nets_kept_in_order():
    """add_remote_net keeps opaque objects for custom sessions, in order."""
    group = dj.TaskGroup()
    first, second = object(), {"net": 1}
    group.add_remote_net(first)
    group.add_remote_net(second)
    assert group.remote_nets() == [first, second]
    group.remote_nets().clear()
    assert len(group.remote_nets()) == 2


def test_group_docstring_disclaims_other_task_groups():
    """TaskGroup's docstring says it is unrelated to asyncio.TaskGroup and Dask's task groups."""
    doc = dj.TaskGroup.__doc__
    assert "asyncio.TaskGroup" in doc
    assert "Dask" in doc


def test_inputs_cycle_raises_when_used():
    """Inputs that form a cycle raise ValueError naming the cycle when the group runs (not when its tasks are read)."""
    with dj.TaskGroup() as group:
        first = dj.Task(noop, node="a", name="first", outputs="x")
        second = dj.Task(noop, node="b", name="second", outputs="y", inputs={"x_in": first.outputs()[0]})
    first.add_input("y_in", second.outputs()[0])
    assert len(group.tasks()) == 2
    with pytest.raises(ValueError, match=r"cycle: a/first -> b/second -> a/first"):
        run_group(group)


def test_inputs_self_cycle_raises_when_used():
    """A task consuming its own output is a cycle."""
    with dj.TaskGroup() as group:
        task = dj.Task(noop, node="a", name="self", outputs="x")
    task.add_input("x_in", task.outputs()[0])
    with pytest.raises(ValueError, match="cycle"):
        run_group(group)


def test_inputs_from_outside_group_raise_when_used():
    """An input produced by a task outside the group raises ValueError when the group runs."""
    outside = dj.Task(noop, outputs="x")
    with dj.TaskGroup() as group:
        dj.Task(noop, name="consumer", node="a", inputs={"x": outside.outputs()[0]})
    with pytest.raises(ValueError, match=r"'a/consumer'.*not an output of a task in this group"):
        run_group(group)


def test_inputs_are_recorded():
    """A task's inputs map local names to the producing TaskOutputs."""
    with dj.TaskGroup():
        producer = dj.Task(noop, outputs="x")
        consumer = dj.Task(noop, inputs={"local_x": producer.outputs()[0]})
    assert consumer.inputs() == {"local_x": producer.outputs()[0]}


# -- repr ------------------------------------------------------------------------------------------


def test_task_repr():
    """A task's repr shows its full name, node and output names."""
    task = dj.Task(noop, node="a", outputs=["x", "y"])
    assert repr(task) == "Task(name=a/noop, node=a, outputs=[['x'], ['y']])"
    assert task._repr_html_() == "<code>Task(name=a/noop, node=a, outputs=[[&#x27;x&#x27;], [&#x27;y&#x27;]])</code>"


def test_group_repr():
    """A group's repr shows task names, workspace type and remote nets; its HTML is a table of tasks."""
    with dj.TaskGroup() as group:
        dj.Task(noop, node="a", outputs="x")
        dj.Task(noop, node="b", num_instances=3)
    assert repr(group) == "TaskGroup(tasks=['a/noop', 'b/noop'], workspace_type=None, remote_nets=[])"
    html = group._repr_html_()
    assert html.startswith("<b>TaskGroup</b> (untyped, 2 tasks)<table>")
    assert "<tr><td>a</td><td>a/noop</td><td>1</td><td>x</td></tr>" in html
    assert "<tr><td>b</td><td>b/noop</td><td>3</td><td></td></tr>" in html
    group.tasks()
    assert repr(group) == "TaskGroup(tasks=['a/noop', 'b/noop'], workspace_type=PRIVATE, remote_nets=[])"
    assert group._repr_html_().startswith("<b>TaskGroup</b> (PRIVATE, 2 tasks)")


def test_job_repr():
    """A job's repr counts tasks per group, stop conditions and nodes; its HTML shows the groups."""
    with dj.Job(name="reader") as job:
        with job.init_group, dj.Node("ps"):
            dj.Task(noop)
        dj.Task(noop, node="trainer_0")
        job.add_stop_condition(dj.Task(noop, node="trainer_0", outputs="done").outputs()[0])
    assert repr(job) == (
        "Job(name='reader', tasks=(init=1, epoch=2, download=0, exit=0), stop_conditions=1, nodes=['ps', 'trainer_0'])"
    )
    html = job._repr_html_()
    assert html.startswith("<b>Job</b> reader &mdash; stop conditions: done; checkpointed nodes: ps<table>")
    assert "<tr><td>init</td><td>1</td><td>ps</td></tr>" in html
    assert "<tr><td>epoch</td><td>2</td><td>trainer_0</td></tr>" in html
    assert "<tr><td>exit</td><td>0</td><td></td></tr>" in html


# -- Job -------------------------------------------------------------------------------------------


def test_job_default_groups():
    """A job's default init group is GLOBAL and the other groups are untyped and labelled by role."""
    job = dj.Job()
    assert job.name == "job"
    assert job.init_group.workspace_type() is dj.WorkspaceType.GLOBAL
    assert job.epoch_group.workspace_type() is None
    assert job.download_group.workspace_type() is None
    assert job.exit_group.workspace_type() is None
    assert {k: g.label for k, g in job.groups().items()} == {
        "init": "init",
        "epoch": "epoch",
        "download": "download",
        "exit": "exit",
    }
    assert job.stop_conditions == []


def test_job_uses_given_groups():
    """Groups given to a job are used as they are."""
    groups = [dj.TaskGroup(dj.WorkspaceType.PRIVATE) for _ in range(4)]
    job = dj.Job(*groups)
    assert [job.init_group, job.epoch_group, job.download_group, job.exit_group] == groups
    assert job.init_group.workspace_type() is dj.WorkspaceType.PRIVATE
    with pytest.raises(ValueError, match="epoch_group must be a TaskGroup"):
        dj.Job(epoch_group="epoch")


def test_job_context_enters_epoch_group():
    """Entering a job enters it and its epoch group; the other groups are entered explicitly."""
    with dj.Job() as job:
        assert dj.Job.current() is job
        assert dj.TaskGroup.current() is job.epoch_group
        epoch_task = dj.Task(noop)
        with job.init_group:
            init_task = dj.Task(noop)
        with job.download_group:
            download_task = dj.Task(noop)
        with job.exit_group:
            exit_task = dj.Task(noop)
        assert dj.TaskGroup.current() is job.epoch_group
    assert dj.TaskGroup.current(required=False) is None
    assert job.epoch_group.tasks() == [epoch_task]
    assert job.init_group.tasks() == [init_task]
    assert job.download_group.tasks() == [download_task]
    assert job.exit_group.tasks() == [exit_task]


def test_job_current_outside_raises():
    """Job.current() outside a job raises RuntimeError, or returns None when not required."""
    with pytest.raises(RuntimeError, match="no active Job"):
        dj.Job.current()
    assert dj.Job.current(required=False) is None


def test_add_stop_condition_with_task_output():
    """A TaskOutput stop condition is kept as it is."""
    with dj.Job() as job:
        output = dj.Task(noop, outputs="done").outputs()[0]
        assert job.add_stop_condition(output) is output
    assert job.stop_conditions == [output]
    assert dj.Job(stop_conditions=[output]).stop_conditions == [output]


def test_add_stop_condition_with_blob_name():
    """A blob-name stop condition creates a step-less task in the epoch group on the current node."""
    job = dj.Job()
    with dj.Node("trainer_1"):
        output = job.add_stop_condition("data_finished")
    assert output.names == ["data_finished"]
    (task,) = job.epoch_group.tasks()
    assert task.name == "trainer_1/task"
    assert task.has_work() is False
    assert task.outputs() == [output]
    assert job.stop_conditions == [output]


def test_add_stop_condition_rejects_bad_values():
    """A stop condition that is not a single-blob TaskOutput or blob name raises ValueError."""
    job = dj.Job()
    with pytest.raises(ValueError, match="exactly one blob"):
        job.add_stop_condition(dj.TaskOutput(["a", "b"]))
    with pytest.raises(ValueError, match="TaskOutput or a blob name"):
        job.add_stop_condition(3)
    with pytest.raises(ValueError, match=re.escape("'a/b'")):
        job.add_stop_condition("a/b")
    assert job.stop_conditions == []
    assert job.epoch_group.num_registered_tasks() == 0


def test_nodes_to_checkpoint_defaults_to_init_nodes():
    """nodes_to_checkpoint is the init group's nodes unless an explicit list is given."""
    with dj.Job() as job:
        with job.init_group:
            dj.Task(noop, node="trainer_1")
            dj.Task(noop, node="ps")
            dj.Task(noop, node="trainer_1")
        dj.Task(noop, node="trainer_0")
    assert job.nodes_to_checkpoint() == ["trainer_1", "ps"]
    assert job.nodes() == ["trainer_1", "ps", "trainer_0"]
    explicit = dj.Job(nodes_to_checkpoint=[dj.Node("b"), "a"])
    with explicit.init_group:
        dj.Task(noop, node="c")
    assert explicit.nodes_to_checkpoint() == ["b", "a"]
    assert explicit.nodes() == ["c", "b", "a"]


@pytest.mark.parametrize("num_epochs", [0, -1, True, 1.5, "3", None])
def test_epoch_limiter_rejects_bad_counts(num_epochs):
    """epoch_limiter with a count that is not a positive int raises ValueError at once, adding nothing."""
    job = dj.Job()
    with pytest.raises(ValueError, match="num_epochs"):
        dj.epoch_limiter(job, num_epochs)
    assert job.init_group.num_registered_tasks() == 0
    assert job.epoch_group.num_registered_tasks() == 0
    assert job.stop_conditions == []


def test_epoch_limiter_builds_tasks_on_current_node():
    """epoch_limiter adds a counter task to init, a count-down task to epoch and a stop condition."""
    job = dj.Job()
    with dj.Node("trainer_2"):
        output = dj.epoch_limiter(job, 3)
    (init_task,) = job.init_group.tasks()
    (epoch_task,) = job.epoch_group.tasks()
    assert (init_task.name, epoch_task.name) == ("trainer_2/epoch_limiter", "trainer_2/epoch_limiter")
    assert epoch_task.outputs() == [output]
    assert job.stop_conditions == [output]
    assert job.nodes_to_checkpoint() == ["trainer_2"]


def test_epoch_limiter_names_repeat_when_job_is_defined_again():
    """A job defined twice the same way uses the same limiter blob names, and two limiters differ."""

    def define():
        job = dj.Job()
        first = dj.epoch_limiter(job, 3, node="a")
        second = dj.epoch_limiter(job, 5, node="b")
        return first.names + second.names

    names = define()
    dj.Job()
    assert define() == names
    assert len(set(names)) == 2
