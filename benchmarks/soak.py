"""SPEC §4 flat memory: RSS growth per 1000 epochs of the driver and of each worker.

Runs a tiny 2-node job (``JobRunner`` on a ``DaskSession`` over ``node_cluster(["a", "b"])``)
for ``--epochs`` epochs in one ``train()`` call. After ``--warmup`` epochs it samples, every
``--every`` epochs, the resident set size of the driver and of each worker process (psutil),
and reports the least-squares slope in MB per 1000 epochs per process, plus open files and
threads at the first and last sample. Target: every slope <= 2 MB / 1000 epochs.

``--checkpoint``: the same job with a checkpoint committed every epoch (``keep_last=3``, in a
temporary folder removed at the end). ``--in-memory``: every epoch committed in cluster memory
(tier 0, one replica), durably every 10th (``in_memory=True, durable_every=10``). ``--nodes N``:
the N-node job of ``scale_nodes.py`` (a tiny step per node, two worker processes, one thread per
node) instead.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/soak.py [--epochs 3000] [--checkpoint]``
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import numpy as np
import psutil
from _report import write_json
from scale_nodes import define_job as scale_job

import daskjobs as dj


def define_job() -> dj.Job:
    """Two nodes, two tasks each; node a publishes a value node b consumes."""
    with dj.Cluster(), dj.Job(name="soak") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("w", np.zeros(4)))
            dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1.0), name="step")
            dj.Task(lambda ws: ws.log("loss", 1.0 / (1 + ws.epoch)), name="log")
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", 0))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
            dj.Task(lambda ws: None, name="idle")
    return job


def process_stats(process: psutil.Process) -> dict[str, float]:
    """RSS in MB, open files and threads of ``process``."""
    with process.oneshot():
        return {
            "rss_mb": process.memory_info().rss / 2**20,
            "open_files": len(process.open_files()),
            "threads": process.num_threads(),
        }


def slope_per_1000(epochs: list[int], values: list[float]) -> float:
    """Least-squares growth of ``values`` per 1000 epochs."""
    if len(epochs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(epochs, float), np.asarray(values, float), 1)[0] * 1000)


def soak(
    epochs: int, warmup: int, every: int, checkpoint: bool = False, in_memory: bool = False, nodes: int = 0
) -> dict[str, object]:
    """Run the job (the ``nodes``-node job if given) for ``epochs`` epochs and sample every process
    after ``warmup`` epochs."""
    node_names = [f"n{i:03d}" for i in range(nodes)]
    spec = {"w0": node_names[0::2], "w1": node_names[1::2]} if nodes else ["a", "b"]
    with (
        tempfile.TemporaryDirectory(prefix="daskjobs-soak-") as folder,
        dj.node_cluster(spec, nthreads=max(2, -(-nodes // 2))) as cluster,
        dj.DaskSession(cluster) as session,
    ):
        pids = session.client.run(os.getpid)
        names = {w["name"]: addr for addr, w in session.client.scheduler_info(n_workers=-1)["workers"].items()}
        processes = {"driver": psutil.Process()} | {f"worker {n}": psutil.Process(pids[a]) for n, a in names.items()}
        samples: dict[str, list[tuple[int, dict[str, float]]]] = {name: [] for name in processes}

        def on_epoch(record: dj.EpochRecord) -> None:
            if record.epoch >= warmup and (record.epoch - warmup) % every == 0:
                gc.collect()
                for name, process in processes.items():
                    samples[name].append((record.epoch, process_stats(process)))

        manager = None
        if in_memory:
            manager = dj.MultiNodeCheckpointManager(folder, in_memory=True, durable_every=10)
        elif checkpoint:
            manager = dj.MultiNodeCheckpointManager(folder, keep_last=3)
        job = scale_job(node_names) if nodes else define_job()
        runner = dj.JobRunner(job, manager, max_epochs=epochs, on_epoch=on_epoch, progress=False)
        runner.train(session)
        history_bytes = sum(sys.getsizeof(r) for r in runner.history)
    result: dict[str, object] = {
        "epochs": epochs,
        "warmup": warmup,
        "checkpoint_every_epoch": checkpoint,
        "in_memory": in_memory,
        "nodes": nodes or 2,
    }
    result["history_records"] = len(runner.history)
    result["history_record_bytes"] = history_bytes
    per_process = {}
    for name, rows in samples.items():
        at = [epoch for epoch, _ in rows]
        first, last = rows[0][1], rows[-1][1]
        per_process[name] = {
            "rss_growth_mb_per_1000_epochs": slope_per_1000(at, [s["rss_mb"] for _, s in rows]),
            "rss_mb_series": {epoch: round(stats["rss_mb"], 2) for epoch, stats in rows},
            "rss_mb_first": first["rss_mb"],
            "rss_mb_last": last["rss_mb"],
            "open_files_first": first["open_files"],
            "open_files_last": last["open_files"],
            "threads_first": first["threads"],
            "threads_last": last["threads"],
        }
    result["processes"] = per_process
    return result


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3000, help="epochs to run (default 3000)")
    parser.add_argument("--warmup", type=int, default=300, help="epochs before the first sample (default 300)")
    parser.add_argument("--every", type=int, default=100, help="epochs between samples (default 100)")
    parser.add_argument("--checkpoint", action="store_true", help="commit a checkpoint every epoch (keep_last=3)")
    parser.add_argument(
        "--in-memory", action="store_true", help="commit every epoch in cluster memory (tier 0), every 10th durably"
    )
    parser.add_argument("--nodes", type=int, default=0, help="run the N-node job of scale_nodes.py instead")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.epochs < args.warmup + 2 * args.every:
        parser.error("--epochs must leave at least two samples after --warmup")
    result = soak(args.epochs, args.warmup, args.every, args.checkpoint, args.in_memory, args.nodes)
    header = f"{'process':<12} {'MB/1000 epochs':>15} {'RSS first→last MB':>20} {'files':>8} {'threads':>9}"
    lines = [header]
    for name, row in result["processes"].items():
        lines.append(
            f"{name:<12} {row['rss_growth_mb_per_1000_epochs']:>15.2f} "
            f"{row['rss_mb_first']:>9.1f} → {row['rss_mb_last']:<8.1f} "
            f"{row['open_files_first']:>3}→{row['open_files_last']:<3} "
            f"{row['threads_first']:>4}→{row['threads_last']:<4}"
        )
    lines.append(f"target: <= 2 MB per 1000 epochs; history: {result['history_records']} records")
    print("\n".join(lines), file=sys.stderr)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
