"""How a DaskSession tells that it lost a node, and why.

While a run is in flight a :class:`Watchdog` notices nodes left without a worker; distributed's own
failures become :class:`~daskjobs.errors.NodeLostError` (:func:`lost_node_error`); and the
scheduler's event log tells a worker that left on purpose from one that failed
(:func:`departure`, :func:`with_departure`). A worker leaves on purpose when it is retired
(``client.retire_workers``, an adaptive cluster scaling down), when its ``--lifetime`` runs out
(dask-jobqueue's walltime rotation), or when it is sent SIGTERM (a preemption or spot notice): its
workspace is gone all the same, but nothing failed, so the runner restores the job without
counting it against ``max_failures``. A graceful close logs the reason the worker gave
(``closing-worker``) and a retirement an *expected* removal (``remove-worker``); a worker that
was killed or crashed logs neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError
from typing import Any

from distributed import Client, Future
from distributed.comm.core import CommClosedError
from distributed.scheduler import KilledWorker, NoValidWorkerError, NoWorkerError

from .._config import config_timeout
from ..errors import NodeLostError
from ._client import scheduler_rpc
from ._placement import WorkerTable, served_nodes
from ._plugin import INCARNATION

RECOVERY_HINT = (
    "Its workspace is gone: wait for the node's worker to return (session.wait_for_nodes) and restore "
    "the workspace from a checkpoint (JobRunner does both when given a checkpoint manager and max_failures > 0)."
)

DISTRIBUTED_FAILURES = (KilledWorker, NoValidWorkerError, NoWorkerError, CancelledError, CommClosedError)
"""What distributed raises when a node's worker dies, is missing, or the cluster connection breaks."""


class Watchdog:
    """Notices nodes that stay without a worker while some of a run's futures are pending.

    ``gone(table)`` names the nodes whose workspace is certainly gone: pool nodes whose worker
    left the table (they are lost at once, to be placed on the remaining workers); other nodes
    may wait ``daskjobs.placement-timeout`` for their worker.
    """

    def __init__(
        self,
        workers: Callable[[], WorkerTable],
        cancel: Callable[[list[Future]], Any],
        futures: list[Future],
        node_of: dict[str, str],
        gone: Callable[[WorkerTable], Iterable[str]] = lambda table: (),
    ) -> None:
        self.workers, self.cancel, self.futures, self.node_of = workers, cancel, futures, node_of
        self.gone = gone
        self.missing_since: dict[str, float] = {}

    def check(self) -> NodeLostError | None:
        """Cancel the run and return the error once a node had no worker for ``daskjobs.placement-timeout``
        (or at once, for a node whose worker left for good)."""
        tolerance = config_timeout("placement-timeout")
        table = self.workers()
        served = served_nodes(table)
        now = time.monotonic()
        pending = {self.node_of[str(f.key)] for f in self.futures if not f.done()}
        for node in pending:
            if node in served:
                self.missing_since.pop(node, None)
            else:
                self.missing_since.setdefault(node, now)
        left = sorted(set(self.gone(table)) & pending)
        if left:
            self.cancel(self.futures)
            return NodeLostError(f"the worker of node(s) {left} left the cluster while running. {RECOVERY_HINT}", left)
        lost = sorted(n for n, since in self.missing_since.items() if now - since >= tolerance)
        if not lost:
            return None
        self.cancel(self.futures)
        return NodeLostError(f"node(s) {lost} had no worker for {tolerance:g} s while running. {RECOVERY_HINT}", lost)


def lost_node_error(exc: BaseException, node_of: dict[str, str]) -> NodeLostError:
    """The NodeLostError for a distributed failure ``exc`` of a run on ``node_of``'s nodes (Dask key -> node)."""
    key = getattr(exc, "task", None)
    nodes = [node_of[key]] if key in node_of else sorted(set(node_of.values()))
    if isinstance(exc, KilledWorker):
        what = f"the worker of node {nodes[0]!r} ({exc.last_worker.address}) died while running {key!r}"
    elif isinstance(exc, NoValidWorkerError | NoWorkerError):
        what = f"no worker served node(s) {nodes} for {exc.timeout:g} s"
    else:
        what = f"the run on node(s) {nodes} was cancelled or lost its connection to the Dask cluster ({exc!r})"
    return NodeLostError(f"{what}. {RECOVERY_HINT}", nodes)


