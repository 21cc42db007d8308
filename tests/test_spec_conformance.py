"""SPEC conformance: one test per public promise not already pinned elsewhere, with exact values.

Each test names the SPEC section it checks. Tests taking ``session`` run on a LocalSession and on
a DaskSession over the shared cluster.
"""

from __future__ import annotations

import inspect
import pickle
import re
import threading

import numpy as np
import pytest

import daskjobs as dj
from daskjobs import errors


def counter_job(name: str = "job", node: str = "a") -> dj.Job:
    """A job whose init group creates ``n = 0`` on ``node`` and whose epochs add one to it."""
    with dj.Cluster(), dj.Job(name=name) as job, dj.Node(node):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)), name="init")
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


def snapshot(prefix: str) -> dict[str, bytes]:
    """Every file under a local checkpoint prefix (lock files excluded) and its bytes."""
    import pathlib

    root = pathlib.Path(prefix)
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and "lock" not in p.name]
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


# -- §1.1 Cluster and Node -------------------------------------------------------------------


def test_node_kwargs_are_the_extra_resources():
    """§1.1: ``node.kwargs()`` gives the extra resources; ``str(node)`` the name."""
    node = dj.Node("trainer", GPU=1)
    assert node.kwargs() == {"GPU": 1}
    assert str(node) == "trainer"
    assert dj.Node("x").kwargs() == {}


def test_node_name_keyword():
    """§1.1: the signature is ``Node(name="local", **resources)``."""
    assert next(iter(inspect.signature(dj.Node).parameters)) == "name"
    node = dj.Node(name="trainer", GPU=1)
    assert (str(node), node.name, node.kwargs()) == ("trainer", "trainer", {"GPU": 1})
    assert str(dj.Node()) == "local"


def test_node_current_inside_and_nested():
    """§1.1: ``Node.current()`` is the innermost active node."""
    with dj.Node("a"):
        with dj.Node("b"):
            assert str(dj.Node.current()) == "b"
        assert str(dj.Node.current()) == "a"
    assert str(dj.Node.current()) == "local"


def test_cluster_records_task_nodes_and_kwargs_in_first_use_order():
    """§1.1: a Cluster records nodes used inside it (also through ``Task(node=...)``), in order."""
    with dj.Cluster() as cluster, dj.TaskGroup():
        dj.Task(None, node="c")
        with dj.Node("a", GPU=2):
            dj.Task(None)
        dj.Task(None, node="c")
    assert cluster.nodes() == ["c", "a"]
    assert cluster.node_kwargs()["a"] == {"GPU": 2}


# -- §1.3 Task ----------------------------------------------------------------------------------


def named_step(ws):
    ws["x"] = 1


def test_task_name_from_step_list_and_suffixes():
    """§1.3: the default name is the step's ``__name__`` (a list has none: ``"task"``); duplicates get ``:1``."""
    with dj.Cluster(), dj.TaskGroup() as group:
        first = dj.Task(named_step)
        second = dj.Task([named_step, named_step])
        third = dj.Task(named_step, node="b")
        fourth = dj.Task(named_step)
        plain = dj.Task(None)
    assert [t.name for t in group.tasks()] == [
        "local/named_step",
        "local/task",
        "b/named_step",
        "local/named_step:1",
        "local/task:1",
    ]
    assert (first.node, second.node, third.node) == ("local", "local", "b")
    assert (fourth.name, plain.name) == ("local/named_step:1", "local/task:1")


def test_task_names_are_labels_not_paths():
    """§1.3: a lambda's default name is its ``__name__``; an explicit name may hold any printable
    characters but ``/`` (task names are not node or blob names), and not be empty, too long or multi-line."""
    assert dj.Task(lambda ws: None).name == "local/<lambda>"
    assert dj.Task(named_step, name="train step (v2)").name == "local/train step (v2)"
    for bad in ["", "x" * 129, "two\nlines", "a/b"]:
        with pytest.raises(ValueError, match="invalid task name"):
            dj.Task(named_step, name=bad)
    with pytest.raises(TypeError, match="task name must be a str"):
        dj.Task(named_step, name=3)


def test_step_list_runs_in_order(session):
    """§1.3: a list of callables runs in order, in one task."""
    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group, dj.Node("a"):
        dj.Task(
            [
                lambda ws: ws.__setitem__("log", ["one"]),
                lambda ws: ws.__setitem__("log", [*ws["log"], "two"]),
                lambda ws: ws.__setitem__("log", [*ws["log"], "three"]),
            ]
        )
    session.run(group)
    assert session.fetch("log", node="a") == ["one", "two", "three"]


def test_add_output_add_outputs_and_fetch_shapes(session):
    """§1.3: ``add_output``/``add_outputs``; ``fetch()`` gives one value for one name, else a list."""
    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(lambda ws: ws.update(p=np.int64(1), q=np.int64(2), r=np.int64(3)), node="a")
        single = task.add_output("p")
        pair = task.add_outputs(["q", "r"])
    assert single.names == ["p"]
    with pytest.raises(errors.OutputNotReadyError, match="p"):
        single.fetch()
    session.run(group)
    assert int(single.fetch()) == 1
    assert [o.names for o in pair] == [["q"], ["r"]]
    assert [int(v) for v in task.output_list().fetch()] == [1, 2, 3]
    multi = dj.TaskOutput(["q", "r"])
    assert multi.names == ["q", "r"]


def test_output_not_ready_is_a_runtime_error_naming_the_blob():
    """§1.3 + §5: ``fetch()`` before the run raises ``OutputNotReadyError`` (a ``RuntimeError``)."""
    with dj.Cluster(), dj.TaskGroup():
        output = dj.Task(named_step, outputs="x").outputs()[0]
    with pytest.raises(RuntimeError, match="'x'") as info:
        output.fetch()
    assert isinstance(info.value, errors.OutputNotReadyError)


def test_modifying_a_task_after_its_group_ran_raises(session):
    """§1.3: modifying a task after its group has run raises ``RuntimeError``."""
    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(named_step, node="a")
    session.run(group)
    with pytest.raises(RuntimeError):
        task.add_output("x")
    with pytest.raises(RuntimeError):
        task.add_outputs(["x"])
    late = dj.Task(named_step, node="a")
    with pytest.raises(RuntimeError):
        group.add(late)


