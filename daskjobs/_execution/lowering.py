"""Lowering: one run of a TaskGroup becomes a keyed Dask task graph, placed by node.

Without ``inputs`` edges each node gets one Dask task that runs all its tasks concurrently
(the cheapest form the scheduler sees). With edges, each node gets an ``open`` task, one
task per Task (depending on its producers, so data moves worker to worker) and a ``close``
task. Every session runs the graphs this module builds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask.core import literal

from .._model.group import TaskGroup
from .._model.task import Task, WorkspaceType
from ..errors import JobDefinitionError
from .node_run import NodeState, NodeStateProvider, close_node, open_node, run_node, run_node_task
from .plan import NodePlan, RunInfo, TaskSpec


@dataclass(frozen=True)
class Dep:
    """A reference to the result of another key of the same graph."""

    key: str


@dataclass(frozen=True)
class LoweredTask:
    """One Dask task: ``fn(*args)`` on ``node``'s worker, with :class:`Dep` args resolved."""

    key: str
    node: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass
class LoweredGraph:
    """A group run as Dask tasks in dependency order; ``result_keys`` give each node's result."""

    tasks: list[LoweredTask]
    result_keys: dict[str, str]
    resources: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dask(self) -> dict[str, tuple]:
        """The graph as a classic Dask dict ``{key: (fn, *args)}``."""
        return {t.key: (t.fn, *(a.key if isinstance(a, Dep) else _quote(a) for a in t.args)) for t in self.tasks}

    def nodes(self) -> list[str]:
        """The nodes the graph runs on."""
        return list(self.result_keys)


def _quote(value: Any) -> Any:
    # Dask would treat tuples starting with a callable as tasks and strings equal to keys as
    # references; wrap literals so they pass through unchanged.
    return literal(value) if isinstance(value, tuple | list | dict | str) else value


@dataclass(frozen=True)
class GroupPlan:
    """A used TaskGroup compiled once: per-node plans and whether it has dataflow edges.

    It holds nothing of the group (no task, no output): the cache of plans keys groups weakly, and
    a value that reached its key would keep every group run once alive for good.
    """

    node_plans: dict[str, NodePlan]
    producers: dict[int, list[int]]
    """Task index -> indices of the tasks it consumes from, in input order (edge mode)."""
    has_edges: bool
    resources: dict[str, dict[str, float]]


_plans: weakref.WeakKeyDictionary[TaskGroup, dict[str, GroupPlan]] = weakref.WeakKeyDictionary()
"""Each group's plans by job, for as long as the group lives."""


def _spec(task: Task, index: int, index_of: dict[int, tuple[int, int]]) -> TaskSpec:
    try:
        inputs = tuple((local, *index_of[id(out)]) for local, out in task.inputs().items())
    except KeyError:
        raise JobDefinitionError(f"task {task.name!r}: its inputs come from outside its group") from None
    return TaskSpec(
        index=index,
        name=task.name,
        steps=tuple(task._steps),
        task_init=tuple(task._task_init),
        task_exit=tuple(task._task_exit),
        instance_init=tuple(task._instance_init),
        instance_exit=tuple(task._instance_exit),
        num_instances=task.num_instances,
        outputs=tuple(tuple(o.names) for o in task.outputs()),
        inputs=inputs,
        subtasks=tuple(_spec(sub, i, {}) for i, sub in enumerate(task._subtasks)),
    )


