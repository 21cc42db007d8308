"""Worker side of :class:`~daskjobs.DaskSession`: node workspaces kept in a Dask worker plugin.

The plugin is registered once per cluster (idempotently) and re-installed by the scheduler on
every new or restarted worker. Its :meth:`WorkspacePlugin.setup` starts empty with a fresh
incarnation id, so a restarted worker's node states carry new tokens and a session that expected
the old ones raises :class:`~daskjobs.errors.NodeLostError` instead of running on an emptied
workspace.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from distributed import Client, Worker, get_worker, secede
from distributed.diagnostics.plugin import WorkerPlugin

from .._execution.node_run import NodeState
from ..errors import NodeLostError, NodePlacementError, TaskFailedError, picklable_cause
from ._placement import node_resource

T = TypeVar("T")

PLUGIN_NAME = "daskjobs-workspaces"

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

    def teardown(self, worker: Worker) -> None:
        with self._lock:
            self._states.clear()

    def node_state(self, session: str, node: str) -> NodeState:
        """The state of ``node`` for ``session``; created empty on first use."""
        with self._lock:
            state = self._states.get((session, node))
            if state is None:
                incarnation = f"{self.incarnation}-{next(self._serial)}"
                state = self._states[session, node] = NodeState(node, incarnation=incarnation, where=self._where)
            return state

    def drop_session(self, session: str) -> None:
        """Forget every workspace of ``session``."""
        with self._lock:
            for key in [k for k in self._states if k[0] == session]:
                del self._states[key]


@dataclass(frozen=True)
class WorkerStates:
    """The node-state provider lowered tasks carry: finds the plugin on the worker they run on."""

    session: str

    def node_state(self, node: str, token: str | None) -> NodeState:
        """``node``'s state on this worker; the caller checks ``token``.

        Raises :class:`~daskjobs.errors.NodePlacementError` if this worker does not serve ``node``.
        """
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
        return plugin.node_state(self.session, node)


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
