"""Task, its outputs, and setup hooks."""

from __future__ import annotations

import enum
import functools
import html
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DefinitionTypeError, InvalidStateError, JobDefinitionError, OutputNotReadyError, StepTypeError
from .context import Managed
from .node import Cluster, Node
from .values import check_count, check_label, copy_value, validate_name

if TYPE_CHECKING:
    from .group import TaskGroup
    from .values import BlobValue, Value

Step = Callable[..., Any]
"""A step is a callable taking the node's workspace: ``step(ws)``."""


class WorkspaceType(enum.StrEnum):
    """Where a task's new blobs live.

    ``GLOBAL`` tasks run in the node's persistent workspace; ``PRIVATE`` tasks run in a child
    workspace created for one run: they can update blobs that already exist in the node
    workspace, but new blobs vanish when the run ends.

    The members are strings, ``"global"`` and ``"private"`` (Caffe2's constants), and wherever
    a workspace type is taken, those strings are accepted too.

    Examples
    --------
    >>> import daskjobs as dj
    >>> dj.WorkspaceType.GLOBAL == "global", dj.TaskGroup("private").workspace_type()
    (True, <WorkspaceType.PRIVATE: 'private'>)
    """

    PRIVATE = "private"
    GLOBAL = "global"


def as_workspace_type(value: object, owner: str) -> WorkspaceType | None:
    """``value`` as a :class:`WorkspaceType`: a member, its value in any case (``"global"``), or ``None``.

    Raises
    ------
    DefinitionTypeError
        ``value`` is neither ``None``, a WorkspaceType nor a str.
    JobDefinitionError
        ``value`` is a str naming no workspace type.
    """
    if value is None or isinstance(value, WorkspaceType):
        return value
    if not isinstance(value, str):
        raise DefinitionTypeError(f"{owner}: workspace_type must be a WorkspaceType, got {value!r}")
    try:
        return WorkspaceType(value.lower())
    except ValueError:
        raise JobDefinitionError(
            f"{owner}: workspace_type {value!r} is no WorkspaceType; use WorkspaceType.GLOBAL or .PRIVATE "
            "(or 'global' / 'private')"
        ) from None


def as_steps(steps: Step | Sequence[Step] | None, what: str) -> list[Step]:
    """Normalise ``None``, one callable or a list of callables into a list of plain steps.

    Raises
    ------
    StepTypeError
        An item is not callable, or is an ``async def`` or generator function (also behind
        ``functools.partial`` or as an object's ``__call__``): its call would not run its body.
    """
    if steps is None:
        return []
    items: list[Any] = list(steps) if isinstance(steps, list | tuple) else [steps]  # checked below
    for item in items:
        if not callable(item):
            raise StepTypeError(f"{what} must be callables taking the workspace, got {item!r}")
        kind = not_plain(item)
        if kind:
            raise StepTypeError(
                f"{what}: step {_step_name(item)} is {kind}, so calling it would not run its body; steps must be "
                "plain synchronous callables: wrap it in a plain function (e.g. def step(ws): asyncio.run(f(ws)), "
                "or consume the generator inside the step)"
            )
    return items


def not_plain(step: Step) -> str:
    """What makes ``step`` not a plain synchronous callable (``""`` when it is one)."""
    target = step
    while isinstance(target, functools.partial):
        target = target.func
    candidates = [(target, "")]
    if not inspect.isroutine(target) and not isinstance(target, type):
        candidates.append((type(target).__call__, "an object whose __call__ is "))
    for candidate, prefix in candidates:
        if inspect.iscoroutinefunction(candidate):
            return f"{prefix}an async def function"
        if inspect.isasyncgenfunction(candidate):
            return f"{prefix}an async generator function"
        if inspect.isgeneratorfunction(candidate):
            return f"{prefix}a generator function"
    return ""


def _as_outputs(outputs: object, owner: str) -> list[TaskOutput]:
    """New :class:`TaskOutput` objects for ``outputs``: a name, a TaskOutput, or a list of them."""
    if not isinstance(outputs, str | TaskOutput | list | tuple):
        raise DefinitionTypeError(
            f"{owner}: outputs must be a blob name, a TaskOutput or a list of them, got {outputs!r}"
        )
    items = [outputs] if isinstance(outputs, str | TaskOutput) else list(outputs)
    return [item if isinstance(item, TaskOutput) else TaskOutput(item) for item in items]