def test_final_output_inside_task_context(session):
    """§1.3: ``final_output`` inside ``with Task():`` adds to that task."""
    with dj.Cluster(), dj.TaskGroup() as group, dj.Task(lambda ws: ws.__setitem__("v", np.int64(7)), node="a") as task:
        out = dj.final_output("v")
    assert task.outputs() == [out]
    session.run(group)
    assert int(out.fetch()) == 7


def test_setup_nets_init_and_exit_order(session):
    """§1.3: ``add_local_setup`` runs all ``init_nets`` before the node's tasks, ``exit_nets`` after."""
    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group, dj.Node("a"):

        def note(tag):
            def step(ws):
                with ws.lock:
                    ws["order"] = [*ws.get("order", []), tag]

            step.__name__ = tag
            return step

        dj.Task(note("task1"))
        dj.Task(note("task2"))
        setup = dj.SetupNets(init_nets=[note("init1"), note("init2")], exit_nets=[note("exit1"), note("exit2")])
        group.add_local_setup(setup)
    session.run(group)
    order = session.fetch("order", node="a")
    assert order[:2] == ["init1", "init2"]
    assert sorted(order[2:4]) == ["task1", "task2"]
    assert order[4:] == ["exit1", "exit2"]


def test_ws_attributes(session):
    """§1.2: ``ws.node``, ``ws.epoch`` (None outside epochs), ``ws.instance_id``, re-entrant ``ws.lock``."""

    def probe(ws):
        with ws.lock, ws.lock:  # re-entrant
            ws["ids"] = sorted([*ws["ids"], ws.instance_id])

    def task_exit(ws):
        ws["seen_node"] = ws.node
        ws["seen_epoch"] = ws.epoch
        ws["exit_id"] = ws.instance_id

    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group, dj.Node("b"):
        dj.Task(probe, num_instances=3, task_init=lambda ws: ws.__setitem__("ids", []), task_exit=task_exit)
    session.run(group)
    assert session.fetch("ids", node="b") == [0, 1, 2]
    assert session.fetch("seen_node", node="b") == "b"
    assert session.fetch("seen_epoch", node="b") is None
    assert int(session.fetch("exit_id", node="b")) == 0  # outside the instances: 0


@pytest.mark.parametrize("workspace_type", [dj.WorkspaceType.GLOBAL, dj.WorkspaceType.PRIVATE])
def test_ws_lock_is_shared_by_tasks_of_a_node(session, workspace_type):
    """§1.2: ``ws.lock`` is one lock for all tasks (and instances) of the node: increments never race."""

    def bump(ws):
        for _ in range(200):
            with ws.lock:
                value = int(ws["n"])
                ws["n"] = np.int64(value + 1)

    with dj.Cluster():
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as init:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)), node="a")
        with dj.TaskGroup(workspace_type) as group:
            for _ in range(3):
                dj.Task(bump, node="a")
            dj.Task(bump, node="a", num_instances=2)
    session.run(init)
    session.run(group)
    assert int(session.fetch("n", node="a")) == 1000


# -- §1.4 TaskGroup -----------------------------------------------------------------------------


def test_group_add_counts_nodes_and_type():
    """§1.4: ``add``, ``tasks``, ``num_registered_tasks``, ``used_nodes``, ``workspace_type``."""
    with dj.Cluster():
        outside = dj.Task(named_step, node="b")
        with dj.TaskGroup() as group:
            dj.Task(named_step, node="c")
        assert group.num_registered_tasks() == 1
        group.add(outside)
        assert group.num_registered_tasks() == 2
        # As Caffe2: added tasks come before pending ones; an untyped first task makes the group PRIVATE.
        assert group.used_nodes() == ["b", "c"]
        assert group.workspace_type() is dj.WorkspaceType.PRIVATE
        assert [t.name for t in group.tasks()] == ["b/named_step", "c/named_step"]


def test_group_type_conflict_raises_value_error():
    """§1.4: an explicit task type conflicting with the group's raises ``ValueError``."""
    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        task = dj.Task(named_step, workspace_type=dj.WorkspaceType.PRIVATE, group=None)
    with pytest.raises(ValueError, match="PRIVATE"):
        group.add(task)


def test_adding_after_run_raises(session):
    """§1.4: adding tasks after the group has run raises ``RuntimeError``."""
    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(named_step, node="a")
    session.run(group)
    with pytest.raises(RuntimeError, match="already"):
        dj.Task(named_step, node="a", group=group)


def test_report_step_runs_once_more_after_tasks(session):
    """§1.4: a report step runs once more after all of its node's tasks finished (here exactly once)."""

    def report(ws):
        with ws.lock:
            ws["reports"] = np.int64(ws["reports"] + 1)
            ws["saw_done"] = bool(ws["done"])

    with dj.Cluster():
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as init:
            dj.Task(lambda ws: ws.update(reports=np.int64(0), done=False), node="a")
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(lambda ws: ws.__setitem__("done", True), node="a")
            group.report_step(report, node="a", interval_ms=60_000)
    session.run(init)
    session.run(group)
    assert int(session.fetch("reports", node="a")) == 1
    saw_done = session.fetch("saw_done", node="a")
    assert (saw_done.dtype, saw_done.shape, bool(saw_done)) == (np.dtype(bool), (), True)


def test_remote_nets_are_kept_opaque(session):
    """§1.4: ``add_remote_net``/``remote_nets`` keep opaque objects; sessions ignore them."""
    marker = object()
    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(named_step, node="a")
    group.add_remote_net(marker)
    group.add_remote_net("second")
    assert group.remote_nets() == [marker, "second"]
    session.run(group)


def test_inputs_cycle_raises_value_error_when_run(session):
    """§1.3: an ``inputs`` cycle raises ``ValueError`` when the group is used (run)."""
    with dj.Cluster(), dj.TaskGroup() as group:
        first = dj.Task(lambda ws: ws.__setitem__("p", 1), node="a", outputs="p")
        second = dj.Task(lambda ws: ws.__setitem__("q", 1), node="b", outputs="q", inputs={"p": first.outputs()[0]})
        first.add_input("q", second.outputs()[0])
    with pytest.raises(ValueError, match="cycle"):
        session.run(group)


# -- §1.5 Job ---------------------------------------------------------------------------------


