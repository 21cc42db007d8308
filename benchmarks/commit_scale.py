"""The driver's commit path at 1000 nodes x 100 blobs, fed synthetic node entries (SPEC §6 Scale a).

Per epoch, what the driver does to commit an epoch saved inside its graph, without a cluster: the
save hooks for every node (the commit pipeline's writer: save id, delta references, one small hook object
per node), then ``CommitPipeline.accept`` of what every node's hook returned (synthetic summaries: each
names a manifest of ``--blobs`` blobs, as a node's save returns it) and the commit itself (commit
record built, validated, sealed, written with fsync while holding the writer lock, retention with
``keep_last=3``, commit folder synced). Nodes never run: the commit path alone.

Measured for ``--nodes`` (default 100 and 1000) interleaved, ``--epochs`` epochs each (median), on a
local disk. Targets: commit <= 50 ms at 1000 nodes, record <= 256 KiB, 1000 nodes <= 12x 100 nodes.
For comparison, the same commit with a record of format 3 (every node's whole entry inside the
record, as daskjobs wrote it before manifests): its size and commit time.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/commit_scale.py [--nodes 100 1000] [--blobs 100] [--epochs 15]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
from _report import write_json

import daskjobs as dj
from daskjobs.checkpoint._format.manifests import group_document, reference
from daskjobs.checkpoint._format.records import seal
from daskjobs.checkpoint._managers.saving import SaveMode, SavePlan


def synthetic_entry(node: str, epoch: int, save_id: str, blobs: int, rng: np.random.Generator) -> dict[str, Any]:
    """A node's whole entry: ``blobs`` float32 arrays of 1024 values, one chunk each, random digests."""
    metas = {
        f"layer_{i:03d}": {
            "kind": "array",
            "dtype": "<f4",
            "shape": [1024],
            "nbytes": 4096,
            "chunks": [1024],
            "codec": None,
            "hashes": [rng.bytes(16).hex()],
        }
        for i in range(blobs)
    }
    total = 4096 * blobs
    return {
        "node": node,
        "epoch": epoch,
        "save_id": save_id,
        "blobs": metas,
        "bytes": total,
        "bytes_written": total // 10,
        "bytes_reused": total - total // 10,
        "seconds": float(rng.uniform(0.001, 0.01)),
    }


