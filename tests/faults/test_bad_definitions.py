"""Fault catalogue: bad arguments to every public constructor and method of the job model.

Each case raises the exact error type when the object is built (a wrong kind is a
``DefinitionTypeError``, both ``TypeError`` and ``ValueError``; a bad value of the right kind is a
``JobDefinitionError``; a step that is not a plain synchronous callable is a ``StepTypeError``),
names the bad thing, and registers nothing: no task in the group, no node in the cluster.
An unpicklable step on a DaskSession fails naming its task before anything runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import threading

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import DefinitionTypeError, JobDefinitionError, StepTypeError, TaskFailedError, TaskValueError


def noop(ws):
    """A plain step."""


async def async_step(ws):
    """An async def step: calling it runs nothing."""


def generator_step(ws):
    """A generator step: calling it runs nothing."""
    yield


async def async_generator_step(ws):
    """An async generator step."""
    yield


class AsyncCallable:
    """An object whose __call__ is async."""

    async def __call__(self, ws):
        pass


class GeneratorMethod:
    """A bound method that is a generator function."""

    def step(self, ws):
        yield


NOT_PLAIN = {
    "async-def": async_step,
    "generator": generator_step,
    "async-generator": async_generator_step,
    "partial-of-async": functools.partial(async_step),
    "partial-of-partial-of-generator": functools.partial(functools.partial(generator_step)),
    "async-call": AsyncCallable(),
    "generator-method": GeneratorMethod().step,
    "not-callable": 3,
}

STEP_PLACES = {
    "step": lambda s: dj.Task(s),
    "step-list": lambda s: dj.Task([noop, s]),
    "task_init": lambda s: dj.Task(noop, task_init=s),
    "task_exit": lambda s: dj.Task(noop, task_exit=[s]),
    "instance_init": lambda s: dj.Task(noop, instance_init=s),
    "instance_exit": lambda s: dj.Task(noop, instance_exit=s),
    "setup-init": lambda s: dj.SetupNets(init_nets=s),
    "setup-exit": lambda s: dj.SetupNets(exit_nets=[noop, s]),
    "report_step": lambda s: dj.TaskGroup.current().report_step(s),
    "session-run": lambda s: dj.LocalSession().run(s),
}


@pytest.mark.parametrize(
    ("kind", "place"),
    # session.run(3) is not a step at all: session.run refuses it as a runnable.
    [(k, p) for k in NOT_PLAIN for p in STEP_PLACES if (k, p) != ("not-callable", "session-run")],
)
def test_step_that_is_not_a_plain_callable_is_refused_when_built(kind, place):
    """async def, generator functions (also behind partial or __call__) and non-callables raise StepTypeError."""
    with dj.Cluster() as cluster, dj.TaskGroup() as group, pytest.raises(StepTypeError) as info:
        STEP_PLACES[place](NOT_PLAIN[kind])
    assert type(info.value) is StepTypeError
    assert isinstance(info.value, TypeError)
    assert "plain synchronous" in str(info.value) or "callables" in str(info.value)
    assert group.num_registered_tasks() == 0
    assert group.report_steps() == []
    assert cluster.nodes() == []


def _job() -> dj.Job:
    return dj.Job(name="j")


def _reader(**options: object) -> dj.ArrayReader:
    with dj.Job(name="j") as job, job.init_group:
        return dj.ArrayReader(np.arange(4), name="r", **{"batch_size": 2, **options})


def _limited(**options: object) -> dj.ReaderWithLimit:
    with dj.Cluster(), dj.Job(name="j") as job:  # the valid reader's node stays out of the test's cluster
        with job.init_group:
            reader = dj.ArrayReader(np.arange(4), batch_size=2, name="r")
        return dj.ReaderWithLimit(reader, **options)


def _piped(num_threads: object) -> dj.Task:
    with dj.Cluster(), dj.Job(name="j") as job:
        with job.init_group:
            reader = dj.ArrayReader(np.arange(4), batch_size=2, name="r")
        return dj.pipe(reader, lambda ws, batch: None, num_threads=num_threads)


BAD = {
    # id: (call, exact error type, text the message must contain)
    "node-int-name": (lambda: dj.Node(3), DefinitionTypeError, "3"),
    "node-none-name": (lambda: dj.Node(None), DefinitionTypeError, "None"),
    "node-bytes-name": (lambda: dj.Node(b"a"), DefinitionTypeError, "b'a'"),
    "node-dotdot-name": (lambda: dj.Node(".."), JobDefinitionError, "'..'"),
    "node-resource-bool": (lambda: dj.Node("a", GPU=True), DefinitionTypeError, "GPU"),
    "node-resource-str": (lambda: dj.Node("a", GPU="1"), DefinitionTypeError, "GPU"),
    "node-resource-zero": (lambda: dj.Node("a", GPU=0), JobDefinitionError, "GPU"),
    "node-resource-nan": (lambda: dj.Node("a", GPU=float("nan")), JobDefinitionError, "GPU"),
    "node-resource-inf": (lambda: dj.Node("a", GPU=float("inf")), JobDefinitionError, "GPU"),
    "node-resource-bad-name": (lambda: dj.Node("a", **{"G=1": 1}), JobDefinitionError, "'G=1'"),
    "task-workspace-type": (lambda: dj.Task(noop, workspace_type="globl"), JobDefinitionError, "WorkspaceType"),
    "task-workspace-type-kind": (lambda: dj.Task(noop, workspace_type=1), DefinitionTypeError, "WorkspaceType"),
    "task-instances-bool": (lambda: dj.Task(noop, num_instances=True), DefinitionTypeError, "num_instances"),
    "task-instances-float": (lambda: dj.Task(noop, num_instances=2.0), DefinitionTypeError, "num_instances"),
    "task-instances-str": (lambda: dj.Task(noop, num_instances="2"), DefinitionTypeError, "num_instances"),
    "task-instances-zero": (lambda: dj.Task(noop, num_instances=0), JobDefinitionError, "num_instances"),
    "task-name-int": (lambda: dj.Task(noop, name=3), DefinitionTypeError, "3"),
    "task-name-slash": (lambda: dj.Task(noop, name="a/b"), JobDefinitionError, "'a/b'"),
    "task-name-empty": (lambda: dj.Task(noop, name=""), JobDefinitionError, "''"),
    "task-group-str": (lambda: dj.Task(noop, group="g"), DefinitionTypeError, "TaskGroup"),
    "task-node-int": (lambda: dj.Task(noop, node=3), DefinitionTypeError, "3"),
    "task-node-dotdot": (lambda: dj.Task(noop, node="../x"), JobDefinitionError, "'../x'"),
    "task-outputs-zarr-json": (lambda: dj.Task(noop, outputs="zarr.json"), JobDefinitionError, "'zarr.json'"),
    "task-outputs-int": (lambda: dj.Task(noop, outputs=3), DefinitionTypeError, "outputs"),
    "task-outputs-slash": (lambda: dj.Task(noop, outputs="a/b"), JobDefinitionError, "'a/b'"),
    "task-outputs-dunder": (lambda: dj.Task(noop, outputs=["ok", "__x"]), JobDefinitionError, "'__x'"),
    "task-outputs-nested-int": (lambda: dj.Task(noop, outputs=[["a", 3]]), DefinitionTypeError, "3"),
    "task-inputs-list": (lambda: dj.Task(noop, inputs=["x"]), DefinitionTypeError, "inputs"),
    "task-inputs-bad-local": (
        lambda: dj.Task(noop, inputs={"../x": dj.TaskOutput("y")}),
        JobDefinitionError,
        "'../x'",
    ),
    "task-inputs-not-output": (lambda: dj.Task(noop, inputs={"x": "y"}), DefinitionTypeError, "TaskOutput"),
    "task-inputs-two-blobs": (
        lambda: dj.Task(noop, inputs={"x": dj.TaskOutput(["p", "q"])}),
        JobDefinitionError,
        "single-blob",
    ),
    "output-int": (lambda: dj.TaskOutput(3), DefinitionTypeError, "3"),
    "output-empty": (lambda: dj.TaskOutput([]), JobDefinitionError, "at least one"),
    "output-int-in-list": (lambda: dj.TaskOutput(["a", 3]), DefinitionTypeError, "3"),
    "final-output-dotdot": (lambda: dj.final_output(".."), JobDefinitionError, "'..'"),
    "final-output-int": (lambda: dj.final_output(3), DefinitionTypeError, "3"),
    "group-workspace-type": (lambda: dj.TaskGroup("shared"), JobDefinitionError, "WorkspaceType"),
    "group-workspace-type-kind": (lambda: dj.TaskGroup(True), DefinitionTypeError, "WorkspaceType"),
    "report-interval-zero": (lambda: dj.TaskGroup().report_step(noop, interval_ms=0), JobDefinitionError, "interval"),
    "report-interval-negative": (
        lambda: dj.TaskGroup().report_step(noop, interval_ms=-5),
        JobDefinitionError,
        "interval",
    ),
    "report-interval-below-1": (
        lambda: dj.TaskGroup().report_step(noop, interval_ms=0.5),
        JobDefinitionError,
        "interval",
    ),
    "report-interval-nan": (
        lambda: dj.TaskGroup().report_step(noop, interval_ms=float("nan")),
        JobDefinitionError,
        "interval",
    ),
    "report-interval-str": (
        lambda: dj.TaskGroup().report_step(noop, interval_ms="x"),
        DefinitionTypeError,
        "interval",
    ),
    "report-interval-bool": (
        lambda: dj.TaskGroup().report_step(noop, interval_ms=True),
        DefinitionTypeError,
        "interval",
    ),
    "report-no-step": (lambda: dj.TaskGroup().report_step(None), JobDefinitionError, "needs a step"),
    "report-step-list": (lambda: dj.TaskGroup().report_step([noop, noop]), DefinitionTypeError, "one callable"),
    "report-node-dotdot": (lambda: dj.TaskGroup().report_step(noop, node=".."), JobDefinitionError, "'..'"),
    "local-setup-list": (lambda: dj.TaskGroup().add_local_setup([noop]), DefinitionTypeError, "SetupNets"),
    "local-setup-node": (
        lambda: dj.TaskGroup().add_local_setup(dj.SetupNets(noop), node="a b"),
        JobDefinitionError,
        "'a b'",
    ),
    "tasks-by-node-str": (lambda: dj.TaskGroup().tasks_by_node("a"), DefinitionTypeError, "node_remap"),
    "tasks-by-node-bad-target": (
        lambda: dj.TaskGroup().tasks_by_node({"a": "../b"}),
        JobDefinitionError,
        "'../b'",
    ),
    "job-empty-name": (lambda: dj.Job(name=""), JobDefinitionError, "''"),
    "job-int-name": (lambda: dj.Job(name=3), DefinitionTypeError, "3"),
    "job-group-str": (lambda: dj.Job(init_group="g"), DefinitionTypeError, "init_group"),
    "job-same-group-twice": (
        lambda: dj.Job(epoch_group=(g := dj.TaskGroup()), exit_group=g),
        JobDefinitionError,
        "same TaskGroup",
    ),
    "job-stop-conditions-int": (lambda: dj.Job(stop_conditions=3), DefinitionTypeError, "stop_conditions"),
    "job-stop-condition-bad-name": (lambda: dj.Job(stop_conditions=["a/b"]), JobDefinitionError, "'a/b'"),
    "job-nodes-int": (lambda: dj.Job(nodes_to_checkpoint=[3]), DefinitionTypeError, "3"),
    "job-nodes-dotdot": (lambda: dj.Job(nodes_to_checkpoint=["a", "../x"]), JobDefinitionError, "'../x'"),
    "job-nodes-dict": (lambda: dj.Job(nodes_to_checkpoint={"a": 1}), DefinitionTypeError, "nodes_to_checkpoint"),
    "stop-condition-bad-name": (lambda: _job().add_stop_condition("bad/name"), JobDefinitionError, "'bad/name'"),
    "stop-condition-int": (lambda: _job().add_stop_condition(3), DefinitionTypeError, "TaskOutput"),
    "stop-condition-two-blobs": (
        lambda: _job().add_stop_condition(dj.TaskOutput(["a", "b"])),
        JobDefinitionError,
        "exactly one",
    ),
    "limiter-not-a-job": (lambda: dj.epoch_limiter("job", 3), DefinitionTypeError, "Job"),
    "limiter-bool": (lambda: dj.epoch_limiter(_job(), True), DefinitionTypeError, "num_epochs"),
    "limiter-float": (lambda: dj.epoch_limiter(_job(), 1.5), DefinitionTypeError, "num_epochs"),
    "limiter-str": (lambda: dj.epoch_limiter(_job(), "3"), DefinitionTypeError, "num_epochs"),
    "limiter-none": (lambda: dj.epoch_limiter(_job(), None), DefinitionTypeError, "num_epochs"),
    "limiter-zero": (lambda: dj.epoch_limiter(_job(), 0), JobDefinitionError, "num_epochs"),
    "limiter-bad-node": (lambda: dj.epoch_limiter(_job(), 3, node="../x"), JobDefinitionError, "'../x'"),
    "metric-bad-name": (
        lambda: dj.LocalSession().run(lambda ws: ws.log("a\nb", 1.0)),
        TaskValueError,  # a TaskFailedError that is also the ValueError of the bad name
        "invalid metric name 'a\\nb'",
    ),
    "reader-float-batch": (lambda: _reader(batch_size=1.5), DefinitionTypeError, "reader 'r': batch_size"),
    "reader-str-passes": (lambda: _reader(num_passes="2"), DefinitionTypeError, "reader 'r': num_passes"),
    "reader-bool-seed": (lambda: _reader(seed=True), DefinitionTypeError, "reader 'r': seed"),
    "reader-zero-batch": (lambda: _reader(batch_size=0), JobDefinitionError, "reader 'r': batch_size"),
    "limit-float": (lambda: _limited(num_iter=1.5), DefinitionTypeError, "num_iter"),
    "limit-negative": (lambda: _limited(num_iter=-1), JobDefinitionError, "num_iter"),
    "pipe-float-threads": (lambda: _piped(2.0), DefinitionTypeError, "num_threads"),
    "pipe-zero-threads": (lambda: _piped(0), JobDefinitionError, "num_threads"),
    "runner-float-max-epochs": (lambda: dj.JobRunner(_job(), max_epochs=1.5), DefinitionTypeError, "max_epochs"),
    "runner-zero-max-epochs": (lambda: dj.JobRunner(_job(), max_epochs=0), JobDefinitionError, "max_epochs"),
    "runner-str-max-failures": (lambda: dj.JobRunner(_job(), max_failures="1"), DefinitionTypeError, "max_failures"),
    "manager-float-keep-last": (
        lambda: dj.MultiNodeCheckpointManager("memory://bad-definitions", keep_last=1.5),
        DefinitionTypeError,
        "keep_last",
    ),
    "manager-zero-keep-every": (
        lambda: dj.MultiNodeCheckpointManager("memory://bad-definitions", keep_every=0),
        JobDefinitionError,
        "keep_every",
    ),
    "cluster-float-threads": (lambda: dj.node_cluster(["a"], nthreads=1.5), DefinitionTypeError, "nthreads"),
    "feed-bad-blob": (lambda: dj.LocalSession().feed("a/b", 1, node="a"), JobDefinitionError, "'a/b'"),
    "feed-int-blob": (lambda: dj.LocalSession().feed(3, 1, node="a"), DefinitionTypeError, "3"),
    "fetch-bad-blob": (lambda: dj.LocalSession().fetch("..", node="a"), JobDefinitionError, "'..'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_argument_raises_exact_error_at_construction(case):
    """Each bad argument raises its exact error type naming the bad thing, and registers no task or node."""
    call, error, text = BAD[case]
    with dj.Cluster() as cluster, dj.TaskGroup() as group, pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert text in str(info.value)
    if not issubclass(error, TaskFailedError):
        assert group.num_registered_tasks() == 0
        assert cluster.nodes() == []


def test_wrong_kinds_are_both_type_and_value_errors():
    """DefinitionTypeError is a TypeError and a JobDefinitionError (ValueError); StepTypeError is one too."""
    assert issubclass(DefinitionTypeError, TypeError)
    assert issubclass(DefinitionTypeError, JobDefinitionError)
    assert issubclass(DefinitionTypeError, ValueError)
    assert issubclass(StepTypeError, DefinitionTypeError)


def test_default_task_name_is_the_steps_name_or_task():
    """A step's ``__name__`` names its task, dunder and non-ASCII names too (task names are labels,
    not paths); a step without one (a partial) gives "task"."""

    def __call__(ws):
        pass

    def étape(ws):
        pass

    with dj.Cluster():
        assert dj.Task(__call__).name == "local/__call__"
        assert dj.Task(étape).name == "local/étape"
        assert dj.Task(functools.partial(noop)).name == "local/task"


def test_good_values_are_accepted():
    """The corrected arguments are accepted (numpy integers count as ints)."""
    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(noop, num_instances=np.int64(3), name="ok", outputs=("a", "b"))
        group.report_step(noop, interval_ms=2.5)
    assert task.num_instances == 3
    job = dj.Job(stop_conditions="done", nodes_to_checkpoint="ps")
    assert job.nodes_to_checkpoint() == ["ps"]
    assert [c.names for c in job.stop_conditions] == [["done"]]
    assert dj.Node("n", GPU=np.float32(0.5)).kwargs() == {"GPU": np.float32(0.5)}


# -- unpicklable steps on a DaskSession ----------------------------------------------------------

_lock = threading.Lock()


# A lambda has no importable name, so cloudpickle sends it by value, with the globals it uses.
_global_lock_step = lambda ws: ws.__setitem__("x", _lock.locked())  # noqa: E731


def _closure_over(value):
    def step(ws):
        ws["x"] = repr(value)

    return step


UNPICKLABLE = {
    # id: (make the step, closing resources on the stack; what the message names)
    "global-lock": (lambda stack: _global_lock_step, "_lock"),
    "closure-lock": (lambda stack: _closure_over(threading.RLock()), "value"),
    "closure-generator": (lambda stack: _closure_over(i for i in range(3)), "value"),
    "closure-socket": (lambda stack: _closure_over(stack.enter_context(socket.socket())), "value"),
    "partial-file": (lambda stack: functools.partial(noop_with, stack.enter_context(open(os.devnull, "w"))), "partial"),  # noqa: SIM115
}


def noop_with(resource, ws):
    """A step taking an extra resource first."""


@pytest.mark.cluster
@pytest.mark.parametrize("kind", list(UNPICKLABLE))
def test_unpicklable_step_on_dask_session_names_its_task(kind, shared_cluster):
    """On worker processes, a step that cannot be pickled fails its run with TaskFailedError naming job, group,
    node, task and what it refers to; nothing ran on any node and the session stays usable."""
    make, culprit = UNPICKLABLE[kind]
    with contextlib.ExitStack() as stack:
        _check_unpicklable(make(stack), culprit, shared_cluster)


def _check_unpicklable(step, culprit, shared_cluster):
    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(lambda ws: ws.__setitem__("ran", 1), node="b", name="fine")
        dj.Task(step, node="a", name="unpicklable")
    with dj.DaskSession(shared_cluster) as session:
        with pytest.raises(TaskFailedError) as info:
            session.run_group(group, job="pickles")
        error = info.value
        assert (error.job, error.node, error.task) == ("pickles", "a", "a/unpicklable")
        assert error.group == group.label
        assert re.search(r"cannot be pickled", str(error))
        assert culprit in str(error)
        assert isinstance(error.__cause__, Exception)
        session.feed("y", 1, node="a")
        assert int(session.fetch("y", node="a")) == 1
        assert "x" not in session.blobs("a")
