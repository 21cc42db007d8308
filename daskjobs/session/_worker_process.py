"""Set-up of the Dask workers daskjobs starts (a Dask preload module) and of this process's logs.

Signals: a terminal's Ctrl-C reaches the whole foreground process group, and SLURM's ``scancel``,
systemd and Kubernetes send SIGTERM to every process of the job: the driver (where daskjobs
turns the signal into a graceful stop) and every worker process of the ``node_cluster`` it
started. A worker process that took the signal would die, and the job would lose its nodes instead
of committing the running epoch. Those workers belong to the driver, which closes them when it is
done, so they ignore SIGINT and SIGTERM (:func:`dask_setup`); SIGKILL still works, and a worker
process exits as soon as its nanny does (Dask ties it to its parent). The same holds for the
worker process of a ``daskjobs worker`` (or a ``dask worker`` with this preload): its nanny closes
it gracefully on the group's signal, a planned departure for a running job.

Logs: a step that fails is reported once, by daskjobs, as a
:class:`~daskjobs.errors.TaskFailedError` naming job, group, node, task and epoch; Dask's own
"Compute Failed" block for the same failure (an ERROR with the task's repr and traceback) is
dropped for daskjobs' tasks (:func:`quiet_compute_failures`), in worker processes that daskjobs
starts and in this process, whose in-process workers log there. Likewise a node's worker that
dies is reported by daskjobs (a :class:`~daskjobs.errors.NodeLostError`, or one line when the
runner recovers): the ERRORs Dask logs for the same loss are dropped — the scheduler's "Task ...
marked as failed because 1 workers died" and "Couldn't gather keys" of daskjobs' tasks (in this
process, where a ``node_cluster`` runs its scheduler), and a worker's "Worker stream died during
communication" or "failed during get data" with the traceback of the peer it lost while fetching
data from it or sending data to it (in worker processes daskjobs starts). On a cluster that
shrinks, the scheduler's "broadcast to ... failed" about a worker that left while a call to every
worker reached it is dropped too (the caller handles the worker's absence). And a worker that is
closing (its driver is done, or its nanny got a signal) does not log "Failed to communicate with
scheduler during heartbeat" with a traceback when its own close cut the heartbeat it had in flight.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
from collections.abc import Iterable
from typing import Any

from distributed import Worker
from distributed.comm.core import CommClosedError
from distributed.core import Status

KEY_PREFIX = "daskjobs-"
"""Every Dask key a daskjobs session submits starts with this."""


_ABOUT_ONE_TASK = ("Compute Failed", "Task %s marked as failed because")
"""Dask ERROR messages whose first argument is the key of the task they are about."""
_ABOUT_KEYS = "Couldn't gather keys"
"""The scheduler's ERROR whose argument maps the keys it could not gather to their states."""
_LOST_SNAPSHOTS = re.compile(
    r"^Removing worker .* caused the cluster to lose scattered data, which can't be recovered: \{(.*)\}"
)
"""The scheduler's ERROR when the worker it removes held the last copy of data without a task: for
daskjobs keys, tier-0 snapshots whose loss daskjobs handles (it restores from another tier)."""
_PEER_LOST = ("Worker stream died during communication", "failed during get data with")
"""A worker's ERRORs (with a traceback) when a peer it fetches data from, or sends data to, goes away."""


def _daskjobs_keys(keys: Iterable[object]) -> bool:
    return bool(keys) and all(str(key).startswith(KEY_PREFIX) for key in keys)


class _DropDaskjobsComputeFailures(logging.Filter):
    """Drops Dask's ERROR records about daskjobs tasks that daskjobs reports itself: "Compute
    Failed" (a step that raised), "marked as failed because ... workers died" and "Couldn't
    gather keys" (a node's worker that died), and the scheduler's "lose scattered data" about
    daskjobs' tier-0 snapshots (their loss is handled: a restore from another copy or tier)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if record.levelno != logging.ERROR:
            return True
        if message.startswith(_ABOUT_ONE_TASK):
            key = record.args[0] if isinstance(record.args, tuple) and record.args else ""
            return not str(key).startswith(KEY_PREFIX)
        if message.startswith(_ABOUT_KEYS):
            states = record.args[0] if isinstance(record.args, tuple) and record.args else record.args
            return not (isinstance(states, dict) and _daskjobs_keys(states))
        lost = _LOST_SNAPSHOTS.match(message)
        if lost is not None:
            return not _daskjobs_keys(re.findall(r"'([^']*)'", lost.group(1)))
        return True


class _DropPeerLoss(logging.Filter):
    """Drops a worker's ERRORs about a peer lost in a transfer (daskjobs reports the lost node)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.ERROR or not str(record.msg).startswith(_PEER_LOST)


