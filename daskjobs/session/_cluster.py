"""node_cluster: a local Dask cluster with one worker per node, on the loopback interface only."""

from __future__ import annotations

import logging
import shutil
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import dask.config
from distributed import Nanny, Scheduler, Security, SpecCluster, Worker

from .._model.job import Job
from .._model.node import Node
from .._model.values import check_count, validate_name
from ..errors import DefinitionTypeError, JobDefinitionError
from . import _worker_process
from ._placement import worker_resources
from ._scratch import make_cluster_folder

_HOST = "127.0.0.1"

# A SpecCluster hard-closes the nanny of a worker that has not come back within this time after it
# was lost. Dask's default (15 s) is shorter than a restart can take on a busy machine, after which
# the node would never get a worker again; a node's worker must come back every time.
dask.config.update_defaults({"distributed": {"deploy": {"lost-worker-timeout": "600s"}}})

CLUSTER_CONFIG = {
    "distributed.scheduler.no-workers-timeout": "10s",
    "distributed.admin.low-level-log-length": 100,
}
"""Dask config of ``node_cluster``. Dask keeps its last ``low-level-log-length`` messages per
connection and event topic for debugging (with every task's run spec); 100 instead of 1000 keeps
that bounded memory small and reached after a few hundred epochs."""

NodesLike = Job | Sequence[str | Node] | Mapping[str, Sequence[str | Node]]
"""A Job (one worker per node it uses, with its Nodes' resources), node names or Nodes (one worker
each), or worker name -> the nodes that worker serves."""


def _needs(node: str | Node) -> tuple[str, dict[str, float]]:
    return validate_name(str(node), "node"), node.kwargs() if isinstance(node, Node) else {}


def _worker_plan(nodes: NodesLike) -> dict[str, tuple[list[str], dict[str, float]]]:
    """Worker name -> (nodes it serves, extra resources those nodes need)."""
    if isinstance(nodes, str | Node):
        raise DefinitionTypeError(f"node_cluster needs a list of nodes, got {nodes!r}")
    if isinstance(nodes, Job):
        groups = {name: [(name, needs)] for name, needs in nodes.node_resources().items()}
    elif isinstance(nodes, Mapping):
        groups = {
            worker: [_needs(n) for n in ([served] if isinstance(served, str | Node) else served)]
            for worker, served in nodes.items()
        }
    else:
        groups = {str(n): [_needs(n)] for n in nodes}
    plan: dict[str, tuple[list[str], dict[str, float]]] = {}
    owner: dict[str, str] = {}
    for worker, served in groups.items():
        names: list[str] = []
        extra: dict[str, float] = {}
        for name, needs in served:
            if name in owner:
                raise JobDefinitionError(
                    f"node {name!r} is listed for workers {owner[name]!r} and {worker!r}; one per node"
                )
            owner[name] = worker
            names.append(name)
            for resource, amount in needs.items():
                extra[resource] = max(extra.get(resource, 0), amount)
        plan[validate_name(str(worker), "worker")] = (names, extra)
    if not owner:
        raise JobDefinitionError("node_cluster needs at least one node")
    return plan


def _preloads() -> dict[str, list[Any]]:
    """The worker processes' preloads: those the Dask config names (``distributed.worker.preload``,
    with their ``preload-argv``), then daskjobs' own (:mod:`._worker_process`)."""
    configured = dask.config.get("distributed.worker.preload", None) or []
    configured = [configured] if isinstance(configured, str) else list(configured)
    argv = dask.config.get("distributed.worker.preload-argv", None) or []
    if argv and isinstance(argv[0], str):
        argv = [list(argv) for _ in configured]
    elif not argv:
        argv = [[] for _ in configured]
    return {"preload": [*configured, _worker_process.__name__], "preload_argv": [*map(list, argv), []]}


