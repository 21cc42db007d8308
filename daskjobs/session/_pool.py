"""pool_cluster: a local Dask cluster of pool workers (no node resources), on the loopback interface only.

What ``daskjobs run --workers N`` and the elastic modes of ``daskjobs check`` run on: a
:class:`~daskjobs.DaskSession` places the job's nodes on these workers itself (SPEC §1.6a), and the
cluster can grow (``cluster.scale(n)``) and shrink under a running job.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from typing import Any

import dask.config
from distributed import Nanny, Scheduler, SpecCluster, Worker

from .._model.values import check_count
from ._cluster import _HOST, CLUSTER_CONFIG, _preloads


def pool_cluster(n_workers: int, *, nthreads: int = 2, processes: bool = True, **kwargs: Any) -> SpecCluster:
    """A ready local Dask cluster of ``n_workers`` pool workers, listening on 127.0.0.1 only.

    Like :func:`~daskjobs.node_cluster` (a nanny per worker process, daskjobs' worker preload, the
    scheduler's dashboard on a free port of 127.0.0.1, Dask's debugging logs kept short), but its
    workers provide no node resource: a session places any number of nodes on them, and
    ``cluster.scale(n)`` adds workers of the same kind.

    Parameters
    ----------
    n_workers : int
        Workers to start (at least 1).
    nthreads : int
        Threads per worker.
    processes : bool
        One process per worker when true, else in-process workers.
    **kwargs
        Passed to :class:`distributed.SpecCluster`.

    Examples
    --------
    >>> from daskjobs.session._pool import pool_cluster
    >>> with pool_cluster(2) as cluster:  # doctest: +SKIP
    ...     print(len(cluster.workers))
    2
    """
    n_workers = check_count(n_workers, "n_workers")
    nthreads = check_count(nthreads, "nthreads")
    silence_logs = kwargs.pop("silence_logs", logging.ERROR)
    directory = tempfile.mkdtemp(prefix="daskjobs-pool-")
    worker = {
        "cls": Nanny if processes else Worker,
        "options": {
            **(_preloads() if processes else {}),
            "nthreads": nthreads,
            "host": _HOST,
            "local_directory": directory,
            "dashboard": False,
            "silence_logs": silence_logs,
        },
    }
    scheduler = {
        "cls": Scheduler,
        "options": {
            "host": _HOST,
            "port": 0,
            "dashboard": True,
            "dashboard_address": f"{_HOST}:0",
            "allowed_failures": 0,  # a task whose worker died fails at once: its node is placed again
        },
    }
    try:
        with dask.config.set(CLUSTER_CONFIG):
            cluster = SpecCluster(
                workers={f"pool-{i}": worker for i in range(n_workers)},
                scheduler=scheduler,
                worker=worker,
                silence_logs=silence_logs,
                **kwargs,
            )
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    weakref.finalize(cluster, shutil.rmtree, directory, ignore_errors=True)
    return cluster
