"""DaskSession: TaskGroups run on a ``distributed`` cluster, node workspaces live on the workers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from distributed import Client, Future
from distributed.comm.core import CommClosedError
from distributed.scheduler import KilledWorker, NoValidWorkerError, NoWorkerError

from .._execute import NodeResult
from .._lowering import Dep, LoweredGraph
from .._validation import validate_name
from ..errors import NodeLostError, SessionClosedError
from ._base import Session
from ._placement import WorkerTable, config_timeout, node_resource, served_nodes, wait_for_placement
from ._plugin import PLUGIN_NAME, WorkerStates, WorkspacePlugin, call_on_node, drop_session

T = TypeVar("T")

_WATCH_INTERVAL = 1.0
"""Seconds between checks, while a run is in flight, that its nodes still have workers."""

_RECOVERY_HINT = (
    "Its workspace is gone: wait for the node's worker to return (session.wait_for_nodes) and restore "
    "the workspace from a checkpoint (JobRunner does both when given a checkpoint manager and max_failures > 0)."
)


_DISTRIBUTED_FAILURES = (KilledWorker, NoValidWorkerError, NoWorkerError, CancelledError, CommClosedError)
"""What distributed raises when a node's worker dies, is missing, or the cluster connection breaks."""


def _connect(target: object) -> tuple[Client, bool]:
    """A synchronous client for ``target`` and whether the session owns (and later closes) it."""
    if isinstance(target, Client):
        if target.asynchronous:
            raise TypeError("DaskSession needs a synchronous distributed.Client, got an asynchronous one")
        return target, False
    if isinstance(target, str) or hasattr(target, "scheduler_address"):
        return Client(target, set_as_default=False), True
    raise TypeError(f"DaskSession needs a distributed.Client, a cluster object or a scheduler address, got {target!r}")


def _when_all_done(futures: Sequence[Future]) -> threading.Event:
    """An event set once every future has finished, erred or been cancelled."""
    event = threading.Event()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                event.set()

    for future in futures:
        future.add_done_callback(one_done)
    return event


