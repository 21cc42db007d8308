"""A node's share of a TaskGroup run, as data that travels to the node (see :mod:`.shipping`), and
what the node sends back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._model.group import ReportStep
from .._model.metrics import MetricSums
from .._model.task import SetupNets, Step, WorkspaceType
from .._model.values import Value

if TYPE_CHECKING:
    from .node_run import NodeState

Captured = list[list[Value]]
"""The values of a task's outputs: one list of values per TaskOutput."""


@dataclass(frozen=True)
class TaskSpec:
    """What a node needs to run one task: picklable, without references to the job model."""

    index: int
    name: str
    steps: tuple[Step, ...]
    task_init: tuple[Step, ...]
    task_exit: tuple[Step, ...]
    instance_init: tuple[Step, ...]
    instance_exit: tuple[Step, ...]
    num_instances: int
    outputs: tuple[tuple[str, ...], ...]
    inputs: tuple[tuple[str, int, int], ...]
    """``(local_name, producer task index, producer output index)`` per input."""
    subtasks: tuple[TaskSpec, ...] = ()

    @property
    def has_work(self) -> bool:
        """Whether the task runs code; step-less tasks only capture their outputs."""
        return bool(
            self.steps or self.task_init or self.task_exit or self.instance_init or self.instance_exit or self.subtasks
        )


@dataclass(frozen=True, eq=False)
class NodePlan:
    """One node's share of a TaskGroup (compared and hashed by identity: made once per group and job).

    Pickling it gives a :class:`~.shipping.PackedPlan` (see :mod:`.shipping`)."""

    job: str
    group: str
    node: str
    workspace_type: WorkspaceType
    tasks: tuple[TaskSpec, ...]
    report_steps: tuple[ReportStep, ...] = ()
    local_setups: tuple[SetupNets, ...] = ()

    @property
    def reserved(self) -> frozenset[str]:
        """Output names of this node's tasks: new blobs with these names live at node level."""
        return frozenset(n for t in self.tasks for out in t.outputs for n in out)

    def steps(self) -> Iterator[tuple[str, Step]]:
        """Every user callable of the plan with the name of the task it belongs to."""

        def of(spec: TaskSpec) -> Iterator[tuple[str, Step]]:
            for steps in (spec.task_init, spec.instance_init, spec.steps, spec.instance_exit, spec.task_exit):
                yield from ((spec.name, step) for step in steps)
            for sub in spec.subtasks:
                yield from of(sub)

        for spec in self.tasks:
            yield from of(spec)
        for report in self.report_steps:
            yield f"{self.node}/report_step", report.step
        for setup in self.local_setups:
            yield from ((f"{self.node}/local_init", step) for step in setup.init_nets)
            yield from ((f"{self.node}/local_exit", step) for step in setup.exit_nets)


@dataclass(frozen=True)
class RunInfo:
    """Identifies one run of a group; ``token`` is the node generation the run expects."""

    key: str
    epoch: int | None
    token: str | None = None
    finish: Callable[[NodeState], Any] | None = None
    """Called on the node's state after the node's share of the run (e.g. the epoch's checkpoint
    save); its result comes back as :attr:`NodeResult.finished`."""


@dataclass(frozen=True)
class NodeResult:
    """What a node returns from a group run: its generation token, captured outputs by task
    index, the metrics its steps logged, the blobs caught in the accumulate-in-PRIVATE trap
    (see :func:`private_trap_message`), and what :attr:`RunInfo.finish` returned."""

    token: str
    captured: dict[int, Captured]
    metrics: MetricSums = field(default_factory=dict)
    traps: tuple[str, ...] = ()
    finished: Any = None


@dataclass(frozen=True)
class GroupRun:
    """What a group run returned to the driver: the sums and counts of the metrics its steps logged
    (``ws.log``, over all nodes) and, by node, what each ``finish`` hook returned."""

    metrics: MetricSums
    finished: dict[str, Any] = field(default_factory=dict)


class RunFailed(Exception):
    """A run that failed: its own :attr:`error`, and :attr:`results`, the :class:`NodeResult` of every
    node whose share finished before (a session's ``_execute`` raises it)."""

    def __init__(self, error: Exception, results: dict[str, NodeResult]) -> None:
        super().__init__(error)
        self.error, self.results = error, results


class GroupRunFailed(Exception):
    """A group run with ``finish`` hooks that failed: its own :attr:`error` (what the run raises
    without hooks) and :attr:`finished`, by node, what the hooks of the nodes that finished returned
    (a save hook's report must not be lost with the run)."""

    def __init__(self, error: Exception, finished: dict[str, Any]) -> None:
        super().__init__(error)
        self.error, self.finished = error, finished
