"""Placement: the only module that maps node names to Dask worker resources, and decides which
worker serves which node (pure functions of the scheduler's worker table; no Dask calls).

Node ``n`` is served by the worker that provides the resource :func:`node_resource` ``(n)``.
Every task of the node asks for one unit of it, so a worker with ``nthreads`` units runs up to
``nthreads`` of the node's Dask tasks at once. A worker gets that resource in one of two ways:

* **pinned**: it was started with it (``daskjobs worker --node n``, ``node_cluster``, or
  ``--resources`` by hand). Such a worker serves its pinned nodes only.
* **given**: a worker without pinned node resources belongs to the **pool**, and a
  :class:`~daskjobs.DaskSession` gives it the resources of the nodes it places there at run time
  (the workspace plugin records which session gave which resource, see :class:`Survey`).

:func:`assign` keeps pinned nodes on their workers and spreads the others over the pool (a node's
extra resources, e.g. ``GPU=1``, must be met; no worker serves more nodes per thread than another
when that can be avoided; a node stays where it is while its worker lives), and
:func:`plan_moves` evens the spread out when workers joined. The pre-flight explains, before
anything is submitted, why a node cannot be placed.

Waits are bounded by Dask config values (seconds or strings such as ``"10s"``, read by
:mod:`daskjobs._config`):

``daskjobs.preflight-timeout``
    how long the check before a node's first run waits for a missing worker (default 2 s);
``daskjobs.placement-timeout``
    how long :meth:`DaskSession.wait_for_nodes` waits, and how long a running group tolerates
    a pinned node without a worker before raising :class:`~daskjobs.errors.NodeLostError`
    (default 10 s; a pool node whose worker left is lost at once, and placed again);
``daskjobs.connect-timeout``
    how long a :class:`DaskSession` waits to connect to its scheduler, for the scheduler to
    answer, and for a lost connection to come back before raising
    :class:`~daskjobs.errors.SessionLostError` (default 30 s);
``daskjobs.straggler-timeout``
    how long the next run of a :class:`DaskSession` waits for the steps an interrupted run left
    running on the workers before it closes the session with
    :class:`~daskjobs.errors.SessionClosedError` (default 60 s);
``daskjobs.rebalance``
    ``"on-join"`` (default): workers that join take nodes at the next epoch boundary when that
    evens the spread; ``"never"``: nodes move only when their worker leaves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._model.values import validate_name
from ..errors import NodePlacementError

RESOURCE_PREFIX = "daskjobs-node-"

WorkerTable = Mapping[str, Mapping[str, Any]]
"""``client.scheduler_info()["workers"]``: worker address -> its identity (name, resources, …)."""
Demands = Mapping[str, Mapping[str, float]]
"""Node -> the extra resources its worker must provide, e.g. ``{"trainer": {"GPU": 1}}``."""


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


def live_workers(workers: WorkerTable) -> dict[str, Mapping[str, Any]]:
    """The workers of ``workers`` that are not closing or closed."""
    return {addr: w for addr, w in workers.items() if w.get("status", "running") not in ("closing", "closed")}


def served_nodes(workers: WorkerTable) -> dict[str, list[str]]:
    """Node -> addresses of the live workers that provide its resource."""
    served: dict[str, list[str]] = {}
    for addr, info in live_workers(workers).items():
        for resource, amount in info.get("resources", {}).items():
            node = resource_node(resource)
            if node is not None and amount > 0:
                served.setdefault(node, []).append(addr)
    return served


def describe_demands(needs: Mapping[str, float]) -> str:
    """``GPU=1, MEM=2`` (empty for no demands)."""
    return ", ".join(f"{r}={amount:g}" for r, amount in needs.items())


@dataclass(frozen=True)
class Survey:
    """What placement decides from: the scheduler's worker table, which session gave which node
    resource to which worker, and which of those sessions are still open.

    A node resource that no record explains is **pinned** (given by hand or at start-up); one that
    only sessions no longer open gave is **stale** (a driver that died): its worker is a pool
    worker again.
    """

    workers: WorkerTable
    given: Mapping[str, Mapping[str, Sequence[str]]] = field(default_factory=dict)
    """Worker address -> node resource -> the ids of the sessions that gave it."""
    open_sessions: frozenset[str] = frozenset()

    def live(self) -> dict[str, Mapping[str, Any]]:
        """The workers that are not closing or closed."""
        return live_workers(self.workers)

    def held(self, address: str) -> dict[str, str]:
        """Node -> ``"pinned"``, ``"given"`` (by an open session) or ``"stale"``, for every node
        resource the worker at ``address`` provides."""
        records = self.given.get(address, {})
        held = {}
        for resource, amount in self.workers[address].get("resources", {}).items():
            node = resource_node(resource)
            if node is None or amount <= 0:
                continue
            if resource not in records:
                held[node] = "pinned"
            else:
                held[node] = "given" if set(records[resource]) & self.open_sessions else "stale"
        return held

    def owners(self, address: str, node: str) -> set[str]:
        """The open sessions that gave ``node``'s resource to the worker at ``address``."""
        return set(self.given.get(address, {}).get(node_resource(node), ())) & self.open_sessions

    def pool(self) -> list[str]:
        """Addresses of the live workers without pinned nodes that take work (not retiring), in name order."""
        live = self.live()
        taking = [addr for addr, info in live.items() if info.get("status", "running") != "closing_gracefully"]
        pool = [addr for addr in taking if "pinned" not in self.held(addr).values()]
        return sorted(pool, key=lambda addr: (str(live[addr].get("name", addr)), addr))

    def fits(self, address: str, needs: Mapping[str, float]) -> bool:
        """Whether the worker at ``address`` has ``needs`` (its total resources, not what is free)."""
        have = self.workers[address].get("resources", {})
        return all(have.get(r, 0) >= amount for r, amount in needs.items())

    def threads(self, address: str) -> int:
        return max(int(self.workers[address].get("nthreads", 1) or 1), 1)


