"""Naming the step that stops a run from being sent to Dask workers (it cannot be pickled)."""

from __future__ import annotations

import functools
import inspect

import cloudpickle

from .._execute import NodePlan, RunInfo
from .._lowering import LoweredTask
from .._model.task import Step
from ..errors import TaskFailedError


def unpicklable_step_error(task: LoweredTask) -> TaskFailedError | None:
    """The error naming job, group, node, task and step when submitting ``task`` failed because a
    user step cannot be pickled; ``None`` when every step pickles (the failure is someone else's).
    Its ``__cause__`` is the step's pickling error.

    Only called after a submission failed, so the extra pickling costs nothing on the happy path.
    """
    run = next((a for a in task.args if isinstance(a, RunInfo)), None)
    for plan in (a for a in task.args if isinstance(a, NodePlan)):
        for task_name, step in plan.steps():
            try:
                cloudpickle.dumps(step)
            except Exception as cause:
                epoch = None if run is None else run.epoch
                at = "" if epoch is None else f", epoch {epoch}"
                message = (
                    f"task {task_name!r} failed in the {plan.group} group of job {plan.job!r} on node "
                    f"{plan.node!r}{at}: it cannot be sent to the node's worker because step {_label(step)}"
                    f"{_culprit(step)} cannot be pickled ({type(cause).__name__}: {cause}). A DaskSession runs "
                    "steps in worker processes: create locks, sockets, open files and generators inside the "
                    "step (or in task_init) instead of capturing them, or run on a LocalSession"
                )
                error = TaskFailedError(message, plan.job, plan.group, plan.node, task_name, epoch)
                error.__cause__ = cause
                return error
    return None


def _label(step: Step) -> str:
    return repr(getattr(step, "__qualname__", None) or step)


def _culprit(step: Step) -> str:
    """``" (through <what it refers to>)"`` for the first thing ``step`` refers to that does not pickle."""
    target = step
    while isinstance(target, functools.partial):
        for i, arg in enumerate(target.args):
            if not _pickles(arg):
                return f" (through its partial argument {i}, a {type(arg).__name__})"
        for key, arg in target.keywords.items():
            if not _pickles(arg):
                return f" (through its partial argument {key}=, a {type(arg).__name__})"
        target = target.func
    if inspect.isfunction(target):
        refs = inspect.getclosurevars(target)
        named = [("closure variable", refs.nonlocals), ("global", refs.globals)]
    elif not inspect.isroutine(target):
        named = [("attribute", getattr(target, "__dict__", {}))]
    else:
        named = []
    for kind, values in named:
        for name, value in values.items():
            if not _pickles(value):
                return f" (through its {kind} {name!r}, a {type(value).__name__})"
    return ""


def _pickles(value: object) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:
        return False
    return True
