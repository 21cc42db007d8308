"""Set-up of the worker processes of :func:`~daskjobs.node_cluster` (a Dask preload module).

A terminal's Ctrl-C reaches the whole foreground process group: the driver (where daskjobs turns
it into a graceful stop) and every worker process of a ``node_cluster`` it started. A worker
process that took it would die (and its nanny would not bring it back: it exited on its own), so
the job would lose its nodes instead of stopping gracefully. These workers ignore SIGINT; the
cluster still ends them when it closes, and SIGTERM and SIGKILL still work.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def dask_setup(worker: Any) -> None:
    """Ignore SIGINT in this worker process (Dask calls it on the process's main thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
