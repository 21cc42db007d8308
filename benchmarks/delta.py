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

Run::

    python benchmarks/delta.py [--quick] [--runs 5] [--size-mib 1024] [--table-mib 256] [--dir DIR]

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB workspace, 64 MiB table")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--table-mib", type=int, default=256)
    parser.add_argument("--rows-pct", type=float, nargs="+", default=[1.0, 0.1, 0.01])
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed afterwards)")
    args = parser.parse_args(argv)
    runs = max(5, args.runs)
    size, table = (256, 64) if args.quick else (args.size_mib, args.table_mib)
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="daskjobs-delta-"))
        one = part_one(root, runs, size)
        two = part_two(root, table, args.rows_pct)
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
    print(json.dumps({"runs": runs, "workspace_mib": size, "delta": one, "sparse": two, "rows_pct": args.rows_pct}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
