"""SPEC §6 async save: the per-epoch stall from checkpointing, async vs synchronous, same run, same disk.

The job keeps ``--mib`` MiB of float32 per node on two nodes and does a little work per epoch
(long enough for a background write to finish, as in real training). The stall of an epoch is
the time the runner spends in checkpointing after the epoch group ran
(``EpochRecord.checkpoint_seconds``). Prints a table and a JSON line.

    python benchmarks/async_stall.py [--mib 256] [--epochs 6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import daskjobs as dj


def define_job(mib: int, work_seconds: float) -> dj.Job:
    elements = mib * (1 << 20) // 4
    with dj.Cluster(), dj.Job(name="async-stall") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(
                        lambda ws: ws.__setitem__(
                            "weights", np.random.default_rng(0).standard_normal(elements, dtype=np.float32)
                        )
                    )

                def train(ws):
                    deadline = time.perf_counter() + work_seconds
                    ws["weights"] = ws["weights"] * np.float32(0.999)
                    while time.perf_counter() < deadline:
                        time.sleep(0.005)

                dj.Task(train)
    return job


def run(directory: Path, *, mib: int, epochs: int, work_seconds: float, async_save: bool) -> list[float]:
    prefix = directory / ("async" if async_save else "sync")
    shutil.rmtree(prefix, ignore_errors=True)
    manager = dj.MultiNodeCheckpointManager(str(prefix), async_save=async_save)
    runner = dj.JobRunner(define_job(mib, work_seconds), manager, max_epochs=epochs, progress=False)
    runner.train(None)
    shutil.rmtree(prefix, ignore_errors=True)
    return [record.checkpoint_seconds for record in runner.history[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of float32 per node (two nodes)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--work", type=float, default=None, help="seconds of work per epoch (default: 1.5x a save)")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="daskjobs-bench-"))
    sync = run(directory, mib=args.mib, epochs=2, work_seconds=0.0, async_save=False)
    work = args.work if args.work is not None else 1.5 * max(sync)
    sync = run(directory, mib=args.mib, epochs=args.epochs, work_seconds=work, async_save=False)
    stall = run(directory, mib=args.mib, epochs=args.epochs, work_seconds=work, async_save=True)
    result = {
        "workspace_mib": 2 * args.mib,
        "work_seconds_per_epoch": round(work, 3),
        "sync_save_median_s": round(statistics.median(sync), 4),
        "async_stall_median_s": round(statistics.median(stall), 4),
        "ratio": round(statistics.median(stall) / statistics.median(sync), 4),
        "target": "<= 0.10",
    }
    print(f"{'workspace':>12} {'sync save':>12} {'async stall':>12} {'ratio':>8}")
    print(
        f"{result['workspace_mib']:>9} MiB {result['sync_save_median_s']:>10.3f} s "
        f"{result['async_stall_median_s']:>10.3f} s {result['ratio']:>8.3f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
