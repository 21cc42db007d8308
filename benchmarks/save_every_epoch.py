"""SPEC §6 checkpointing every epoch: a tiny 2-node job on a local process cluster, with a
checkpoint committed every epoch vs the same job without checkpoints, same cluster, same run.

The cost of an epoch is what the driver sees: the time between consecutive ``on_epoch``
callbacks (each once its epoch is committed), so the save, the commit and retention all count.
The first interval (start-up) and the last two (the final flush commits the last epochs back to
back) are left out. The script also reports the whole ``train()`` (start-up, the lock, epoch 0's
save, the final commits included), which is what a run of few epochs costs.
Runs alternate (plain, checkpointed, plain, …), each checkpointed run on a fresh prefix; each
run's figure is the median over its epochs, and the result is the median over runs. Prints a
table and a JSON line.

    python benchmarks/save_every_epoch.py [--runs 5] [--epochs 40] [--keep-last 3] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import daskjobs as dj


def define_job() -> dj.Job:
    """Two nodes, two small tasks each (a few KiB of state per node)."""
    with dj.Cluster(), dj.Job(name="save-every-epoch") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(w=np.zeros(512), step=np.int64(0)))
                dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1.0), name="update")
                dj.Task(lambda ws: ws.log("loss", 1.0), name="metric")
    return job


def epoch_seconds(session: dj.Session, prefix: Path | None, epochs: int, keep_last: int | None) -> tuple[float, float]:
    """Median driver-visible seconds per epoch of one run, and the seconds of the whole ``train()``."""
    ends: list[float] = []
    manager = None if prefix is None else dj.MultiNodeCheckpointManager(str(prefix), keep_last=keep_last)
    runner = dj.JobRunner(
        define_job(), manager, max_epochs=epochs, progress=False, on_epoch=lambda r: ends.append(time.perf_counter())
    )
    started = time.perf_counter()
    runner.train(session)
    whole = time.perf_counter() - started
    return statistics.median(b - a for a, b in itertools.pairwise(ends[1:-2])), whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each kind, interleaved")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--keep-last", type=int, default=3, help="retention of the checkpointed runs (0: keep all)")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="3 runs of 15 epochs")
    args = parser.parse_args()
    runs, epochs = (3, 15) if args.quick else (args.runs, args.epochs)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="daskjobs-bench-"))
    keep_last = args.keep_last or None
    plain, saved = [], []
    with dj.node_cluster(["a", "b"], nthreads=2) as cluster, dj.DaskSession(cluster) as session:
        epoch_seconds(session, None, 5, None)  # warm-up
        for run in range(runs):  # a fresh prefix per run, all deleted at the end: deleting the last
            # run's files while measuring would add their discards to this run's fsyncs
            plain.append(epoch_seconds(session, None, epochs, None))
            saved.append(epoch_seconds(session, directory / f"ckpt-{run}", epochs, keep_last))

    def median_ms(runs: list[tuple[float, float]], which: int) -> float:
        return round(1e3 * statistics.median(r[which] for r in runs), 3)

    result = {
        "runs": runs,
        "epochs_per_run": epochs,
        "keep_last": keep_last,
        "plain_epoch_median_ms": median_ms(plain, 0),
        "checkpointed_epoch_median_ms": median_ms(saved, 0),
        "ratio": round(median_ms(saved, 0) / median_ms(plain, 0), 3),
        "plain_run_median_ms": median_ms(plain, 1),
        "checkpointed_run_median_ms": median_ms(saved, 1),
        "run_ratio": round(median_ms(saved, 1) / median_ms(plain, 1), 3),
        "target": "<= 1.5",
    }
    print(f"{'':>28} {'no checkpoint':>14} {'every epoch':>14} {'ratio':>8}")
    for label, key in (("per epoch (steady state)", "epoch"), (f"whole train(), {epochs} epochs", "run")):
        plain_ms, saved_ms = result[f"plain_{key}_median_ms"], result[f"checkpointed_{key}_median_ms"]
        print(f"{label:>28} {plain_ms:>11.2f} ms {saved_ms:>11.2f} ms {saved_ms / plain_ms:>8.3f}")
    print(json.dumps(result))
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