class Bench:
    """One prefix, manager and saver of ``nodes`` nodes, holding the writer lock."""

    def __init__(self, root: str, nodes: int, blobs: int, legacy: bool) -> None:
        self.names = [f"node-{i:04d}" for i in range(nodes)]
        self.blobs, self.legacy = blobs, legacy
        prefix = os.path.join(root, f"{'v3' if legacy else 'v4'}-{nodes}")
        self.manager = dj.MultiNodeCheckpointManager(prefix, keep_last=3)
        self.manager.set_params(self.names, job_name="scale")
        self.lock = contextlib.ExitStack()
        self.pipeline = self.lock.enter_context(self.manager.writing("scale"))
        self.rng = np.random.default_rng(nodes)
        self.epoch = 0
        self.record_bytes = 0

    def finished(self, save_id: str) -> dict[str, Any]:
        """What every node's save hook returns: a summary naming its manifest (format 3: the whole entry)."""
        out = {}
        for node in self.names:
            entry = synthetic_entry(node, self.epoch, save_id, self.blobs, self.rng)
            if not self.legacy:
                entry = {
                    **{k: v for k, v in entry.items() if k != "blobs"},
                    "manifest": reference(group_document(entry)),
                }
            out[node] = {"entry": entry, "later": False, "flushed": None}
        return out

    def epoch_once(self) -> tuple[float, float]:
        """One epoch's hooks and commit; returns their seconds."""
        writer = self.pipeline.writer
        started = time.perf_counter()
        hooks = writer.hooks(self.epoch, self.names)
        hooks_seconds = time.perf_counter() - started
        finished = self.finished(writer.ledger.ids[self.epoch])
        started = time.perf_counter()
        if self.legacy:
            self.commit_legacy(finished)
        else:
            plan = SavePlan(self.epoch, SaveMode.IN_GRAPH, hooks)
            self.pipeline.accept(None, plan, finished, {"done": False}, {"loss": 0.5})  # type: ignore[arg-type]
            self.pipeline.commit_ready()
        commit = time.perf_counter() - started
        assert self.epoch in self.manager.store.committed_epochs()
        self.record_bytes = os.path.getsize(self.manager.store.commit_path(self.epoch))
        writer.tidy()  # retention's deletions, in the background (off the commit path)
        self.epoch += 1
        return hooks_seconds, commit

    def commit_legacy(self, finished: dict[str, Any]) -> None:
        """The same commit with a format-3 record (whole entries), as daskjobs committed before manifests."""
        record = {
            "format": "daskjobs-checkpoint",
            "format_version": 3,
            "daskjobs_version": "0.1.0",
            "created": "2026-01-01T00:00:00+00:00",
            "job": "scale",
            "epoch": self.epoch,
            "nodes": sorted(finished),
            "node_entries": {node: result["entry"] for node, result in finished.items()},
            "stop_values": {"done": False},
            "timings": {"save_seconds": 0.0},
            "metrics": {"loss": 0.5},
        }
        store = self.manager.store
        store._check_held()
        store._files().replace(store._commit_file(self.epoch), seal(record), sync_folder=True)
        self.pipeline.ledger.forget(self.epoch)

    def close(self) -> None:
        self.lock.close()  # the final deletions, then the lock released


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--blobs", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=15, help="epochs per variant (median; at least 5)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    epochs = max(5, args.epochs)
    with tempfile.TemporaryDirectory(prefix="daskjobs-commit-", dir=args.dir) as root:
        benches = {
            (nodes, legacy): Bench(root, nodes, args.blobs, legacy) for nodes in args.nodes for legacy in (False, True)
        }
        for bench in benches.values():
            bench.epoch_once()  # warm up
        times: dict[tuple[int, bool], list[tuple[float, float]]] = {key: [] for key in benches}
        keys = list(benches)
        for run in range(epochs):
            for key in keys if run % 2 == 0 else keys[::-1]:
                times[key].append(benches[key].epoch_once())
        sizes = {key: bench.record_bytes for key, bench in benches.items()}
        for bench in benches.values():
            bench.close()
    rows = []
    for (nodes, legacy), values in times.items():
        rows.append(
            {
                "nodes": nodes,
                "blobs": args.blobs,
                "record_format": 3 if legacy else 4,
                "hooks_ms": 1000 * statistics.median(h for h, _ in values),
                "commit_ms": 1000 * statistics.median(c for _, c in values),
                "record_bytes": sizes[nodes, legacy],
            }
        )
    current = {row["nodes"]: row for row in rows if row["record_format"] == 4}
    small, large = min(current), max(current)
    result = {
        "epochs": epochs,
        "rows": rows,
        "commit_ratio_largest_to_smallest": current[large]["commit_ms"] / current[small]["commit_ms"],
        "targets": {"commit_ms_at_1000": 50, "record_bytes_at_1000": 256 << 10, "ratio_1000_to_100": 12},
    }
    print(
        f"{'nodes':>6} {'blobs':>5} {'format':>6} {'hooks ms':>9} {'commit ms':>10} {'record bytes':>13}",
        file=sys.stderr,
    )
    for row in sorted(rows, key=lambda r: (r["record_format"], r["nodes"]), reverse=True):
        print(
            f"{row['nodes']:6d} {row['blobs']:5d} {row['record_format']:6d} {row['hooks_ms']:9.2f} "
            f"{row['commit_ms']:10.2f} {row['record_bytes']:13d}",
            file=sys.stderr,
        )
    print(
        f"commit {large} / {small} nodes: {result['commit_ratio_largest_to_smallest']:.2f} (target <= 12); "
        f"at {large} nodes: {current[large]['commit_ms']:.1f} ms (target <= 50), "
        f"record {current[large]['record_bytes'] / 1024:.1f} KiB (target <= 256)",
        file=sys.stderr,
    )
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
