"""How a node's steps travel to the worker that runs them, and turn back into functions there.

Dask pickles a task's arguments with plain pickle first, which refers to a function by its module
and name. A worker that cannot import that module (a job file that ``daskjobs run`` loaded, a
helper module next to it, a notebook's code) then fails to *deserialise* the task: Dask takes that
for the worker dying, and the job would lose the node. So daskjobs pickles a node's plan itself:
each task's steps become bytes made by cloudpickle (which pickles the modules registered with
:func:`cloudpickle.register_pickle_by_value` by value: ``daskjobs run`` registers the job file and
the helper modules next to it), and the worker turns them back into functions inside the Dask task
that runs them (:func:`unpack_plan`). A module the worker cannot import fails that task with a
:class:`~daskjobs.errors.TaskFailedError` naming the task, the node and the module; the worker
lives on and nothing is retried.

Pickling a :class:`~.plan.NodePlan` gives its :class:`PackedPlan` (registered with
:mod:`copyreg`, for plain pickle and cloudpickle alike). A plan is packed once (its group is
compiled once per job), and a worker keeps the plans it unpacked (by digest, the last
:data:`_KEEP_UNPACKED`): a job file's module state then lives on the worker across epochs, as it
would in a module the worker imported.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import pickle
import threading
import traceback
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import cloudpickle
import xxhash

from .._model.task import Step, WorkspaceType
from ..errors import TaskFailedError
from .plan import NodePlan, RunInfo, TaskSpec
from .sources import SourceFiles, restore_source_files, source_files

_KEEP_UNPACKED = 64
"""Unpacked plans a process keeps (a job has a few groups per node; a session a few jobs)."""


@dataclass(frozen=True)
class PackedPart:
    """Some of a plan's steps as cloudpickle bytes, with the task they belong to."""

    task: str
    payload: bytes


@dataclass(frozen=True)
class PackedPlan:
    """A :class:`~.plan.NodePlan` as it travels: names in the clear, steps as bytes.

    Unpickling it needs nothing but daskjobs: the scheduler and the worker's connection never
    import a user's module. :func:`unpack_plan` makes the plan again, where its steps run.
    """

    job: str
    group: str
    node: str
    workspace_type: WorkspaceType
    parts: tuple[PackedPart, ...]
    files: SourceFiles
    digest: str


_packed: weakref.WeakKeyDictionary[NodePlan, PackedPlan] = weakref.WeakKeyDictionary()
"""The packed form of every plan packed so far (a plan is packed once)."""


def pack_plan(plan: NodePlan) -> PackedPlan:
    """``plan`` with each task's steps (and the node's report and setup steps) as cloudpickle bytes,
    made once per plan.

    Raises
    ------
    TaskFailedError
        A step cannot be pickled; the message names task, node and the step (and what in it
        does not pickle).
    """
    packed = _packed.get(plan)
    if packed is None:
        packed = _packed[plan] = _pack(plan)
    return packed


def _reduce_plan(plan: NodePlan) -> tuple[Any, ...]:
    """How pickle takes a :class:`NodePlan` apart: as its :class:`PackedPlan`."""
    packed = pack_plan(plan)
    return PackedPlan, tuple(getattr(packed, f.name) for f in fields(packed))


copyreg.pickle(NodePlan, _reduce_plan)


def _pack(plan: NodePlan) -> PackedPlan:
    pieces: list[tuple[str, Any]] = [(spec.name, spec) for spec in plan.tasks]
    if plan.report_steps:
        pieces.append((f"{plan.node}/report_step", plan.report_steps))
    if plan.local_setups:
        pieces.append((f"{plan.node}/local_setup", plan.local_setups))
    parts = tuple(PackedPart(task, _dumps(plan, task, value)) for task, value in pieces)
    digest = xxhash.xxh3_128()
    for text in (plan.job, plan.group, plan.node, plan.workspace_type.value):
        digest.update(text.encode() + b"\0")
    for part in parts:
        digest.update(part.task.encode() + b"\0")
        digest.update(len(part.payload).to_bytes(8, "little") + part.payload)
    files = source_files(step for _, step in plan.steps())
    return PackedPlan(plan.job, plan.group, plan.node, plan.workspace_type, parts, files, digest.hexdigest())


