"""Runs one node's share of a TaskGroup run against that node's workspace (no Dask).

Both sessions call these functions from the Dask tasks that lowering produces: the in-process
session with its own node states, the distributed session on the node's worker.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from .._model.group import ReportStep
from .._model.metrics import MetricLog
from .._model.task import Step, WorkspaceType
from .._model.values import Value, copy_value
from .._model.workspace import Scope, Workspace
from ..errors import DaskJobsError, NodeLostError, StepTypeError, TaskFailedError, TaskTypeError, TaskValueError
from .plan import Captured, NodePlan, NodeResult, RunInfo, TaskSpec
from .shipping import PackedPlan, unpack_plan

_pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="daskjobs-task")


def private_trap_message(job: str, group: str, node: str, blob: str) -> str:
    """The warning for a PRIVATE run that looked ``blob`` up, found it missing and created it."""
    return (
        f"node {node!r}, blob {blob!r}: a PRIVATE run of the {group} group of job {job!r} looked {blob!r} up, "
        f"found it missing and created it in its private workspace, which is discarded when the run ends, so "
        f"{blob!r} starts again from nothing every run. To keep it across epochs, create {blob!r} in the "
        f"job's init group (or make the group GLOBAL). (Warned once per job run, node and blob.)"
    )


Slot = TypeVar("Slot")


@dataclass
class NodeState:
    """A node's persistent workspace plus what the node runtime keeps between runs."""

    node: str
    scope: Scope = field(default_factory=Scope)
    lock: threading.RLock = field(default_factory=threading.RLock)
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    generation: int = 0
    runs: dict[str, NodeRun] = field(default_factory=dict)
    slots: dict[type, object] = field(default_factory=dict)
    """What the layers above keep on the node between runs, one object of each type (see :meth:`slot`)."""
    where: str = "this process"
    """Where the node's workspace lives, for messages: e.g. ``worker 'a' (tcp://10.0.0.5:40211)``."""

    def slot(self, kind: type[Slot]) -> Slot:
        """The node's one ``kind()``, made on first use: what a layer above keeps on the node between
        runs, typed by its own class (the checkpoint's background saves, flushes and staged loads:
        ``CheckpointSlots``), which this layer need not know."""
        found = self.slots.get(kind)
        if found is None:
            found = self.slots.setdefault(kind, kind())
        return cast(Slot, found)

    @property
    def token(self) -> str:
        """Changes when the worker restarts (incarnation) or the workspace is restored."""
        return f"{self.incarnation}.{self.generation}"

    def workspace(self, epoch: int | None = None, metrics: MetricLog | None = None) -> Workspace:
        """The GLOBAL workspace (``metrics`` collects what steps log through it)."""
        return Workspace(self.scope, node=self.node, lock=self.lock, epoch=epoch, state=self, metrics=metrics)

    def replace_blobs(self, blobs: dict[str, Value]) -> None:
        """Make the GLOBAL workspace hold exactly ``blobs`` (assigned by no task) and start a new generation."""
        with self.lock:
            self.scope.blobs = dict(blobs)
            self.scope.writers = {}
            self.generation += 1


class NodeStateProvider(Protocol):
    """Finds a node's state where the node's tasks run."""

    def node_state(self, node: str, token: str | None) -> NodeState:
        """The node's state; raises :class:`NodeLostError` if ``token`` is stale."""


def check_token(state: NodeState, token: str | None) -> NodeState:
    """Refuse to run against a workspace from another worker incarnation or generation."""
    if token is not None and token != state.token:
        raise NodeLostError(
            f"node {state.node!r} lost its workspace (expected generation {token}, found {state.token}): "
            "its worker restarted or the workspace was restored; restore from a checkpoint",
            [state.node],
        )
    return state


