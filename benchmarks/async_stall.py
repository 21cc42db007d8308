"""SPEC §6 async save: the per-epoch stall from checkpointing, async vs synchronous, same run, same disk.

The job keeps ``--mib`` MiB of float32 per node on two nodes (512 MiB in all by default) and
does a little work per epoch (3x a synchronous save by default: long enough for a background
write to finish also under load, as in real training; a shorter epoch measures waiting for the
previous save, not the snapshot). Everything is measured from the driver's side: the wall time between the ends of
consecutive epochs (``on_epoch`` callbacks). The kinds of run alternate — no checkpoint,
synchronous save, asynchronous save (per snapshot kind) — and

* the synchronous save time is (sync epoch) - (epoch without checkpoint),
* the stall is (async epoch) - (epoch without checkpoint),

medians over epochs, then over ``--runs`` rounds. ``--load N`` runs N busy processes meanwhile
(the "under load" figure). ``--snapshot`` picks how the asynchronous save takes its snapshot
(``fork``: a copy-on-write child process; ``copy``: a copy of every array; ``auto``: the
manager's default); several, comma-separated, are interleaved in one run. ``--update replace``
(default) gives the weights a new array every epoch; ``--update inplace`` changes them in place
(``*=``), so the parent pays a copy-on-write page fault for every page a forked writer still
holds. Prints a table and a JSON line per snapshot kind.

    python benchmarks/async_stall.py [--mib 256] [--epochs 6] [--runs 3] [--load 0]
        [--snapshot fork,copy] [--update replace|inplace] [--dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import daskjobs as dj


def define_job(mib: int, work_seconds: float, inplace: bool = False) -> dj.Job:
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
                    if inplace:
                        ws["weights"] *= np.float32(0.999)
                    else:
                        ws["weights"] = ws["weights"] * np.float32(0.999)
                    while time.perf_counter() < deadline:
                        time.sleep(0.005)

                dj.Task(train)
    return job


def run(
    directory: Path,
    *,
    mib: int,
    epochs: int,
    work_seconds: float,
    mode: str,
    snapshot: str = "auto",
    inplace: bool = False,
) -> float:
    """Median driver-visible seconds per epoch (after the first) of one run; ``mode`` is
    ``"none"``, ``"sync"`` or ``"async"``."""
    prefix = directory / mode
    shutil.rmtree(prefix, ignore_errors=True)
    manager = None
    if mode != "none":
        manager = dj.MultiNodeCheckpointManager(str(prefix), async_save=mode == "async", async_snapshot=snapshot)
    ends: list[float] = []
    runner = dj.JobRunner(
        define_job(mib, work_seconds, inplace),
        manager,
        max_epochs=epochs,
        progress=False,
        on_epoch=lambda record: ends.append(time.perf_counter()),
    )
    runner.train(None)
    shutil.rmtree(prefix, ignore_errors=True)
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def _busy(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of float32 per node (two nodes)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3, help="rounds of every kind, interleaved")
    parser.add_argument(
        "--work",
        type=float,
        default=None,
        help="seconds of work per epoch (default: 3x a save, so that the "
        "background write ends within the epoch also under load)",
    )
    parser.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument(
        "--snapshot", default="auto", help="async snapshot kinds, comma-separated (auto, fork, copy), interleaved"
    )
    parser.add_argument("--update", choices=("replace", "inplace"), default="replace", help="how epochs change weights")
    args = parser.parse_args()
    snapshots = args.snapshot.split(",")
    if not set(snapshots) <= {"auto", "fork", "copy"}:
        parser.error(f"--snapshot takes auto, fork and copy, not {args.snapshot!r}")
    directory = Path(args.dir or tempfile.mkdtemp(prefix="daskjobs-bench-"))
    inplace = args.update == "inplace"
    probe = run(directory, mib=args.mib, epochs=3, work_seconds=0.0, mode="sync", inplace=inplace)
    work = args.work if args.work is not None else 3.0 * probe
    busy = [multiprocessing.Process(target=_busy, args=(3600,), daemon=True) for _ in range(args.load)]
    for process in busy:
        process.start()
    kinds = [("none", "auto"), ("sync", "auto"), *(("async", snapshot) for snapshot in snapshots)]
    times: dict[tuple[str, str], list[float]] = {kind: [] for kind in kinds}
    try:
        for _ in range(args.runs):
            for mode, snapshot in kinds:
                seconds = run(
                    directory,
                    mib=args.mib,
                    epochs=args.epochs,
                    work_seconds=work,
                    mode=mode,
                    snapshot=snapshot,
                    inplace=inplace,
                )
                times[mode, snapshot].append(seconds)
    finally:
        for process in busy:
            process.kill()
    base = statistics.median(times["none", "auto"])
    sync = statistics.median(times["sync", "auto"]) - base
    print(f"{'workspace':>12} {'snapshot':>9} {'update':>8} {'sync save':>12} {'async stall':>12} {'ratio':>8}")
    for snapshot in snapshots:
        stall = statistics.median(times["async", snapshot]) - base
        result = {
            "workspace_mib": 2 * args.mib,
            "work_seconds_per_epoch": round(work, 3),
            "load_processes": args.load,
            "snapshot": snapshot,
            "update": args.update,
            "epoch_without_checkpoint_s": round(base, 4),
            "sync_save_s": round(sync, 4),
            "async_stall_s": round(stall, 4),
            "ratio": round(stall / sync, 4),
            "target": "<= 0.10",
        }
        print(
            f"{result['workspace_mib']:>9} MiB {snapshot:>9} {args.update:>8} "
            f"{sync:>10.3f} s {stall:>10.3f} s {result['ratio']:>8.3f}"
        )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
