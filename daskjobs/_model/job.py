"""Job: the four task groups and the stop conditions a JobRunner loops over."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DefinitionTypeError, JobDefinitionError
from .context import Managed
from .group import TaskGroup, stepless_output_task
from .node import Node, node_name
from .task import Task, TaskOutput, WorkspaceType
from .values import check_count, validate_name

if TYPE_CHECKING:
    from .workspace import Workspace


class Job(Managed):
    """An epoch-checkpointed job: init once, loop the epoch group, then download and exit.

    ``with Job() as job:`` enters the job *and its epoch group*, so tasks created directly
    inside go to the epoch group; use ``with job.init_group:`` (and ``download_group``,
    ``exit_group``) for the others.

    Parameters
    ----------
    init_group
        Runs once when starting from scratch; GLOBAL by default so its blobs persist.
    epoch_group
        Runs once per epoch until a stop condition is true.
    download_group
        Runs once after the loop, to gather results.
    exit_group
        Runs once at the very end.
    stop_conditions
        :class:`TaskOutput` objects holding one boolean each.
    nodes_to_checkpoint
        Nodes whose workspaces are checkpointed; default: the init group's nodes.
    name
        The job's name, recorded in every checkpoint commit.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.Job(name="count") as job:
    ...     with job.init_group:
    ...         _ = dj.Task(lambda ws: ws.__setitem__("n", 0))
    ...     _ = dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    ...     _ = dj.epoch_limiter(job, 3)
    >>> dj.JobRunner(job).train(None)
    3
    """

    def __init__(
        self,
        init_group: TaskGroup | None = None,
        epoch_group: TaskGroup | None = None,
        download_group: TaskGroup | None = None,
        exit_group: TaskGroup | None = None,
        stop_conditions: Sequence[TaskOutput] | None = None,
        nodes_to_checkpoint: Sequence[str | Node] | None = None,
        *,
        name: str = "job",
    ) -> None:
        self.name = validate_name(name, "job")
        given = {"init": init_group, "epoch": epoch_group, "download": download_group, "exit": exit_group}
        seen: dict[int, str] = {}
        for label, group in given.items():
            if group is None:
                continue
            if not isinstance(group, TaskGroup):
                raise DefinitionTypeError(f"job {self.name!r}: {label}_group must be a TaskGroup, got {group!r}")
            if id(group) in seen:
                raise JobDefinitionError(
                    f"job {self.name!r}: the same TaskGroup is both the {seen[id(group)]} and the {label} group; "
                    "give each role its own TaskGroup"
                )
            seen[id(group)] = label
        nodes = [nodes_to_checkpoint] if isinstance(nodes_to_checkpoint, str | Node) else nodes_to_checkpoint
        if nodes is not None and not isinstance(nodes, list | tuple):
            raise DefinitionTypeError(
                f"job {self.name!r}: nodes_to_checkpoint must be a list of node names, got {nodes_to_checkpoint!r}"
            )
        for node in nodes or []:
            if not isinstance(node, str | Node):
                raise DefinitionTypeError(
                    f"job {self.name!r}: nodes_to_checkpoint holds {node!r}; give node names (str) or Nodes"
                )
        self._nodes_to_checkpoint = list(dict.fromkeys(validate_name(str(n), "node") for n in nodes or []))
        conditions = [stop_conditions] if isinstance(stop_conditions, str | TaskOutput) else stop_conditions
        if conditions is not None and not isinstance(conditions, list | tuple):
            raise DefinitionTypeError(
                f"job {self.name!r}: stop_conditions must be a list of TaskOutputs or blob names, "
                f"got {stop_conditions!r}"
            )
        self.init_group = init_group if init_group is not None else TaskGroup(WorkspaceType.GLOBAL)
        self.epoch_group = epoch_group if epoch_group is not None else TaskGroup()
        self.download_group = download_group if download_group is not None else TaskGroup()
        self.exit_group = exit_group if exit_group is not None else TaskGroup()
        for label, group in self.groups().items():
            group.label = label
        self.stop_conditions: list[TaskOutput] = []
        for condition in conditions or []:
            self.add_stop_condition(condition)
        self._num_limiters = 0
        self.epoch_limit: int | None = None
        """The smallest ``num_epochs`` of the job's :func:`epoch_limiter` calls (progress bars show it as the total)."""

    def groups(self) -> dict[str, TaskGroup]:
        """The four groups by role: ``init``, ``epoch``, ``download``, ``exit``."""
        return {
            "init": self.init_group,
            "epoch": self.epoch_group,
            "download": self.download_group,
            "exit": self.exit_group,
        }

    def __enter__(self) -> Job:
        super().__enter__()
        self.epoch_group.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.epoch_group.__exit__(*exc)
        super().__exit__(*exc)

    def add_stop_condition(self, output: TaskOutput | str) -> TaskOutput:
        """Stop the loop once ``output`` (one boolean) is true after an epoch.

        A blob name creates a step-less task in the epoch group on the current node that
        reads that blob after the node's other epoch tasks finished.
        """
        if not isinstance(output, TaskOutput | str):
            raise DefinitionTypeError(f"a stop condition must be a TaskOutput or a blob name, got {output!r}")
        if isinstance(output, TaskOutput) and len(output.names) != 1:
            raise JobDefinitionError(f"a stop condition must hold exactly one blob, got {output.names}")
        if isinstance(output, str):
            output = stepless_output_task(output, self.epoch_group)
        self.stop_conditions.append(output)
        return output

    def nodes_to_checkpoint(self) -> list[str]:
        """The explicit list if given, else the nodes used by the init group."""
        return list(self._nodes_to_checkpoint) or self.init_group.used_nodes()

    def nodes(self) -> list[str]:
        """Every node any group of the job uses, in first-use order."""
        names = [n for group in self.groups().values() for n in group.used_nodes()]
        return list(dict.fromkeys(names + self._nodes_to_checkpoint))

    def _fixed_stop_conditions(self) -> list[str]:
        """Names of the stop conditions no epoch-group task produces: captured once, they never change."""
        group = self.epoch_group
        produced = {id(output) for task in group._tasks + group._pending for output in task.outputs()}
        return [output.names[0] for output in self.stop_conditions if id(output) not in produced]

    def node_resources(self) -> dict[str, dict[str, float]]:
        """Every node of :meth:`nodes` with the extra Dask resources its worker must provide.

        They come from the :class:`Node` objects the job's tasks were placed on, e.g.
        ``{"ps": {}, "trainer": {"GPU": 1}}``; :func:`~daskjobs.node_cluster` accepts the job itself
        and gives each node's worker these resources.
        """
        needs: dict[str, dict[str, float]] = {name: {} for name in self.nodes()}
        for group in self.groups().values():
            for task in group._tasks + group._pending:
                for resource, amount in task._node_resources.items():
                    needs[task.node][resource] = max(needs[task.node].get(resource, 0), amount)
        return needs

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={g.num_registered_tasks()}" for k, g in self.groups().items())
        return (
            f"Job(name={self.name!r}, tasks=({counts}), stop_conditions={len(self.stop_conditions)}, "
            f"nodes={self.nodes()})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{k}</td><td>{g.num_registered_tasks()}</td><td>{html.escape(', '.join(g.used_nodes()))}</td></tr>"
            for k, g in self.groups().items()
        )
        stops = html.escape(", ".join(n for c in self.stop_conditions for n in c.names)) or "none"
        return (
            f"<b>Job</b> {html.escape(self.name)} &mdash; stop conditions: {stops}; "
            f"checkpointed nodes: {html.escape(', '.join(self.nodes_to_checkpoint()))}"
            f"<table><tr><th>group</th><th>tasks</th><th>nodes</th></tr>{rows}</table>"
        )


