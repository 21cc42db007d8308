"""Checkpoint I/O against numpy baselines on the same disk, in the same run (SPEC §6).

Every figure is a ratio of medians over ``--runs`` runs (``--small-runs`` for the small-blob
rows; at least 5) in which daskjobs and its baseline alternate, so load from other processes hits
both alike:

* small save: 100 blobs of 4 KiB on one node, ``CheckpointStore.write_node`` and the commit
  (fsync on) against the floor of the format itself (SPEC §6, target <= 1.3x): the same folders and
  files created and made durable without daskjobs — the group's folder and ``zarr.json`` (its
  manifest), per blob a folder, ``zarr.json`` and chunk file, then the commit record — made durable
  in the order the format needs (one ``syncfs`` for the group, then the record's fsync and its
  folder's). Also against that floor with the format's atomic renames (the group in a staging folder
  renamed into place and that rename made durable, the record through a temp file): what proves a
  folder daskjobs' own after a power loss costs a rename and an fsync more. For reference:
  ``np.savez`` to one file followed by fsync of the file and of its folder,
  and the floor of a layout that is not daskjobs': every array's metadata consolidated into the
  group's ``zarr.json`` (a folder and a chunk file per blob), what dropping the per-array files would save;
* small restore: ``open_checkpoint(...)[node][blob]`` for every blob, ``read_node`` (what a
  resume or ``load`` runs on the node) and a whole resume (``JobRunner(..., resume_from_epoch=e,
  max_epochs=e).train()`` on a ``LocalSession``: lock, checks, load, no further epoch), against
  ``np.load`` of that ``.npz`` reading every array;
* scaling: the same with 1000 blobs, as a ratio to the 100-blob time of the same path;
* bulk save: ``--size-mib`` (default 1024) of float32 over 2 nodes (4 arrays each) with fsync
  against ``np.save`` of the same arrays, each file and the folder fsynced;
* bulk restore: ``read_node`` (verifying every chunk's XXH3-128) against ``np.load``, both from
  the page cache (each read once, untimed, first).

Run::

    python benchmarks/checkpoint_io.py [--quick] [--small-only] [--runs 5] [--small-runs 15] [--size-mib 1024]
        [--dir DIR] [--json FILE]

``--quick`` uses 256 MiB for the bulk rows. Prints the table (stderr) and the JSON of all results
(stdout, or ``--json FILE``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np
from _report import write_json

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.checkpoint._storage.durable import FSYNC_EACH_UP_TO, fsync_path, sync_paths

MIB = 1 << 20


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def interleaved(runs: int, actions: dict[str, Callable[[int], object]]) -> dict[str, list[float]]:
    """Seconds of each action per run; the order of the actions alternates between runs."""
    times: dict[str, list[float]] = {label: [] for label in actions}
    items = list(actions.items())
    for run in range(runs):
        for label, action in items if run % 2 == 0 else items[::-1]:
            times[label].append(timed(lambda a=action, r=run: a(r)))
    return times


def savez_durable(path: str, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as file:
        np.savez(file, **arrays)
        file.flush()
        os.fsync(file.fileno())
    fsync_path(os.path.dirname(path))


def _create(path: str, data: bytes) -> int:
    """Create ``path`` holding ``data``; return its open descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, data)
    return fd


def _floor_group(folder: str, arrays: dict[str, np.ndarray], sizes: tuple[int, int, int]) -> None:
    """Create the folders and files of a group of ``arrays`` at ``folder`` (its ``zarr.json`` of
    ``sizes[0]`` bytes, per blob a folder, a ``zarr.json`` of ``sizes[1]`` bytes and the chunk file)
    and make them durable with one syncfs, as daskjobs does."""
    os.mkdir(folder)
    os.close(_create(f"{folder}/zarr.json", b"{" + b" " * (sizes[0] - 2) + b"}"))
    metadata = b"{" + b" " * (sizes[1] - 2) + b"}"
    for name, array in arrays.items():
        os.mkdir(f"{folder}/{name}")
        os.close(_create(f"{folder}/{name}/zarr.json", metadata))
        os.close(_create(f"{folder}/{name}/c.0", array.tobytes()))
    sync_paths([folder] * (FSYNC_EACH_UP_TO + 1))  # more paths than fsync-each: one syncfs


