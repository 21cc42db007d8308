"""Where a DaskSession's nodes run, on a cluster that shrinks and grows (SPEC §1.6a).

A :class:`Placer` keeps a session's placement: node -> the address of the worker serving it. Pinned
nodes stay on their workers; the others are spread over the pool (see
:func:`~._placement.assign`), whose workers get the nodes' resources at run time, recorded as given
by this session (:func:`~._plugin.set_node_resources`), and taken back when the session closes. A
node whose pool worker left is placed on the remaining workers; workers that join (announced by
their workspace plugin under :data:`~._plugin.JOINED_TOPIC`) take nodes at the next epoch boundary
when that evens the spread (``daskjobs.rebalance``), the nodes moving with their workspaces.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from distributed import Client, Future

from .._config import config_choice, config_timeout
from ..errors import NodePlacementError
from ._client import scheduler_rpc
from ._placement import (
    Assignment,
    Demands,
    Survey,
    WorkerTable,
    assign,
    live_workers,
    node_resource,
    placement_error,
    plan_moves,
    resource_node,
)
from ._plugin import (
    JOINED_TOPIC,
    WorkerStates,
    export_node,
    given_resources,
    install_node,
    set_node_resources,
)

logger = logging.getLogger("daskjobs")

Gather = Callable[[dict[str, Future], dict[str, str], list[str]], list[Any]]
"""How the session runs futures: ``gather(futures by key, node by key, keys to gather)``."""

_listeners: weakref.WeakKeyDictionary[Client, weakref.WeakSet[Placer]] = weakref.WeakKeyDictionary()
"""The placers of each client that want to hear of workers joining (one subscription per client)."""


def _listen(client: Client, placer: Placer) -> None:
    placers = _listeners.get(client)
    if placers is None:
        placers = _listeners[client] = weakref.WeakSet()

        def joined(event: object, placers: weakref.WeakSet[Placer] = placers) -> None:
            for listening in list(placers):
                listening.joined.set()

        client.subscribe_topic(JOINED_TOPIC, joined)
    placers.add(placer)


def _stop_listening(client: Client, placer: Placer) -> None:
    placers = _listeners.get(client)
    if placers is None:
        return
    placers.discard(placer)
    if not placers:
        del _listeners[client]
        if client.status == "running":
            with contextlib.suppress(Exception):
                client.unsubscribe_topic(JOINED_TOPIC)


class Placer:
    """A session's placement of its nodes on the workers of one cluster (see the module docstring)."""

    def __init__(self, client: Client, session: str, workers: Callable[[], WorkerTable]) -> None:
        self._client, self._session, self._workers = client, session, workers
        self.placement: dict[str, str] = {}
        """Node -> the address of the worker serving it."""
        self.pooled: set[str] = set()
        """The nodes placed on pool workers by this session (the others are pinned)."""
        self.demands: dict[str, dict[str, float]] = {}
        """Node -> the extra resources its worker must provide (as the session's groups asked)."""
        self._checked: dict[str, frozenset[str]] = {}
        """Node -> the demands its placement was checked for (until it is lost)."""
        self.joined = threading.Event()
        """Set when a worker joins the cluster: the next :meth:`moves` looks at the spread again."""
        _listen(client, self)

    # -- surveying ------------------------------------------------------------------------
    def survey(self, table: WorkerTable | None = None) -> Survey:
        """The worker table (``table``, else asked for), which session gave which node resource,
        and which sessions are open."""
        table = self._workers() if table is None else table
        holders = [
            addr
            for addr, info in live_workers(table).items()
            if any(resource_node(r) is not None and a > 0 for r, a in info.get("resources", {}).items())
        ]
        given: dict[str, dict[str, list[str]]] = {}
        if holders:
            answers = self._run(given_resources, holders)
            given = {addr: found for addr, found in answers.items() if isinstance(found, dict) and found}
            # A worker that did not answer is leaving: it is left out, not taken for a pinned one.
            table = {a: info for a, info in table.items() if a not in holders or isinstance(answers.get(a), dict)}
        others = sorted(
            {s for found in given.values() for sessions in found.values() for s in sessions} - {self._session}
        )
        open_sessions = {self._session}
        if others:
            anchors = {f"daskjobs-{s}-anchor": s for s in others}
            client = self._client
            timeout = config_timeout("connect-timeout")
            states = client.sync(scheduler_rpc(client).get_task_status, keys=list(anchors), callback_timeout=timeout)
            open_sessions |= {anchors[key] for key, state in states.items() if state is not None}
        return Survey(table, given, frozenset(open_sessions))

    def _run(self, function: Callable[..., Any], workers: list[str], *args: Any) -> dict[str, Any]:
        """``client.run`` of ``function`` on ``workers``: address -> result, or the error of a worker that
        could not be reached (it left), within ``daskjobs.connect-timeout``."""
        try:
            return self._client.run(
                function, *args, workers=workers, on_error="return", callback_timeout=config_timeout("connect-timeout")
            )
        except OSError as exc:  # the scheduler refused the whole call (a worker of ``workers`` left)
            return dict.fromkeys(workers, exc)

    def gone(self, table: WorkerTable) -> set[str]:
        """The pool nodes whose worker is no longer in ``table``: their workspaces are gone."""
        live = live_workers(table)
        return {node for node in self.pooled if self.placement.get(node) not in live}

    def known_nodes(self) -> list[str]:
        """The nodes placed by this session or pinned on the cluster."""
        survey = self.survey()
        pinned = {n for addr in survey.live() for n, kind in survey.held(addr).items() if kind == "pinned"}
        return sorted(pinned | set(self.placement))

    # -- placing --------------------------------------------------------------------------
    def unchecked(self, nodes: Iterable[str], resources: Demands) -> list[str]:
        """Record the nodes' demands; return those whose placement is not checked for them yet."""
        unchecked = []
        for node in nodes:
            needs = self.demands.setdefault(node, {})
            needs.update(resources.get(node, {}))
            if node not in self._checked or not set(needs) <= self._checked[node]:
                unchecked.append(node)
        return unchecked

    def forget(self, nodes: Iterable[str]) -> None:
        """The nodes lost their worker or workspace: check their placement, and that of the nodes
        that shared their worker, again before they run."""
        nodes = list(nodes)
        lost = {self.placement[n] for n in nodes if n in self.placement}
        for node in [*nodes, *(n for n, addr in self.placement.items() if addr in lost)]:
            self._checked.pop(node, None)

    def place(self, nodes: list[str], timeout: float) -> None:
        """Place ``nodes`` (pool nodes on pool workers, given their resources now), waiting up to
        ``timeout`` seconds for workers that fit; raise :class:`NodePlacementError` then."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            survey = self.survey()
            current = {n: self.placement[n] for n in nodes if n in self.pooled and n in self.placement}
            done = assign(survey, nodes, self.demands, current, self._session)
            if not done.problems:
                failed = self._apply(survey, done, nodes)
                # A worker that could not be told left since the survey: look again if it was to serve.
                done.problems = {
                    n: f"its worker at {a} could not be given the node ({failed[a]!r})"
                    for n, a in done.placement.items()
                    if a in failed
                }
                if not done.problems:
                    break
            if time.monotonic() >= deadline:
                waited = f" (waited {timeout:g} s)" if timeout else ""
                raise placement_error(done.problems, survey, self.demands, waited)
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
        self._record(done, nodes)

    def _apply(self, survey: Survey, done: Assignment, nodes: list[str]) -> dict[str, BaseException]:
        """Give and take back node resources so that the workers serve ``done``'s placement of
        ``nodes`` (and no longer the stale resources of closed sessions); return the workers that
        could not be told (they left) with their errors."""
        changes: dict[str, dict[str, tuple[float, list[str]]]] = {}
        for addr in survey.live():
            records = survey.given.get(addr, {})
            for resource, sessions in records.items():
                owners = set(sessions) & survey.open_sessions
                node = resource_node(resource)
                if node in nodes:
                    if node in done.pooled and done.placement.get(node) == addr:
                        owners.add(self._session)
                    else:
                        owners.discard(self._session)
                if owners != set(sessions):
                    changes.setdefault(addr, {})[resource] = (survey.threads(addr) if owners else 0, sorted(owners))
            for node in nodes:
                resource = node_resource(node)
                if node in done.pooled and done.placement[node] == addr and resource not in records:
                    changes.setdefault(addr, {})[resource] = (survey.threads(addr), [self._session])
        return self._tell(changes)

    def _tell(self, changes: Mapping[str, Mapping[str, tuple[float, list[str]]]]) -> dict[str, BaseException]:
        """Apply ``changes`` (worker address -> resource -> (amount, sessions)); return the workers
        that could not be told, with their errors."""
        if not changes:
            return {}
        answers = self._run(set_node_resources, list(changes), dict(changes))
        failed = {addr: answer for addr, answer in answers.items() if isinstance(answer, BaseException)}
        failed.update({addr: LookupError("no answer") for addr in changes if addr not in answers})
        return failed

    def _record(self, done: Assignment, nodes: list[str]) -> None:
        changed = {n: a for n, a in done.placement.items() if self.placement.get(n) != a}
        self.placement.update(done.placement)
        self.pooled = (self.pooled - set(nodes)) | done.pooled
        for node in nodes:
            self._checked[node] = frozenset(self.demands.get(node, {}))
        if changed:
            logger.info("DaskSession %s: placement now %s", self._session, self.describe(changed))

    def describe(self, placement: Mapping[str, str] | None = None) -> str:
        """``node -> address`` pairs, pool nodes marked as such."""
        placement = self.placement if placement is None else placement
        return ", ".join(
            f"{node} -> {addr}{' (pool)' if node in self.pooled else ''}" for node, addr in sorted(placement.items())
        )

    # -- growing --------------------------------------------------------------------------
    def moves(self) -> dict[str, str]:
        """Node -> new worker address, when workers joined since the last look and moving nodes to
        them evens the spread (``daskjobs.rebalance`` ``"on-join"``); else ``{}``."""
        if not self.joined.is_set() or config_choice("rebalance") == "never":
            return {}
        self.joined.clear()
        survey = self.survey()
        live = survey.live()
        placed = {n: a for n, a in self.placement.items() if a in live}
        return plan_moves(survey, Assignment(placed, self.pooled & set(placed)), self.demands)

    def move(
        self, moves: Mapping[str, str], states: WorkerStates, tokens: Mapping[str, str], gather: Gather
    ) -> dict[str, str]:
        """Move each node of ``moves`` to its new worker with its workspace (sent from its old worker
        to the new one, never through this process); return the nodes' new tokens.

        The old worker keeps the node's resource until the new one holds the workspace: a task sent
        to the node in between cannot find an emptied workspace (the tokens refuse it).
        """
        survey = self.survey()
        live = survey.live()
        old = {node: self.placement[node] for node in moves}
        futures: dict[str, Future] = {}
        node_of: dict[str, str] = {}
        prefix = f"daskjobs-{self._session}-move-{uuid.uuid4().hex[:8]}"
        for node, source in old.items():
            key = f"{prefix}-export-{node}"
            futures[key] = self._client.submit(
                export_node,
                states,
                node,
                tokens.get(node),
                key=key,
                resources={node_resource(node): 1},
                workers=[source],
                allow_other_workers=False,
                pure=False,
            )
            node_of[key] = node
        give: dict[str, dict[str, tuple[float, list[str]]]] = {}
        for node, target in moves.items():
            owners = sorted(survey.owners(target, node) | {self._session})
            give.setdefault(target, {})[node_resource(node)] = (survey.threads(target), owners)
        if self._tell(give):
            self._client.cancel(list(futures.values()))
            raise NodePlacementError(
                f"could not give node(s) {sorted(moves)} to the workers that joined", sorted(moves)
            )
        installs = []
        for node, target in moves.items():
            key = f"{prefix}-install-{node}"
            futures[key] = self._client.submit(
                install_node,
                states,
                node,
                futures[f"{prefix}-export-{node}"],
                key=key,
                resources={node_resource(node): 1},
                workers=[target],
                allow_other_workers=False,
                pure=False,
            )
            node_of[key] = node
            installs.append(key)
        self.placement.update(moves)  # a loss from here on is a loss of the new worker
        new_tokens = dict(zip(moves, gather(futures, node_of, installs), strict=True))
        take: dict[str, dict[str, tuple[float, list[str]]]] = {}
        for node, source in old.items():
            if source in live:
                owners = sorted(survey.owners(source, node) - {self._session})
                take.setdefault(source, {})[node_resource(node)] = (survey.threads(source) if owners else 0, owners)
        self._tell(take)  # the old workers forget the nodes' workspaces too
        logger.info(
            "DaskSession %s: moved node(s) %s with their workspaces to workers that joined; placement now %s",
            self._session,
            sorted(moves),
            self.describe(),
        )
        return new_tokens

    # -- closing --------------------------------------------------------------------------
    def release(self, timeout: float) -> None:
        """Take back every node resource this session gave, and stop listening for joins (the
        scheduler must answer within ``timeout`` seconds)."""
        _stop_listening(self._client, self)
        if not self.pooled or self._client.status != "running":
            return
        client = self._client
        survey = self.survey(
            client.sync(scheduler_rpc(client).identity, n_workers=-1, callback_timeout=timeout)["workers"]
        )
        take: dict[str, dict[str, tuple[float, list[str]]]] = {}
        for addr in survey.live():
            for resource, sessions in survey.given.get(addr, {}).items():
                if self._session in sessions:
                    owners = sorted(set(sessions) & survey.open_sessions - {self._session})
                    take.setdefault(addr, {})[resource] = (survey.threads(addr) if owners else 0, owners)
        self._tell(take)
        self.pooled.clear()
