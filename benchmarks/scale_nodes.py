"""Many nodes cost what Dask costs: a 64-node job per epoch against raw Dask (SPEC §6 Scale b).

One ``node_cluster`` of ``--nodes`` (default 64) nodes, one worker thread each, and a job whose
epoch is a tiny step per node (``w += 1`` on a 16-element array). Per epoch:

* ``raw``: one ``client.submit`` per node of the same tiny step (a per-worker counter) and one
  ``client.gather`` -- the cheapest hand-written loop on the same cluster;
* ``daskjobs``: ``JobRunner.train`` of the job without checkpoints (target <= 1.2x ``raw``);
* ``daskjobs+ckpt``: the same with a checkpoint every epoch (``MultiNodeCheckpointManager`` on a
  local disk, fsync on, ``keep_last=3``; target <= 1.5x ``daskjobs``).

A daskjobs epoch's cost is the interval between consecutive ``on_epoch`` calls of one run (every
epoch's whole loop: graph, saves, commits, retention, history), after ``--warmup`` epochs; ``raw``
epochs are timed one by one. Runs of ``--epochs`` epochs of each variant alternate, ``--rounds``
times (rotating the order), so drift of the machine hits all alike; medians over every epoch.

The cluster: ``--workers`` (default 2, one per core of this machine) worker processes, each serving
``nodes / workers`` nodes with one thread per node (``node_cluster({worker: nodes}, nthreads=...,
processes=True)``). Node work (the steps, and with checkpoints each node's save, background flush
and retention) runs in worker processes as on a real cluster, off the driver's process and its
GIL. One worker process per node (``--workers 64``) puts 64 workers and their 64 nannies on this
2-core machine shared with other work: that measures the operating system's scheduling and memory
pressure more than what daskjobs adds. ``--processes 0`` runs every worker in the driver's process
(in-process workers: node work, Dask's per-worker monitors and the driver share one process).
``--profile DIR`` writes a pyinstrument profile of the driver for one run of each daskjobs variant.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/scale_nodes.py [--nodes 64] [--workers 2] [--epochs 30] [--rounds 5] [--keep-last 3]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _report import write_json
from distributed import Client, get_worker

import daskjobs as dj


def _step(ws: dj.Workspace) -> None:
    ws["w"] += 1.0


def _init(ws: dj.Workspace) -> None:
    ws["w"] = np.zeros(16)


def define_job(nodes: list[str]) -> dj.Job:
    """Every node: ``w`` created in the init group, one tiny step per epoch."""
    with dj.Cluster(), dj.Job(name="scale") as job:
        for node in nodes:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(_init, name="init")
                dj.Task(_step, name="step")
    return job


def _raw_step(node: str) -> int:
    """The hand-written loop's task: one increment of a per-worker counter of ``node``."""
    worker = get_worker()
    if not hasattr(worker, "bench_counters"):
        worker.bench_counters, worker.bench_lock = {}, threading.Lock()
    with worker.bench_lock:
        worker.bench_counters[node] = worker.bench_counters.get(node, 0) + 1
        return worker.bench_counters[node]


def raw_run(client: Client, nodes: list[str], epochs: int) -> list[float]:
    """``epochs`` epochs of one ``client.submit`` per node and one ``gather``; seconds of each."""
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        futures = [client.submit(_raw_step, node, resources={dj.node_resource(node): 1}, pure=False) for node in nodes]
        client.gather(futures)
        times.append(time.perf_counter() - started)
    return times


def runner_run(
    session: dj.DaskSession, nodes: list[str], epochs: int, warmup: int, checkpoint: bool, keep_last: int | None = 3
) -> list[float]:
    """One ``JobRunner.train`` of ``epochs`` epochs; the intervals between its ``on_epoch`` calls after ``warmup``."""
    stamps: list[float] = []
    prefix = tempfile.mkdtemp(prefix="daskjobs-scale-") if checkpoint else None
    try:
        manager = dj.MultiNodeCheckpointManager(prefix, keep_last=keep_last) if prefix else None
        runner = dj.JobRunner(
            define_job(nodes),
            manager,
            max_epochs=epochs,
            progress=False,
            on_epoch=lambda record: stamps.append(time.perf_counter()),
        )
        assert runner.train(session) == epochs
    finally:
        if prefix:
            shutil.rmtree(prefix, ignore_errors=True)
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]