def _dumps(plan: NodePlan, task: str, value: Any) -> bytes:
    try:
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as cause:
        steps = [step for name, step in plan.steps() if name == task] or [step for _, step in plan.steps()]
        culprit = next((s for s in steps if not _pickles(s)), None)
        what = "a step" if culprit is None else f"step {_label(culprit)}{_culprit(culprit)}"
        message = (
            f"task {task!r} failed in the {plan.group} group of job {plan.job!r} on node {plan.node!r}: it cannot "
            f"be sent to the node's worker because {what} cannot be pickled ({type(cause).__name__}: {cause}). "
            "A DaskSession runs steps in worker processes: create locks, sockets, open files and generators inside "
            "the step (or in task_init) instead of capturing them, or run on a LocalSession"
        )
        raise TaskFailedError(message, plan.job, plan.group, plan.node, task) from cause


class _Unpacked:
    """The plans this process unpacked, by digest (the newest :data:`_KEEP_UNPACKED`)."""

    def __init__(self) -> None:
        self._plans: OrderedDict[str, NodePlan] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> NodePlan | None:
        with self._lock:
            plan = self._plans.get(digest)
            if plan is not None:
                self._plans.move_to_end(digest)
            return plan

    def put(self, digest: str, plan: NodePlan) -> None:
        with self._lock:
            self._plans[digest] = plan
            while len(self._plans) > _KEEP_UNPACKED:
                self._plans.popitem(last=False)


_unpacked = _Unpacked()


def unpack_plan(plan: NodePlan | PackedPlan, run: RunInfo) -> NodePlan:
    """The plan to run: ``plan`` itself, or the plan a :class:`PackedPlan` packed.

    Raises
    ------
    TaskFailedError
        A part cannot be unpickled here (a module this worker cannot import, a class it lacks, an
        exception raised while unpickling); the message names the task, the node and the module.
    """
    if not isinstance(plan, PackedPlan):
        return plan
    found = _unpacked.get(plan.digest)
    if found is not None:
        return found
    tasks, report_steps, local_setups = [], (), ()
    for part in plan.parts:
        value = _loads(plan, part, run)
        if isinstance(value, TaskSpec):
            tasks.append(value)
        elif part.task.endswith("/report_step"):
            report_steps = value
        else:
            local_setups = value
    unpacked = NodePlan(
        job=plan.job,
        group=plan.group,
        node=plan.node,
        workspace_type=plan.workspace_type,
        tasks=tuple(tasks),
        report_steps=report_steps,
        local_setups=local_setups,
    )
    restore_source_files((step for _, step in unpacked.steps()), plan.files)
    _unpacked.put(plan.digest, unpacked)
    return unpacked


def _loads(plan: PackedPlan, part: PackedPart, run: RunInfo) -> Any:
    try:
        return pickle.loads(part.payload)
    except BaseException as cause:  # whatever unpickling raised (SystemExit from an import included)
        if isinstance(cause, KeyboardInterrupt | GeneratorExit):
            raise
        task = part.task
        at = "" if run.epoch is None else f", epoch {run.epoch}"
        message = (
            f"task {task!r} failed in the {plan.group} group of job {plan.job!r} on node {plan.node!r}{at}: "
            f"its steps cannot be loaded on the node's worker: {_why(cause)}"
        )
        error = TaskFailedError(
            message, plan.job, plan.group, plan.node, task, run.epoch, "".join(traceback.format_exception(cause))
        )
        raise error from cause


def _why(cause: BaseException) -> str:
    """What went wrong unpickling a part, and what would fix it."""
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        return (
            f"the worker cannot import module {cause.name!r} ({type(cause).__name__}: {cause}). Install it where "
            f"the workers run, or let daskjobs send it with the steps: `daskjobs run path/to/file.py:job` sends the "
            f"job file and the modules next to it; in your own code call "
            f"cloudpickle.register_pickle_by_value({cause.name.partition('.')[0]}) before running the job"
        )
    return f"{type(cause).__name__}: {cause}"


def _pickles(value: object) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:
        return False
    return True


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
    named: list[tuple[str, dict[str, Any]]]
    if inspect.isfunction(target):
        refs = inspect.getclosurevars(target)
        named = [("closure variable", dict(refs.nonlocals)), ("global", dict(refs.globals))]
    elif not inspect.isroutine(target):
        named = [("attribute", getattr(target, "__dict__", {}))]
    else:
        named = []
    for kind, values in named:
        for name, value in values.items():
            if not _pickles(value):
                return f" (through its {kind} {name!r}, a {type(value).__name__})"
    return ""
