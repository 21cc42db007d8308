"""Checkpoint I/O against numpy baselines on the same disk (SPEC §6: bulk and small-blob targets).

Measures, over ``--runs`` runs with the order of baseline and daskjobs alternating, and reports
the ratio of the medians (and of the best runs, less disturbed by other load on the machine):

* small blobs: 100 blobs of 4 KiB on one node, ``CheckpointStore.write_node`` against
  ``np.savez`` of the same blobs, both fsynced (also reported without fsync); target time
  ratio <= 5. Two untimed warm-up rounds come first: file creation is slow while the
  filesystem's metadata blocks are not cached (e.g. right after dropping caches);
* bulk save: 1 GiB of float32 over 2 nodes (4 arrays of 128 MiB each) with ``write_node``
  (fsync included) against ``np.save`` of the same arrays to ``.npy`` files, each fsynced;
  target ratio of throughputs >= 0.85;
* bulk restore: ``read_node`` (verifying every checksum) against ``np.load``, both reading what
  was just written from the page cache (each read once, untimed, first); with ``--drop-caches``
  (root) instead after dropping the page cache, then again warm. Target ratio >= 0.85.

Run::

    python benchmarks/checkpoint_io.py [--dir DIR] [--runs 5] [--small-runs 21] [--drop-caches] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._files import fsync_path

MIB = 1 << 20


def _drop_caches() -> bool:
    """Write back and drop the page cache (needs root on Linux); whether it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
    except OSError:
        return False
    return True


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _np_save(folder: str, arrays: dict[str, np.ndarray]) -> None:
    os.makedirs(folder)
    for name, array in arrays.items():
        path = os.path.join(folder, f"{name}.npy")
        with open(path, "wb") as file:
            np.save(file, array)
            file.flush()
            os.fsync(file.fileno())
    fsync_path(folder)


def _np_load(folder: str, names: list[str]) -> dict[str, np.ndarray]:
    return {name: np.load(os.path.join(folder, f"{name}.npy")) for name in names}


