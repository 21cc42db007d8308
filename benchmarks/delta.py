"""Delta checkpoints: bytes written and time of a delta save against a full save, in the same run (SPEC §6).

Part 1 (the target row): a workspace of ``--size-mib`` (default 1024) float32 on one node, of
which 5% (the "model") changes every epoch beside frozen layers, data shards and a lookup table.
Each run saves a new epoch twice, interleaved: fully (no previous entry) and as a delta against
the previous committed epoch; both with fsync. Reported: the fraction of bytes the delta wrote
and the ratio of median times (targets: <= 6% of the bytes, <= 15% of the time), and that the
delta epoch verifies on its own after the epoch it reused from was deleted.

Part 2 (report only): an embedding table of ``--table-mib`` (default 256) float32 rows of 64
values, of which ``--rows-pct`` (default 1%, 0.1% and 0.01%) rows scattered at random change per
epoch; the fraction of the table a delta save writes for chunks of 64 MiB, 4 MiB, 1 MiB, 256 KiB.

Part 3 (what ``full_every`` costs): the workspace of part 1 saved for ``--cycles`` (default 2) x
``--full-every`` (default 10) epochs in a row, as a manager with that ``full_every`` saves them
(every epoch divisible by it in full, sharing no file with an earlier one; the others as deltas),
and as pure delta (``full_every=0``), the two interleaved epoch by epoch, each keeping the two
newest epochs (retention). Reported per variant: the mean bytes written and the mean and median
time per epoch (fsync on), and the time of a full epoch; between full epochs the saves are the
deltas of part 1.

Run::

    python benchmarks/delta.py [--quick] [--runs 5] [--size-mib 1024] [--table-mib 256] [--dir DIR]
                               [--full-every 10] [--cycles 2]

``--quick`` uses 256 MiB and a 64 MiB table. The last line printed is the JSON of all results.
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

import numpy as np

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.checkpoint._protocol.retention import writes_in_full

MIB = 1 << 20


def workspace(size_mib: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """5% model, the rest frozen layers, data shards and a lookup table (float32)."""
    floats = size_mib * MIB // 4
    model = floats // 20
    rest = (floats - model) // 6
    blobs = {"model": rng.standard_normal(model, dtype=np.float32)}
    for i in range(2):
        blobs[f"frozen{i}"] = rng.standard_normal(rest, dtype=np.float32)
        blobs[f"shard{i}"] = rng.standard_normal(rest, dtype=np.float32)
        blobs[f"table{i}"] = rng.standard_normal((rest // 64, 64), dtype=np.float32)
    return blobs


def commit(store: CheckpointStore, epoch: int, entry: dict) -> None:
    store.commit(make_commit_record("delta", epoch, {"n": entry}, {}, {}))


def part_one(root: str, runs: int, size_mib: int) -> dict[str, object]:
    rng = np.random.default_rng(0)
    blobs = workspace(size_mib, rng)
    total = sum(a.nbytes for a in blobs.values())
    full_store = CheckpointStore(os.path.join(root, "full"))
    delta_store = CheckpointStore(os.path.join(root, "delta"))
    previous = delta_store.write_node("n", 0, blobs, save_id="e0")
    commit(delta_store, 0, previous)
    times: dict[str, list[float]] = {"full": [], "delta": []}
    written: list[float] = []
    for run in range(1, runs + 1):
        blobs["model"] += 1  # the model changes every epoch
        order = ["full", "delta"] if run % 2 else ["delta", "full"]
        for kind in order:
            os.sync()
            started = time.perf_counter()
            if kind == "full":
                full_store.write_node("n", run, blobs, save_id=f"f{run}")
            else:
                entry = delta_store.write_node("n", run, blobs, save_id=f"d{run}", previous=previous)
            times[kind].append(time.perf_counter() - started)
        commit(delta_store, run, entry)
        written.append(entry["bytes_written"] / total)
        delta_store.delete_epoch(run - 1, ["n"])  # retention: the epoch reused from is gone
        shutil.rmtree(os.path.join(full_store.url, f"n.{run}"))
        previous = entry
    checked = delta_store.read_node("n", runs, delta_store.read_commit(runs)["manifests"]["n"])
    assert all(np.array_equal(checked[name], blobs[name]) for name in blobs)
    full, delta = statistics.median(times["full"]), statistics.median(times["delta"])
    return {
        "bytes": total,
        "written_fraction": statistics.median(written),
        "full_s": full,
        "delta_s": delta,
        "time_ratio": delta / full,
        "seconds": times,
        "verified_alone": True,
    }


def part_two(root: str, table_mib: int, percents: list[float], epochs: int = 3) -> list[dict[str, object]]:
    rng = np.random.default_rng(1)
    rows = table_mib * MIB // (64 * 4)
    table = rng.standard_normal((rows, 64), dtype=np.float32)
    results = []
    for rows_pct, chunk_kib in [(p, c) for p in percents for c in (64 * 1024, 4 * 1024, 1024, 256)]:
        _chunks.CHUNK_BYTES = chunk_kib * 1024
        store = CheckpointStore(os.path.join(root, f"table{chunk_kib}"), fsync=False)
        work = table.copy()
        previous = store.write_node("n", 0, {"table": work}, save_id="e0")
        fractions = []
        for epoch in range(1, epochs + 1):
            touched = rng.choice(rows, size=max(1, int(rows * rows_pct / 100)), replace=False)
            work[touched] += 0.01
            previous = store.write_node("n", epoch, {"table": work}, save_id=f"e{epoch}", previous=previous)
            fractions.append(previous["bytes_written"] / work.nbytes)
        shutil.rmtree(store.url)
        results.append({"rows_pct": rows_pct, "chunk_kib": chunk_kib, "written_fraction": statistics.median(fractions)})
    _chunks.CHUNK_BYTES = 64 * MIB
    return results


def part_three(root: str, size_mib: int, full_every: int, cycles: int) -> dict[str, object]:
    """Epochs 1 .. ``cycles * full_every`` (epoch 0 full in both), saved with ``full_every`` and as pure
    delta, interleaved; bytes written and seconds per epoch of each."""
    rng = np.random.default_rng(2)
    blobs = workspace(size_mib, rng)
    total = sum(a.nbytes for a in blobs.values())
    variants = {"with_full_every": full_every, "pure_delta": 0}
    stores = {name: CheckpointStore(os.path.join(root, f"cycle-{name}")) for name in variants}
    previous = {}
    for name, store in stores.items():
        previous[name] = store.write_node("n", 0, blobs, save_id="e0")
        commit(store, 0, previous[name])
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    written: dict[str, list[int]] = {name: [] for name in variants}
    full_seconds: list[float] = []
    for epoch in range(1, cycles * full_every + 1):
        blobs["model"] += 1
        order = list(variants) if epoch % 2 else list(reversed(variants))
        for name in order:
            store, full = stores[name], writes_in_full(epoch, variants[name], None)
            os.sync()
            started = time.perf_counter()
            entry = store.write_node("n", epoch, blobs, save_id=f"e{epoch}", previous=None if full else previous[name])
            elapsed = time.perf_counter() - started
            commit(store, epoch, entry)
            if epoch >= 2:
                store.delete_epoch(epoch - 2, ["n"])  # keep_last=2
            seconds[name].append(elapsed)
            written[name].append(entry["bytes_written"])
            if full and name == "with_full_every":
                full_seconds.append(elapsed)
            previous[name] = entry
    result: dict[str, object] = {"epochs": cycles * full_every, "full_every": full_every, "bytes": total}
    for name in variants:
        result[name] = {
            "mean_written_fraction": statistics.mean(written[name]) / total,
            "mean_s": statistics.mean(seconds[name]),
            "median_s": statistics.median(seconds[name]),
            "seconds": seconds[name],
        }
    result["full_epoch_s"] = statistics.median(full_seconds)
    result["mean_time_ratio"] = result["with_full_every"]["mean_s"] / result["pure_delta"]["mean_s"]  # type: ignore[index]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB workspace, 64 MiB table")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--table-mib", type=int, default=256)
    parser.add_argument("--rows-pct", type=float, nargs="+", default=[1.0, 0.1, 0.01])
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed afterwards)")
    parser.add_argument("--full-every", type=int, default=10, help="part 3: every Nth epoch is written in full")
    parser.add_argument("--cycles", type=int, default=2, help="part 3: how many times --full-every epochs run")
    args = parser.parse_args(argv)
    runs = max(5, args.runs)
    size, table = (256, 64) if args.quick else (args.size_mib, args.table_mib)
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="daskjobs-delta-"))
        one = part_one(root, runs, size)
        two = part_two(root, table, args.rows_pct)
        three = part_three(root, size, args.full_every, args.cycles)
    print(f"delta save, {size} MiB workspace, 5% changing (median of {runs} interleaved runs, fsync on)")
    print(f"  bytes written: {one['written_fraction']:.2%} of a full save (target <= 6%)")
    print(
        f"  time: {one['delta_s']:.3f} s vs full {one['full_s']:.3f} s = {one['time_ratio']:.1%} "
        "(target <= 15%); the last delta epoch verified alone after its source was deleted"
    )
    print(f"sparse updates of a {table} MiB table (64 float32 per row), rows changed at random per epoch")
    for row in two:
        print(
            f"  {row['rows_pct']:5.2f}% of rows, chunks of {row['chunk_kib']:6d} KiB: "
            f"{row['written_fraction']:.1%} of the table written"
        )
    every = three["full_every"]
    print(f"full_every={every} against pure delta, {three['epochs']} epochs in a row, keeping the newest two")
    for name, label in (("with_full_every", f"full_every={every}"), ("pure_delta", "pure delta")):
        row = three[name]
        print(
            f"  {label:<14} {row['mean_written_fraction']:.2%} of the workspace written per epoch, "
            f"{row['mean_s']:.3f} s per epoch on average (median {row['median_s']:.3f} s)"
        )
    print(
        f"  a full epoch takes {three['full_epoch_s']:.3f} s; full_every={every} costs "
        f"{three['mean_time_ratio']:.2f}x the time of pure delta per epoch on average"
    )
    print(
        json.dumps(
            {
                "runs": runs,
                "workspace_mib": size,
                "delta": one,
                "sparse": two,
                "rows_pct": args.rows_pct,
                "full_every": three,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