def _check_input(owner: str, local_name: object, output: object) -> None:
    validate_name(local_name, "blob")
    if not isinstance(output, TaskOutput):
        raise DefinitionTypeError(f"{owner}: input {local_name!r} must be a TaskOutput, got {output!r}")
    if len(output.names) != 1:
        raise JobDefinitionError(
            f"{owner}: input {local_name!r} must come from a single-blob output, got {output.names}"
        )


def _check_task_name(name: object) -> str:
    """``name`` if it can name a task: it follows ``"<node>/"`` in messages and records."""
    return check_label(name, "task", forbidden="/")


def _default_name(steps: list[Step]) -> str:
    """A single step's ``__name__`` (``"<lambda>"`` for a lambda) when it can name a task, else ``"task"``."""
    base = getattr(steps[0], "__name__", None) if len(steps) == 1 else None
    try:
        return _check_task_name(base)
    except JobDefinitionError:
        return "task"


def _step_name(step: Step) -> str:
    return repr(getattr(step, "__qualname__", None) or step)


class TaskOutput:
    """The value(s) of one or more blobs captured when a task finished (copies, so PRIVATE outputs survive).

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.TaskGroup() as group:
    ...     task = dj.Task(lambda ws: ws.__setitem__("x", 41 + 1), outputs="x")
    >>> with dj.LocalSession() as session:
    ...     session.run(group)
    ...     print(task.outputs()[0].fetch())
    42
    """

    def __init__(self, names: str | Sequence[str]) -> None:
        self._scalar = isinstance(names, str)
        if not isinstance(names, str | list | tuple):
            raise DefinitionTypeError(
                f"a TaskOutput takes a blob name or a list of names, got {type(names).__name__}: {names!r}"
            )
        raw = [names] if isinstance(names, str) else list(names)
        if not raw:
            raise JobDefinitionError("a TaskOutput needs at least one blob name")
        self.names: list[str] = [validate_name(n, "blob") for n in raw]
        self._values: list[Value] | None = None
        self._resolver: Callable[[], list[Value]] | None = None
        self.task: Task | None = None

    def _set(self, values: list[Value] | Callable[[], list[Value]]) -> None:
        if callable(values):
            self._values, self._resolver = None, values
        else:
            self._values, self._resolver = list(values), None

    def is_ready(self) -> bool:
        """Whether the task has run and its values can be fetched."""
        return self._values is not None or self._resolver is not None

    def fetch(self) -> BlobValue:
        """The captured value (an array or a JSON value): one value for a single name, else a list.

        Each call returns a copy: changing it changes neither the snapshot nor later fetches.

        Raises
        ------
        OutputNotReadyError
            The task has not run in any session yet.
        """
        if self._values is None:
            if self._resolver is None:
                owner = f" of task {self.task.name!r}" if self.task is not None else ""
                raise OutputNotReadyError(
                    f"output {self.names}{owner} has no value yet: run its TaskGroup in a session first"
                )
            self._values, self._resolver = list(self._resolver()), None
        values = [copy_value(value, name) for value, name in zip(self._values, self.names, strict=True)]
        return values[0] if self._scalar else values

    def __repr__(self) -> str:
        return f"TaskOutput(names={self.names}, ready={self.is_ready()})"


class TaskOutputList:
    """Several outputs viewed as one flat list of names and values."""

    def __init__(self, outputs: Iterable[TaskOutput] | None = None) -> None:
        self.outputs: list[TaskOutput] = list(outputs or [])

    def names(self) -> list[str]:
        """All blob names, flattened."""
        return [name for output in self.outputs for name in output.names]

    def fetch(self) -> list[BlobValue]:
        """All values, flattened, in the order of :meth:`names`."""
        values: list[Value] = []
        for output in self.outputs:
            value = output.fetch()
            # A single-name output's value may itself be a JSON list: never spread it.
            values.extend([value] if output._scalar else value)
        return values

    def __repr__(self) -> str:
        return f"TaskOutputList(names={self.names()})"


class SetupNets:
    """Callables to run before (``init_nets``) and after (``exit_nets``) a unit of work.

    Given to :meth:`TaskGroup.add_local_setup`, they run once per node around all of that
    node's tasks in a group run.
    """

    def __init__(
        self, init_nets: Step | Sequence[Step] | None = None, exit_nets: Step | Sequence[Step] | None = None
    ) -> None:
        self.init_nets = as_steps(init_nets, "SetupNets.init_nets")
        self.exit_nets = as_steps(exit_nets, "SetupNets.exit_nets")

    def __repr__(self) -> str:
        return f"SetupNets(init_nets={self.init_nets or None}, exit_nets={self.exit_nets or None})"