def test_job_groups_types_and_current():
    """§1.5: default init group is GLOBAL, others untyped; ``Job.current()`` inside only."""
    with dj.Cluster(), dj.Job() as job:
        assert dj.Job.current() is job
        assert dj.TaskGroup.current() is job.epoch_group
        with job.exit_group:
            assert dj.TaskGroup.current() is job.exit_group
    assert job.init_group.workspace_type() is dj.WorkspaceType.GLOBAL
    assert job.download_group.workspace_type() is None
    assert job.exit_group.workspace_type() is None
    with pytest.raises(RuntimeError):
        dj.Job.current()


def test_add_stop_condition_blob_name_runs(session):
    """§1.5: ``add_stop_condition("blob")`` makes a step-less epoch task on the current node."""
    with dj.Cluster(), dj.Job() as job, dj.Node("b"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))
        dj.Task(lambda ws: ws.update(n=ws["n"] + 1, done=bool(ws["n"] + 1 >= 3)))
        output = job.add_stop_condition("done")
    assert output.names == ["done"]
    assert [t.node for t in job.epoch_group.tasks()] == ["b", "b"]
    assert dj.JobRunner(job, progress=False).train(session) == 3
    assert int(session.fetch("n", node="b")) == 3


def test_nodes_to_checkpoint_explicit_list():
    """§1.5: ``nodes_to_checkpoint()`` is the explicit list when given."""
    with dj.Cluster(), dj.Job(nodes_to_checkpoint=["b", "a"]) as job, job.init_group:
        dj.Task(named_step, node="c")
    assert job.nodes_to_checkpoint() == ["b", "a"]


def test_reprs_and_html_reprs(session, prefix):
    """§1.5/§5: readable ``repr`` and ``_repr_html_`` for Job, TaskGroup, JobRunner, checkpoints."""
    job = counter_job("reprjob")
    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(job, manager, max_epochs=2, progress=False)
    runner.train(session)
    for obj in (job, job.epoch_group, runner, manager, dj.open_checkpoint(prefix)):
        assert isinstance(repr(obj), str)
        assert "object at 0x" not in repr(obj)
        html = obj._repr_html_()
        assert isinstance(html, str)
        assert html.strip()
    assert "reprjob" in repr(job)
    assert "reprjob" in job._repr_html_()


# -- §1.5 epoch_limiter -------------------------------------------------------------------------


