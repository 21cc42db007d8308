"""A run's Dask futures: its lowered graph submitted (:func:`submit_graph`), then settled
(:func:`settle`): gathered in one transfer once all are done while a :class:`~._losses.Watchdog`
looks for nodes left without a worker, or, when some failed, waited for to the last and reduced to
the run's first error (a :class:`Failure`). The session decides what a failure means (a lost node,
a lost scheduler, a failed step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from distributed import Client, Future
from distributed.comm.core import CommClosedError

from .._execution.lowering import Dep, LoweredGraph
from .._execution.plan import NodePlan
from .._execution.shipping import pack_plan
from ..errors import NodeLostError
from ._client import gather_within, send_at_once, when_all_done
from ._losses import Watchdog
from ._placement import WorkerTable, node_resource
from ._plugin import OnWorker

_WATCH_INTERVAL = 0.5
"""Seconds between checks, while a run is in flight, that its nodes still have workers (a pool
node whose worker left is placed again at once: the check is most of the time a loss takes)."""

_EDGE_SHARE = 1 / 1024
"""The part of a node's resources one Dask task of a run with dataflow edges asks for."""


def submit_graph(client: Client, graph: LoweredGraph) -> dict[str, Future]:
    """Submit every task of ``graph`` (in dependency order), with Dep args replaced by futures."""
    for task in graph.tasks:  # pack the steps first: a step that cannot be pickled raises before any submit
        for arg in task.args:
            if isinstance(arg, NodePlan):
                pack_plan(arg)  # made once per plan, then reused by every run
    send_at_once(client)
    futures: dict[str, Future] = {}
    # A run with dataflow edges is one Dask task per daskjobs task: each takes a sliver of its
    # node's resources and leaves the worker's thread pool, so that all of a node's tasks run
    # at once, as they do in the one Dask task of a run without edges.
    share = _EDGE_SHARE if len(graph.tasks) > len(graph.result_keys) else 1.0
    for task in graph.tasks:
        needs = {node_resource(task.node): 1, **graph.resources.get(task.node, {})}
        try:
            futures[task.key] = client.submit(
                OnWorker(task.fn, seceding=share != 1.0),
                *(futures[a.key] if isinstance(a, Dep) else a for a in task.args),
                key=task.key,
                resources={name: amount * share for name, amount in needs.items()},
                pure=False,
            )
        except Exception:
            client.cancel(list(futures.values()))
            raise
    return futures


@dataclass(frozen=True)
class Failure:
    """How a run's futures ended when they did not all succeed."""

    error: BaseException
    """The run's first error in submission (dependency) order, a lost node the watchdog noticed, or
    distributed's own error (the futures cancelled, the connection closed)."""
    traceback: TracebackType | None
    """The remote traceback of an error a future raised (``None`` for the others)."""
    finished: dict[str, Any]
    """Node -> the result of each node (by ``node_of``) whose key finished."""


def settle(
    client: Client,
    futures: dict[str, Future],
    node_of: dict[str, str],
    keys: list[str],
    workers: Callable[[], WorkerTable],
    gone: Callable[[WorkerTable], Iterable[str]],
) -> list[Any] | Failure:
    """The results of ``keys``, gathered in one transfer once they are done, or the run's :class:`Failure`.

    While the run is in flight a :class:`~._losses.Watchdog` (over ``workers()`` and ``gone``) looks
    for nodes left without a worker. On failure the run's other futures are waited for too (no
    straggler may touch a workspace after the run was reported). ``futures`` is emptied before this
    returns or raises, and a failure refers to none of them, so failed runs leave no keys on the
    scheduler.
    """
    every = list(futures.values())
    watchdog = Watchdog(workers, client.cancel, every, node_of, gone)
    tb = None
    partial: dict[str, Any] = {}
    try:
        results = _gather_watched(client, [futures[k] for k in keys], watchdog)
        if isinstance(results, list) and len(results) == len(keys):
            return results
        if isinstance(results, list):  # the failed ones skipped: keep what the others returned
            done = [k for k in keys if futures[k].status == "finished"]
            if len(done) == len(results):
                partial = {node_of[k]: result for k, result in zip(done, results, strict=True)}
        error: BaseException | None = results if isinstance(results, NodeLostError) else _drain(watchdog)
        if error is None:
            erred = [f for f in every if f.status == "error"][:1]
            if erred:
                error, tb = erred[0].exception(), erred[0].traceback()
                erred.clear()
            else:
                error = CancelledError("the run's Dask futures were cancelled")
    except (CancelledError, CommClosedError) as exc:
        error = exc
    finally:
        futures.clear()
        every.clear()
    return Failure(error, tb, partial)


def _gather_watched(client: Client, futures: list[Future], watchdog: Watchdog) -> list[Any] | NodeLostError:
    """The results of the successful ``futures`` once all are done, or the watchdog's error."""
    results, pending = client.sync(gather_within, client, futures, _WATCH_INTERVAL)
    while pending is not None:
        lost = watchdog.check()
        if lost is not None:
            return lost
        results, pending = client.sync(gather_within, client, futures, _WATCH_INTERVAL, pending)
    return results


def _drain(watchdog: Watchdog) -> NodeLostError | None:
    """Block until all of the run's futures are done, or return the watchdog's error."""
    done = when_all_done(watchdog.futures)
    while not done.wait(_WATCH_INTERVAL):
        lost = watchdog.check()
        if lost is not None:
            return lost
    return None
