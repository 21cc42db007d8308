"""The session interface: what every session does the same way, and the seams where they differ."""

from __future__ import annotations

import abc
import contextlib
import itertools
import logging
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar

from .._execution.lowering import LoweredGraph, lower, plan_group
from .._execution.memory import ClusterMemory
from .._execution.node_run import NodeState, NodeStateProvider, abandon_node_run, private_trap_message
from .._execution.plan import GroupRun, GroupRunFailed, NodeResult, RunFailed
from .._model.group import TaskGroup
from .._model.metrics import merge_sums
from .._model.node import Node
from .._model.task import Task, WorkspaceType, as_workspace_type
from .._model.values import BlobValue, Value, as_value, copy_value, validate_name
from ..errors import JobDefinitionError, NodeLostError, SessionClosedError

T = TypeVar("T")

logger = logging.getLogger("daskjobs")

Runnable = TaskGroup | Task | Callable[..., Any] | Sequence[Callable[..., Any]]
_wrapped_tasks: weakref.WeakKeyDictionary[Task, weakref.ref[TaskGroup]] = weakref.WeakKeyDictionary()
"""The group each task run on its own was wrapped in. The group holds its task, so it is held
weakly here (the task's ``_group`` keeps it alive as long as the task lives)."""


def as_group(runnable: Runnable, workspace_type: WorkspaceType | str | None = None) -> TaskGroup:
    """A TaskGroup for ``runnable``; tasks and callables are wrapped in a GLOBAL group."""
    workspace_type = as_workspace_type(workspace_type, "session.run")
    if isinstance(runnable, TaskGroup):
        declared = runnable.workspace_type()
        if workspace_type is not None and declared is not None and declared != workspace_type:
            raise JobDefinitionError(f"{runnable!r} is {declared.name}, cannot run it as {workspace_type.name}")
        if workspace_type is not None and declared is None:
            runnable._workspace_type = workspace_type
        return runnable
    if isinstance(runnable, Task):
        wrapped = _wrapped_tasks.get(runnable)
        group = wrapped() if wrapped is not None else None
        if group is None:
            group = TaskGroup(workspace_type or WorkspaceType.GLOBAL)
            group.add(runnable)
            _wrapped_tasks[runnable] = weakref.ref(group)
        return group
    if callable(runnable) or (isinstance(runnable, list | tuple) and all(callable(r) for r in runnable)):
        group = TaskGroup(workspace_type or WorkspaceType.GLOBAL)
        Task(list(runnable) if isinstance(runnable, list | tuple) else runnable, group=group)
        return group
    raise JobDefinitionError(f"cannot run {runnable!r}: give a TaskGroup, a Task, a callable or a list of callables")


def _fetch_blob(state: NodeState, blob: str) -> Value:
    if blob not in state.scope.blobs:
        raise KeyError(
            f"blob {blob!r} is not in the workspace of node {state.node!r}; it has {sorted(state.scope.blobs)}"
        )
    return copy_value(state.scope.blobs[blob], blob)


def _feed_blob(state: NodeState, blob: str, value: Value) -> str:
    state.workspace()[blob] = value
    return state.token


def _blob_names(state: NodeState) -> list[str]:
    return sorted(state.scope.blobs)