@pytest.mark.parametrize("num_epochs", [1, 3])
def test_epoch_limiter_with_checkpoints_resumes_to_absolute_epoch(session, prefix, num_epochs):
    """§1.5: epoch_limiter gives exactly ``num_epochs`` epochs; a re-run after it finished runs none."""

    def make():
        job = counter_job()
        dj.epoch_limiter(job, num_epochs)
        return job

    runner = dj.JobRunner(make(), dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(session) == num_epochs
    assert [r.epoch for r in runner.history] == list(range(1, num_epochs + 1))
    assert int(session.fetch("n", node="a")) == num_epochs
    committed = snapshot(prefix)
    for _ in range(3):
        again = dj.JobRunner(make(), dj.MultiNodeCheckpointManager(prefix), progress=False)
        assert again.train(session) == num_epochs
        assert again.history == []
    assert snapshot(prefix) == committed


def test_epoch_limiter_resume_from_middle(session, prefix):
    """§1.5: resuming from epoch 2 of a 5-epoch limiter runs epochs 3, 4, 5 and stops at 5."""

    def make():
        job = counter_job()
        dj.epoch_limiter(job, 5)
        return job

    dj.JobRunner(make(), dj.MultiNodeCheckpointManager(prefix), progress=False).train(session)
    runner = dj.JobRunner(make(), dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=2, progress=False)
    assert runner.train(session) == 5
    assert [r.epoch for r in runner.history] == [3, 4, 5]
    assert int(session.fetch("n", node="a")) == 5


@pytest.mark.parametrize("bad", [0, -1])
def test_epoch_limiter_below_one_is_value_error(bad):
    """§1.5: ``num_epochs < 1`` raises ``ValueError`` at once."""
    with dj.Cluster(), dj.Job() as job:
        pass
    with pytest.raises(ValueError, match=str(bad)):
        dj.epoch_limiter(job, bad)


# -- §1.6 Sessions ---------------------------------------------------------------------------


def test_run_single_callable_is_global(session):
    """§1.6: a callable runs wrapped in a GLOBAL group, so its new blobs persist."""
    session.run(lambda ws: ws.__setitem__("made", np.int64(5)))
    assert int(session.fetch("made", node="local")) == 5


# -- §1.7 Checkpoints ----------------------------------------------------------------------------


def test_naming_functions():
    """§1.7: Caffe2 naming, with and without ``path_prefix``."""
    assert dj.get_ckpt_filename("trainer_0", 7) == "trainer_0.7"
    assert dj.db_name(7, "trainer_0", "/tmp/db") == "/tmp/db/trainer_0.7"
    assert dj.CheckpointManager("/tmp/db", "ps").get_ckpt_db_name("ps", 3) == "/tmp/db/ps.3"
    assert dj.db_name(3, "ps", "/tmp/db/") == "/tmp/db/ps.3"
    assert dj.db_name(3, "ps", "/ignored", path_prefix="/other/") == "/other/ps.3"


def test_naming_functions_take_paths_and_refuse_names_that_leave_the_prefix(tmp_path):
    """§1.1/§3: a ``pathlib.Path`` prefix works; a bad node name or epoch raises ValueError naming it
    (a name never leads out of the prefix), also through ``manager.get_ckpt_db_name``."""
    assert dj.db_name(3, "ps", tmp_path) == f"{tmp_path}/ps.3"
    manager = dj.MultiNodeCheckpointManager(tmp_path)
    for node, epoch, named in [("../etc", 1, "'../etc'"), ("a/b", 1, "'a/b'"), ("a b", 1, "'a b'"), ("ps", -1, "-1")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            dj.get_ckpt_filename(node, epoch)
        with pytest.raises(ValueError, match=re.escape(named)):
            dj.db_name(epoch, node, tmp_path)
        with pytest.raises(ValueError, match=re.escape(named)):
            manager.get_ckpt_db_name(node, epoch)


@pytest.mark.parametrize("db_prefix", ["relative/db", "file:///tmp/spec-naming", "memory://spec-naming/db"])
def test_manager_checkpoint_name_is_db_name(db_prefix):
    """§1.7: ``manager.get_ckpt_db_name(node, epoch)`` is ``db_name(epoch, node, db_prefix)``."""
    manager = dj.MultiNodeCheckpointManager(db_prefix)
    assert manager.get_ckpt_db_name("ps", 3) == dj.db_name(3, "ps", db_prefix) == f"{db_prefix}/ps.3"


def test_single_node_manager_refuses_several_nodes(prefix):
    """§1.7: ``CheckpointManager.init`` with more than one node raises ``ValueError``."""
    manager = dj.CheckpointManager(prefix, "a")
    with pytest.raises(ValueError, match="a"):
        manager.init(["a", "b"])


def test_db_type_other_than_zarr_is_value_error(prefix):
    """§1.7: ``db_type`` other than ``"zarr"`` raises ``ValueError`` for both managers."""
    with pytest.raises(ValueError, match="minidb"):
        dj.MultiNodeCheckpointManager(prefix, db_type="minidb")
    with pytest.raises(ValueError, match="minidb"):
        dj.CheckpointManager(prefix, "a", db_type="minidb")


class RecordingHandler:
    """A metadata handler that records its calls and resumes from a fixed answer."""

    def __init__(self, answer=None):
        self.calls = []
        self.answer = answer

    def set_params(self, db_prefix, db_type, node_names, path_prefix=None, path_type=None):
        self.calls.append(("set_params", db_type, list(node_names)))

    def last_epoch(self, user_epoch=None):
        self.calls.append(("last_epoch", user_epoch))
        return self.answer if user_epoch is None else user_epoch

    def cp_accessible(self, epoch=None):
        return True

    def write(self, epoch):
        self.calls.append(("write", epoch))

    def report(self, action_name, stats):
        self.calls.append(("report", action_name, sorted(stats)))


def test_custom_metadata_handler_protocol(session, prefix):
    """§1.7: a custom handler gets ``set_params``, ``last_epoch``, ``write(epoch)`` per commit."""
    handler = RecordingHandler()
    manager = dj.MultiNodeCheckpointManager(prefix, metadata_handler=handler)
    assert dj.JobRunner(counter_job(), manager, max_epochs=2, progress=False).train(session) == 2
    assert handler.calls[0] == ("set_params", "zarr", ["a"])
    assert ("last_epoch", None) in handler.calls
    assert [c[1] for c in handler.calls if c[0] == "write"] == [0, 1, 2]
    saves = [c for c in handler.calls if c[0] == "report"]
    assert saves == [("report", "checkpoint_save", [manager.get_ckpt_db_name("a", e)]) for e in (0, 1, 2)]
    manager.report_checkpoint_stats("save")
    assert handler.calls[-1] == ("report", "save", [manager.get_ckpt_db_name("a", 2)])


def test_custom_metadata_handler_decides_resume(session, prefix):
    """§1.7/§2.1: the epoch the handler's ``last_epoch`` names is the one resumed from."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(session)
    handler = RecordingHandler(answer=1)
    manager = dj.MultiNodeCheckpointManager(prefix, metadata_handler=handler)
    runner = dj.JobRunner(counter_job(), manager, max_epochs=4, progress=False)
    assert runner.train(session) == 4
    assert [r.epoch for r in runner.history] == [2, 3, 4]
    assert int(session.fetch("n", node="a")) == 4
    reports = [c for c in handler.calls if c[0] == "report"]
    assert reports[0] == ("report", "checkpoint_load", [manager.get_ckpt_db_name("a", 1)])


def test_builtin_handler_user_epoch_not_committed(prefix, session):
    """§1.7: the built-in handler: ``get_resume_from_epoch_id(k)`` of an uncommitted ``k`` raises."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(session)
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(["a"])
    assert manager.get_resume_from_epoch_id() == 2
    assert manager.get_resume_from_epoch_id(1) == 1
    with pytest.raises(errors.CheckpointNotFoundError, match="7"):
        manager.get_resume_from_epoch_id(7)
    assert manager.cp_accessible() is True


def test_manager_check_db_exists_blob_list_and_load_blobs_locally(session, prefix):
    """§1.7: ``check_db_exists``, ``blob_list``, ``load_blobs_locally`` (False for a missing epoch)."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    dj.JobRunner(counter_job(), manager, max_epochs=2, progress=False).train(session)
    assert manager.check_db_exists(2) is True
    assert manager.check_db_exists(9) is False
    assert "n" in manager.blob_list()["a"]
    session.feed("n", np.int64(-1), node="a")
    assert manager.load_blobs_locally(["a"], ["n"], 9, session) is False
    assert int(session.fetch("n", node="a")) == -1
    assert manager.load_blobs_locally(["a"], ["n"], 1, session) is True
    assert int(session.fetch("n", node="a")) == 1


def test_single_manager_blob_list_is_a_list(session, prefix):
    """§1.7: ``CheckpointManager.blob_list()`` lists that node's blobs."""
    manager = dj.CheckpointManager(prefix, "a")
    dj.JobRunner(counter_job(), manager, max_epochs=1, progress=False).train(session)
    assert "n" in manager.blob_list()


def test_blobs_created_after_init_are_saved(session, prefix):
    """§1.7: every blob of the GLOBAL workspace at save time is saved, also ones made in epochs."""
    with dj.Cluster(), dj.Job() as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))
        dj.Task(
            lambda ws: ws.update(n=ws["n"] + 1, late=np.int64(ws.epoch * 10)), workspace_type=dj.WorkspaceType.GLOBAL
        )
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(session)
    view = dj.open_checkpoint(prefix, 2)
    assert int(view["a"]["late"]) == 20
    assert int(view["a"]["n"]) == 2


def test_upload_builder_gets_last_epoch_and_manager(session, prefix):
    """§1.7/§2.4: the upload builder's ``build(epoch, manager)`` runs once, after the loop."""
    seen = []

    class Builder(dj.UploadTaskGroupBuilder):
        def build(self, epoch, checkpoint_manager):
            seen.append((epoch, checkpoint_manager))
            with dj.TaskGroup() as group:
                dj.Task(lambda ws: ws.__setitem__("uploaded", np.int64(1)), node="a")
            return group

    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(counter_job(), manager, upload_task_group_builder=Builder(), max_epochs=3, progress=False)
    assert runner.train(session) == 3
    assert seen == [(3, manager)]


