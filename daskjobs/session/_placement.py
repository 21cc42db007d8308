"""Placement: the only module that maps node names to Dask worker resources, and checks them.

Node ``n`` is served by the worker that provides the resource :func:`node_resource` ``(n)``.
Every task of the node asks for one unit of it, so a worker with ``nthreads`` units runs up to
``nthreads`` of the node's Dask tasks at once. The pre-flight check reads the scheduler's worker
table and explains, before anything is submitted, why a node cannot be placed.

Waits are bounded by Dask config values (seconds or strings such as ``"10s"``, read by
:mod:`daskjobs._config`):

``daskjobs.preflight-timeout``
    how long the check before a node's first run waits for a missing worker (default 2 s);
``daskjobs.placement-timeout``
    how long :meth:`DaskSession.wait_for_nodes` waits, and how long a running group tolerates
    a node without a worker before raising :class:`~daskjobs.errors.NodeLostError` (default 10 s);
``daskjobs.connect-timeout``
    how long a :class:`DaskSession` waits to connect to its scheduler, for the scheduler to
    answer, and for a lost connection to come back before raising
    :class:`~daskjobs.errors.SessionLostError` (default 30 s);
``daskjobs.straggler-timeout``
    how long the next run of a :class:`DaskSession` waits for the steps an interrupted run left
    running on the workers before it closes the session with
    :class:`~daskjobs.errors.SessionClosedError` (default 60 s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._model.values import validate_name
from ..errors import NodePlacementError

RESOURCE_PREFIX = "daskjobs-node-"

WorkerTable = Mapping[str, Mapping[str, Any]]
"""``client.scheduler_info()["workers"]``: worker address -> its identity (name, resources, …)."""


def node_resource(node: object) -> str:
    """The Dask worker resource that places tasks on ``node``.

    Parameters
    ----------
    node : str or Node
        A node name (validated like every node name).

    Returns
    -------
    str
        The resource name the node's worker must provide.

    Examples
    --------
    >>> import daskjobs as dj
    >>> dj.node_resource("trainer")
    'daskjobs-node-trainer'
    """
    return RESOURCE_PREFIX + validate_name(str(node), "node")


def resource_node(resource: str) -> str | None:
    """The node a resource name stands for, or ``None`` for other resources."""
    return resource[len(RESOURCE_PREFIX) :] if resource.startswith(RESOURCE_PREFIX) else None


def worker_resources(nodes: Iterable[str], nthreads: int, extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """The resources of a worker that serves ``nodes`` with ``nthreads`` threads, plus ``extra``."""
    return {**{node_resource(n): nthreads for n in nodes}, **(extra or {})}


def _live(workers: WorkerTable) -> dict[str, Mapping[str, Any]]:
    return {addr: w for addr, w in workers.items() if w.get("status", "running") not in ("closing", "closed")}


def served_nodes(workers: WorkerTable) -> dict[str, list[str]]:
    """Node -> addresses of the live workers that provide its resource."""
    served: dict[str, list[str]] = {}
    for addr, info in _live(workers).items():
        for resource, amount in info.get("resources", {}).items():
            node = resource_node(resource)
            if node is not None and amount > 0:
                served.setdefault(node, []).append(addr)
    return served


def placement_problems(
    workers: WorkerTable, nodes: Iterable[str], resources: Mapping[str, Mapping[str, float]]
) -> dict[str, str]:
    """Node -> why it cannot be placed, for each node of ``nodes`` that cannot.

    ``resources`` gives the extra resources a node's worker must provide (e.g. ``{"GPU": 1}``).
    """
    live = _live(workers)
    served = served_nodes(workers)
    problems = {}
    for node in nodes:
        owners = served.get(node, [])
        if not owners:
            problems[node] = f"no worker provides {node_resource(node)!r}"
        elif len(owners) > 1:
            names = ", ".join(sorted(repr(str(live[a].get("name", a))) for a in owners))
            problems[node] = f"{len(owners)} workers provide it ({names}); a node needs exactly one worker"
        else:
            have = live[owners[0]].get("resources", {})
            lacking = {r: amount for r, amount in resources.get(node, {}).items() if have.get(r, 0) < amount}
            if lacking:
                needed = ", ".join(f"{r}={amount:g}" for r, amount in lacking.items())
                problems[node] = f"its worker {live[owners[0]].get('name')!r} lacks {needed}"
    return problems


def describe_workers(workers: WorkerTable) -> str:
    """One line per live worker: name, address, nodes served and other resources."""
    lines = []
    for addr, info in sorted(_live(workers).items(), key=lambda item: str(item[1].get("name", item[0]))):
        res = info.get("resources", {})
        nodes = sorted(n for r in res if (n := resource_node(r)) is not None)
        other = {r: a for r, a in res.items() if resource_node(r) is None}
        lines.append(f"  {str(info.get('name', addr))!r} at {addr}: nodes {nodes}, other resources {other}")
    return "\n".join(lines) or "  (no workers)"


def check_nodes(
    workers: WorkerTable, nodes: Iterable[str], resources: Mapping[str, Mapping[str, float]] | None = None
) -> None:
    """Raise :class:`~daskjobs.errors.NodePlacementError` unless each node has exactly one suitable worker.

    Parameters
    ----------
    workers : mapping
        The scheduler's worker table, ``client.scheduler_info()["workers"]``.
    nodes : iterable of str
        Node names to check.
    resources : mapping, optional
        Node -> extra resources its worker must provide, e.g. ``{"trainer": {"GPU": 1}}``.

    Examples
    --------
    >>> import daskjobs as dj
    >>> workers = {"tcp://127.0.0.1:1": {"name": "ps", "resources": {dj.node_resource("ps"): 2}}}
    >>> check_nodes(workers, ["ps"])
    >>> try:
    ...     check_nodes(workers, ["ps", "trainer"])
    ... except dj.errors.NodePlacementError as exc:
    ...     print(exc.nodes)
    ['trainer']
    """
    problems = placement_problems(workers, nodes, resources or {})
    if problems:
        raise _placement_error(problems, workers, "")


def _placement_error(problems: dict[str, str], workers: WorkerTable, waited: str) -> NodePlacementError:
    details = "\n".join(f"  node {node!r}: {why}" for node, why in problems.items())
    missing = " ".join(f"--node {n}" for n in problems)
    message = (
        f"cannot place node(s) {list(problems)} on the Dask cluster{waited}:\n{details}\n"
        f"available workers:\n{describe_workers(workers)}\n"
        f"Start exactly one worker per node (e.g. `daskjobs worker SCHEDULER_ADDRESS {missing}`) "
        "or use daskjobs.node_cluster(...)."
    )
    return NodePlacementError(message, list(problems))


def wait_for_placement(
    workers: Callable[[], WorkerTable],
    nodes: Iterable[str],
    resources: Mapping[str, Mapping[str, float]],
    timeout: float,
) -> WorkerTable:
    """Poll ``workers()`` until every node can be placed and return the table that showed it; raise
    NodePlacementError after ``timeout`` s."""
    nodes = list(nodes)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        table = workers()
        problems = placement_problems(table, nodes, resources)
        if not problems:
            return table
        if time.monotonic() >= deadline:
            raise _placement_error(problems, table, f" (waited {timeout:g} s)")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
