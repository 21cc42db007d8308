"""Worker side of :class:`~daskjobs.DaskSession`: node workspaces kept in a Dask worker plugin.

The plugin is registered once per cluster (idempotently) and re-installed by the scheduler on
every new or restarted worker. Its :meth:`WorkspacePlugin.setup` starts empty with a fresh
incarnation id, so a restarted worker's node states carry new tokens and a session that expected
the old ones raises :class:`~daskjobs.errors.NodeLostError` instead of running on an emptied
workspace. It logs that incarnation in the scheduler's event log of the worker's address (so a
session can tell which stay of a worker at that address its nodes lived in, see
:func:`~._losses.departure`) and the worker's arrival under :data:`JOINED_TOPIC` (so sessions
notice workers that join, see :mod:`._elastic`).

Pool workers get node resources at run time (:func:`set_node_resources`); the plugin records which
session gave which, so that resources given by hand stay apart from them. Nodes move between
workers with their workspaces (:func:`export_node`, :func:`install_node`, :func:`drop_node`).

A worker process behind a nanny leaves through its nanny: it ignores SIGINT and SIGTERM (the
nanny, which gets the same signal from a process-group kill, closes it gracefully, so the
scheduler's log tells a planned departure), and dies with its nanny.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from distributed import Client, Worker, get_worker, secede
from distributed.diagnostics.plugin import WorkerPlugin

from .._execution.node_run import NodeState
from .._model.values import Value, copy_value
from ..errors import NodeLostError, NodePlacementError, TaskFailedError, picklable_cause
from ._growth import trim_key_cache
from ._memory import WorkerMemory
from ._placement import node_resource, resource_node

T = TypeVar("T")

PLUGIN_NAME = "daskjobs-workspaces"
JOINED_TOPIC = "daskjobs-workers"
"""The scheduler's event topic under which each worker's plugin announces the worker's arrival."""
INCARNATION = "daskjobs-incarnation"
"""The action of the event, under a worker's own address, naming its plugin's incarnation."""

logger = logging.getLogger("daskjobs")


class WorkspacePlugin(WorkerPlugin):
    """Holds the node states of every session on one worker, keyed by ``(session id, node)``.

    State is created in :meth:`setup`, on the worker: the instance itself is pickled when it
    is registered.
    """

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Worker) -> None:
        self.incarnation = uuid.uuid4().hex[:12]
        self._where = f"worker {worker.name!r} ({worker.address}, host {socket.gethostname()})"
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], NodeState] = {}
        self.memory = WorkerMemory(worker)
        """The tier-0 snapshots of the nodes this worker serves (see :mod:`._memory`)."""
        self.given: dict[str, set[str]] = {}
        """Node resource -> the sessions that gave it to this worker at run time."""
        if worker.nanny and threading.current_thread() is threading.main_thread():
            leave_through_nanny()
        address = worker.contact_address or worker.address
        worker.log_event(address, {"action": INCARNATION, "incarnation": self.incarnation})
        worker.log_event(JOINED_TOPIC, {"action": "joined", "worker": address})

    def teardown(self, worker: Worker) -> None:
        with self._lock:
            self._states.clear()

    def node_state(self, session: str, node: str) -> NodeState:
        """The state of ``node`` for ``session``; created empty on first use."""
        with self._lock:
            state = self._states.get((session, node))
            if state is None:
                state = self._new_state(session, node)
            return state

    def fresh_node_state(self, session: str, node: str) -> NodeState:
        """A new, empty state of ``node`` for ``session`` (a new token), replacing any it had here."""
        with self._lock:
            return self._new_state(session, node)

    def _new_state(self, session: str, node: str) -> NodeState:
        incarnation = f"{self.incarnation}-{next(self._serial)}"
        state = NodeState(node, incarnation=incarnation, where=self._where, memory=self.memory)
        self._states[session, node] = state
        return state

    def drop_node(self, session: str, node: str) -> None:
        """Forget ``session``'s workspace of ``node`` on this worker."""
        with self._lock:
            self._states.pop((session, node), None)

    def drop_session(self, session: str) -> None:
        """Forget every workspace of ``session``."""
        with self._lock:
            for key in [k for k in self._states if k[0] == session]:
                del self._states[key]


def register_workspaces(client: Client) -> None:
    """Register the workspace plugin on every worker, now and to come. A worker that leaves while
    it is told fails the call; the scheduler has the plugin then, so the next call returns at once."""
    for attempt in range(3):
        try:
            client.register_plugin(WorkspacePlugin(), name=PLUGIN_NAME)
            return
        except OSError:  # CommClosedError: a worker left (an adaptive cluster scaling down)
            if attempt == 2 or client.status != "running":
                raise


def leave_through_nanny() -> None:
    """In a worker process behind a nanny, on its main thread: ignore SIGINT and SIGTERM. A signal
    to the whole process group (``scancel``, ``kill -TERM -PGID``, Ctrl-C) reaches the nanny too,
    which then closes this worker gracefully, with the signal as its reason."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass(frozen=True)
class WorkerStates:
    """The node-state provider lowered tasks carry: finds the plugin on the worker they run on."""

    session: str

    def node_state(self, node: str, token: str | None) -> NodeState:
        """``node``'s state on this worker; the caller checks ``token``.

        Raises :class:`~daskjobs.errors.NodePlacementError` if this worker does not serve ``node``.
        """
        trim_key_cache()  # once per node task: the worker sees new keys every epoch
        return _serving(node).node_state(self.session, node)


def _serving(node: str) -> WorkspacePlugin:
    """The workspace plugin of this worker, which must serve ``node``."""
    worker = get_worker()
    if worker.state.total_resources.get(node_resource(node), 0) <= 0:
        raise NodePlacementError(
            f"worker {worker.name!r} ({worker.address}) does not serve node {node!r}: "
            f"it lacks the resource {node_resource(node)!r}",
            [node],
        )
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, WorkspacePlugin):
        raise NodeLostError(
            f"worker {worker.name!r} ({worker.address}) has no daskjobs workspace plugin; "
            "the node's workspace is unavailable",
            [node],
        )
    return plugin


def call_on_node(states: WorkerStates, node: str, token: str | None, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(state, *args)`` on ``node``'s state, refusing a worker that restarted since ``token``."""
    state = states.node_state(node, token)
    # A token is "<incarnation>.<generation>": a new generation (a restore) is fine here, a new
    # incarnation means the worker restarted and the blobs the caller expects are gone.
    if token is not None and token.rpartition(".")[0] != state.incarnation:
        raise NodeLostError(
            f"node {node!r} lost its workspace: its worker restarted (expected {token}, found {state.token}); "
            "restore it from a checkpoint",
            [node],
        )
    return fn(state, *args)