def _np_savez(path: str, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    with open(path, "wb") as file:
        np.savez(file, **arrays)
        if fsync:
            file.flush()
            os.fsync(file.fileno())


def _settle(*paths: str) -> None:
    """Remove earlier outputs (outside the timings) and let the disk catch up."""
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    os.sync()
    time.sleep(0.5)


def bulk(root: str, runs: int, total_mib: int, drop_caches: bool) -> dict[str, object]:
    """Bulk save and restore: 2 nodes x 4 float32 arrays, ``total_mib`` in all."""
    rng = np.random.default_rng(0)
    per_array = total_mib * MIB // 8 // 4
    nodes = {
        node: {f"w{i}": rng.standard_normal(per_array, dtype=np.float32) for i in range(4)}
        for node in ("ps", "trainer")
    }
    flat = {f"{node}_{name}": array for node, arrays in nodes.items() for name, array in arrays.items()}
    nbytes = sum(a.nbytes for a in flat.values())
    store = CheckpointStore(os.path.join(root, "ckpt"))
    labels = ["np_save", "dj_save", "np_load", "dj_load"] + (["np_load_cold", "dj_load_cold"] if drop_caches else [])
    times: dict[str, list[float]] = {label: [] for label in labels}
    dropped = True
    for run in range(runs):
        baseline = os.path.join(root, f"npy{run}")
        entries: dict[str, dict] = {}

        def save_ours(run: int = run, entries: dict = entries) -> None:
            for node, arrays in nodes.items():
                entries[node] = store.write_node(node, run, arrays, save_id=f"bench{run}")

        def load_ours(run: int = run, entries: dict = entries) -> None:
            for node in nodes:
                store.read_node(node, run, entries[node])

        swap = run % 2 == 1
        saves = [("np_save", lambda b=baseline: _np_save(b, flat)), ("dj_save", save_ours)]
        for label, action in saves[::-1] if swap else saves:
            _settle()
            times[label].append(_timed(action))
        loads = [("np_load", lambda b=baseline: _np_load(b, list(flat))), ("dj_load", load_ours)]
        for label, action in loads[::-1] if swap else loads:
            if drop_caches:
                dropped = _drop_caches() and dropped
                times[f"{label}_cold"].append(_timed(action))
            else:
                action()  # the page cache may have dropped some of it since the save: read it in first
            times[label].append(_timed(action))
        check = store.read_node("ps", run, entries["ps"])
        assert all(np.array_equal(check[name], nodes["ps"][name]) for name in check)
        _settle(baseline, store.db_name("ps", run), store.db_name("trainer", run))
    result: dict[str, object] = {"bytes": nbytes, "runs": runs, "seconds": times}
    if drop_caches:
        result["page_cache_dropped"] = dropped
    return result


def small(root: str, runs: int) -> dict[str, object]:
    """100 blobs of 4 KiB on one node: ``write_node`` against ``np.savez`` (after two untimed warm-up rounds).

    Every save goes to a new place and nothing is deleted until the end: on ext4, creating files
    right after deleting many others is slower (recently freed inodes are skipped), which would
    measure deletion churn rather than saving.
    """
    rng = np.random.default_rng(1)
    blobs = {f"b{i:03d}": rng.standard_normal(1024, dtype=np.float32) for i in range(100)}
    synced = CheckpointStore(os.path.join(root, "small"))
    unsynced = CheckpointStore(os.path.join(root, "small"), fsync=False)
    times: dict[str, list[float]] = {"savez_fsync": [], "dj_fsync": [], "savez": [], "dj_nofsync": []}
    for run in range(-2, runs):
        archive = os.path.join(root, f"small{run}.npz")
        order: list[tuple[str, Callable[[], object]]] = [
            ("savez_fsync", lambda a=archive: _np_savez(a, blobs, True)),
            ("dj_fsync", lambda r=run: synced.write_node("n", 2 * r + 4, blobs, save_id="s")),
            ("savez", lambda a=archive: _np_savez(a, blobs, False)),
            ("dj_nofsync", lambda r=run: unsynced.write_node("n", 2 * r + 5, blobs, save_id="s")),
        ]
        for label, action in order if run % 2 == 0 else order[::-1]:
            seconds = _timed(action)
            if run >= 0:
                times[label].append(seconds)
        _settle()
    _settle(os.path.join(root, "small"), *(os.path.join(root, f"small{run}.npz") for run in range(-2, runs)))
    return {"runs": runs, "seconds": times}


ROWS = [  # label, part, baseline, daskjobs, ratio of ("throughput" | "time"), target
    ("bulk save 1 GiB, 2 nodes, fsync", "bulk", "np_save", "dj_save", "throughput", ">= 0.85"),
    ("bulk restore, verified, page cache", "bulk", "np_load", "dj_load", "throughput", ">= 0.85"),
    ("bulk restore, verified, caches dropped", "bulk", "np_load_cold", "dj_load_cold", "throughput", ">= 0.85"),
    ("100 x 4 KiB save, fsync", "small", "savez_fsync", "dj_fsync", "time", "<= 5"),
    ("100 x 4 KiB save, no fsync", "small", "savez", "dj_nofsync", "time", "<= 5"),
]


def summarise(results: dict[str, dict]) -> list[dict[str, object]]:
    """Median (and best) seconds of each comparison and their ratio as the target states it."""
    rows = []
    for label, part, baseline, ours, kind, target in ROWS:
        times = results[part]["seconds"]
        if baseline not in times:
            continue
        row: dict[str, object] = {"benchmark": label, "target": target}
        for stat, pick in (("median", statistics.median), ("best", min)):
            base, mine = pick(times[baseline]), pick(times[ours])
            row[f"baseline_{stat}_s"], row[f"daskjobs_{stat}_s"] = base, mine
            row[f"ratio_{stat}"] = base / mine if kind == "throughput" else mine / base
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run both benchmarks, print a table and the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write (default: a new temporary directory, removed afterwards)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--small-runs", type=int, default=21)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="also time restores after dropping the page cache (root only; slows the whole "
        "machine's file metadata for a while, so the small-blob benchmark runs first)",
    )
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="daskjobs-bench-"))
        os.makedirs(root, exist_ok=True)
        results = {
            "small": small(root, args.small_runs),
            "bulk": bulk(root, args.runs, args.size_mib, args.drop_caches),
        }
    results["summary"] = summarise(results)
    print(
        f"{'benchmark (seconds, median of runs)':40s} {'baseline':>9s} {'daskjobs':>9s} {'ratio':>6s} "
        f"{'best-run ratio':>14s} {'target':>8s}"
    )
    for row in results["summary"]:
        print(
            f"{row['benchmark']:40s} {row['baseline_median_s']:9.4f} {row['daskjobs_median_s']:9.4f} "
            f"{row['ratio_median']:6.2f} {row['ratio_best']:14.2f} {row['target']:>8s}"
        )
    if args.drop_caches and not results["bulk"]["page_cache_dropped"]:
        print("note: the page cache could not be dropped (not root?): 'cold' reads were warm", file=sys.stderr)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