def with_departure(
    client: Client, where: Mapping[str, str], error: NodeLostError, incarnations: Mapping[str, str] | None = None
) -> NodeLostError:
    """``error``, telling why its nodes' worker (``where``: node -> worker address) left when the
    scheduler's log shows it left on purpose (:func:`departure`): the runner then recovers without
    counting a failure. ``incarnations`` (node -> the incarnation of the workspace plugin its
    workspace lived in) picks the worker's stay at that address that the node lost, also when a
    new worker took the address since."""
    incarnations = incarnations or {}
    for node in sorted(n for n in error.nodes if n in where):
        address = where[node]
        try:
            events = client.sync(
                scheduler_rpc(client).events, topic=address, callback_timeout=config_timeout("connect-timeout")
            )
        except Exception:  # the log is an explanation, not a necessity
            continue
        why = departure(events, incarnations.get(node))
        if why is not None:
            message = f"{error.message} (the worker at {address} left on purpose: {why})"
            error.message, error.departure, error.args = message, why, (message, error.nodes, why)
            break
    return error


_REASONS = {
    "worker-lifetime-reached": "its --lifetime ran out",
    "signal-15": "it was sent SIGTERM (a preemption or spot notice)",
    "signal-2": "it was sent SIGINT",
    "scheduler-remove-worker": "it was retired",
    "scheduler-close-worker": "the scheduler closed it",
    "nanny-close": "its nanny closed it",
    "nanny-close-gracefully": "its nanny closed it",
    "worker-close-gracefully": "it closed gracefully",
}
"""The reasons a worker gives for closing (Dask's ``closing-worker`` event) that mean it left on purpose."""


def departure(events: Iterable[tuple[float, Mapping[str, Any]]], incarnation: str | None = None) -> str | None:
    """Why the worker that logged ``events`` (the scheduler's log of its address, oldest first) left on
    purpose, or ``None`` if it did not (it died, was killed or lost its connection).

    A new worker may take the address of one that left: each stay starts at its ``add-worker``. The
    stay judged is the one in which the workspace plugin of ``incarnation`` started; without it (or
    when the log does not name it), the latest.

    Examples
    --------
    >>> departure([(0, {"action": "add-worker"}), (1, {"action": "closing-worker", "reason": "signal-15"})])
    'it was sent SIGTERM (a preemption or spot notice)'
    >>> departure([(0, {"action": "add-worker"}), (1, {"action": "remove-worker", "expected": False})]) is None
    True
    >>> restarted = [(0, {"action": "add-worker"}), (1, {"action": "daskjobs-incarnation", "incarnation": "x"}),
    ...              (2, {"action": "closing-worker", "reason": "signal-15"}), (3, {"action": "remove-worker"}),
    ...              (4, {"action": "add-worker"})]
    >>> departure(restarted, "x")
    'it was sent SIGTERM (a preemption or spot notice)'
    """
    stays: list[list[Mapping[str, Any]]] = [[]]
    for _, message in events:
        if message.get("action") == "add-worker":
            stays.append([])
        stays[-1].append(message)
    named = [stay for stay in stays if incarnation is not None and _started(stay, incarnation)]
    return _why_left(named[-1] if named else stays[-1])


def _started(stay: list[Mapping[str, Any]], incarnation: str) -> bool:
    return any(m.get("action") == INCARNATION and m.get("incarnation") == incarnation for m in stay)


def _why_left(stay: list[Mapping[str, Any]]) -> str | None:
    reason, expected, stimulus = None, False, ""
    for message in stay:
        action = message.get("action")
        if action == "closing-worker":
            reason = message.get("reason")
        elif action == "remove-worker":
            expected, stimulus = bool(message.get("expected")), str(message.get("stimulus_id", ""))
    if reason in _REASONS:
        return _REASONS[reason]
    if not expected:
        return None
    if stimulus.startswith("worker-close-gracefully"):  # the worker retired itself: its lifetime ran out
        return _REASONS["worker-lifetime-reached"]
    return "it was retired"