def test_list_and_open_checkpoint(session, prefix):
    """§1.7: ``list_checkpoints`` lists committed epochs; ``open_checkpoint`` reads verified arrays."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(session)
    listed = dj.list_checkpoints(prefix)
    assert [c.epoch for c in listed] == [c["epoch"] for c in listed] == [0, 1, 2]
    assert listed[2]["stop_values"] == listed[2].stop_values
    assert listed[2]["format_version"] == listed[2].record["format_version"]  # the rest of the record
    latest = dj.open_checkpoint(prefix)
    assert latest.epoch == 2
    assert list(latest.nodes) == ["a"]
    value = latest["a"]["n"]
    assert isinstance(value, np.ndarray)
    assert int(value) == 2
    assert int(dj.open_checkpoint(prefix, epoch=1)["a"]["n"]) == 1


# -- §1.8 JobRunner ---------------------------------------------------------------------------


def test_job_runner_signature():
    """§1.8: the documented parameters, the later ones keyword-only."""
    params = inspect.signature(dj.JobRunner).parameters
    assert list(params)[:4] == ["job", "checkpoint_manager", "resume_from_epoch", "upload_task_group_builder"]
    for name in ("max_epochs", "max_failures", "on_save_error", "progress"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["on_save_error"].default == "raise"
    assert params["progress"].default is None


def test_runner_is_callable_like_train(session):
    """§1.8: ``runner(session)`` is ``train(session)``."""
    runner = dj.JobRunner(counter_job(), max_epochs=3, progress=False)
    assert runner(session) == 3
    assert int(session.fetch("n", node="a")) == 3


def test_runner_save_checkpoints_commits_an_epoch(session, prefix):
    """§1.8: ``save_checkpoints(epoch, session)`` saves and commits that epoch."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(counter_job(), manager, max_epochs=1, progress=False)
    runner.train(session)
    session.feed("n", np.int64(41), node="a")
    runner.save_checkpoints(5, session)
    assert int(dj.open_checkpoint(prefix, 5)["a"]["n"]) == 41


@pytest.mark.parametrize("bad", [True, 1.0, "1", -1])
def test_resume_from_epoch_must_be_a_non_negative_int(prefix, bad):
    """§2.9: ``resume_from_epoch`` that is not a non-negative int raises before anything is read."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=1, progress=False).train(None)
    before = dj.list_checkpoints(prefix)
    manager = dj.MultiNodeCheckpointManager(prefix)

    def start():  # refused by JobRunner() or by train(): SPEC only says before anything is read
        return dj.JobRunner(counter_job(), manager, resume_from_epoch=bad, max_epochs=3, progress=False).train(None)

    with pytest.raises((TypeError, ValueError), match="resume_from_epoch"):
        start()
    assert dj.list_checkpoints(prefix) == before


def test_stop_value_of_several_elements_names_the_condition(session):
    """§2.5: a two-element bool array is refused with ``TypeError`` naming the condition."""
    with dj.Cluster(), dj.Job() as job:
        task = dj.Task(lambda ws: ws.__setitem__("halt", np.array([True, False])), node="a", outputs="halt")
        job.add_stop_condition(task.outputs()[0])
    with pytest.raises(TypeError, match="halt"):
        dj.JobRunner(job, progress=False).train(session)


def test_task_failed_error_in_an_epoch(session):
    """§2.8: a failing epoch task raises ``TaskFailedError`` with job, group, node, task and epoch."""

    def boom(ws):
        if ws.epoch == 2:
            raise KeyError("broken-in-epoch-2")

    with dj.Cluster(), dj.Job(name="failing") as job, dj.Node("b"):
        dj.Task(boom, name="boom")
    with pytest.raises(errors.TaskFailedError) as info:
        dj.JobRunner(job, max_epochs=5, progress=False).train(session)
    error = info.value
    assert (error.job, error.group, error.node, error.task, error.epoch) == ("failing", "epoch", "b", "b/boom", 2)
    assert isinstance(error.__cause__, KeyError)
    assert "broken-in-epoch-2" in str(error.__cause__)
    assert "boom" in error.remote_traceback
    for part in ("failing", "b/boom", "2"):
        assert part in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.job, copy.node, copy.task, copy.epoch) == ("failing", "b", "b/boom", 2)


# -- §5 errors -----------------------------------------------------------------------------------


def test_definition_errors_are_value_or_type_errors():
    """§5: invalid names, dtypes and job definitions raise ``ValueError``/``TypeError`` subclasses."""
    with pytest.raises(ValueError, match="bad/name"):
        dj.Node("bad/name")
    with pytest.raises(TypeError, match="blob"), dj.LocalSession() as session:
        session.feed("blob", {1, 2}, node="a")
    with pytest.raises(ValueError, match="num_epochs"), dj.Cluster(), dj.Job() as job:
        dj.epoch_limiter(job, 0)


def test_library_logs_through_daskjobs_logger(session, caplog, prefix, capsys):
    """§1.7/§5: resuming from the latest commit is logged (epoch, prefix) by ``daskjobs``; nothing printed."""
    import logging

    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=1, progress=False).train(session)
    with caplog.at_level(logging.INFO, logger="daskjobs"):
        dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(session)
    resumed = [r.getMessage() for r in caplog.records if r.name == "daskjobs" and "resum" in r.getMessage()]
    assert resumed
    assert "1" in resumed[0]
    assert prefix in resumed[0]
    captured = capsys.readouterr()
    assert captured.out == ""


def test_threads_have_their_own_default_context():
    """§1.1: a default cluster exists per thread (registrations do not leak across threads)."""
    seen = {}

    def worker():
        dj.Node("threadnode")
        seen["nodes"] = dj.Cluster.current().nodes()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert seen["nodes"] == ["threadnode"]
    assert "threadnode" not in dj.Cluster.current().nodes()


# -- §1.7 managers by hand, §2 execution semantics, and the rest --------------------------------


def test_manager_caffe2_flow_by_hand(session, prefix):
    """§1.7: ``init``/``save``/``write_checkpoint_metadata``/``load`` return groups a session runs."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    session.feed("w", np.arange(4.0), node="a")
    session.feed("w", np.arange(2), node="b")
    for group in (manager.init(["a", "b"]), manager.save(0)):
        assert isinstance(group, dj.TaskGroup)
        session.run(group)
    manager.write_checkpoint_metadata(0)
    assert manager.check_db_exists(0) is True
    session.feed("w", np.zeros(4), node="a")
    session.feed("w", np.zeros(2, dtype=np.int64), node="b")
    session.run(manager.load(0))
    assert session.fetch("w", node="a").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert session.fetch("w", node="b").tolist() == [0, 1]
    assert manager.blob_list() == {"a": ["w"], "b": ["w"]}


