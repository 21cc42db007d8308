"""TaskGroup: tasks that run concurrently, on one or several nodes."""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import DefinitionTypeError, InvalidStateError, JobDefinitionError
from .node import Node, node_name
from .task import SetupNets, Step, Task, TaskOutput, TaskRegistry, WorkspaceType, as_steps, as_workspace_type
from .values import check_positive, validate_name

_group_ids = itertools.count()


@dataclass(frozen=True)
class ReportStep:
    """A step run periodically on a node while a group runs, and once more at the end."""

    step: Step
    node: str
    interval_ms: int


class TaskGroup(TaskRegistry):
    """The tasks that make up one run: they start together and the run ends with the last one.

    Not related to :class:`asyncio.TaskGroup` nor to the task groups Dask's scheduler shows on
    its dashboard. Tasks created inside ``with group:`` join it. Tasks on one node run in
    concurrent threads and share that node's workspace; tasks on different nodes run on
    different workers. ``inputs`` edges between tasks order them and carry data.

    Parameters
    ----------
    workspace_type
        :class:`WorkspaceType` (or ``"global"`` / ``"private"``) of every task in the group.
        ``None`` takes the first task's type, else PRIVATE.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.TaskGroup() as group:
    ...     with dj.Node("a"):
    ...         _ = dj.Task(lambda ws: None, name="first")
    ...     with dj.Node("b"):
    ...         _ = dj.Task(lambda ws: None, name="second")
    >>> group.used_nodes(), [t.name for t in group.tasks()]
    (['a', 'b'], ['a/first', 'b/second'])
    """

    def __init__(self, workspace_type: WorkspaceType | str | None = None) -> None:
        self._workspace_type = as_workspace_type(workspace_type, "TaskGroup")
        self._pending: list[Task] = []
        self._tasks: list[Task] = []
        self._used = False
        self._report_steps: list[ReportStep] = []
        self._local_setups: dict[str, list[SetupNets]] = {}
        self._remote_nets: list[object] = []
        self._by_node: tuple[dict[str, str], TaskGroup] | None = None
        self.id = next(_group_ids)
        self.label = f"group{self.id}"

    # -- registration ---------------------------------------------------------------------
    def _unique_task_name(self, name: str) -> str:
        taken = {t.name for t in self._pending + self._tasks}
        if name not in taken:
            return name
        return next(f"{name}:{i}" for i in itertools.count(1) if f"{name}:{i}" not in taken)

    def _register(self, task: Task) -> None:
        self._check_unused(f"add task {task.name!r} to")
        self._pending.append(task)

    def _move_to_end(self, task: Task) -> None:
        if task in self._pending:
            self._pending.remove(task)
            self._pending.append(task)

    def _check_unused(self, what: str) -> None:
        if self._used:
            raise InvalidStateError(
                f"cannot {what} {self!r}: the group has already run (or was regrouped by tasks_by_node); "
                "build a new TaskGroup"
            )

    def add(self, task: Task) -> None:
        """Add ``task``, giving it the group's workspace type.

        Raises
        ------
        InvalidStateError
            The group has already run.
        JobDefinitionError
            The task's workspace type conflicts with the group's.
        """
        self._check_unused(f"add task {task.name!r} to")
        if task in self._tasks:
            return
        if task in self._pending:
            self._pending.remove(task)
        task_type = task.workspace_type()
        if self._workspace_type is not None and task_type is not None and task_type != self._workspace_type:
            raise JobDefinitionError(
                f"task {task.name!r} is {task_type.name} but its group is {self._workspace_type.name} "
                f"(a group takes its first task's type): give the task the group's type, or give the group "
                f"its type up front, e.g. TaskGroup(WorkspaceType.{task_type.name})"
            )
        if self._workspace_type is None:
            # As Caffe2: an untyped group takes its first task's type, and an untyped task is PRIVATE.
            self._workspace_type = task_type or WorkspaceType.PRIVATE
        task._set_workspace_type(self._workspace_type)
        task._group = self
        self._tasks.append(task)

    def tasks(self) -> list[Task]:
        """All tasks, in order; pending ones are added first (see :meth:`add`).

        Reading the tasks does not freeze the group: tasks may still be added until it runs.

        Raises
        ------
        JobDefinitionError
            A pending task's workspace type conflicts with the group's.
        """
        for task in list(self._pending):
            self.add(task)
        return list(self._tasks)

    def _freeze(self) -> list[Task]:
        """The tasks, for a run (or a regrouping): check inputs, then mark the group and its
        tasks used, so that neither can be changed afterwards.

        Raises
        ------
        JobDefinitionError
            An input comes from outside the group, or inputs form a cycle.
        """
        tasks = self.tasks()
        if not self._used:
            self._check_inputs()
            self._used = True
            for task in tasks:
                task._notify_used()
        return tasks

    def _check_inputs(self) -> None:
        owners = {id(out): task for task in self._tasks for out in task.outputs()}
        for task in self._tasks:
            for local, out in task.inputs().items():
                if id(out) not in owners:
                    raise JobDefinitionError(
                        f"task {task.name!r}: input {local!r} comes from {out!r}, which is not an output "
                        f"of a task in this group"
                    )
        state: dict[int, str] = {}

        def visit(task: Task, path: list[str]) -> None:
            if state.get(id(task)) == "done":
                return
            if state.get(id(task)) == "active":
                raise JobDefinitionError(f"inputs form a cycle: {' -> '.join([*path, task.name])}")
            state[id(task)] = "active"
            for out in task.inputs().values():
                visit(owners[id(out)], [*path, task.name])
            state[id(task)] = "done"

        for task in self._tasks:
            visit(task, [])

    def num_registered_tasks(self) -> int:
        """Tasks added or pending."""
        return len(self._tasks) + len(self._pending)

    def used_nodes(self) -> list[str]:
        """Node names of the tasks, unique, in first-use order."""
        nodes = [t.node for t in self._tasks + self._pending]
        nodes += [r.node for r in self._report_steps] + list(self._local_setups)
        return list(dict.fromkeys(nodes))

    def workspace_type(self) -> WorkspaceType | None:
        """The group's workspace type (``None`` while undecided)."""
        return self._workspace_type

    # -- node-level extras ----------------------------------------------------------------
    def report_step(self, step: Step | None = None, node: Node | str | None = None, interval_ms: float = 1000) -> None:
        """Run ``step(ws)`` every ``interval_ms`` on ``node`` while the group runs, and once
        more after all of that node's tasks finished.

        Raises
        ------
        StepTypeError
            ``step`` is not one plain synchronous callable.
        DefinitionTypeError
            ``interval_ms`` is not a number.
        JobDefinitionError
            ``step`` is missing, or ``interval_ms`` is not a finite number of at least 1.
        """
        self._check_unused("add a report step to")
        if step is None:
            raise JobDefinitionError("report_step needs a step")
        if isinstance(step, list | tuple):
            raise DefinitionTypeError(f"report_step takes one callable, got {step!r}")
        (step,) = as_steps(step, "report_step")
        interval = check_positive(interval_ms, "report_step interval_ms")
        if interval < 1:
            raise JobDefinitionError(f"report_step interval_ms must be at least 1, got {interval_ms!r}")
        self._report_steps.append(ReportStep(step, node_name(node), int(interval)))

    def report_steps(self) -> list[ReportStep]:
        """The registered report steps."""
        return list(self._report_steps)

    def add_local_setup(self, setup: SetupNets, node: Node | str | None = None) -> None:
        """Run ``setup.init_nets`` on ``node`` before all its tasks of each run, and
        ``setup.exit_nets`` after all of them."""
        self._check_unused("add a local setup to")
        if not isinstance(setup, SetupNets):
            raise DefinitionTypeError(f"add_local_setup takes a SetupNets, got {setup!r}")
        name = node_name(node)
        self._local_setups.setdefault(name, []).append(setup)

    def local_setups(self, node: str) -> list[SetupNets]:
        """The node-local setups of ``node``."""
        return list(self._local_setups.get(node, []))

    def add_remote_net(self, obj: object) -> None:
        """Keep ``obj`` (opaque) for custom sessions; the built-in sessions ignore it."""
        self._remote_nets.append(obj)

    def remote_nets(self) -> list[object]:
        """Objects added with :meth:`add_remote_net`."""
        return list(self._remote_nets)

    # -- regrouping -----------------------------------------------------------------------
    def tasks_by_node(self, node_remap: dict[str, str] | None = None) -> TaskGroup:
        """A new group with one task per (remapped) node running that node's tasks concurrently.

        The result is computed once and holds this group's tasks, so the group is frozen as
        by a run: no task may be added or changed afterwards. Calling again with a different
        mapping raises :class:`~daskjobs.errors.InvalidStateError`.
        """
        if node_remap is not None and not isinstance(node_remap, dict):
            raise DefinitionTypeError(f"node_remap must be a dict of node names, got {node_remap!r}")
        for source, target in (node_remap or {}).items():
            validate_name(source, "node")
            validate_name(target, "node")
        tasks = self._freeze()
        mapping = {n: (node_remap or {}).get(n, n) for n in self.used_nodes()}
        if self._by_node is not None:
            if self._by_node[0] != mapping:
                raise InvalidStateError("tasks_by_node was already called with a different node mapping")
            return self._by_node[1]
        grouped = TaskGroup(self._workspace_type)
        for target in dict.fromkeys(mapping.values()):
            members = [t for t in tasks if mapping[t.node] == target]
            merged = Task(group=grouped, node=target, name="grouped_by_node")
            merged._subtasks = members
            for report in self._report_steps:
                if mapping[report.node] == target:
                    grouped._report_steps.append(ReportStep(report.step, target, report.interval_ms))
            for source, setups in self._local_setups.items():
                if mapping[source] == target:
                    grouped._local_setups.setdefault(target, []).extend(setups)
            for member in members:
                merged._outputs.extend(member.outputs())
        self._by_node = (mapping, grouped)
        return grouped

    def to_task(self, node: Node | str | None = None) -> Task:
        """All tasks as one task on ``node`` (default: the current node)."""
        target = node_name(node)
        grouped = self.tasks_by_node(dict.fromkeys(self.used_nodes(), target))
        tasks = grouped.tasks()
        return tasks[0] if tasks else Task(group=None, node=target)

    # -- display --------------------------------------------------------------------------
    def __repr__(self) -> str:
        names = [t.name for t in self._tasks + self._pending]
        kind = self._workspace_type.name if self._workspace_type else None
        return f"TaskGroup(tasks={names}, workspace_type={kind}, remote_nets={self._remote_nets})"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(t.node)}</td><td>{html.escape(t.name)}</td>"
            f"<td>{t.num_instances}</td><td>{html.escape(', '.join(n for o in t.outputs() for n in o.names))}</td></tr>"
            for t in self._tasks + self._pending
        )
        kind = self._workspace_type.name if self._workspace_type else "untyped"
        return (
            f"<b>TaskGroup</b> ({kind}, {self.num_registered_tasks()} tasks)"
            f"<table><tr><th>node</th><th>task</th><th>instances</th><th>outputs</th></tr>{rows}</table>"
        )


def stepless_output_task(blobs: str | Sequence[str], group: TaskGroup) -> TaskOutput:
    """A step-less task in ``group`` on the current node whose output is ``blobs``."""
    output = TaskOutput(blobs)
    return Task(group=group, outputs=None).add_output(output)