class DaskSession(Session):
    """Runs jobs on a Dask ``distributed`` cluster; each node's workspace lives on its worker.

    A node is placed on the one worker providing the resource :func:`~daskjobs.node_resource`
    of its name (see :func:`~daskjobs.node_cluster` and ``daskjobs worker``). Before a node's
    first run the session checks that exactly one worker serves it, with the node's extra
    resources, and raises :class:`~daskjobs.errors.NodePlacementError` within seconds otherwise.
    A worker that dies or restarts is detected (its workspace would be empty) and reported as
    :class:`~daskjobs.errors.NodeLostError`.

    Parameters
    ----------
    target : distributed.Client, cluster or str
        A synchronous client (left open by :meth:`close`), a cluster object such as the result
        of :func:`~daskjobs.node_cluster`, or a scheduler address such as ``"tcp://127.0.0.1:8786"``.
        For the last two the session makes its own client and closes it with the session.

    Notes
    -----
    Workspaces are private to the session: two sessions on one cluster never see each other's
    blobs, and :meth:`close` frees the session's workspaces on the workers.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.node_cluster(["ps"]) as cluster, dj.DaskSession(cluster) as session:  # doctest: +SKIP
    ...     session.feed("w", 1.5, node="ps")
    ...     print(session.fetch("w"))
    1.5
    """

    def __init__(self, target: Client | str | Any) -> None:
        client, owned = _connect(target)
        super().__init__()
        self._client, self._owns_client = client, owned
        self._states = WorkerStates(self.session_id)
        self._node_resources: dict[str, dict[str, float]] = {}
        self._placed: dict[str, frozenset[str]] = {}
        try:
            client.register_plugin(WorkspacePlugin(), name=PLUGIN_NAME)
        except BaseException:
            if owned:
                client.close()
            raise

    @property
    def client(self) -> Client:
        """The ``distributed.Client`` the session submits to."""
        return self._client

    # -- seams ----------------------------------------------------------------------------
    def _provider(self) -> WorkerStates:
        return self._states

    def _execute(self, graph: LoweredGraph) -> dict[str, NodeResult]:
        self._check_client()
        self._preflight(graph.nodes(), graph.resources)
        node_of = {task.key: task.node for task in graph.tasks}
        results = self._settle_and_gather(self._submit(graph), node_of, list(graph.result_keys.values()))
        return dict(zip(graph.result_keys, results, strict=True))

    def _submit(self, graph: LoweredGraph) -> dict[str, Future]:
        """Submit every task of ``graph`` (in dependency order), with Dep args replaced by futures."""
        futures: dict[str, Future] = {}
        for task in graph.tasks:
            futures[task.key] = self._client.submit(
                task.fn,
                *(futures[a.key] if isinstance(a, Dep) else a for a in task.args),
                key=task.key,
                resources={node_resource(task.node): 1, **graph.resources.get(task.node, {})},
                pure=False,
            )
        return futures

    def _call_on_node(self, node: str, fn: Callable[..., T], *args: Any) -> T:
        self._check_client()
        self._preflight([node], {})
        key = f"daskjobs-{self.session_id}-call-{uuid.uuid4().hex}"
        resources = {node_resource(node): 1}
        token = self._tokens.get(node)
        futures = {
            key: self._client.submit(
                call_on_node, self._states, node, token, fn, *args, key=key, resources=resources, pure=False
            )
        }
        return self._settle_and_gather(futures, {key: node}, [key])[0]

    def _known_nodes(self) -> list[str]:
        return sorted(served_nodes(self._workers()))

    def _shutdown(self) -> None:
        try:
            if self._client.status == "running":
                self._client.run(drop_session, self.session_id, on_error="ignore")
        finally:
            if self._owns_client:
                self._client.close()

    # -- placement ------------------------------------------------------------------------
    def _check_client(self) -> None:
        if self._client.status in ("closing", "closed"):
            raise SessionClosedError(f"the Dask client of DaskSession {self.session_id} was closed")

    def _workers(self) -> WorkerTable:
        self._check_client()
        return self._client.scheduler_info(n_workers=-1)["workers"]

    def _preflight(self, nodes: Iterable[str], resources: Mapping[str, Mapping[str, float]]) -> None:
        """Check placement of nodes not yet checked (or needing resources not yet checked)."""
        unchecked = []
        for node in nodes:
            needs = dict(resources.get(node, {}))
            self._node_resources.setdefault(node, {}).update(needs)
            if node not in self._placed or not set(needs) <= self._placed[node]:
                unchecked.append(node)
        if unchecked:
            self._wait_placed(unchecked, config_timeout("preflight-timeout"))

    def _wait_placed(self, nodes: list[str], timeout: float) -> None:
        wait_for_placement(self._workers, nodes, self._node_resources, timeout)
        for node in nodes:
            self._placed[node] = frozenset(self._node_resources.get(node, {}))

    def wait_for_nodes(self, nodes: Iterable[object] | None = None, timeout: float | None = None) -> None:
        """Wait until each node has exactly one suitable worker again (e.g. after a worker restart).

        Parameters
        ----------
        nodes : iterable of str or Node, optional
            The nodes to wait for; default: every node this session has used.
        timeout : float, optional
            Seconds to wait; default: the Dask config value ``daskjobs.placement-timeout`` (10 s).

        Raises
        ------
        NodePlacementError
            If some node still has no worker, several, or one lacking the node's extra
            resources when the time is up; the message lists the available workers.

        Examples
        --------
        >>> session.wait_for_nodes(["ps", "trainer"], timeout=30)  # doctest: +SKIP
        """
        self._check_open()
        names = list(self._node_resources) if nodes is None else [validate_name(str(n), "node") for n in nodes]
        for name in names:
            self._node_resources.setdefault(name, {})
        self._wait_placed(names, config_timeout("placement-timeout") if timeout is None else timeout)

    # -- waiting and errors ---------------------------------------------------------------
    def _settle_and_gather(self, futures: dict[str, Future], node_of: dict[str, str], keys: list[str]) -> list[Any]:
        """Wait until every future is done (watching for lost nodes), then gather ``keys`` at once.

        On failure, raise the first error in submission (dependency) order with its remote
        traceback; distributed's failures become NodeLostError. The futures are released first
        and no raised traceback refers to them, so failed runs leave no keys on the scheduler.
        """
        tb = None
        try:
            error: BaseException | None = self._settle(list(futures.values()), node_of)
            if error is None:
                erred = [f for f in futures.values() if f.status == "error"][:1]
                if not erred:
                    return self._client.gather([futures[k] for k in keys])
                error, tb = erred[0].exception(), erred[0].traceback()
                erred.clear()
        except (CancelledError, CommClosedError) as exc:
            error = exc
        finally:
            futures.clear()
        if isinstance(error, _DISTRIBUTED_FAILURES):
            raise self._lost(error, node_of) from None
        if isinstance(error, NodeLostError):
            self._unplace(error.nodes)
        raise error.with_traceback(tb)

    def _settle(self, futures: list[Future], node_of: dict[str, str]) -> NodeLostError | None:
        """Block until all ``futures`` are done; cancel them and return an error if a node stays without a worker."""
        done = _when_all_done(futures)
        missing_since: dict[str, float] = {}
        tolerance = config_timeout("placement-timeout")
        while not done.wait(_WATCH_INTERVAL):
            pending = {node_of[f.key] for f in futures if not f.done()}
            served = served_nodes(self._workers())
            now = time.monotonic()
            for node in pending:
                if node in served:
                    missing_since.pop(node, None)
                else:
                    missing_since.setdefault(node, now)
            lost = sorted(n for n, since in missing_since.items() if now - since >= tolerance)
            if lost:
                self._client.cancel(futures)
                return NodeLostError(
                    f"node(s) {lost} had no worker for {tolerance:g} s while running. {_RECOVERY_HINT}", lost
                )
        return None

    def _lost(self, exc: BaseException, node_of: dict[str, str]) -> NodeLostError:
        """The NodeLostError for a distributed failure ``exc`` of a run on ``node_of``'s nodes."""
        key = getattr(exc, "task", None)
        nodes = [node_of[key]] if key in node_of else sorted(set(node_of.values()))
        self._unplace(nodes)
        if isinstance(exc, KilledWorker):
            what = f"the worker of node {nodes[0]!r} died while running {key!r}"
        elif isinstance(exc, NoValidWorkerError | NoWorkerError):
            what = f"no worker served node(s) {nodes} for {exc.timeout:g} s"
        else:
            what = f"the connection to the Dask cluster broke while running on node(s) {nodes}"
        return NodeLostError(f"{what} ({type(exc).__name__}: {exc}). {_RECOVERY_HINT}", nodes)

    def _unplace(self, nodes: Iterable[str]) -> None:
        for node in nodes:
            self._placed.pop(node, None)

    def __repr__(self) -> str:
        state = "open" if self.is_open() else "closed"
        return f"DaskSession({state}, id={self.session_id}, scheduler={self._client.scheduler.address})"