def node_cluster(
    nodes: NodesLike,
    *,
    nthreads: int = 2,
    processes: bool = True,
    security: Security | bool | None = None,
    **kwargs: Any,
) -> SpecCluster:
    """A ready local Dask cluster with one worker per node, listening on 127.0.0.1 only.

    Each worker is named after its node and provides :func:`~daskjobs.node_resource` of it
    (``nthreads`` units, so up to ``nthreads`` Dask tasks of the node run at once), plus the
    extra resources of :class:`~daskjobs.Node` objects (``Node("t", GPU=1)`` adds ``GPU: 1``).
    The scheduler fails a job task at once when its worker dies (``allowed-failures`` 0) and
    fails tasks that wait more than 10 s for a missing worker (``no-workers-timeout``); its
    dashboard listens on a free port of 127.0.0.1. Dask's debugging logs of recent messages
    keep 100 entries instead of 1000 (``distributed.admin.low-level-log-length``), so memory
    stays flat after a short warm-up however many epochs run.

    Parameters
    ----------
    nodes : Job, sequence of str or Node, or mapping
        The nodes, one worker each; or a mapping worker name -> nodes, for a worker that
        serves several nodes. A :class:`~daskjobs.Job` stands for every node it uses, with the
        resources of the :class:`~daskjobs.Node` objects its tasks were placed on.
    nthreads : int
        Threads per worker.
    processes : bool
        One process per worker (behind a ``Nanny`` that restarts it, every time it dies) when
        true, else in-process workers (faster to start; all share this process). Worker
        processes ignore SIGINT and SIGTERM: a Ctrl-C, ``scancel`` or ``kill -TERM -PGID``
        reaching every process of the job stops the driver gracefully, and the driver then
        closes its workers. The preloads of the Dask config (``distributed.worker.preload``)
        run in them too, before daskjobs' own.
    security : distributed.Security or bool, optional
        TLS for every connection of the cluster (``tls://`` addresses; plain TCP clients are
        refused). ``True`` makes a temporary self-signed certificate
        (``distributed.Security.temporary()``). A :class:`~daskjobs.DaskSession` on the
        cluster object uses it.
    **kwargs
        Passed to :class:`distributed.SpecCluster` (e.g. ``name``, ``silence_logs``).

    Returns
    -------
    distributed.SpecCluster
        Also a context manager. Worker files go to a temporary directory (``daskjobs-cluster-*``)
        that is removed when the cluster object is garbage-collected; the folders of runs whose
        process was killed are removed by the next ``node_cluster`` of this user and host.

    Raises
    ------
    DefinitionTypeError
        ``nodes`` is a single node instead of a list of them.
    JobDefinitionError
        No node, a node listed for two workers, an invalid node or worker name, or an
        ``nthreads`` that is not a positive integer.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.node_cluster(["ps", dj.Node("trainer", GPU=1)]) as cluster:  # doctest: +SKIP
    ...     with dj.DaskSession(cluster) as session:
    ...         print(session.nodes())
    ['ps', 'trainer']
    >>> cluster = dj.node_cluster({"machine0": ["ps", "trainer"]}, processes=False)  # doctest: +SKIP
    >>> secure = dj.node_cluster(["ps"], security=True)  # doctest: +SKIP
    """
    nthreads = check_count(nthreads, "nthreads")
    plan = _worker_plan(nodes)
    if security is True:
        security = Security.temporary()
    tls = {"security": security, "protocol": "tls://"} if security else {}
    silence_logs = kwargs.pop("silence_logs", logging.ERROR)
    directory = make_cluster_folder()
    own_processes = _preloads() if processes else {}
    workers = {
        name: {
            "cls": Nanny if processes else Worker,
            "options": {
                **own_processes,
                "nthreads": nthreads,
                "host": _HOST,
                "resources": worker_resources(served, nthreads, extra),
                "local_directory": directory,
                "dashboard": False,
                "silence_logs": silence_logs,
                **tls,
            },
        }
        for name, (served, extra) in plan.items()
    }
    scheduler = {
        "cls": Scheduler,
        "options": {
            "host": _HOST,
            "port": 0,
            "dashboard": True,
            "dashboard_address": f"{_HOST}:0",
            "allowed_failures": 0,
            **tls,
        },
    }
    try:
        # Read when the scheduler and workers start, inside the constructor (nannies pass the
        # config on to their worker processes).
        with dask.config.set(CLUSTER_CONFIG):
            cluster = SpecCluster(
                workers=workers, scheduler=scheduler, silence_logs=silence_logs, security=security or None, **kwargs
            )
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    weakref.finalize(cluster, shutil.rmtree, directory, ignore_errors=True)
    return cluster
