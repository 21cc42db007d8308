"""LocalSession: the same lowered graphs, run by Dask's local scheduler in this process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import dask
import dask.threaded

from .._config import config_timeout
from .._execution.lowering import LoweredGraph
from .._execution.node_run import NodeState
from .._execution.plan import NodeResult, RunFailed
from .._model.values import Value
from ..errors import SessionClosedError
from ._base import Session
from ._memory import ProcessMemory

T = TypeVar("T")


class _LocalStates:
    """Node states kept in this process, created on first use, with their tier-0 snapshots."""

    def __init__(self) -> None:
        self.states: dict[str, NodeState] = {}
        self._lock = threading.Lock()
        self.memory = ProcessMemory(self._restore)

    def node_state(self, node: str, token: str | None) -> NodeState:
        with self._lock:
            state = self.states.get(node)
            if state is None:
                state = self.states[node] = NodeState(node, memory=self.memory)
            return state

    def _restore(self, node: str, blobs: dict[str, Value]) -> None:
        self.node_state(node, None).replace_blobs(blobs)


class _Failure:
    """A task's error, handed to the tasks that depend on it instead of their inputs."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Running:
    """How many Dask tasks of a session's runs are running (an interrupted run's go on in the pool)."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = threading.Condition()

    def wait_idle(self, timeout: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.count == 0, timeout)


class _Settled:
    """A task function that returns its error as a :class:`_Failure` (and passes one on) instead of raising."""

    def __init__(self, fn: Callable[..., Any], running: _Running) -> None:
        self.fn, self.running = fn, running

    def __call__(self, *args: Any) -> Any:
        for arg in args:
            if isinstance(arg, _Failure):
                return arg
        with self.running.idle:
            self.running.count += 1
        try:
            return self.fn(*args)
        except BaseException as exc:  # raised in the caller's thread once every task ended
            return _Failure(exc)
        finally:
            with self.running.idle:
                self.running.count -= 1
                self.running.idle.notify_all()


class LocalSession(Session):
    """Runs jobs in this process, with one workspace per node and no cluster.

    Each TaskGroup run is lowered to the same Dask graph a :class:`DaskSession` runs and
    executed by Dask's local threaded scheduler, so tasks of a group really run concurrently.
    Unlike Caffe2's LocalSession, nodes do not share blobs.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.LocalSession() as session:
    ...     session.feed("x", 2.5, node="ps")
    ...     print(session.fetch("x"), session.blobs())
    2.5 ['x']
    """

    in_process = True

    def __init__(self) -> None:
        super().__init__()
        self._states = _LocalStates()
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="daskjobs-local")
        self._running = _Running()

    def start_job_run(self, job: str) -> None:
        """Start a new run of ``job`` (see :meth:`Session.start_job_run`).

        After an interrupted run (a second Ctrl-C abandons an epoch at once) its steps may still
        run in this process's threads, and would write into the workspaces the new run uses: the
        new run first waits for them, at most ``daskjobs.straggler-timeout`` (60 s); then the
        session is closed, with :class:`~daskjobs.errors.SessionClosedError`.
        """
        super().start_job_run(job)
        timeout = config_timeout("straggler-timeout")
        if not self._running.wait_idle(timeout):
            self.close()
            raise SessionClosedError(
                f"LocalSession closed: steps of an interrupted run still run after {timeout:g} s "
                "(daskjobs.straggler-timeout); they could change the workspaces of a new run. Open a new session"
            )

    def _provider(self) -> _LocalStates:
        return self._states

    @property
    def memory(self) -> ProcessMemory:
        """Tier 0 in this process: each node snapshot is a copy kept here (no replicas)."""
        return self._states.memory

    def _execute(self, graph: LoweredGraph, meanwhile: Callable[[], None] | None = None) -> dict[str, NodeResult]:
        if meanwhile is not None:
            meanwhile()
        # Every task runs to its end in the pool, a failure passed on to its dependents instead of
        # raised at once: no task runs on after the run failed, and the nodes that finished are
        # known. An interrupted run's tasks also run to their end: the next run waits for them.
        dsk = {key: (_Settled(task[0], self._running), *task[1:]) for key, task in graph.to_dask().items()}
        values = dict(zip(dsk, dask.threaded.get(dsk, list(dsk), pool=self._pool), strict=True))
        failure = next((values[t.key] for t in graph.tasks if isinstance(values[t.key], _Failure)), None)
        if failure is not None and not isinstance(failure.error, Exception):
            raise failure.error
        if failure is not None:
            finished = {n: values[k] for n, k in graph.result_keys.items() if not isinstance(values[k], _Failure)}
            raise RunFailed(failure.error, finished)
        return {node: values[key] for node, key in graph.result_keys.items()}

    def _call_on_node(self, node: str, fn: Callable[..., T], *args: Any) -> T:
        return fn(self._states.node_state(node, None), *args)

    def _has_workspace(self, node: str) -> bool:
        return node in self._states.states

    def _known_nodes(self) -> list[str]:
        return list(self._states.states)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        state = "open" if self.is_open() else "closed"
        return f"LocalSession({state}, nodes={self._known_nodes()})"