def test_manager_options_are_accepted(prefix):
    """§1.7: ``storage_options``, ``keep_last``, ``keep_every``, ``async_save`` are options of both managers."""
    options = {"storage_options": {}, "keep_last": 2, "keep_every": 5, "async_save": True}
    assert dj.MultiNodeCheckpointManager(prefix, **options).keep_last == 2
    assert dj.CheckpointManager(prefix, "a", **options).keep_every == 5


def test_manager_signatures():
    """§1.7: the Caffe2 method signatures."""

    def names(fn):
        return list(inspect.signature(fn).parameters)

    manager = dj.MultiNodeCheckpointManager
    assert names(manager.init)[:5] == ["self", "nodes", "retrieve_from_epoch", "path_prefix", "path_type"]
    assert names(manager.load)[:2] == ["self", "epoch"]
    assert names(manager.save) == ["self", "epoch"]
    assert names(manager.load_blobs_locally) == ["self", "nodes", "blob_names", "epoch", "session"]
    assert names(manager.check_db_exists) == ["self", "epoch"]
    assert names(manager.write_checkpoint_metadata)[:2] == ["self", "epoch"]
    assert names(manager.get_resume_from_epoch_id) == ["self", "user_epoch"]
    assert names(manager.set_params)[:4] == ["self", "nodes", "path_prefix", "path_type"]
    assert names(manager.cp_accessible) == ["self", "epoch"]
    assert names(manager.report_checkpoint_stats) == ["self", "action_name"]
    assert names(manager.blob_list) == ["self"]
    assert names(dj.CheckpointManager)[:4] == ["db_prefix", "node_name", "db_type", "metadata_handler"]
    assert names(dj.MultiNodeCheckpointManager)[:3] == ["db_prefix", "db_type", "metadata_handler"]
    assert names(dj.JobRunner.load_blobs_from_checkpoints)[:4] == ["self", "blob_names", "epoch", "session"]
    assert names(dj.JobRunner.save_checkpoints)[:3] == ["self", "epoch", "session"]
    assert names(dj.UploadTaskGroupBuilder.build) == ["self", "epoch", "checkpoint_manager"]


