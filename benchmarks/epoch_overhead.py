"""Epoch overhead of DaskSession against hand-written ``client.submit`` + ``gather`` (SPEC §6).

A tiny epoch: 2 nodes x 2 tasks, each task adds 1 to a counter blob of its node under the
workspace lock; one task per node outputs the counter (like a stop condition). Measured on one
``node_cluster(["a", "b"])`` (Nanny processes):

* ``raw``: per epoch one ``client.submit`` per node running the same two increments, then one
  ``client.gather`` -- the cheapest hand-written form (feasibility study, section 3);
* ``raw-4``: per epoch one ``client.submit`` per task (4), then one ``gather``, for reference;
* ``dask``: ``DaskSession.run_group`` of the epoch group (what ``JobRunner`` does per epoch);
* ``local``: ``LocalSession.run_group`` of the same group;
* flat cost: DaskSession's median epoch time over the 100 epochs around epoch 50 and around
  epoch ``--flat-epochs`` of one session.

Blocks of the variants are interleaved so that drift of the machine affects all of them alike.
Prints a table and writes the numbers as JSON (to stdout, or to ``--json FILE``).

Run: ``python benchmarks/epoch_overhead.py [--epochs 200] [--rounds 3] [--flat-epochs 5000]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable

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


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=200, help="epochs per block and variant")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved blocks per variant")
    parser.add_argument("--flat-epochs", type=int, default=5000, help="epoch whose cost is compared with epoch 50")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)

    times: dict[str, list[float]] = {"raw": [], "raw-4": [], "dask": [], "local": []}
    with dj.LocalSession() as local:
        run = session_epoch(local, epoch_group())
        time_epochs(run, 50)
        times["local"] = time_epochs(run, args.epochs * args.rounds)

    with dj.node_cluster(["a", "b"]) as cluster, Client(cluster) as client, dj.DaskSession(client) as session:
        variants = {
            "raw": raw_epoch(client, 2),
            "raw-4": raw_epoch(client, 1),
            "dask": session_epoch(session, epoch_group()),
        }
        for run in variants.values():
            time_epochs(run, 30)  # warm up
        for _ in range(args.rounds):
            for name, run in variants.items():
                times[name] += time_epochs(run, args.epochs)

    with dj.node_cluster(["a", "b"]) as cluster, dj.DaskSession(cluster) as session:
        flat = time_epochs(session_epoch(session, epoch_group()), args.flat_epochs + 50)
    # "around epoch N": the 100 epochs centred on N (epoch k is flat[k - 1])
    early, late = flat[:100], flat[args.flat_epochs - 51 : args.flat_epochs + 49]

    medians = {name: ms(values) for name, values in times.items()}
    result = {
        "median_ms_per_epoch": medians,
        "ratio_dask_to_raw": medians["dask"] / medians["raw"],
        "ratio_dask_to_raw_4": medians["dask"] / medians["raw-4"],
        "flat": {
            "around_epoch_50_ms": ms(early),
            f"around_epoch_{args.flat_epochs}_ms": ms(late),
            "ratio": ms(late) / ms(early),
        },
        "epochs_per_variant": args.epochs * args.rounds,
    }
    rows = [
        ("LocalSession", f"{medians['local']:.3f} ms"),
        ("raw submit per node + gather", f"{medians['raw']:.2f} ms"),
        ("raw submit per task + gather", f"{medians['raw-4']:.2f} ms"),
        ("DaskSession.run_group", f"{medians['dask']:.2f} ms"),
        ("ratio DaskSession / raw per node", f"{result['ratio_dask_to_raw']:.3f} (target <= 1.2)"),
        ("flat: epoch ~50", f"{ms(early):.2f} ms"),
        (f"flat: epoch ~{args.flat_epochs}", f"{ms(late):.2f} ms (ratio {ms(late) / ms(early):.3f}, target <= 1.1)"),
    ]
    width = max(len(label) for label, _ in rows)
    table = "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
    print(table, file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