def run_concurrently(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` at the same time (the last one in this thread); raise the first failure."""
    if len(calls) <= 1:
        return [call() for call in calls]
    futures: list[Future] = [_pool.submit(call) for call in calls[:-1]]
    results, errors = [None] * len(calls), []
    try:
        results[-1] = calls[-1]()
    except Exception as exc:
        errors.append(exc)
    for i, fut in enumerate(futures):
        try:
            results[i] = fut.result()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


INTERNAL = "daskjobs_internal"
"""Attribute marking a step of daskjobs' own (checkpoint save, load, check, wait): the
:class:`~daskjobs.errors.DaskJobsError` it raises surfaces as itself, not as a user failure."""


def _internal_error(step: Step, exc: BaseException) -> bool:
    """Whether ``exc`` is a daskjobs error raised by one of daskjobs' own steps (and mark it so)."""
    if isinstance(exc, DaskJobsError) and getattr(step, INTERNAL, False):
        setattr(exc, INTERNAL, True)
    return getattr(exc, INTERNAL, False) is True


class _Failure:
    """Turns a user exception into a :class:`TaskFailedError` naming where it happened.

    Errors of daskjobs' own steps (see :data:`INTERNAL`) pass through unchanged.
    """

    def __init__(self, plan: NodePlan, run: RunInfo) -> None:
        self.plan, self.run = plan, run

    def wrap(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except TaskFailedError:
            raise
        except Exception as exc:
            if getattr(exc, INTERNAL, False) is True:
                raise
            raise self._error(what, exc) from exc
        except (SystemExit, KeyboardInterrupt) as exc:
            # A step's own sys.exit() or KeyboardInterrupt (steps run in pool threads, where no
            # signal arrives): a failure of that task, never the end of the worker or of the run.
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> TaskFailedError:
        epoch = "" if self.run.epoch is None else f", epoch {self.run.epoch}"
        message = (
            f"task {what!r} failed in the {self.plan.group} group of job {self.plan.job!r} "
            f"on node {self.plan.node!r}{epoch}: {type(exc).__name__}: {exc}"
        )
        return _failure_class(exc)(
            message,
            self.plan.job,
            self.plan.group,
            self.plan.node,
            what,
            self.run.epoch,
            "".join(traceback.format_exception(exc)),
        )


def _failure_class(cause: BaseException) -> type[TaskFailedError]:
    """The :class:`TaskFailedError` for ``cause``: one that also is the builtin error of a daskjobs
    ``TypeError``/``ValueError`` (a refused blob value, an invalid reader source); else the plain one."""
    if isinstance(cause, DaskJobsError):
        if isinstance(cause, TypeError):
            return TaskTypeError
        if isinstance(cause, ValueError):
            return TaskValueError
    return TaskFailedError


def _call_steps(steps: Sequence[Step], ws: Workspace) -> None:
    for step in steps:
        try:
            _check_result(step, step(ws))
        except Exception as exc:
            _internal_error(step, exc)
            raise


def _check_result(step: Step, result: object) -> None:
    """Refuse a step whose call gave a coroutine, generator or awaitable: its body never ran."""
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()  # no "never awaited" warning; nothing of the body has run
    elif not (inspect.isasyncgen(result) or inspect.isawaitable(result)):
        return
    raise StepTypeError(
        f"step {getattr(step, '__qualname__', step)!r} returned {type(result).__name__} {result!r} instead of "
        "running: steps must be plain synchronous callables (no async def, no yield); call the async code "
        "with asyncio.run(...) inside a plain function, or consume the generator in the step"
    )


def _capture(spec: TaskSpec, ws: Workspace) -> Captured:
    captured = []
    for names in spec.outputs:
        values = []
        for name in names:
            scope = ws._scope.find(name)  # not ``in``: capturing is no lookup of the task's own
            if scope is None:
                raise KeyError(
                    f"task {spec.name!r} declares output {name!r} but no such blob exists when it finishes; "
                    f"assign ws[{name!r}] in one of its steps or drop the output"
                )
            values.append(copy_value(scope.blobs[name], name))
        captured.append(values)
    return captured


class _Reporter:
    """Runs a report step every interval in a thread, and once more at the end."""

    def __init__(self, report: ReportStep, ws: Workspace, failure: _Failure) -> None:
        self.report, self.ws, self.failure = report, ws, failure
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"daskjobs-report-{ws.node}", daemon=True)
        self.thread.start()

    def _call(self) -> None:
        self.failure.wrap(f"{self.ws.node}/report_step", lambda: _call_steps([self.report.step], self.ws))

    def _loop(self) -> None:
        while not self.stop.wait(self.report.interval_ms / 1000):
            try:
                self._call()
            except TaskFailedError as exc:
                self.error = exc
                return

    def finish(self, run_final: bool) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise self.error
        if run_final:
            self._call()


class NodeRun:
    """One node's share of one group run: open, run tasks (possibly one by one), close."""

    def __init__(self, state: NodeState, plan: NodePlan, run: RunInfo) -> None:
        self.state, self.plan, self.run = state, plan, run
        self.failure = _Failure(plan, run)
        self.metrics = MetricLog()
        global_ws = state.workspace(run.epoch, self.metrics)
        self.base = global_ws if plan.workspace_type is WorkspaceType.GLOBAL else global_ws.child()
        if plan.workspace_type is WorkspaceType.PRIVATE:
            self.base._scope.traps = {}
        self._saved_reserved = self.base._scope.reserved
        self.base._scope.reserved = plan.reserved
        self.reporters: list[_Reporter] = []

    def open(self) -> None:
        """Run node-local init and start report steps."""
        for setup in self.plan.local_setups:
            self.failure.wrap(
                f"{self.plan.node}/local_init", functools.partial(_call_steps, setup.init_nets, self.base)
            )
        self.reporters = [_Reporter(r, self.base, self.failure) for r in self.plan.report_steps]

    def traps(self) -> tuple[str, ...]:
        """Blobs this PRIVATE run looked up, found missing and then created (in order)."""
        return tuple(self.base._scope.traps or ())

    def run_task(self, spec: TaskSpec, inputs: dict[str, Value] | None = None) -> Captured:
        """Run one task with its setup layers and instances; return its captured outputs."""
        if not spec.has_work:
            return []
        return self._run_task(spec, self.base, inputs or {})

    def _run_task(self, spec: TaskSpec, parent: Workspace, inputs: dict[str, Value]) -> Captured:
        ws = (parent if self.plan.workspace_type is WorkspaceType.GLOBAL else parent.child()).for_task(
            spec.index, spec.name
        )
        for local, value in inputs.items():
            # A copy: the producer's captured output (and other consumers) must not see in-place writes.
            ws._scope.blobs[local] = copy_value(value, local)
        wrap = self.failure.wrap
        wrap(spec.name, lambda: _call_steps(spec.task_init, ws))
        if spec.subtasks:
            working = [t for t in spec.subtasks if t.has_work]
            results = run_concurrently([functools.partial(self._run_task, t, ws, {}) for t in working])
            sub_by_index = {t.index: c for t, c in zip(working, results, strict=True)}
            wrap(spec.name, lambda: _call_steps(spec.task_exit, ws))
            return [
                out
                for t in spec.subtasks
                for out in (sub_by_index[t.index] if t.has_work else wrap(t.name, functools.partial(_capture, t, ws)))
            ]
        if spec.num_instances > 1:

            def instance(i: int) -> None:
                iws = ws.child(instance_id=i)
                _call_steps(spec.instance_init, iws)
                _call_steps(spec.steps, iws)
                _call_steps(spec.instance_exit, iws)

            run_concurrently(
                [functools.partial(wrap, spec.name, functools.partial(instance, i)) for i in range(spec.num_instances)]
            )
        else:
            wrap(spec.name, lambda: _call_steps([*spec.instance_init, *spec.steps, *spec.instance_exit], ws))
        wrap(spec.name, lambda: _call_steps(spec.task_exit, ws))
        return wrap(spec.name, lambda: _capture(spec, ws))

    def close(self, captured: dict[int, Captured], ok: bool = True) -> dict[int, Captured]:
        """Stop report steps (running each once more), capture step-less outputs, run local exit."""
        try:
            for reporter in self.reporters:  # stop every reporter thread, even if one of them failed
                reporter.stop.set()
            for reporter in self.reporters:
                if ok:
                    reporter.finish(run_final=True)
                else:  # the task's failure is already propagating: do not replace it
                    with contextlib.suppress(TaskFailedError):
                        reporter.finish(run_final=False)
            if ok:
                for spec in self.plan.tasks:
                    if not spec.has_work:
                        captured[spec.index] = self.failure.wrap(
                            spec.name, functools.partial(_capture, spec, self.base)
                        )
                for setup in self.plan.local_setups:
                    self.failure.wrap(
                        f"{self.plan.node}/local_exit", functools.partial(_call_steps, setup.exit_nets, self.base)
                    )
        finally:
            self.base._scope.reserved = self._saved_reserved
        return captured


def run_node(provider: NodeStateProvider, plan: NodePlan | PackedPlan, run: RunInfo) -> NodeResult:
    """Run all of a node's tasks of one group run concurrently; return captured outputs by task."""
    state = check_token(provider.node_state(plan.node, run.token), run.token)
    plan = unpack_plan(plan, run)
    node_run = NodeRun(state, plan, run)
    captured: dict[int, Captured] = {}
    ok = False
    try:
        node_run.open()
        work = [spec for spec in plan.tasks if spec.has_work]
        if work:
            results = run_concurrently([functools.partial(node_run.run_task, s) for s in work])
            captured.update({spec.index: result for spec, result in zip(work, results, strict=True)})
        ok = True
    finally:
        node_run.close(captured, ok=ok)
    return NodeResult(
        state.token, captured, node_run.metrics.sums(), traps=node_run.traps(), finished=_finish(state, run)
    )


def _finish(state: NodeState, run: RunInfo) -> Any:
    """Run the run's ``finish`` hook on the node (after all of its tasks and outputs)."""
    return None if run.finish is None else run.finish(state)


def open_node(provider: NodeStateProvider, plan: NodePlan | PackedPlan, run: RunInfo) -> str:
    """Edge mode: open the node's run and keep it in the node state until :func:`close_node`."""
    state = check_token(provider.node_state(plan.node, run.token), run.token)
    plan = unpack_plan(plan, run)
    node_run = NodeRun(state, plan, run)
    state.runs[run.key] = node_run
    try:
        node_run.open()
    except Exception:
        state.runs.pop(run.key, None)
        node_run.close({}, ok=False)
        raise
    return run.key


def run_node_task(
    provider: NodeStateProvider,
    plan: NodePlan | PackedPlan,
    run: RunInfo,
    index: int,
    opened: str,
    *producer_results: Captured,
) -> Captured:
    """Edge mode: run one task; ``producer_results`` are the captures its inputs come from."""
    state = check_token(provider.node_state(plan.node, run.token), run.token)
    plan = unpack_plan(plan, run)
    spec = next(s for s in plan.tasks if s.index == index)
    node_run = _opened(state, opened)
    inputs = {local: producer_results[i][out][0] for i, (local, _, out) in enumerate(spec.inputs)}
    return node_run.run_task(spec, inputs)


def close_node(
    provider: NodeStateProvider, plan: NodePlan | PackedPlan, run: RunInfo, opened: str, *task_results: Captured
) -> NodeResult:
    """Edge mode: finish the node's run; ``task_results`` follow the order of ``plan.tasks`` with work."""
    state = provider.node_state(plan.node, None)
    plan = unpack_plan(plan, run)
    node_run = _opened(state, opened)
    del state.runs[opened]
    work = [spec for spec in plan.tasks if spec.has_work]
    captured = {spec.index: result for spec, result in zip(work, task_results, strict=True)}
    captured = node_run.close(captured, ok=True)
    return NodeResult(
        state.token, captured, node_run.metrics.sums(), traps=node_run.traps(), finished=_finish(state, run)
    )


def _opened(state: NodeState, opened: str) -> NodeRun:
    """The node run :func:`open_node` opened as ``opened``; :class:`NodeLostError` when this worker
    does not hold it (the node's worker left or restarted after the run opened there)."""
    node_run = state.runs.get(opened)
    if node_run is None:
        raise NodeLostError(
            f"node {state.node!r} lost the run {opened!r} it opened (its worker left or restarted); "
            "restore from a checkpoint",
            [state.node],
        )
    return node_run


def abandon_node_run(state: NodeState, key: str) -> None:
    """Edge mode clean-up after a failed run: stop report steps, drop run state."""
    node_run = state.runs.pop(key, None)
    if node_run is not None:
        node_run.close({}, ok=False)
