"""The error tree: every class pickles, subclasses DaskJobsError and the matching builtin."""

from __future__ import annotations

import pickle
import signal

import pytest

import daskjobs as dj
from daskjobs import errors
from daskjobs.runner._interrupt import AbandonedRun

BUILTIN = {
    "DaskJobsError": Exception,
    "ConfigError": ValueError,
    "JobDefinitionError": ValueError,
    "DefinitionTypeError": TypeError,
    "StepTypeError": TypeError,
    "TargetError": ValueError,
    "TargetLoadError": RuntimeError,
    "BlobTypeError": TypeError,
    "StopConditionError": TypeError,
    "InvalidStateError": RuntimeError,
    "OutputNotReadyError": RuntimeError,
    "SessionClosedError": RuntimeError,
    "TaskFailedError": RuntimeError,
    "TaskValueError": ValueError,
    "TaskTypeError": TypeError,
    "NodePlacementError": RuntimeError,
    "NodeLostError": RuntimeError,
    "SessionLostError": ConnectionError,
    "SchedulerAddressError": ValueError,
    "JobInterruptedError": RuntimeError,
    "ResumeCheckError": RuntimeError,
    "ResumeDivergenceError": AssertionError,
    "CheckpointError": OSError,
    "CheckpointNotFoundError": FileNotFoundError,
    "CheckpointCorruptError": OSError,
    "CheckpointFormatError": OSError,
    "CheckpointLockedError": OSError,
    "CheckpointStorageError": OSError,
    "CheckpointWriteError": OSError,
}
CHECKPOINT = {name for name, base in BUILTIN.items() if name.startswith("Checkpoint") and name != "CheckpointError"}


def test_all_lists_every_expected_error():
    """errors.__all__ is sorted and holds exactly the known error classes."""
    assert errors.__all__ == sorted(errors.__all__)
    assert set(errors.__all__) == set(BUILTIN)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_error_hierarchy(name):
    """Each error subclasses DaskJobsError and its matching builtin, and has a docstring."""
    cls = getattr(errors, name)
    assert issubclass(cls, errors.DaskJobsError)
    assert issubclass(cls, BUILTIN[name])
    assert cls.__dict__.get("__doc__")
    if name in CHECKPOINT:
        assert issubclass(cls, errors.CheckpointError)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_error_pickles(name):
    """Each error survives pickling with its type, message and attributes."""
    cls = getattr(errors, name)
    error = cls("something about node 'a' went wrong")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == "something about node 'a' went wrong"
    assert copy.args == error.args
    with pytest.raises(BUILTIN[name]) as caught:
        raise copy
    assert caught.value is copy


@pytest.mark.parametrize("name", ["NodeLostError", "NodePlacementError", "CheckpointStorageError"])
def test_node_errors_keep_nodes_through_pickle(name):
    """Node errors keep the nodes they name through pickling."""
    cls = getattr(errors, name)
    error = cls("nodes a and b have no worker", ["a", "b"])
    copy = pickle.loads(pickle.dumps(error))
    assert copy.nodes == ["a", "b"]
    assert str(copy) == "nodes a and b have no worker"


def test_resume_check_error_keeps_its_run_through_pickle():
    """A ResumeCheckError keeps the run it names through pickling."""
    copy = pickle.loads(pickle.dumps(errors.ResumeCheckError("run kill@3 failed: ...", "kill@3")))
    assert (copy.run, str(copy)) == ("kill@3", "run kill@3 failed: ...")


def test_task_failed_error_keeps_fields_and_cause_through_pickle():
    """A TaskFailedError keeps job, group, node, task, epoch, traceback text and its cause through pickling."""
    try:
        try:
            raise KeyError("missing blob")
        except KeyError as cause:
            raise errors.TaskFailedError("task failed", "job1", "epoch", "a", "a/t", 3, "Traceback ...") from cause
    except errors.TaskFailedError as raised:
        error = raised
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.job, copy.group, copy.node, copy.task, copy.epoch, copy.remote_traceback) == (
        "task failed",
        "job1",
        "epoch",
        "a",
        "a/t",
        3,
        "Traceback ...",
    )
    assert type(copy.__cause__) is KeyError
    assert copy.__cause__.args == ("missing blob",)
    twice = pickle.loads(pickle.dumps(copy))
    assert type(twice.__cause__) is KeyError


def test_task_failed_error_without_cause_pickles():
    """A TaskFailedError without a cause pickles to one without a cause."""
    copy = pickle.loads(pickle.dumps(errors.TaskFailedError("plain")))
    assert copy.__cause__ is None
    assert (copy.job, copy.epoch, copy.remote_traceback) == (None, None, "")


def test_errors_reachable_from_package():
    """dj.errors is the errors module."""
    assert dj.errors is errors


def _run_and_modify_group() -> None:
    with dj.Cluster(), dj.TaskGroup() as group:
        task = dj.Task(lambda ws: None)
    with dj.LocalSession() as session:
        session.run(group)
    task.add_output("x")


def _fetch_without_node() -> None:
    with dj.LocalSession() as session:
        session.feed("x", 1, node="a")
        session.feed("x", 2, node="b")
        session.fetch("x")


@pytest.mark.parametrize(
    ("misuse", "expected", "builtin"),
    [
        (_run_and_modify_group, errors.InvalidStateError, RuntimeError),
        (dj.Job.current, errors.InvalidStateError, RuntimeError),
        (_fetch_without_node, errors.JobDefinitionError, ValueError),
        (lambda: dj.node_cluster([]), errors.JobDefinitionError, ValueError),
        (lambda: dj.node_cluster(["a"], nthreads=0), errors.JobDefinitionError, ValueError),
        (lambda: dj.node_cluster("a"), errors.DefinitionTypeError, TypeError),
        (lambda: dj.DaskSession(5), errors.DefinitionTypeError, TypeError),
        (lambda: dj.CopyCheckpointUploader("memory://copy").build(3, None), errors.JobDefinitionError, ValueError),
        (lambda: dj.MultiNodeCheckpointManager("memory://unused").nodes(), errors.InvalidStateError, RuntimeError),
        (lambda: dj.MultiNodeCheckpointManager("memory://unused").blob_list(), errors.InvalidStateError, RuntimeError),
    ],
    ids=[
        "task-after-run",
        "job-current",
        "fetch-no-node",
        "cluster-no-nodes",
        "cluster-nthreads",
        "cluster-one-node",
        "session-target",
        "uploader-no-manager",
        "manager-nodes",
        "manager-blob-list",
    ],
)
def test_library_errors_are_in_the_tree(misuse, expected, builtin):
    """Misuse of the API raises a DaskJobsError that is also the builtin it used to be."""
    with pytest.raises(expected) as caught:
        misuse()
    assert isinstance(caught.value, errors.DaskJobsError)
    assert isinstance(caught.value, builtin)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_abandoned_run_pickles(signum):
    """What a second signal raises internally is the ``__context__`` of the public error; it
    pickles too (tblib, which distributed installs, pickles the chain)."""
    copy = pickle.loads(pickle.dumps(AbandonedRun(signum)))
    assert isinstance(copy, KeyboardInterrupt)
    assert copy.signum == signum
    assert str(copy) == str(AbandonedRun(signum))
