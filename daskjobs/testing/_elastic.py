"""The local pool clusters of a check's elastic modes (SPEC §1.6a): ``"shrink"`` runs on two pool
workers, one of which its driver kills without replacement; ``"grow"`` on one, and a second joins
once the run has committed the epoch it is to grow after (its driver waits for it there)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from distributed import Client

from ..checkpoint import CheckpointStore
from ..errors import CheckpointError
from ..session._pool import pool_cluster

ELASTIC_MODES = ("shrink", "grow")
_LOOK_EVERY = 0.05
"""Seconds between looks at a growing run's commits."""


@contextlib.contextmanager
def elastic_pool(mode: str, at: int, prefix: str, nthreads: int = 2) -> Iterator[Any]:
    """A new local pool cluster for one run of ``mode`` interrupted at epoch ``at`` against
    ``prefix``: yields a ``distributed.Client`` of it; closed afterwards."""
    workers = 2 if mode == "shrink" else 1
    with pool_cluster(workers, nthreads=nthreads) as cluster, Client(cluster, set_as_default=False) as client:
        stop = threading.Event()
        grower = threading.Thread(target=_grow_after, args=(cluster, prefix, at, stop), daemon=True)
        if mode == "grow":
            grower.start()
        try:
            yield client
        finally:
            stop.set()
            if grower.is_alive():
                grower.join()


def _grow_after(cluster: Any, prefix: str, at: int, stop: threading.Event) -> None:
    """Add a worker to ``cluster`` once epoch ``at`` is committed under ``prefix``."""
    store = CheckpointStore(prefix)
    while not stop.wait(_LOOK_EVERY):
        with contextlib.suppress(CheckpointError, OSError):  # nothing committed yet
            if at in store.committed_epochs():
                cluster.scale(len(cluster.workers) + 1)
                return