@pytest.mark.parametrize("max_epochs", [2, 3])
def test_resume_past_max_epochs_runs_nothing(session, prefix, max_epochs):
    """§2.6: resuming from an epoch ``>= max_epochs`` runs no epoch and returns that epoch."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(session)
    runner = dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=max_epochs, progress=False)
    assert runner.train(session) == 3
    assert runner.history == []
    assert [c.epoch for c in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]


def test_failed_epoch_is_not_committed(session, prefix):
    """§2.8: nothing of the failed epoch is committed; earlier epochs stay."""

    def boom(ws):
        if ws.epoch == 3:
            raise ValueError("epoch 3 breaks")

    job = counter_job()
    with job.epoch_group:
        dj.Task(boom, node="a")
    with pytest.raises(errors.TaskFailedError) as info:
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=5, progress=False).train(session)
    assert info.value.epoch == 3
    assert [c.epoch for c in dj.list_checkpoints(prefix)] == [0, 1, 2]


def test_init_group_failure_names_no_epoch(session):
    """§2.8: a failure in the init group is a ``TaskFailedError`` whose epoch is ``None``."""
    with dj.Cluster(), dj.Job(name="initfail") as job:
        with job.init_group:
            dj.Task(lambda ws: 1 / 0, node="a", name="divide")
        dj.Task(named_step, node="a")
    with pytest.raises(errors.TaskFailedError) as info:
        dj.JobRunner(job, max_epochs=2, progress=False).train(session)
    error = info.value
    assert (error.job, error.group, error.node, error.task, error.epoch) == ("initfail", "init", "a", "a/divide", None)
    assert isinstance(error.__cause__, ZeroDivisionError)


def test_job_stop_conditions_argument(session):
    """§1.5: ``Job(stop_conditions=[output])`` registers them like ``add_stop_condition``."""
    with dj.Cluster(), dj.TaskGroup() as epoch_group:
        task = dj.Task(lambda ws: ws.__setitem__("stop", bool(ws.epoch >= 2)), node="a", outputs="stop")
    job = dj.Job(epoch_group=epoch_group, stop_conditions=[task.outputs()[0]])
    assert dj.JobRunner(job, progress=False).train(session) == 2


def test_stop_condition_on_another_node(session):
    """§2.3: stop conditions of every node are fetched each epoch; any true one stops."""
    with dj.Cluster(), dj.Job() as job:
        first = dj.Task(lambda ws: ws.__setitem__("a_stop", False), node="a", outputs="a_stop")
        second = dj.Task(lambda ws: ws.__setitem__("b_stop", bool(ws.epoch == 3)), node="b", outputs="b_stop")
        job.add_stop_condition(first.outputs()[0])
        job.add_stop_condition(second.outputs()[0])
    runner = dj.JobRunner(job, progress=False)
    assert runner.train(session) == 3
    assert runner.history[-1].stop_values == {"a_stop": False, "b_stop": True}


def test_node_resource_names():
    """§1.6: ``dj.node_resource(n)`` is a stable resource name per node and validates the name."""
    assert dj.node_resource("a") == dj.node_resource(dj.Node("a"))
    assert dj.node_resource("a") != dj.node_resource("b")
    with pytest.raises(ValueError, match="bad/name"):
        dj.node_resource("bad/name")


@pytest.mark.cluster
def test_dask_session_from_address_and_client(shared_cluster):
    """§1.6: ``DaskSession`` takes a cluster, a client or an address string."""
    from distributed import Client

    with dj.DaskSession(shared_cluster.scheduler_address) as by_address:
        by_address.run(lambda ws: ws.__setitem__("k", np.int64(3)))
        assert int(by_address.fetch("k", node="local")) == 3
    with Client(shared_cluster, set_as_default=False) as client:
        with dj.DaskSession(client) as by_client:
            by_client.feed("k", np.int64(4), node="b")
            assert int(by_client.fetch("k", node="b")) == 4
        assert client.status == "running"


def test_resume_from_older_epoch_keeps_newer_commits_until_a_new_commit(session, prefix):
    """§2.9: a crash in the first epoch after resuming from an older epoch leaves every commit as it was."""
    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(session)

    def boom(ws):
        raise RuntimeError("first epoch after resume breaks")

    job = counter_job()
    with job.epoch_group:
        dj.Task(boom, node="a")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=1, max_epochs=5, progress=False)
    with pytest.raises(errors.TaskFailedError):
        runner.train(session)
    assert [c.epoch for c in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]


def test_corrupt_checkpoint_on_resume_is_not_a_task_failure(session, prefix):
    """§2.10: a corrupt checkpoint during resume raises ``CheckpointCorruptError``, not ``TaskFailedError``."""
    import pathlib

    dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(session)
    chunks = [p for p in (pathlib.Path(prefix) / "a.2").rglob("*") if p.is_file() and "zarr.json" not in p.name]
    assert chunks
    for chunk in chunks:
        data = bytearray(chunk.read_bytes())
        data[-1] ^= 0xFF
        chunk.write_bytes(bytes(data))
    runner = dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False)
    with pytest.raises(errors.CheckpointCorruptError, match="2"):
        runner.train(session)


@pytest.mark.cluster
def test_dask_session_shows_dashboard_link(shared_cluster, caplog):
    """§5: the dashboard link is logged whenever a session connects, and is in its reprs."""
    import logging

    from distributed import Client

    with Client(shared_cluster, set_as_default=False) as client:
        link = client.dashboard_link
        with caplog.at_level(logging.INFO, logger="daskjobs"), dj.DaskSession(client) as session:
            assert any(link in r.getMessage() for r in caplog.records if r.name.startswith("daskjobs"))
            assert link in repr(session)
            assert link in session._repr_html_()


BAD_NAMES = ["", "__hidden", ".", "..", "a..b", "a/b", "a b", "é", "x" * 129]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_names_refused_before_storage_or_cluster(bad, tmp_path):
    """§1.1: bad node and blob names raise ``ValueError`` at construction, touching no storage or cluster."""
    prefix = tmp_path / "never"
    with pytest.raises(ValueError, match="name"):
        dj.CheckpointManager(str(prefix), bad)
    with pytest.raises(ValueError, match="name"):
        dj.MultiNodeCheckpointManager(str(prefix)).init(["a", bad])
    with pytest.raises(ValueError, match="name"):
        dj.node_cluster([bad])
    with pytest.raises(ValueError, match="name"):
        dj.node_resource(bad)
    with dj.LocalSession() as session:
        with pytest.raises(ValueError, match="name"):
            session.feed(bad, 1, node="a")
        with pytest.raises(ValueError, match="name"):
            session.fetch(bad, node="a")
        with pytest.raises(ValueError, match="name"):
            session.feed("ok", 1, node=bad)
    assert not prefix.exists()


async def async_step(ws):
    ws["x"] = 1


def generator_step(ws):
    yield ws


class AsyncCallable:
    async def __call__(self, ws):
        ws["x"] = 1


@pytest.mark.parametrize("bad", [async_step, generator_step, AsyncCallable()], ids=["async", "generator", "object"])
@pytest.mark.parametrize(
    "where", ["step", "list", "task_init", "task_exit", "instance_init", "instance_exit", "setup", "report"]
)
def test_non_plain_steps_refused_when_built(bad, where):
    """§1.2: ``async def`` and generator functions raise ``TypeError`` when the Task is built."""
    builders = {
        "step": lambda group: dj.Task(bad),
        "list": lambda group: dj.Task([named_step, bad]),
        "setup": lambda group: group.add_local_setup(dj.SetupNets(init_nets=[bad])),
        "report": lambda group: group.report_step(bad),
    }
    build = builders.get(where, lambda group: dj.Task(named_step, **{where: bad}))
    with dj.Cluster(), dj.TaskGroup() as group, pytest.raises(TypeError, match=r"async|generator|plain"):
        build(group)


class InaccessibleHandler(RecordingHandler):
    """A handler whose storage is never accessible."""

    def cp_accessible(self, epoch=None):
        self.calls.append(("cp_accessible", epoch))
        return False


def test_inaccessible_storage_skips_saves_with_a_warning(session, prefix, caplog):
    """§1.7 protocol: ``cp_accessible()`` is asked before every save (``epoch=None``); False skips it, warned."""
    import logging

    handler = InaccessibleHandler()
    runner = dj.JobRunner(counter_job(), dj.MultiNodeCheckpointManager(prefix, metadata_handler=handler), max_epochs=2)
    runner.progress = False
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert runner.train(session) == 2
    assert [c for c in handler.calls if c[0] == "cp_accessible"] == [("cp_accessible", None)] * 3
    assert not [c for c in handler.calls if c[0] == "write"]
    assert dj.list_checkpoints(prefix) == []
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 1


def test_checkpoint_methods_need_a_manager(session):
    """§1.8: ``save_checkpoints``/``load_blobs_from_checkpoints`` without a manager raise ``ValueError``."""
    runner = dj.JobRunner(counter_job(), max_epochs=1, progress=False)
    with pytest.raises(ValueError, match="manager"):
        runner.save_checkpoints(1, session)
    with pytest.raises(ValueError, match="manager"):
        runner.load_blobs_from_checkpoints(["n"], 1, session)


def test_task_failed_error_cause_keeps_its_original_traceback(session):
    """§2.8: the chained user exception carries its original traceback, down to the raising line."""
    import traceback

    def deep_failure(ws):
        raise LookupError("raised-here")

    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(deep_failure, node="b")
    with pytest.raises(errors.TaskFailedError) as info:
        session.run(group)
    cause = info.value.__cause__
    assert isinstance(cause, LookupError)
    text = "".join(traceback.format_exception(cause))
    assert "deep_failure" in text
    assert 'raise LookupError("raised-here")' in text or "raised-here" in info.value.remote_traceback
    assert 'raise LookupError("raised-here")' in info.value.remote_traceback


def test_public_parameter_names_follow_spec():
    """§1: parameter names as SPEC spells them, so keyword calls written from it work."""
    assert dj.get_ckpt_filename(node="n", epoch=2) == "n.2"
    assert dj.db_name(epoch=2, node="n", db_prefix="P", path_prefix=None) == "P/n.2"
    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(named_step)
        assert task.add_output(name="x").names == ["x"]
        assert [o.names for o in task.add_outputs(names=["y", "z"])] == [["y"], ["z"]]
    group.add_remote_net(obj="opaque")
    assert group.remote_nets() == ["opaque"]
    with dj.Cluster(), dj.TaskGroup() as group:
        group.report_step(step=named_step, node="a", interval_ms=5)
        group.add_local_setup(setup=dj.SetupNets(init_nets=None, exit_nets=None), node="a")
        assert dj.final_output(blob="w").names == ["w"]
    assert str(group.to_task(node="a").node) == "a"


def test_fetch_and_feed_copy_json_values(session):
    """§1.6: ``fetch`` returns a copy and ``feed`` stores one, for JSON values too."""
    fed = {"counts": [1, 2], "name": "x"}
    session.feed("state", fed, node="a")
    fed["counts"].append(99)
    got = session.fetch("state", node="a")
    assert got == {"counts": [1, 2], "name": "x"}
    got["counts"].append(3)
    assert session.fetch("state", node="a") == {"counts": [1, 2], "name": "x"}


def test_output_list_keeps_json_list_values_whole(session):
    """§1.3: ``output_list().fetch()`` gives one value per name, even when a value is a JSON list."""

    def make(ws):
        ws.update(arr=np.arange(3), js=[1, 2], p=[5], q="text", r=[[]])

    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(make, node="a", outputs=["arr", "js"])
        task.add_output(["p", "q"])
        task.add_output("r")
    session.run(group)
    output_list = task.output_list()
    assert output_list.names() == ["arr", "js", "p", "q", "r"]
    arr, js, p, q, r = output_list.fetch()
    assert (arr.tolist(), js, p, q, r) == ([0, 1, 2], [1, 2], [5], "text", [[]])


def test_copy_uploader_to_memory_url(prefix):
    """§1.7: the ready builder copies the final epoch to any fsspec destination (here ``memory://``)."""
    import uuid

    destination = f"memory://spec-upload-{uuid.uuid4().hex[:8]}/copy"
    runner = dj.JobRunner(
        counter_job(),
        dj.MultiNodeCheckpointManager(prefix),
        upload_task_group_builder=dj.CopyCheckpointUploader(destination),
        max_epochs=2,
        progress=False,
    )
    assert runner.train(dj.LocalSession()) == 2
    view = dj.open_checkpoint(destination)
    assert (view.epoch, view.nodes, int(view["a"]["n"])) == (2, ["a"], 2)
    assert [c.epoch for c in dj.list_checkpoints(destination)] == [2]


def test_upload_builder_base_must_be_subclassed():
    """§1.7: the base ``UploadTaskGroupBuilder.build`` is abstract."""
    with pytest.raises(NotImplementedError):
        dj.UploadTaskGroupBuilder().build(1, None)


SPEC_NAMES = [
    "Node",
    "Cluster",
    "Workspace",
    "WorkspaceType",
    "Task",
    "TaskOutput",
    "final_output",
    "SetupNets",
    "TaskGroup",
    "Job",
    "epoch_limiter",
    "Session",
    "LocalSession",
    "DaskSession",
    "node_cluster",
    "node_resource",
    "CheckpointManager",
    "MultiNodeCheckpointManager",
    "get_ckpt_filename",
    "db_name",
    "UploadTaskGroupBuilder",
    "list_checkpoints",
    "open_checkpoint",
    "JobRunner",
    "errors",
]


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_spec_name_is_exported(name):
    """§1: every name SPEC lists is exported from ``daskjobs`` and in ``__all__``."""
    assert name in dj.__all__
    assert getattr(dj, name) is not None


@pytest.mark.parametrize("name", ["Reader", "ArrayReader", "ReaderWithLimit", "pipe"])
def test_reader_names_are_exported(name):
    """§1.9: the reader names are exported too."""
    assert name in dj.__all__
    assert getattr(dj, name) is not None


@pytest.mark.parametrize("bad", [True, 1.5, "2", -3])
def test_resume_from_epoch_validated_without_a_manager(bad):
    """§2.9: a non-int or negative ``resume_from_epoch`` raises at once, also with no manager."""
    with pytest.raises((TypeError, ValueError), match="resume_from_epoch"):
        dj.JobRunner(counter_job(), resume_from_epoch=bad, max_epochs=4, progress=False).train(None)


def test_reprs_do_not_freeze_a_job_being_defined(session):
    """§1.5/§5: showing a job in a notebook while defining it does not stop more tasks being added."""
    with dj.Cluster(), dj.Job() as job:
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)), node="a")
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), node="a")
        for shown in (job, job.epoch_group, job.init_group):
            repr(shown)
            shown._repr_html_()
        assert job.nodes_to_checkpoint() == ["a"]
        assert job.epoch_group.used_nodes() == ["a"]
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 10), node="a", workspace_type=dj.WorkspaceType.PRIVATE)
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("m", np.int64(1)), node="b")
    assert job.nodes_to_checkpoint() == ["a", "b"]
    assert dj.JobRunner(job, max_epochs=1, progress=False).train(session) == 1