def _plugin(worker: Worker) -> WorkspacePlugin:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, WorkspacePlugin):
        raise NodePlacementError(f"worker {worker.name!r} ({worker.address}) has no daskjobs workspace plugin", [])
    return plugin


def given_resources(dask_worker: Worker) -> dict[str, list[str]]:
    """``client.run`` target: node resource -> the sessions that gave it to this worker (those it
    still has)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, WorkspacePlugin):
        return {}
    have = dask_worker.state.total_resources
    return {resource: sorted(sessions) for resource, sessions in plugin.given.items() if have.get(resource, 0) > 0}


async def set_node_resources(changes: dict[str, dict[str, tuple[float, list[str]]]], dask_worker: Worker) -> None:
    """``client.run`` target: give this worker (its entry of ``changes``, by address) node resources
    and record the sessions that gave them: resource -> (amount, sessions); amount 0 takes it back.
    A session that no longer holds a node's resource here (it closed, its driver died, or the node
    moved away) no longer has the node's workspace here either. The scheduler knows the new
    resources when this returns."""
    mine = changes.get(dask_worker.contact_address or "") or changes.get(dask_worker.address) or {}
    plugin = _plugin(dask_worker)
    for resource, (_, sessions) in mine.items():
        for left in plugin.given.get(resource, set()) - set(sessions):
            plugin.drop_node(left, resource_node(resource) or resource)
        if sessions:
            plugin.given[resource] = set(sessions)
        else:
            plugin.given.pop(resource, None)
    await dask_worker.set_resources(**{resource: amount for resource, (amount, _) in mine.items()})


def export_node(states: WorkerStates, node: str, token: str | None) -> dict[str, Value]:
    """Task on ``node``'s worker: the blobs of its GLOBAL workspace, refusing a restarted worker (see
    :func:`call_on_node`)."""
    return call_on_node(states, node, token, lambda state: dict(state.scope.blobs))


def install_node(states: WorkerStates, node: str, blobs: dict[str, Value]) -> str:
    """Task on ``node``'s new worker: a fresh workspace of ``node`` holding copies of ``blobs``;
    returns its token."""
    state = _serving(node).fresh_node_state(states.session, node)
    state.replace_blobs({name: copy_value(value, name) for name, value in blobs.items()})
    return state.token


def install_snapshot(states: WorkerStates, node: str, bundle: Mapping[str, dict[str, Value]]) -> str:
    """Task on ``node``'s worker: a fresh workspace of ``node`` holding copies of its snapshot in
    ``bundle`` (a tier-0 bundle: node -> snapshot); returns its token."""
    return install_node(states, node, bundle[node])


def drop_session(session: str, dask_worker: Worker) -> None:
    """``client.run`` target: forget ``session``'s workspaces on this worker."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, WorkspacePlugin):
        plugin.drop_session(session)


def running_keys(prefix: str, dask_worker: Any = None) -> list[str]:
    """On a worker: the keys starting with ``prefix`` whose code still runs in a thread, also
    after the scheduler released them (state ``cancelled``: a step of a dropped run)."""
    running = ("executing", "long-running")
    return [
        str(ts.key)
        for ts in list(dask_worker.state.tasks.values())
        if str(ts.key).startswith(prefix) and (ts.state in running or ts.previous in running)
    ]


def wait_for_steps(client: Client, prefix: str, timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds until no task whose key starts with ``prefix`` runs on any
    worker; return the keys still running then (``[]``: none)."""
    deadline, logged = time.monotonic() + timeout, False
    while True:
        left = max(0.0, deadline - time.monotonic())
        found = client.run(running_keys, prefix, on_error="ignore", callback_timeout=max(left, 1.0))
        keys = sorted(key for keys in found.values() for key in keys)
        if not keys or not left:
            return keys
        if not logged:
            logger.info("waiting for %d step(s) of an interrupted run to end on the workers", len(keys))
            logged = True
        time.sleep(min(0.1, left))


class OnWorker:
    """A Dask task function of a run, as a worker calls it.

    With ``seceding`` it first leaves the worker's thread pool (``distributed.secede``). A
    :class:`~daskjobs.errors.TaskFailedError` leaves the worker with causes that can be pickled:
    Dask pickles an error with its whole chain of causes, and one that cannot be pickled would
    reach the client as a bare ``Exception`` holding a repr.
    """

    def __init__(self, fn: Callable[..., Any], seceding: bool) -> None:
        self.fn, self.seceding = fn, seceding

    def __call__(self, *args: Any) -> Any:
        if self.seceding:
            secede()
        try:
            return self.fn(*args)
        except TaskFailedError as exc:
            exc.__cause__ = picklable_cause(exc.__cause__)
            exc.__context__ = exc.__cause__
            raise