@dataclass
class Assignment:
    """Where a session's nodes go: ``placement`` (node -> worker address), which of them are
    ``pooled`` (placed by the session on pool workers, the others are pinned or shared), and why
    each node of ``problems`` cannot be placed now."""

    placement: dict[str, str] = field(default_factory=dict)
    pooled: set[str] = field(default_factory=set)
    problems: dict[str, str] = field(default_factory=dict)


def assign(
    survey: Survey, nodes: Sequence[str], demands: Demands, current: Mapping[str, str], session: str
) -> Assignment:
    """Place ``nodes`` on the surveyed workers; ``current`` is where the session's pool nodes are now.

    A node with a pinned worker goes there (two pinned workers, or one lacking the node's extra
    resources, is a problem); a node whose resource an open session (another one, or this one)
    gave stays on that worker; the others go to the fitting pool worker that then serves the
    fewest nodes per thread (the nodes with extra resources first).

    Examples
    --------
    >>> workers = {"tcp://w1": {"name": "w1", "nthreads": 1, "resources": {}},
    ...            "tcp://w2": {"name": "w2", "nthreads": 1, "resources": {"GPU": 1}}}
    >>> done = assign(Survey(workers), ["a", "b", "g"], {"g": {"GPU": 1}}, {}, "s1")
    >>> done.placement
    {'g': 'tcp://w2', 'a': 'tcp://w1', 'b': 'tcp://w1'}
    """
    live, pool = survey.live(), survey.pool()
    done = Assignment()
    load = dict.fromkeys(live, 0)
    holders: dict[str, dict[str, list[str]]] = {}
    for addr in live:
        for node, kind in survey.held(addr).items():
            holders.setdefault(node, {}).setdefault(kind, []).append(addr)
            if kind == "pinned" or (kind == "given" and node not in nodes):
                load[addr] += 1
    waiting = []
    for node in nodes:
        needs = demands.get(node, {})
        found = holders.get(node, {})
        pinned = found.get("pinned", [])
        if len(pinned) > 1:
            names = ", ".join(sorted(repr(str(live[a].get("name", a))) for a in pinned))
            done.problems[node] = f"{len(pinned)} workers provide it ({names}); a node needs exactly one worker"
        elif pinned:
            if survey.fits(pinned[0], needs):
                done.placement[node] = pinned[0]
            else:
                lacking = {r: a for r, a in needs.items() if not survey.fits(pinned[0], {r: a})}
                done.problems[node] = f"its worker {live[pinned[0]].get('name')!r} lacks {describe_demands(lacking)}"
        else:
            kept = [a for a in found.get("given", []) if a in pool and survey.fits(a, needs)]
            here = current.get(node)
            if here in kept or (not kept and here in pool and survey.fits(here, needs)):
                kept = [here]
            if kept:
                done.placement[node] = kept[0]
                done.pooled.add(node)
                load[kept[0]] += 1
            else:
                waiting.append(node)
    waiting.sort(key=lambda node: not demands.get(node))  # stable: the nodes with demands first
    for node in waiting:
        needs = demands.get(node, {})
        fitting = [a for a in pool if survey.fits(a, needs)]
        if not fitting:
            done.problems[node] = _why_unplaced(survey, node, needs)
            continue
        best = min(fitting, key=lambda a: ((load[a] + 1) / survey.threads(a), load[a]))
        done.placement[node] = best
        done.pooled.add(node)
        load[best] += 1
    return done