def profiled(run: Callable[[], object], path: str) -> None:
    """Run ``run`` under pyinstrument (driver thread) and write the text report to ``path``."""
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.001)
    profiler.start()
    try:
        run()
    finally:
        profiler.stop()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(profiler.output_text(unicode=False, color=False, show_all=False))


def ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=30, help="epochs per run")
    parser.add_argument("--warmup", type=int, default=3, help="epochs of a run not counted")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each variant, interleaved (at least 5)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes, each serving nodes/workers nodes")
    parser.add_argument("--processes", type=int, default=1, help="0: every worker in this process")
    parser.add_argument("--keep-last", type=int, default=3, help="retention of the checkpointed runs (0: keep all)")
    parser.add_argument("--profile", help="write pyinstrument profiles of the driver into this folder")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    nodes = [f"n{i:03d}" for i in range(args.nodes)]
    workers = max(1, min(args.workers, args.nodes))
    spec = {f"w{j}": nodes[j::workers] for j in range(workers)}
    keep_last = args.keep_last or None
    rounds = max(5, args.rounds)
    times: dict[str, list[float]] = {"raw": [], "daskjobs": [], "daskjobs+ckpt": []}
    started = time.perf_counter()
    with (
        dj.node_cluster(spec, nthreads=-(-args.nodes // workers), processes=bool(args.processes)) as cluster,
        Client(cluster) as client,
        dj.DaskSession(client) as session,
    ):
        variants: dict[str, Callable[[], list[float]]] = {
            "raw": lambda: raw_run(client, nodes, args.epochs)[args.warmup :],
            "daskjobs": lambda: runner_run(session, nodes, args.epochs, args.warmup, False),
            "daskjobs+ckpt": lambda: runner_run(session, nodes, args.epochs, args.warmup, True, keep_last),
        }
        for run in variants.values():  # warm up: imports, placement checks, the scheduler's first graphs
            run()
        names = list(variants)
        for number in range(rounds):
            for name in names[number % len(names) :] + names[: number % len(names)]:
                times[name] += variants[name]()
        if args.profile:
            for name in ("daskjobs", "daskjobs+ckpt"):
                profiled(variants[name], f"{args.profile}/scale_nodes-{name}.txt")
    medians = {name: ms(values) for name, values in times.items()}
    result = {
        "nodes": args.nodes,
        "workers": workers,
        "processes": bool(args.processes),
        "keep_last": keep_last,
        "epochs_per_variant": {name: len(values) for name, values in times.items()},
        "median_ms_per_epoch": medians,
        "ratio_daskjobs_to_raw": medians["daskjobs"] / medians["raw"],
        "ratio_ckpt_to_no_ckpt": medians["daskjobs+ckpt"] / medians["daskjobs"],
        "targets": {"daskjobs_to_raw": 1.2, "ckpt_to_no_ckpt": 1.5},
        "wall_seconds": time.perf_counter() - started,
    }
    rows = [
        (f"raw submit per node + gather ({args.nodes} nodes)", f"{medians['raw']:.2f} ms"),
        ("daskjobs JobRunner, no checkpoints", f"{medians['daskjobs']:.2f} ms"),
        ("daskjobs JobRunner, checkpoint every epoch", f"{medians['daskjobs+ckpt']:.2f} ms"),
        ("ratio daskjobs / raw", f"{result['ratio_daskjobs_to_raw']:.3f} (target <= 1.2)"),
        ("ratio checkpoint / no checkpoint", f"{result['ratio_ckpt_to_no_ckpt']:.3f} (target <= 1.5)"),
    ]
    width = max(len(label) for label, _ in rows)
    mode = "worker processes" if args.processes else "in-process workers"
    print(f"{args.nodes} nodes, one thread each, on {workers} {mode}; medians per epoch", file=sys.stderr)
    print("\n".join(f"{label:<{width}}  {value}" for label, value in rows), file=sys.stderr)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