def _floor_record(path: str, sizes: tuple[int, int, int]) -> None:
    """Create a commit record of ``sizes[2]`` bytes at ``path`` and fsync it."""
    fd = _create(path, b"{" + b" " * (sizes[2] - 2) + b"}")
    os.fsync(fd)
    os.close(fd)


def format_floor(path: str, arrays: dict[str, np.ndarray], record: str, sizes: tuple[int, int, int]) -> None:
    """The same folders and files a save and commit of ``arrays`` create, made durable in the order the
    format needs, without daskjobs: the group with one syncfs, then the commit record with its fsync
    and its folder's."""
    _floor_group(path, arrays, sizes)
    _floor_record(record, sizes)
    fsync_path(os.path.dirname(record))


def renamed_floor(path: str, arrays: dict[str, np.ndarray], record: str, sizes: tuple[int, int, int]) -> None:
    """:func:`format_floor` with the format's atomic renames: the group written in a staging folder,
    renamed to its name once durable and that made durable (an fsync of its parent), and the commit
    record written to a temp file, fsynced, renamed into place and its folder fsynced. This is what
    lets cleanup prove a folder daskjobs' own after a power loss, and a record be whole or absent."""
    staging = f"{path}.tmp-{uuid.uuid4().hex}"
    _floor_group(staging, arrays, sizes)
    os.rename(staging, path)
    fsync_path(os.path.dirname(path))
    temp = f"{record}.tmp-{uuid.uuid4().hex}"
    _floor_record(temp, sizes)
    os.replace(temp, record)
    fsync_path(os.path.dirname(record))


