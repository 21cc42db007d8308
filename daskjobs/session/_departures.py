"""Planned departures: telling a worker that left on purpose from one that failed.

A worker leaves on purpose when it is retired (``client.retire_workers``, an adaptive cluster
scaling down), when its ``--lifetime`` runs out (dask-jobqueue's walltime rotation), or when it is
sent SIGTERM (a preemption or spot notice): its workspace is gone all the same, but nothing failed,
so the runner restores the job without counting it against ``max_failures``. The scheduler keeps
an event log per worker address: a graceful close logs the reason the worker gave
(``closing-worker``), and a retirement logs an *expected* removal (``remove-worker``). A worker that
was killed or crashed logs neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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
    reason, expected = None, False
    for _, message in events:
        action = message.get("action")
        if action == "add-worker":
            reason, expected = None, False
        elif action == "closing-worker":
            reason = message.get("reason")
        elif action == "remove-worker":
            expected = bool(message.get("expected"))
    if reason in _REASONS:
        return _REASONS[reason]
    return "it was retired" if expected else None