def _why_unplaced(survey: Survey, node: str, needs: Mapping[str, float]) -> str:
    if not survey.live():
        return "no worker is left on the cluster"
    resource = node_resource(node)
    if not survey.pool():
        return f"no worker provides {resource!r}, and every worker is pinned to other nodes (no pool worker)"
    return f"no worker provides {resource!r}, and no pool worker has {describe_demands(needs)}"


def plan_moves(survey: Survey, done: Assignment, demands: Demands) -> dict[str, str]:
    """Node -> new worker address, for the pool nodes of ``done`` that should move to even the
    spread: a node moves from the worker serving the most nodes per thread to a fitting pool
    worker that then still serves fewer per thread than that worker did (at most one move per
    node).

    Examples
    --------
    >>> workers = {"tcp://w1": {"name": "w1", "nthreads": 1, "resources": {}},
    ...            "tcp://w2": {"name": "w2", "nthreads": 1, "resources": {}}}
    >>> done = Assignment({"a": "tcp://w1", "b": "tcp://w1"}, {"a", "b"})
    >>> plan_moves(Survey(workers), done, {})
    {'b': 'tcp://w2'}
    """
    pool = survey.pool()
    load = {
        addr: sum(1 for n, kind in survey.held(addr).items() if kind == "given" and n not in done.placement)
        for addr in pool
    }
    for addr in done.placement.values():
        if addr in load:
            load[addr] += 1
    where = {node: addr for node, addr in done.placement.items() if node in done.pooled and addr in load}
    moves: dict[str, str] = {}
    while True:
        best = None
        for node in sorted(where, reverse=True):
            source = where[node]
            if node in moves:
                continue
            share = load[source] / survey.threads(source)
            fitting = [a for a in pool if a != source and survey.fits(a, demands.get(node, {}))]
            for target in fitting:
                after = (load[target] + 1) / survey.threads(target)
                if after < share and (best is None or (share, -after) > (best[0], -best[1])):
                    best = (share, after, node, target)
        if best is None:
            return moves
        _, _, node, target = best
        load[where[node]] -= 1
        load[target] += 1
        where[node] = moves[node] = target


def describe_workers(workers: WorkerTable, given: Mapping[str, Mapping[str, Sequence[str]]] | None = None) -> str:
    """One line per live worker: name, address, threads, nodes served (pinned, or given at run time)
    and other resources."""
    lines = []
    for addr, info in sorted(live_workers(workers).items(), key=lambda item: str(item[1].get("name", item[0]))):
        res = info.get("resources", {})
        records = (given or {}).get(addr, {})
        pinned = sorted(n for r, a in res.items() if (n := resource_node(r)) is not None and a > 0 and r not in records)
        placed = sorted(n for r, a in res.items() if (n := resource_node(r)) is not None and a > 0 and r in records)
        other = {r: a for r, a in res.items() if resource_node(r) is None}
        kind = f"pinned nodes {pinned}" if pinned else f"pool worker, nodes placed {placed}"
        threads = info.get("nthreads", "?")
        lines.append(
            f"  {str(info.get('name', addr))!r} at {addr} ({threads} threads): {kind}, other resources {other}"
        )
    return "\n".join(lines) or "  (no workers)"


def placement_error(problems: Mapping[str, str], survey: Survey, demands: Demands, waited: str) -> NodePlacementError:
    """The error for the nodes of ``problems`` (node -> why), listing their demands and the workers."""
    details = []
    for node, why in problems.items():
        needs = describe_demands(demands.get(node, {}))
        details.append(f"  node {node!r}{f' (needs {needs})' if needs else ''}: {why}")
    missing = " ".join(f"--node {n}" for n in problems)
    message = (
        f"cannot place node(s) {list(problems)} on the Dask cluster{waited}:\n" + "\n".join(details) + "\n"
        f"available workers:\n{describe_workers(survey.workers, survey.given)}\n"
        "Add a worker that provides no daskjobs node (a pool worker: `dask worker SCHEDULER_ADDRESS`, "
        "`daskjobs worker SCHEDULER_ADDRESS`, a LocalCluster, dask-jobqueue), with the resources the nodes "
        f"need, or pin a worker to each node (e.g. `daskjobs worker SCHEDULER_ADDRESS {missing}`)."
    )
    return NodePlacementError(message, list(problems))
