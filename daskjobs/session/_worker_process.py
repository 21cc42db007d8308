"""Set-up of the Dask workers daskjobs starts (a Dask preload module) and of this process's logs.

Signals: a terminal's Ctrl-C reaches the whole foreground process group, and SLURM's ``scancel``,
systemd and Kubernetes send SIGTERM to every process of the job: the driver (where daskjobs
turns the signal into a graceful stop) and every worker process of the ``node_cluster`` it
started. A worker process that took the signal would die, and the job would lose its nodes instead
of committing the running epoch. Those workers belong to the driver, which closes them when it is
done, so they ignore SIGINT and SIGTERM (:func:`dask_setup`); SIGKILL still works, and a worker
process exits as soon as its driver does (Dask ties it to its parent).

Logs: a step that fails is reported once, by daskjobs, as a
:class:`~daskjobs.errors.TaskFailedError` naming job, group, node, task and epoch; Dask's own
"Compute Failed" block for the same failure (an ERROR with the task's repr and traceback) is
dropped for daskjobs' tasks (:func:`quiet_compute_failures`), in worker processes that daskjobs
starts and in this process, whose in-process workers log there.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

KEY_PREFIX = "daskjobs-"
"""Every Dask key a daskjobs session submits starts with this."""


class _DropDaskjobsComputeFailures(logging.Filter):
    """Drops ``distributed.worker``'s "Compute Failed" records of daskjobs tasks (reported by daskjobs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or not str(record.msg).startswith("Compute Failed"):
            return True
        key = record.args[0] if isinstance(record.args, tuple) and record.args else ""
        return not str(key).startswith(KEY_PREFIX)


def quiet_compute_failures() -> None:
    """Drop Dask's "Compute Failed" log records of daskjobs tasks in this process (idempotent)."""
    worker_logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _DropDaskjobsComputeFailures) for f in worker_logger.filters):
        worker_logger.addFilter(_DropDaskjobsComputeFailures())


def dask_setup(worker: Any) -> None:
    """In a worker process daskjobs started: ignore SIGINT and SIGTERM (the driver stops the job
    gracefully and then closes this worker) and keep daskjobs' task failures out of the logs.
    Dask calls it on the process's main thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    quiet_compute_failures()