class TaskRegistry(Managed):
    """What a task joins when it is made: the current :class:`TaskGroup` (the only subclass, in
    :mod:`.group`). Tasks know groups through this base, so that :mod:`.task` need not import
    :mod:`.group` (which imports it)."""

    def _register(self, task: Task) -> None:
        raise NotImplementedError

    def _unique_task_name(self, name: str) -> str:
        raise NotImplementedError

    def _move_to_end(self, task: Task) -> None:
        raise NotImplementedError


class Task(Managed):
    """A unit of work: Python steps run in order on one node, inside a :class:`TaskGroup`.

    Parameters
    ----------
    step
        A callable ``step(ws)``, a list of them run in order, or ``None`` (a step-less task,
        whose outputs are read from the node workspace after its other tasks finished).
    outputs
        A blob name or list of names captured when the task finishes.
    workspace_type
        :class:`WorkspaceType` (or ``"global"`` / ``"private"``); defaults to the group's.
    group, node
        Where to register; default to the current :class:`TaskGroup` and :class:`Node`.
    name
        Any 1-128 printable characters but ``/``; defaults to the step's ``__name__``, else ``"task"``. The full name is
        ``"<node>/<name>"``, made unique within the group with ``:1``, ``:2`` … suffixes.
    num_instances
        Run that many concurrent instances of the steps, each in its own child workspace.
    inputs
        ``{"local_name": task_output}``: dataflow edges from tasks of the same group, possibly
        on other nodes. The value appears under ``local_name`` in this task's workspace.
    task_init, task_exit
        Callables run once before any / after all instances.
    instance_init, instance_exit
        Callables run once per instance, in that instance's workspace.

    Examples
    --------
    >>> import daskjobs as dj
    >>> def count(ws):
    ...     with ws.lock:
    ...         ws["n"] = ws["n"] + 1
    >>> with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
    ...     task = dj.Task(count, num_instances=4, task_init=lambda ws: ws.__setitem__("n", 0), outputs="n")
    >>> with dj.LocalSession() as session:
    ...     session.run(group)
    ...     print(int(task.outputs()[0].fetch()))
    4
    """

    def __init__(
        self,
        step: Step | Sequence[Step] | None = None,
        outputs: str | Sequence[str] | None = None,
        workspace_type: WorkspaceType | str | None = None,
        group: TaskGroup | None = None,
        node: Node | str | None = None,
        name: str | None = None,
        num_instances: int | None = None,
        *,
        inputs: dict[str, TaskOutput] | None = None,
        task_init: Step | Sequence[Step] | None = None,
        task_exit: Step | Sequence[Step] | None = None,
        instance_init: Step | Sequence[Step] | None = None,
        instance_exit: Step | Sequence[Step] | None = None,
    ) -> None:
        workspace_type = as_workspace_type(workspace_type, "Task")
        if group is not None and not isinstance(group, TaskRegistry):
            raise DefinitionTypeError(f"group must be a TaskGroup, got {type(group).__name__}: {group!r}")
        if node is not None and not isinstance(node, str | Node):
            raise DefinitionTypeError(f"node must be a str or a Node, got {type(node).__name__}: {node!r}")
        if name is not None:
            _check_task_name(name)
        self._steps = as_steps(step, "Task steps")
        self._task_init = as_steps(task_init, "task_init")
        self._task_exit = as_steps(task_exit, "task_exit")
        self._instance_init = as_steps(instance_init, "instance_init")
        self._instance_exit = as_steps(instance_exit, "instance_exit")
        self._workspace_type = workspace_type
        self._num_instances = 1 if num_instances is None else check_count(num_instances, "num_instances")
        self._used = False
        self._outputs: list[TaskOutput] = []
        self._inputs: dict[str, TaskOutput] = {}
        self._subtasks: list[Task] = []
        if inputs is not None and not isinstance(inputs, dict):
            raise DefinitionTypeError(f"inputs must be a dict {{local_name: TaskOutput}}, got {inputs!r}")
        base = name if name is not None else _default_name(self._steps)
        # Validate outputs and inputs before touching nodes or groups, so a bad one leaves no trace.
        self._name = f"{node if isinstance(node, str) else '<node>'}/{base}"
        made = [] if outputs is None else _as_outputs(outputs, f"task {self._name!r}")
        for local_name, output in (inputs or {}).items():
            _check_input(f"task {self._name!r}", local_name, output)
        node_obj = Node.current() if node is None else node if isinstance(node, Node) else Node(node)
        Cluster.current().add_node(node_obj)
        self._node = str(node_obj)
        self._node_resources = node_obj.kwargs()
        self._group = TaskRegistry.current(group, required=False)
        self._name = f"{self._node}/{base}"
        for output in made:
            self.add_output(output)
        self._inputs.update(inputs or {})
        if self._group is not None:
            self._name = self._group._unique_task_name(self._name)
            self._group._register(self)

    # -- outputs and inputs ---------------------------------------------------------------
    def _check_unused(self, what: str) -> None:
        if self._used:
            raise InvalidStateError(
                f"cannot {what} task {self._name!r}: its group has already run (or was regrouped by tasks_by_node)"
            )

    def add_output(self, name: str | Sequence[str] | TaskOutput) -> TaskOutput:
        """Capture another blob (or list of blobs) when the task finishes.

        Raises
        ------
        InvalidStateError
            The task's group has already run.
        """
        self._check_unused("add an output to")
        out = name if isinstance(name, TaskOutput) else TaskOutput(name)
        out.task = self
        self._outputs.append(out)
        return out

    def add_outputs(self, names: str | Sequence[str] | TaskOutput | Sequence[TaskOutput]) -> list[TaskOutput]:
        """Add each of ``names`` as a separate :class:`TaskOutput` (all or none).

        Raises
        ------
        InvalidStateError
            The task's group has already run.
        """
        self._check_unused("add an output to")
        return [self.add_output(item) for item in _as_outputs(names, f"task {self._name!r}")]

    def add_input(self, local_name: str, output: TaskOutput) -> None:
        """Feed ``output`` of another task of the same group to this task as ``local_name``.

        Raises
        ------
        InvalidStateError
            The task's group has already run.
        """
        self._check_unused("add an input to")
        _check_input(f"task {self._name!r}", local_name, output)
        self._inputs[local_name] = output

    def outputs(self) -> list[TaskOutput]:
        """The task's outputs, in declaration order."""
        return list(self._outputs)

    def output_list(self) -> TaskOutputList:
        """The outputs as one :class:`TaskOutputList`."""
        return TaskOutputList(self._outputs)

    def inputs(self) -> dict[str, TaskOutput]:
        """The task's dataflow inputs by local name."""
        return dict(self._inputs)

    # -- accessors ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Full name ``"<node>/<name>"``."""
        return self._name

    @property
    def node(self) -> str:
        """The node the task runs on."""
        return self._node

    def workspace_type(self) -> WorkspaceType | None:
        """The task's workspace type (``None`` until its group decides)."""
        return self._workspace_type

    @property
    def num_instances(self) -> int:
        """How many concurrent instances of the steps run."""
        return self._num_instances

    @property
    def steps(self) -> list[Step]:
        """The task's steps, in order."""
        return list(self._steps)

    def has_work(self) -> bool:
        """Whether the task runs any code (else it only reads its outputs)."""
        return bool(
            self._steps
            or self._task_init
            or self._task_exit
            or self._instance_init
            or self._instance_exit
            or self._subtasks
        )

    def _set_workspace_type(self, workspace_type: WorkspaceType) -> None:
        self._workspace_type = workspace_type

    def _notify_used(self) -> None:
        """Freeze the task: its group runs (or was regrouped)."""
        self._used = True

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self._group is not None:
            self._group._move_to_end(self)

    def __repr__(self) -> str:
        return f"Task(name={self._name}, node={self._node}, outputs={[o.names for o in self._outputs]})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


def final_output(blob: str | Sequence[str]) -> TaskOutput:
    """Add an output to the current Task, or to a new step-less Task on the current node.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.TaskGroup() as group:
    ...     out = dj.final_output("loss")
    >>> out.names, group.tasks()[0].name
    (['loss'], 'local/task')
    """
    output = blob if isinstance(blob, TaskOutput) else TaskOutput(blob)
    task = Task.current(required=False)
    if task is None:
        task = Task()
    return task.add_output(output)
