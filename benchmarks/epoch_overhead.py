"""Epoch overhead of DaskSession against hand-written ``client.submit`` + ``gather`` (SPEC §6).

A tiny epoch: 2 nodes x 2 tasks, each task adds 1 to a counter blob of its node under the
workspace lock; one task per node outputs the counter (like a stop condition). Measured on one
``node_cluster(["a", "b"])`` (Nanny processes):

* ``raw``: per epoch one ``client.submit`` per node running the same two increments, then one
  ``client.gather`` -- the cheapest hand-written form (feasibility study, section 3);
* ``raw-4``: per epoch one ``client.submit`` per task (4), then one ``gather``, for reference;
* ``dask``: ``DaskSession.run_group`` of the epoch group (what ``JobRunner`` does per epoch);
* ``local``: ``LocalSession.run_group`` of the same group;
* flat cost: a session's median epoch time around epoch 50 and around epoch ``--flat-epochs``,
  in its own series and interleaved with a fresh session's first 100 epochs (which cancels
  load from elsewhere on the machine), plus the tasks and futures left behind afterwards.

Epochs of the cluster variants are interleaved so that drift of the machine affects all alike.
Prints a table and writes the numbers as JSON (to stdout, or to ``--json FILE``).

Run: ``python benchmarks/epoch_overhead.py [--epochs 600] [--flat-epochs 5000]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable

from _report import write_json
from distributed import Client, get_worker

import daskjobs as dj
from daskjobs.session._base import Session


def _add_one(ws: dj.Workspace) -> None:
    with ws.lock:
        ws["counter"] = ws.get("counter", 0) + 1


def _raw_node_epoch(node: str, tasks: int) -> int:
    """The hand-written baseline's node task: ``tasks`` increments of a per-worker counter."""
    worker = get_worker()
    if not hasattr(worker, "bench_counters"):
        worker.bench_counters, worker.bench_lock = {}, threading.Lock()
    with worker.bench_lock:
        for _ in range(tasks):
            worker.bench_counters[node] = worker.bench_counters.get(node, 0) + 1
        return worker.bench_counters[node]


def epoch_group() -> dj.TaskGroup:
    """2 nodes x 2 tasks; the second task of each node outputs the counter."""
    group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
    with group:
        for node in ("a", "b"):
            with dj.Node(node):
                dj.Task(_add_one, name="first")
                dj.Task(_add_one, name="second", outputs="counter")
    return group


def time_epochs(epoch: Callable[[], object], n: int) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``epoch``."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        epoch()
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(variants: dict[str, Callable[[], object]], n: int) -> dict[str, list[float]]:
    """``n`` epochs of every variant, one epoch of each in turn (rotating the order), so that
    load from elsewhere on the machine hits all variants alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def raw_epoch(client: Client, tasks_per_submit: int) -> Callable[[], list[int]]:
    """One epoch of the hand-written loop: 4 increments in ``4 / tasks_per_submit`` submits."""

    def epoch() -> list[int]:
        futures = [
            client.submit(_raw_node_epoch, node, tasks_per_submit, resources={dj.node_resource(node): 1}, pure=False)
            for node in ("a", "b")
            for _ in range(2 // tasks_per_submit)
        ]
        return client.gather(futures)

    return epoch


def session_epoch(session: Session, group: dj.TaskGroup) -> Callable[[], None]:
    """One epoch run of ``group`` in ``session``, numbered like JobRunner numbers epochs."""
    counter = iter(range(1, 10**9))
    return lambda: session.run_group(group, job="bench", epoch=next(counter))


def ms(values: list[float]) -> float:
    """Median in milliseconds."""
    return 1000 * statistics.median(values)


def scheduler_state(client: Client) -> dict[str, int]:
    """What would grow if runs leaked: tasks on the scheduler, futures held by the client."""
    tasks = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
    return {"scheduler_tasks": tasks, "client_futures": len(client.futures)}


def flat_cost(client: Client, epochs: int) -> dict[str, object]:
    """Cost of epoch ~``epochs`` against epoch ~50: within one session's series, and interleaved
    with a fresh session's first 100 epochs (insensitive to load from elsewhere)."""
    with dj.DaskSession(client) as old, dj.DaskSession(client) as fresh:
        series = time_epochs(session_epoch(old, epoch_group()), epochs - 50)  # epochs 1 .. N-50
        interleaved = time_interleaved(
            {"late": session_epoch(old, epoch_group()), "early": session_epoch(fresh, epoch_group())}, 100
        )
    state = scheduler_state(client)
    early, late = ms(series[:100]), ms(series[-100:] + interleaved["late"][:50])
    return {
        "series_around_epoch_50_ms": early,
        f"series_around_epoch_{epochs}_ms": late,
        "series_ratio": late / early,
        f"interleaved_epoch_{epochs}_ms": ms(interleaved["late"]),
        "interleaved_fresh_epoch_50_ms": ms(interleaved["early"]),
        "interleaved_ratio": ms(interleaved["late"]) / ms(interleaved["early"]),
        **state,
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=600, help="epochs per variant")
    parser.add_argument("--flat-epochs", type=int, default=5000, help="epoch whose cost is compared with epoch 50")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.flat_epochs < 200:
        parser.error("--flat-epochs must be at least 200")

    times: dict[str, list[float]] = {}
    with dj.LocalSession() as local:
        run = session_epoch(local, epoch_group())
        time_epochs(run, 50)
        times["local"] = time_epochs(run, args.epochs)

    with dj.node_cluster(["a", "b"]) as cluster, Client(cluster) as client:
        with dj.DaskSession(client) as session:
            variants = {
                "raw": raw_epoch(client, 2),
                "raw-4": raw_epoch(client, 1),
                "dask": session_epoch(session, epoch_group()),
            }
            time_interleaved(variants, 30)  # warm up
            times.update(time_interleaved(variants, args.epochs))
        flat = flat_cost(client, args.flat_epochs)

    medians = {name: ms(values) for name, values in times.items()}
    result = {
        "median_ms_per_epoch": medians,
        "ratio_dask_to_raw": medians["dask"] / medians["raw"],
        "ratio_dask_to_raw_4": medians["dask"] / medians["raw-4"],
        "epochs_per_variant": args.epochs,
        "flat": flat,
    }
    n = args.flat_epochs
    rows = [
        ("LocalSession", f"{medians['local']:.3f} ms"),
        ("raw submit per node + gather", f"{medians['raw']:.2f} ms"),
        ("raw submit per task + gather", f"{medians['raw-4']:.2f} ms"),
        ("DaskSession.run_group", f"{medians['dask']:.2f} ms"),
        ("ratio DaskSession / raw per node", f"{result['ratio_dask_to_raw']:.3f} (target <= 1.2)"),
        (
            f"flat, one series: epoch ~50 / ~{n}",
            f"{flat['series_around_epoch_50_ms']:.2f} / "
            f"{flat[f'series_around_epoch_{n}_ms']:.2f} ms (ratio {flat['series_ratio']:.3f})",
        ),
        (
            f"flat, interleaved: epoch ~{n} / fresh ~50",
            f"{flat[f'interleaved_epoch_{n}_ms']:.2f} / "
            f"{flat['interleaved_fresh_epoch_50_ms']:.2f} ms (ratio {flat['interleaved_ratio']:.3f}, target <= 1.1)",
        ),
        ("left on scheduler / client", f"{flat['scheduler_tasks']} tasks / {flat['client_futures']} futures"),
    ]
    width = max(len(label) for label, _ in rows)
    print("\n".join(f"{label:<{width}}  {value}" for label, value in rows), file=sys.stderr)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