class Session(abc.ABC):
    """Runs TaskGroups on nodes and gives access to node workspaces.

    Subclasses differ only in where node workspaces live and how lowered graphs run: they
    implement ``_provider``, ``_execute``, ``_call_on_node``, ``_known_nodes`` and ``_shutdown``,
    and may override ``_has_workspace``.
    """

    background_flushes: ClassVar[bool] = False
    """Whether the runner lets nodes fsync an epoch's checkpoint in the background while the next
    epoch runs: on a cluster, whose nodes idle between epochs; not in this process, where that
    thread would hold back the steps."""

    in_process: ClassVar[bool] = False
    """Whether every node's workspace lives in this process: the checkpoint storage the nodes see
    is then the driver's, with nothing to prove (see
    :meth:`~daskjobs.MultiNodeCheckpointManager.check_shared`)."""

    def __init__(self) -> None:
        self._open = True
        self.session_id = uuid.uuid4().hex[:8]
        self._run_counter = itertools.count()
        self._tokens: dict[str, str] = {}
        self._warned_traps: set[tuple[str, str, str]] = set()

    # -- seams ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _provider(self) -> NodeStateProvider:
        """What lowered tasks use to find node states where they run."""

    @abc.abstractmethod
    def _execute(self, graph: LoweredGraph, meanwhile: Callable[[], None] | None = None) -> dict[str, NodeResult]:
        """Run ``graph`` to completion; return each node's result.

        A failure of the run raises :class:`~daskjobs._execution.plan.RunFailed` with its first
        error and the results of the nodes whose share finished (their ``finish`` hooks ran);
        an interruption (``KeyboardInterrupt``) goes through as it is. ``meanwhile`` is called once
        while the graph runs (or just before, where it runs in this thread).
        """

    @abc.abstractmethod
    def _call_on_node(self, node: str, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(node_state, *args)`` where the node's workspace lives."""

    @abc.abstractmethod
    def _known_nodes(self) -> list[str]:
        """Nodes this session has workspaces for (or can place work on)."""

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called once by :meth:`close`."""

    # -- optional capabilities ----------------------------------------------------------------
    @property
    def dashboard_link(self) -> str | None:
        """The URL of the Dask dashboard of the cluster the session runs on; ``None`` without one."""
        return None

    @property
    def memory(self) -> ClusterMemory | None:
        """Where tier-0 checkpoints of node workspaces are kept (``None``: this session keeps none)."""
        return None

    def wait_for_nodes(  # noqa: B027 - optional hook
        self,
        nodes: Iterable[object] | None = None,
        timeout: float | None = None,
        resources: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Wait until each node has a worker that can run it (before a job starts, after a worker was
        lost); nothing to wait for where every node runs in this process."""

    def stop_requested(self, requested: bool = True) -> None:  # noqa: B027 - optional hook
        """A stop of the run was asked for (a signal, ``JobRunner.request_stop``; ``False``: the run
        ended): a wait that only the running epoch needs, such as a DaskSession's for its scheduler to
        come back, gives up sooner. Nothing waits so where every node runs in this process."""

    @property
    def placement(self) -> dict[str, str]:
        """Node -> the address of the worker serving it; empty where nodes run in this process."""
        return {}

    def rebalance(self, before: Callable[[], object] | None = None) -> dict[str, str]:
        """Move nodes to workers that joined the cluster, at an epoch boundary (``before()`` first
        when anything moves); return the nodes that moved and their new workers. Nothing moves
        where nodes run in this process."""
        return {}

    # -- running --------------------------------------------------------------------------
    def run(self, runnable: Runnable, workspace_type: WorkspaceType | str | None = None) -> None:
        """Run a TaskGroup, a Task, a callable or a list of callables (blocking).

        Non-groups are wrapped in a GLOBAL TaskGroup on the current node, or in one of
        ``workspace_type`` (a :class:`~daskjobs.WorkspaceType`, or ``"global"`` / ``"private"``)
        when given; a group without a type takes it, and one with another type raises
        :class:`~daskjobs.errors.JobDefinitionError`.
        """
        self._check_open()
        if runnable is None:
            raise JobDefinitionError("session.run needs something to run, got None")
        group = as_group(runnable, workspace_type)
        self.start_job_run("session")
        self.run_group(group)

    def run_group(
        self,
        group: TaskGroup,
        *,
        job: str = "session",
        epoch: int | None = None,
        attempt: int = 0,
        finish: Mapping[str, Callable[[NodeState], Any]] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> GroupRun:
        """Run ``group`` as part of ``job`` (at ``epoch``) and bind its task outputs.

        Returns the sums and counts of the metrics its steps logged (``ws.log``, over all nodes)
        and, by node, what the ``finish`` hooks returned.

        ``finish`` maps some of the group's nodes to ``hook(node_state)``, run on that node in
        the same Dask task as the end of its share of the run (after its tasks and step-less
        outputs): the runner saves an epoch's checkpoint this way, without another round trip.
        Each hook's return value must be picklable. A run with hooks that fails raises
        :class:`~daskjobs._execution.plan.GroupRunFailed`: its ``error`` is what the run raises
        without hooks, its ``finished`` what the hooks of the nodes that finished returned.

        ``meanwhile()`` is called once in this thread while the group runs on the cluster (before
        it runs, in a :class:`LocalSession`): the runner writes the previous epoch's commit there,
        off the epoch's critical path. It must not raise errors (it keeps them for later); an
        interruption (``KeyboardInterrupt``) abandons the run like one during the gather.
        """
        self._check_open()
        plan = plan_group(group, job)
        # Every Dask key of the session starts with "daskjobs-<session id>-": Dask's key_split
        # maps them all to one task group and prefix, so the scheduler's bookkeeping stays flat.
        run_key = f"daskjobs-{self.session_id}-{job}/{group.label}/r{next(self._run_counter)}/a{attempt}"
        graph = lower(
            plan,
            self._provider(),
            run_key=run_key,
            epoch=epoch,
            tokens={n: self._tokens[n] for n in plan.node_plans if n in self._tokens},
            finish=finish,
        )
        try:
            results = self._execute(graph, meanwhile)
        except RunFailed as failed:
            error, finished = failed.error, self._finished(failed.results, finish)
        except Exception as exc:  # before the run started (placement, a closed session): nothing finished
            error, finished = exc, {}
        except BaseException:  # an interruption: the run is abandoned as it stands
            if plan.has_edges:
                self._abandon(graph, run_key)
            raise
        else:
            return self._bind(group, job, results, finish)
        if isinstance(error, NodeLostError):
            self._lost_once(error)
        if plan.has_edges:
            self._abandon(graph, run_key)
        if finish:
            raise GroupRunFailed(error, finished)
        raise error

    def _bind(
        self, group: TaskGroup, job: str, results: dict[str, NodeResult], finish: Mapping[str, Any] | None
    ) -> GroupRun:
        """Take the nodes' ``results`` of a run of ``group`` that succeeded: tokens, trap warnings, outputs."""
        for node, result in results.items():
            self._tokens[node] = result.token
            self._warn_traps(job, group.label, node, result.traps)
            tasks = group.tasks() if result.captured else []  # frozen by plan_group: the plan's order
            for index, captured in result.captured.items():
                for output, values in zip(tasks[index].outputs(), captured, strict=True):
                    output._set(values)
        metrics = merge_sums(result.metrics for result in results.values())
        return GroupRun(metrics, self._finished(results, finish))

    @staticmethod
    def _finished(results: dict[str, NodeResult], finish: Mapping[str, Any] | None) -> dict[str, Any]:
        """What the ``finish`` hooks of the nodes in ``results`` returned, by node."""
        return {node: result.finished for node, result in results.items() if finish and node in finish}

    def _lost_once(self, error: NodeLostError) -> None:
        """Make ``error`` name every node that shared the lost worker, and forget their tokens: the
        loss is reported once, and the next run or call takes the nodes' new (empty) workspaces."""
        lost = self._lost_with(error.nodes)
        shared = sorted(set(lost) - set(error.nodes))
        if shared:
            error.message = f"{error.message} Node(s) {shared} shared that worker: their workspaces are gone too."
            error.nodes = sorted({*error.nodes, *shared})
            error.args = (error.message, error.nodes, error.departure)
        self.forget_tokens(lost)

    def _on_node(self, node: str, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_call_on_node` for the workspace calls, reporting a lost worker once (see :meth:`_lost_once`)."""
        try:
            return self._call_on_node(node, fn, *args)
        except NodeLostError as exc:
            self._lost_once(exc)
            raise

    def _lost_with(self, nodes: Sequence[str]) -> list[str]:
        """``nodes`` and the nodes that shared a worker with them: their tokens start with the same
        worker incarnation (``<worker>-<serial>.<generation>``, see the workspace plugin)."""
        workers = {self._tokens[n].partition("-")[0] for n in nodes if n in self._tokens}
        return [n for n, token in self._tokens.items() if n in nodes or token.partition("-")[0] in workers]

    def start_job_run(self, job: str) -> None:
        """Start a new run of ``job``: its accumulate-in-PRIVATE warnings are logged again.

        :meth:`~daskjobs.JobRunner.train` calls it, and so does each :meth:`run` (job
        ``"session"``), so such a warning is logged once per job run, node and blob.
        """
        self._warned_traps = {key for key in self._warned_traps if key[0] != job}

    def _warn_traps(self, job: str, group: str, node: str, blobs: Sequence[str]) -> None:
        """Log the accumulate-in-PRIVATE warning once per run of ``job``, node and blob."""
        for blob in blobs:
            if (job, node, blob) not in self._warned_traps:
                self._warned_traps.add((job, node, blob))
                logger.warning(private_trap_message(job, group, node, blob))

    def _abandon(self, graph: LoweredGraph, run_key: str) -> None:
        for node in graph.nodes():
            with contextlib.suppress(Exception):
                self._call_on_node(node, abandon_node_run, run_key)

    def forget_tokens(self, nodes: Sequence[str] | None = None) -> None:
        """Accept whatever generation ``nodes`` (default: all) have at their next run."""
        for node in list(self._tokens) if nodes is None else nodes:
            self._tokens.pop(node, None)

    # -- workspace access -----------------------------------------------------------------
    def _has_workspace(self, node: str) -> bool:
        """Whether ``node`` already has a workspace; read-only calls never create one."""
        return True

    def _resolve_node(self, node: object) -> str:
        """The node a workspace call targets: ``node``, else the only node the session knows, else
        the current :class:`~daskjobs.Node` while the session knows none."""
        if node is not None:
            return validate_name(str(node), "node")
        known = self._known_nodes()
        if len(known) == 1:
            return known[0]
        if not known:
            return str(Node.current())
        raise JobDefinitionError(f"this session has nodes {known}; name the node (node=...)")

    def fetch(self, blob: str, node: object = None) -> BlobValue:
        """A copy of ``blob`` from the node's GLOBAL workspace: an array or a JSON value.

        ``node`` may be omitted when the session knows exactly one node, or none yet (then it
        is the current :class:`~daskjobs.Node`, ``"local"`` outside any ``with Node(...)``).

        Raises
        ------
        KeyError
            The node has no blob ``blob`` (or no workspace at all: nothing is created for it).
        JobDefinitionError
            ``node`` is omitted but the session knows several nodes, or a name is invalid.
        """
        self._check_open()
        name, blob = self._resolve_node(node), validate_name(blob, "blob")
        if not self._has_workspace(name):
            raise KeyError(
                f"blob {blob!r} is not in the workspace of node {name!r}: the session has no workspace for "
                f"{name!r} yet (its nodes: {self._known_nodes()})"
            )
        return self._on_node(name, _fetch_blob, blob)

    def feed(self, blob: str, value: object, node: object = None) -> None:
        """Store a copy of ``value`` as ``blob`` in the node's GLOBAL workspace.

        ``value`` is normalised as a step's assignment would be (see :class:`~daskjobs.Workspace`).
        ``node`` may be omitted as for :meth:`fetch`.

        Raises
        ------
        BlobTypeError
            ``value`` could not survive a checkpoint; nothing is sent to the node.
        JobDefinitionError
            ``node`` is omitted but the session knows several nodes, or a name is invalid.
        """
        self._check_open()
        normalised = as_value(value, validate_name(blob, "blob"))
        if normalised is value:
            normalised = copy_value(normalised, blob)
        name = self._resolve_node(node)
        # From now on the node's workspace holds something the caller expects: a worker restart
        # before its next run or call is reported (NodeLostError), not run on an emptied workspace.
        self._tokens.setdefault(name, self._on_node(name, _feed_blob, blob, normalised))

    def blobs(self, node: object = None) -> list[str]:
        """Names of the blobs in the node's GLOBAL workspace, sorted (none for a node without one).

        ``node`` may be omitted as for :meth:`fetch`.
        """
        self._check_open()
        name = self._resolve_node(node)
        if not self._has_workspace(name):
            return []
        return self._on_node(name, _blob_names)

    def nodes(self) -> list[str]:
        """The nodes this session knows."""
        return self._known_nodes()

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._open:
            raise SessionClosedError(f"{type(self).__name__} {self.session_id} is closed; open a new session")

    def is_open(self) -> bool:
        """Whether the session can still be used."""
        return self._open

    def close(self) -> None:
        """Release the session; using it afterwards raises :class:`~daskjobs.errors.SessionClosedError`."""
        if self._open:
            self._open = False
            self._shutdown()

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