def consolidated_floor(path: str, arrays: dict[str, np.ndarray]) -> None:
    """The same with every array's metadata consolidated into the group's ``zarr.json`` (a folder and a
    chunk file per blob): what dropping the per-array ``zarr.json`` would leave. Not daskjobs' format."""
    os.mkdir(path)
    for name, array in arrays.items():
        os.mkdir(f"{path}/{name}")
        fd = os.open(f"{path}/{name}/c.0", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, array.tobytes())
        os.close(fd)
    fd = os.open(f"{path}/zarr.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"{" + b" " * (400 * len(arrays)) + b"}")
    os.close(fd)
    sync_paths([path] * (FSYNC_EACH_UP_TO + 1))


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


def small(root: str, runs: int, count: int) -> dict[str, list[float]]:
    """``count`` blobs of 4 KiB: save and three restore paths against ``np.savez`` / ``np.load``."""
    rng = np.random.default_rng(count)
    blobs = {f"b{i:04d}": rng.standard_normal(1024, dtype=np.float32) for i in range(count)}
    store = CheckpointStore(os.path.join(root, f"small{count}"))
    folder = os.path.join(root, f"npz{count}")
    os.makedirs(folder)
    entries: dict[int, dict] = {}

    def save(run: int) -> None:
        entries[run] = store.write_node("n", run, blobs, save_id="s")
        store.commit(make_commit_record("bench", run, {"n": entries[run]}, {}, {}))

    os.sync()  # start from a settled disk: one syncfs also waits for whatever else is being written
    for warm in (-2, -1):  # file creation is slow while the filesystem's metadata is cold
        savez_durable(os.path.join(folder, f"{warm}.npz"), blobs)
        save(10**6 + warm)
    group = os.path.join(store.url, f"n.{10**6 - 1}")
    sizes = (  # the floor writes files of the sizes daskjobs writes
        os.path.getsize(os.path.join(group, "zarr.json")),
        os.path.getsize(os.path.join(group, next(iter(blobs)), "zarr.json")),
        os.path.getsize(store.commit_path(10**6 - 1)),
    )
    commits = os.path.join(root, f"floor-commits{count}")
    renamed = os.path.join(root, f"renamed{count}")
    os.makedirs(commits)
    os.makedirs(os.path.join(renamed, "commits"))
    times = interleaved(
        runs,
        {
            "savez": lambda r: savez_durable(os.path.join(folder, f"{r}.npz"), blobs),
            "dj_save": save,
            "format_floor": lambda r: format_floor(
                os.path.join(root, f"floor{count}-{r}"), blobs, os.path.join(commits, f"epoch-{r:012d}.json"), sizes
            ),
            "renamed_floor": lambda r: renamed_floor(
                os.path.join(renamed, f"n.{r}"), blobs, os.path.join(renamed, "commits", f"epoch-{r:012d}.json"), sizes
            ),
            "consolidated_floor": lambda r: consolidated_floor(os.path.join(root, f"cons{count}-{r}"), blobs),
        },
    )

    def view_loop(run: int) -> None:
        node = dj.open_checkpoint(store.url, run)["n"]
        for name in node:
            node[name]

    with dj.Cluster(), dj.Job(name="bench") as job, dj.Node("n"):
        with job.init_group:  # a resume does not run it; its node is the one checkpointed
            dj.Task(lambda ws: ws.update(blobs), name="init")
        dj.Task(lambda ws: None, name="step")

    def resume(run: int) -> None:
        epoch = max(run, 1)  # max_epochs=epoch: nothing runs after the load
        manager = dj.MultiNodeCheckpointManager(store.url)
        dj.JobRunner(job, manager, max_epochs=epoch, resume_from_epoch=epoch, progress=False).train(session)

    with dj.LocalSession() as session:
        times.update(
            interleaved(
                runs,
                {
                    "npz_load": lambda r: load_npz(os.path.join(folder, f"{r}.npz")),
                    "dj_open_checkpoint": view_loop,
                    "dj_read_node": lambda r: store.read_node("n", r, entries[r]),
                    "dj_resume": resume,
                },
            )
        )
        assert all(np.array_equal(session.fetch(name, node="n"), blobs[name]) for name in blobs)
    check = store.read_node("n", 0, entries[0])
    assert all(np.array_equal(check[name], blobs[name]) for name in blobs)
    return times


def bulk(root: str, runs: int, size_mib: int) -> dict[str, list[float]]:
    """``size_mib`` of float32 over 2 nodes x 4 arrays: durable save and warm verified restore."""
    rng = np.random.default_rng(0)
    per_array = size_mib * MIB // 4 // 8
    nodes = {n: {f"w{i}": rng.standard_normal(per_array, dtype=np.float32) for i in range(4)} for n in ("ps", "tr")}
    store = CheckpointStore(os.path.join(root, "bulk"))
    entries: dict[tuple[int, str], dict] = {}

    def np_save(run: int) -> None:
        folder = os.path.join(root, f"npy{run}")
        os.makedirs(folder)
        for node, arrays in nodes.items():
            for name, array in arrays.items():
                with open(os.path.join(folder, f"{node}.{name}.npy"), "wb") as file:
                    np.save(file, array)
                    file.flush()
                    os.fsync(file.fileno())
        fsync_path(folder)

    def dj_save(run: int) -> None:
        for node, arrays in nodes.items():
            entries[run, node] = store.write_node(node, run, arrays, save_id="s")

    def np_load(run: int) -> None:
        folder = os.path.join(root, f"npy{run}")
        [np.load(os.path.join(folder, name)) for name in sorted(os.listdir(folder))]

    def dj_load(run: int) -> None:
        for node in nodes:
            store.read_node(node, run, entries[run, node])

    times: dict[str, list[float]] = {"np_save": [], "dj_save": [], "np_load": [], "dj_load": []}
    for run in range(runs):
        pairs = [
            (("np_save", np_save), ("dj_save", dj_save)),
            (("np_load", np_load), ("dj_load", dj_load)),
        ]
        for pair in pairs:
            for label, action in pair if run % 2 == 0 else pair[::-1]:
                if label.endswith("load"):
                    action(run)  # warm: read it into the page cache first
                else:
                    os.sync()
                times[label].append(timed(lambda a=action, r=run: a(r)))
        shutil.rmtree(os.path.join(root, f"npy{run}"))
        for node in nodes:
            shutil.rmtree(os.path.join(store.url, f"{node}.{run}"))
    return times


ROWS: list[tuple[str, tuple[str, str], tuple[str, str], float | None]] = [  # label, baseline, daskjobs, target
    ("100 x 4 KiB save+commit vs the format's floor", ("small100", "format_floor"), ("small100", "dj_save"), 1.3),
    (
        "100 x 4 KiB save+commit vs that floor with renames",
        ("small100", "renamed_floor"),
        ("small100", "dj_save"),
        None,
    ),
    ("100 x 4 KiB save+commit vs np.savez (fsync)", ("small100", "savez"), ("small100", "dj_save"), None),
    ("100 x 4 KiB: floor of the format vs np.savez", ("small100", "savez"), ("small100", "format_floor"), None),
    (
        "100 x 4 KiB: floor, metadata consolidated",
        ("small100", "savez"),
        ("small100", "consolidated_floor"),
        None,
    ),
    ("100 x 4 KiB restore, open_checkpoint", ("small100", "npz_load"), ("small100", "dj_open_checkpoint"), 2.0),
    ("100 x 4 KiB restore, read_node (resume)", ("small100", "npz_load"), ("small100", "dj_read_node"), 2.0),
    ("100 x 4 KiB restore, a whole resume (train)", ("small100", "npz_load"), ("small100", "dj_resume"), 2.0),
    ("1000 vs 100 blobs: save", ("small100", "dj_save"), ("small1000", "dj_save"), 12.0),
    (
        "1000 vs 100 blobs: open_checkpoint",
        ("small100", "dj_open_checkpoint"),
        ("small1000", "dj_open_checkpoint"),
        12.0,
    ),
    ("1000 vs 100 blobs: read_node", ("small100", "dj_read_node"), ("small1000", "dj_read_node"), 12.0),
    ("1000 vs 100 blobs: a whole resume", ("small100", "dj_resume"), ("small1000", "dj_resume"), 12.0),
    ("bulk save (fsync) vs np.save", ("bulk", "np_save"), ("bulk", "dj_save"), 1.05),
    ("bulk restore (warm, verified) vs np.load", ("bulk", "np_load"), ("bulk", "dj_load"), 1.1),
]


def summarise(results: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    rows = []
    for label, (base_part, base), (our_part, ours), target in ROWS:
        if base_part not in results or our_part not in results:
            continue
        baseline, mine = statistics.median(results[base_part][base]), statistics.median(results[our_part][ours])
        rows.append(
            {
                "benchmark": label,
                "baseline_s": baseline,
                "daskjobs_s": mine,
                "ratio": mine / baseline,
                "target": target,
                "met": None if target is None else mine / baseline <= target,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB bulk instead of --size-mib")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--small-runs",
        type=int,
        default=15,
        help="runs of the small-blob rows (cheap, and noisier: a syncfs waits for whatever else the disk is doing)",
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed afterwards)")
    parser.add_argument("--small-only", action="store_true", help="only the small-blob rows")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    runs, size = max(5, args.runs), 256 if args.quick else args.size_mib
    with contextlib.ExitStack() as stack:
        root = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="daskjobs-bench-"))
        results = {
            "small100": small(root, max(5, args.small_runs), 100),
            "small1000": small(root, max(5, args.small_runs), 1000),
        }
        if not args.small_only:
            results["bulk"] = bulk(root, runs, size)
    rows = summarise(results)
    print(
        f"{'benchmark (medians of interleaved runs)':48s} {'baseline':>9s} {'daskjobs':>9s} "
        f"{'ratio':>6s} {'target':>7s}",
        file=sys.stderr,
    )
    for row in rows:
        target = "-" if row["target"] is None else f"<= {row['target']}"
        print(
            f"{row['benchmark']:48s} {row['baseline_s']:9.4f} {row['daskjobs_s']:9.4f} {row['ratio']:6.2f} "
            f"{target:>7s}{'  (missed)' if row['met'] is False else ''}",
            file=sys.stderr,
        )
    summary = {"runs": runs, "small_runs": max(5, args.small_runs), "bulk_mib": size, "rows": rows}
    write_json({**summary, "seconds": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
