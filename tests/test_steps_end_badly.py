"""Steps that end badly (SPEC §4): a step raising SystemExit, KeyboardInterrupt or an exception that
cannot be pickled fails its task with TaskFailedError carrying the original type name and message,
on every session kind; the worker survives (the session runs the next group) and nothing hangs."""

from __future__ import annotations

import re
import sys
import threading

import pytest

import daskjobs as dj
from daskjobs.errors import TaskFailedError, UnpicklableCause


class _Unpicklable(Exception):
    """An exception holding a lock: it cannot be pickled."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def exits(ws):
    sys.exit(3)


def interrupts(ws):
    raise KeyboardInterrupt("the step gave up")


def raises_unpicklable(ws):
    raise _Unpicklable("a failure that cannot travel")


STEPS = {
    "SystemExit": (exits, "SystemExit: 3", SystemExit),
    "KeyboardInterrupt": (interrupts, "KeyboardInterrupt: the step gave up", KeyboardInterrupt),
    "unpicklable": (raises_unpicklable, "_Unpicklable: a failure that cannot travel", None),
}


@pytest.fixture(
    params=[
        "local",
        pytest.param("threads", marks=pytest.mark.cluster),
        pytest.param("processes", marks=[pytest.mark.cluster, pytest.mark.slow]),
    ]
)
def any_session(request):
    """A LocalSession, and DaskSessions on node_clusters of in-process and of process workers."""
    if request.param == "local":
        with dj.LocalSession() as session:
            yield request.param, session
        return
    processes = request.param == "processes"
    with dj.node_cluster(["a"], processes=processes) as cluster, dj.DaskSession(cluster) as session:
        yield request.param, session


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(STEPS))
def test_a_step_ending_badly_fails_its_task_and_the_session_goes_on(any_session, name):
    kind, session = any_session
    step, text, cause_type = STEPS[name]
    with dj.Node("a"):
        session.run(lambda ws: ws.__setitem__("n", 1))
        with pytest.raises(TaskFailedError) as info:
            session.run(dj.Task(step, name="bad"))
    error = info.value
    expected = r"task 'a/bad' failed in the group\d+ group of job 'session' on node 'a': " + re.escape(text)
    assert re.fullmatch(expected, str(error)), str(error)
    assert (error.node, error.task) == ("a", "a/bad")
    if cause_type is not None:
        assert type(error.__cause__) is cause_type
    elif kind != "local":  # it left a Dask worker: a stand-in names the original type and message
        assert isinstance(error.__cause__, UnpicklableCause)
        assert error.__cause__.type_name.endswith("._Unpicklable")
        assert str(error.__cause__) == "_Unpicklable: a failure that cannot travel"
    else:
        assert type(error.__cause__).__name__ == "_Unpicklable"
    with dj.Node("a"):
        session.run(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    assert session.fetch("n", node="a") == 2  # the same workspace: the worker lived on


@pytest.mark.parametrize("call", ["run_node_task", "close_node"])
def test_a_run_opened_on_a_worker_that_left_is_reported_as_a_lost_node(call):
    """Edge mode: a node's tasks of one run reach a worker that did not open the run (the node's
    worker left and a replacement took its resource): NodeLostError naming the node, never a
    KeyError, so the runner recovers."""
    from daskjobs._execution.lowering import plan_group
    from daskjobs._execution.node_run import close_node, open_node, run_node_task
    from daskjobs._execution.plan import RunInfo
    from daskjobs.errors import NodeLostError
    from daskjobs.session._local import _LocalStates

    with dj.TaskGroup() as group, dj.Node("a"):
        first = dj.Task(lambda ws: ws.__setitem__("x", 1), outputs="x")
        dj.Task(lambda ws: None, inputs={"x_in": first.outputs()[0]})
    plan = plan_group(group, "job").node_plans["a"]
    run = RunInfo("run-1", epoch=3)
    opened = open_node(_LocalStates(), plan, run)  # opened on the old worker
    replacement = _LocalStates()  # the new worker's states: it never saw the run
    if call == "run_node_task":
        calling = lambda: run_node_task(replacement, plan, run, 1, opened, [[1]])  # noqa: E731
    else:
        calling = lambda: close_node(replacement, plan, run, opened, [[1]], [])  # noqa: E731
    with pytest.raises(NodeLostError, match=r"node 'a' lost the run 'run-1' it opened") as info:
        calling()
    assert info.value.nodes == ["a"]