def epoch_limiter(job: Job, num_epochs: int, node: Node | str | None = None) -> TaskOutput:
    """Stop ``job`` after exactly ``num_epochs`` epochs from scratch.

    A counter blob is created in the init group (so it is checkpointed and a resumed run still
    stops at absolute epoch ``num_epochs``) and counted down in the epoch group.

    Raises
    ------
    DefinitionTypeError
        ``job`` is not a Job, or ``num_epochs`` is not an int.
    JobDefinitionError
        ``num_epochs`` is smaller than 1.
    """
    if not isinstance(job, Job):
        raise DefinitionTypeError(f"epoch_limiter needs a Job, got {type(job).__name__}: {job!r}")
    num_epochs = check_count(num_epochs, "epoch_limiter num_epochs")
    where = node_name(node)
    # Numbered per job, not per process: a job defined again (to resume it) uses the same blob names.
    suffix = job._num_limiters
    job._num_limiters += 1
    counter, stop = f"epoch_limiter.{suffix}.remaining", f"epoch_limiter.{suffix}.stop"
    start = int(num_epochs) - 1

    def create_counter(ws: Workspace) -> None:
        ws[counter] = np.int64(start)

    def count_down(ws: Workspace) -> None:
        with ws.lock:
            remaining = int(ws[counter])
            if remaining > 0:
                ws[counter] = np.int64(remaining - 1)
            ws[stop] = remaining == 0

    job.epoch_limit = int(num_epochs) if job.epoch_limit is None else min(job.epoch_limit, int(num_epochs))
    Task(create_counter, group=job.init_group, node=where, name="epoch_limiter")
    output = Task(count_down, group=job.epoch_group, node=where, name="epoch_limiter", outputs=stop).outputs()[0]
    return job.add_stop_condition(output)