def test_set_params_forwards_to_the_handler(prefix):
    """§1.7: ``set_params`` forwards prefix, type and node names; the single-node manager names its own node."""
    handler = RecordingHandler()
    dj.MultiNodeCheckpointManager(prefix, metadata_handler=handler).set_params(["b", dj.Node("a")])
    single = RecordingHandler()
    dj.CheckpointManager(prefix, "ps", metadata_handler=single).set_params(["ps"], path_prefix=None, path_type=None)
    assert handler.calls == [("set_params", "zarr", ["b", "a"])]
    assert single.calls == [("set_params", "zarr", ["ps"])]


def test_final_output_sees_every_instance(session):
    """§1.3: a task's output is captured after all of its instances (and ``task_exit``) finished."""

    def bump(ws):
        with ws.lock:
            ws["count"] = np.int64(ws["count"] + 1)

    with (
        dj.Cluster(),
        dj.TaskGroup() as group,
        dj.Task(bump, node="a", num_instances=3, task_init=lambda ws: ws.__setitem__("count", np.int64(0))),
    ):
        out = dj.final_output("count")
    session.run(group)
    assert int(out.fetch()) == 3


@pytest.mark.cluster
def test_node_cluster_workers_provide_node_resources(shared_cluster):
    """§1.6: each node's worker provides the resource ``dj.node_resource(node)``; one worker may serve several."""
    from distributed import Client

    with Client(shared_cluster, set_as_default=False) as client:
        workers = client.scheduler_info()["workers"].values()
        providers = {
            node: [w["name"] for w in workers if dj.node_resource(node) in w.get("resources", {})]
            for node in ["local", "a", "b", "c", "ps"]
        }
    assert providers == {"local": ["w0"], "a": ["w0"], "b": ["w1"], "c": ["w0"], "ps": ["w1"]}