class _DropBroadcastToLeftWorker(logging.Filter):
    """Drops the scheduler's ERROR about a message to a worker that left while it was sent (its
    connection closed or refused): on a cluster that shrinks, daskjobs' calls to every worker (the
    workspace plugin's registration, placement) meet such workers, and the caller handles it; and
    asyncio's "Future exception was never retrieved" of the same broadcast."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR:
            return True
        message = str(record.msg)
        if message.startswith("broadcast to ") and any(kind in message for kind in _LEFT):
            return False
        cause = record.exc_info[1] if record.exc_info else None
        return not (message.startswith("Future exception was never retrieved") and "Scheduler Broadcast" in str(cause))


class _DropHeartbeatCutByClose(logging.Filter):
    """Drops a worker's ERROR about a heartbeat that failed while a worker of this process is
    closing: closing a worker closes its connections, the heartbeat in flight among them (a Dask
    race, harmless: the worker is leaving)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not str(record.msg).startswith(_HEARTBEAT_FAILED):
            return True
        return not any(worker.status in _LEAVING for worker in list(Worker._instances))


class _QuietSchedulerLoss(logging.Filter):
    """What the driver's client logs as its scheduler goes, with tracebacks that are no one's error
    (the session says what happened): closed while it still tried to reconnect, the cancelled
    attempt as an ERROR (dropped); a message it could no longer send, at INFO with the closed
    connection's traceback (kept, without the traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            return False
        if isinstance(error, CommClosedError) and record.levelno <= logging.INFO:
            record.exc_info, record.exc_text = None, None
        return True


_LEAVING = (Status.closing, Status.closing_gracefully)
_HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"
_LEFT = ("CommClosedError", "StreamClosedError", "ConnectionRefusedError", "ConnectionResetError")
"""How a message to a worker that left fails."""


def _add_filter(name: str, kind: type[logging.Filter]) -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())


def quiet_compute_failures() -> None:
    """Drop the ERROR records Dask logs for daskjobs tasks whose failure, or whose node's lost
    worker, daskjobs reports itself, a closing worker's cut heartbeat, and the client's tracebacks
    as its scheduler goes (in this process; idempotent)."""
    for name in ("distributed.worker", "distributed.scheduler"):
        _add_filter(name, _DropDaskjobsComputeFailures)
    _add_filter("distributed.worker", _DropHeartbeatCutByClose)
    for name in ("distributed.scheduler", "asyncio"):
        _add_filter(name, _DropBroadcastToLeftWorker)
    for name in ("distributed.client", "distributed.batched"):
        _add_filter(name, _QuietSchedulerLoss)


def dask_setup(worker: Any) -> None:
    """In a worker process behind a nanny (``node_cluster``, ``daskjobs worker``, ``dask worker
    --preload daskjobs.session._worker_process``): ignore SIGINT and SIGTERM, and keep daskjobs' task
    failures, and the loss of a peer worker (a node daskjobs reports lost), out of the logs. Dask
    calls it on the process's main thread.

    A signal to the whole process group reaches the nanny too: a ``node_cluster``'s nanny lives in
    the driver, which stops the job gracefully and then closes this worker; the nanny of a ``dask
    worker`` command closes it gracefully, with the signal as the reason the scheduler logs, so a
    running job takes it as a planned departure (a worker process killed by the signal would be a
    failure)."""
    if getattr(worker, "nanny", None) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    quiet_compute_failures()
    _add_filter("distributed.worker", _DropPeerLoss)