def plan_group(group: TaskGroup, job: str) -> GroupPlan:
    """Compile ``group`` for a run (freezing it) into per-node plans; cached per group and job."""
    cached = _plans.get(group, {}).get(job)
    if cached is not None:
        return cached
    tasks = group._freeze()
    index_of = {id(out): (ti, oi) for ti, task in enumerate(tasks) for oi, out in enumerate(task.outputs())}
    specs = [_spec(task, i, index_of) for i, task in enumerate(tasks)]
    producers = {spec.index: [producer for _, producer, _ in spec.inputs] for spec in specs}
    for spec in specs:
        for local, producer, _ in spec.inputs:
            if not specs[producer].has_work:
                raise JobDefinitionError(
                    f"task {spec.name!r}: input {local!r} comes from step-less task "
                    f"{specs[producer].name!r}; inputs need a producer with steps"
                )
    workspace_type = group.workspace_type() or WorkspaceType.PRIVATE
    node_plans, resources = {}, {}
    for node in group.used_nodes():
        node_plans[node] = NodePlan(
            job=job,
            group=group.label,
            node=node,
            workspace_type=workspace_type,
            tasks=tuple(s for s, t in zip(specs, tasks, strict=True) if t.node == node),
            report_steps=tuple(r for r in group.report_steps() if r.node == node),
            local_setups=tuple(group.local_setups(node)),
        )
        extra: dict[str, float] = {}
        for task in tasks:
            if task.node == node:
                extra.update({k: v for k, v in task._node_resources.items() if k not in extra})
        resources[node] = extra
    plan = GroupPlan(node_plans, producers, any(producers.values()), resources)
    _plans.setdefault(group, {})[job] = plan
    return plan


def lower(
    plan: GroupPlan,
    provider: NodeStateProvider,
    *,
    run_key: str,
    epoch: int | None,
    tokens: dict[str, str],
    finish: Mapping[str, Callable[[NodeState], Any]] | None = None,
) -> LoweredGraph:
    """The Dask graph of one run of ``plan``; keys start with ``run_key`` (job, group, run, attempt).

    ``finish`` maps nodes of the plan to a hook run on that node inside its last Dask task of
    the run, after its tasks and outputs (see :attr:`RunInfo.finish`).
    """
    finish = finish or {}
    unknown = sorted(set(finish) - set(plan.node_plans))
    if unknown:
        raise JobDefinitionError(f"finish hooks for nodes {unknown} that the group does not use")
    lowered: list[LoweredTask] = []
    result_keys: dict[str, str] = {}
    runs = {node: RunInfo(run_key, epoch, tokens.get(node), finish.get(node)) for node in plan.node_plans}
    if not plan.has_edges:
        for node, node_plan in plan.node_plans.items():
            key = f"{run_key}/{node}"
            lowered.append(LoweredTask(key, node, run_node, (provider, node_plan, runs[node])))
            result_keys[node] = key
        return LoweredGraph(lowered, result_keys, plan.resources)
    task_key: dict[int, str] = {}
    node_of = {spec.index: node for node, np_ in plan.node_plans.items() for spec in np_.tasks}
    for node, node_plan in plan.node_plans.items():
        lowered.append(LoweredTask(f"{run_key}/{node}/open", node, open_node, (provider, node_plan, runs[node])))
    for index in _topological(plan.producers):
        spec_node = node_of[index]
        node_plan = plan.node_plans[spec_node]
        spec = next(s for s in node_plan.tasks if s.index == index)
        if not spec.has_work:
            continue
        key = task_key[index] = f"{run_key}/{spec_node}/t{index}"
        deps = tuple(Dep(task_key[p]) for p in plan.producers[index])
        lowered.append(
            LoweredTask(
                key,
                spec_node,
                run_node_task,
                (provider, node_plan, runs[spec_node], index, Dep(f"{run_key}/{spec_node}/open"), *deps),
            )
        )
    for node, node_plan in plan.node_plans.items():
        key = result_keys[node] = f"{run_key}/{node}/close"
        deps = tuple(Dep(task_key[s.index]) for s in node_plan.tasks if s.has_work)
        lowered.append(
            LoweredTask(key, node, close_node, (provider, node_plan, runs[node], Dep(f"{run_key}/{node}/open"), *deps))
        )
    return LoweredGraph(lowered, result_keys, plan.resources)


def _topological(producers: dict[int, list[int]]) -> list[int]:
    order: list[int] = []
    seen: set[int] = set()

    def visit(index: int) -> None:
        if index in seen:
            return
        seen.add(index)
        for producer in producers[index]:
            visit(producer)
        order.append(index)

    for index in producers:
        visit(index)
    return order
