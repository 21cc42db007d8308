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
from ._placement import WorkerTable, served_nodes

RECOVERY_HINT = (
    "Its workspace is gone: wait for the node's worker to return (session.wait_for_nodes) and restore "
    "the workspace from a checkpoint (JobRunner does both when given a checkpoint manager and max_failures > 0)."
)

DISTRIBUTED_FAILURES = (KilledWorker, NoValidWorkerError, NoWorkerError, CancelledError, CommClosedError)
"""What distributed raises when a node's worker dies, is missing, or the cluster connection breaks."""


class Watchdog:
    """Notices nodes that stay without a worker while some of a run's futures are pending."""

    def __init__(
        self,
        workers: Callable[[], WorkerTable],
        cancel: Callable[[list[Future]], Any],
        futures: list[Future],
        node_of: dict[str, str],
    ) -> None:
        self.workers, self.cancel, self.futures, self.node_of = workers, cancel, futures, node_of
        self.missing_since: dict[str, float] = {}

    def check(self) -> NodeLostError | None:
        """Cancel the run and return the error once a node had no worker for ``daskjobs.placement-timeout``."""
        tolerance = config_timeout("placement-timeout")
        served = served_nodes(self.workers())
        now = time.monotonic()
        for node in {self.node_of[f.key] for f in self.futures if not f.done()}:
            if node in served:
                self.missing_since.pop(node, None)
            else:
                self.missing_since.setdefault(node, now)
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


def with_departure(client: Client, serving: Mapping[str, str], error: NodeLostError) -> NodeLostError:
    """``error``, telling why its nodes' worker (``serving``: node -> worker address) left when the
    scheduler's log shows it left on purpose (:func:`departure`): the runner then recovers without
    counting a failure."""
    for address in sorted({serving[n] for n in error.nodes if n in serving}):
        try:
            events = client.sync(
                client.scheduler.events, topic=address, callback_timeout=config_timeout("connect-timeout")
            )
        except Exception:  # the log is an explanation, not a necessity
            continue
        why = departure(events)
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


def departure(events: Iterable[tuple[float, Mapping[str, Any]]]) -> str | None:
    """Why the worker that logged ``events`` (the scheduler's log of its address, oldest first) left on
    purpose, or ``None`` if it did not (it died, was killed or lost its connection).

    Only its latest stay counts: an address used again by a new worker starts afresh.

    Examples
    --------
    >>> departure([(0, {"action": "add-worker"}), (1, {"action": "closing-worker", "reason": "signal-15"})])
    'it was sent SIGTERM (a preemption or spot notice)'
    >>> departure([(0, {"action": "add-worker"}), (1, {"action": "remove-worker", "expected": False})]) is None
    True
    """
    reason, expected, stimulus = None, False, ""
    for _, message in events:
        action = message.get("action")
        if action == "add-worker":
            reason, expected, stimulus = None, False, ""
        elif action == "closing-worker":
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
