"""Issue 9 reader figures: ArrayReader + pipe vs plain zarr on the same worker, and the reader's checkpoint cost.

1. Reading a float32 Zarr array (1 GiB; ``--quick``: 256 MiB) in 1 MiB batches through
   ``ArrayReader`` + ``ReaderWithLimit`` + ``pipe`` on a node, vs a plain loop of the same zarr
   slices on that node's worker (``client.submit``), both timed on the worker (the pipe from the
   epoch's node-local init to its last batch; the whole epoch, with its scheduling, is printed too).
   Target: ratio <= 1.2.
2. What an epoch's reader state adds to its checkpoint: the median ``checkpoint_seconds`` of a job
   whose node holds a small model plus a reader (Zarr source: the state is the position blob), minus
   the same job without the reader. Target: <= 1 ms.

Both on a ``node_cluster`` of one node; runs interleaved ABBA, medians of ``--repeats`` (>= 5), also
the median of the per-pair ratios/differences. Prints a
table and one JSON line.

    python benchmarks/readers.py [--quick] [--repeats 5] [--dir DIR]
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
import zarr

import daskjobs as dj

ROW = 256
"""float32 values per record: 1 KiB rows, so a 1 MiB batch is 1024 records."""
BATCH_ROWS = 1024


def make_source(path: Path, mib: int) -> str:
    rows = mib * 1024
    array = zarr.create_array(str(path), shape=(rows, ROW), chunks=(BATCH_ROWS, ROW), dtype="f4", compressors=None)
    block = np.random.default_rng(0).standard_normal((BATCH_ROWS * 16, ROW), dtype=np.float32)
    for start in range(0, rows, len(block)):
        array[start : start + len(block)] = block[: rows - start]
    return str(path)


def plain_loop(url: str) -> float:
    """On the worker: read every 1 MiB slice with plain zarr; seconds."""
    started = time.perf_counter()
    array = zarr.open_array(url, mode="r")
    total = 0.0
    for start in range(0, array.shape[0], BATCH_ROWS):
        total += float(array[start : start + BATCH_ROWS][0, 0])
    return time.perf_counter() - started


def touch(ws, batch) -> None:
    """The processor: as little work as the plain loop does."""
    float(batch[0, 0])


def touch_timed(ws, batch) -> None:
    """:func:`touch`, noting when the last batch was done (on the node's clock)."""
    float(batch[0, 0])
    ws["finished"] = time.perf_counter()


def init_clock(ws) -> None:
    ws["started"] = ws["finished"] = 0.0


def start_clock(ws) -> None:
    ws["started"] = time.perf_counter()


def reader_job(url: str) -> dj.Job:
    """One epoch reading the whole source; ``finished - started`` is the time on the node."""
    with dj.Cluster(), dj.Job(name="bench-readers") as job, dj.Node("reader"):
        with job.init_group:
            reader = dj.ArrayReader(url, batch_size=BATCH_ROWS, name="source")
            dj.Task(init_clock)
        job.epoch_group.add_local_setup(dj.SetupNets(init_nets=[start_clock]))
        limited = dj.ReaderWithLimit(reader)
        dj.pipe(limited, touch_timed)
        job.add_stop_condition(limited.data_finished())
    return job


def model_job(url: str | None, epochs: int) -> dj.Job:
    """A small model updated per epoch, with (``url``) or without a reader reading one batch per epoch."""
    with dj.Cluster(), dj.Job(name="bench-reader-state") as job, dj.Node("reader"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("model", np.zeros(4096, dtype=np.float32)))
            if url is not None:
                reader = dj.ArrayReader(url, batch_size=BATCH_ROWS, num_passes=None, name="source")
        dj.Task(lambda ws: ws.__setitem__("model", ws["model"] + 1), name="update")
        if url is not None:
            dj.pipe(dj.ReaderWithLimit(reader, num_iter=1), touch)
        dj.epoch_limiter(job, epochs)
    return job


def checkpoint_seconds(session: dj.DaskSession, prefix: Path, url: str | None, epochs: int) -> float:
    shutil.rmtree(prefix, ignore_errors=True)
    runner = dj.JobRunner(model_job(url, epochs), dj.MultiNodeCheckpointManager(str(prefix)), progress=False)
    runner.train(session)
    shutil.rmtree(prefix, ignore_errors=True)
    return statistics.median(r.checkpoint_seconds for r in runner.history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB instead of 1 GiB")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--dir", default=None, help="directory on the disk to read from (default: a temp dir)")
    args = parser.parse_args()
    mib = 256 if args.quick else 1024
    directory = Path(args.dir or tempfile.mkdtemp(prefix="daskjobs-bench-readers-"))
    try:
        url = make_source(directory / "source.zarr", mib)
        with dj.node_cluster(["reader"], nthreads=2) as cluster, dj.DaskSession(cluster) as session:
            client = session.client
            resources = {dj.node_resource("reader"): 1}
            plain, piped, epochs, with_reader, without_reader = [], [], [], [], []
            client.submit(plain_loop, url, resources=resources, pure=False).result()  # warm the page cache

            def read_plain() -> None:
                plain.append(client.submit(plain_loop, url, resources=resources, pure=False).result())

            def read_piped() -> None:
                runner = dj.JobRunner(reader_job(url), progress=False)
                runner.train(session)
                epochs.append(runner.history[0].seconds)
                piped.append(float(session.fetch("finished", "reader") - session.fetch("started", "reader")))

            def save_without() -> None:
                without_reader.append(checkpoint_seconds(session, directory / "ckpt", None, 12))

            def save_with() -> None:
                with_reader.append(checkpoint_seconds(session, directory / "ckpt", url, 12))

            for repeat in range(args.repeats):  # ABBA: neither side always runs first
                for step in (read_plain, read_piped) if repeat % 2 == 0 else (read_piped, read_plain):
                    step()
                for step in (save_without, save_with) if repeat % 2 == 0 else (save_with, save_without):
                    step()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {
        "source_mib": mib,
        "batch_mib": 1,
        "repeats": args.repeats,
        "plain_zarr_median_s": round(statistics.median(plain), 4),
        "reader_pipe_median_s": round(statistics.median(piped), 4),
        "read_ratio": round(statistics.median(piped) / statistics.median(plain), 3),
        "read_ratio_paired_median": round(statistics.median(a / b for a, b in zip(piped, plain, strict=True)), 3),
        "read_target": "<= 1.2",
        "reader_epoch_median_s": round(statistics.median(epochs), 4),
        "checkpoint_without_reader_ms": round(1000 * statistics.median(without_reader), 3),
        "checkpoint_with_reader_ms": round(1000 * statistics.median(with_reader), 3),
        "reader_state_ms": round(1000 * (statistics.median(with_reader) - statistics.median(without_reader)), 3),
        "reader_state_paired_median_ms": round(
            1000 * statistics.median(a - b for a, b in zip(with_reader, without_reader, strict=True)), 3
        ),
        "reader_state_target": "<= 1 ms",
    }
    print(f"read {mib} MiB in 1 MiB batches on the node (median of {args.repeats}):")
    print(f"  plain zarr loop       {result['plain_zarr_median_s']:8.3f} s")
    piped_s, ratio, paired = result["reader_pipe_median_s"], result["read_ratio"], result["read_ratio_paired_median"]
    print(f"  ArrayReader + pipe    {piped_s:8.3f} s   ratio {ratio:.3f} (paired {paired:.3f}; <= 1.2)")
    print(f"  (the whole epoch, scheduling and stop condition included: {result['reader_epoch_median_s']:.3f} s)")
    print("epoch checkpoint of a small model (median):")
    print(f"  without a reader      {result['checkpoint_without_reader_ms']:8.2f} ms")
    print(
        f"  with a reader         {result['checkpoint_with_reader_ms']:8.2f} ms   "
        f"reader state {result['reader_state_ms']:+.2f} ms "
        f"(paired {result['reader_state_paired_median_ms']:+.2f}; <= 1 ms)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
