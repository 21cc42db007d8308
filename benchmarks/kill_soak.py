"""SPEC §6 Scale (c) and §4 flat memory: a kill soak at size, ending equal to an uninterrupted run.

A job of ``--nodes`` nodes (default 16) with ``--blobs`` arrays each (default 20, ``--size``
float64 elements) runs ``--epochs`` epochs (default 200) on a ``node_cluster`` of worker
processes (one per node by default, ``--workers``), behind nannies that restart a killed worker,
with a checkpoint every epoch (``MultiNodeCheckpointManager`` on local disk, ``keep_last``
``--keep-last``) and recovery on. Each node's step is deterministic: every blob ``w`` becomes
``w * 0.5 + epoch + node index + blob index``.

Two runs on the same cluster, each on its own checkpoint prefix:

* ``reference``: uninterrupted;
* ``killed``: a thread of the driver SIGKILLs the process of a random worker (not its nanny: the
  node comes back) every ``--kill-every`` seconds (default 10, uniformly 0.5-1.5x), once the
  previous kill was recovered from (an epoch committed after it) and while the last committed
  epoch is at least 5 epochs before the end (a kill always lands in an epoch that is recovered).

Measured: epochs, kills, recoveries (``recoveries`` of the kill run's last history record), wall
time of both runs; the median interval between committed epochs (``on_epoch`` calls) of both
runs; per kill, the time until the killed node's next step finished (stamped by the step, on the
replacement worker, after the restore) and until the first commit of an epoch run after the
recovery; equality with the reference (every blob of every node's final workspace, exact bytes,
and every blob of every epoch both prefixes still hold); ``daskjobs checkpoints verify`` of the
kill run's prefix. Every ``--every`` committed epochs after ``--warmup``: RSS, open regular files
(``/proc`` files left out), file descriptors and threads of the driver (its process also holds
the scheduler and the nannies: in both runs, and in the kill run from its first recovery on,
when lazily started thread pools and the nannies' connections have grown) and of every worker
process (those never killed, and the replacements, each its own process, without its first
``REPLACEMENT_WARMUP`` samples): first and last sample and the least-squares slope in MB per 1000
epochs. The JSON also has every sample, the driver's thread names and open files.

With ``--in-memory`` both runs keep every epoch in cluster memory (tier 0, one replica per node's
snapshot on another worker) and commit durably every ``--durable-every`` epochs: a kill is then
recovered from the snapshots in memory (counted from the runner's log), and "kill → next epoch
committed" is the next commit in memory. ``--kill-pairs`` kills, each time, a worker together
with the worker after it in the ring of workers (which holds its replicas): its nodes' snapshots
are gone with both, and the recovery falls back to the newest durable commit.

Exits 1 when the kill run differs from the reference, a commit does not verify, or a kill was
not recovered from.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/kill_soak.py [--nodes 16] [--blobs 20] [--epochs 200] [--kill-every 10] [--workers 16]
[--in-memory --durable-every 10 [--kill-pairs]]``
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
from _report import write_json

import daskjobs as dj

REPLACEMENT_WARMUP = 2
"""Samples of a replacement worker left out of its figures: its first epochs import and allocate."""

KILL_MARGIN = 5
"""No kill once the last committed epoch is this close to the end: the run is then at most two
epochs ahead of its commits, so every kill lands in an epoch (and is recovered from)."""


def blob_name(index: int) -> str:
    return f"w{index:02d}"


@dataclass(frozen=True)
class Init:
    """Init step: blob ``b`` of node ``node`` is ``arange(size) * (node + 1) + b``."""

    node: int
    blobs: int
    size: int

    def __call__(self, ws: dj.Workspace) -> None:
        for b in range(self.blobs):
            ws[blob_name(b)] = np.arange(self.size, dtype=np.float64) * (self.node + 1) + b


@dataclass(frozen=True)
class Step:
    """Epoch step: every blob ``w`` becomes ``w * 0.5 + epoch + node + b``; appends ``<epoch> <time>``
    to ``stamps`` once done, and logs the mean of blob 0."""

    node: int
    blobs: int
    stamps: str
    pause: float = 0.0

    def __call__(self, ws: dj.Workspace) -> None:
        if self.pause:
            time.sleep(self.pause)
        for b in range(self.blobs):
            name = blob_name(b)
            ws[name] = ws[name] * 0.5 + (ws.epoch + self.node + b)
        ws.log("mean", float(ws[blob_name(0)].mean()))
        with open(self.stamps, "a") as out:
            out.write(f"{ws.epoch} {time.time()}\n")


def define_job(nodes: list[str], blobs: int, size: int, stamps: str, pause: float = 0.0) -> dj.Job:
    """Every node: ``blobs`` arrays made in the init group, one step per epoch updating all of them."""
    with dj.Cluster(), dj.Job(name="kill-soak") as job:
        for index, node in enumerate(nodes):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(Init(index, blobs, size), name="init")
                dj.Task(Step(index, blobs, os.path.join(stamps, node), pause), name="step")
    return job


@dataclass
class Kill:
    at: float
    """``time.time()`` of the kill."""
    worker: str
    pid: int
    committed: int
    """The last committed epoch when it struck."""


class Killer(threading.Thread):
    """SIGKILLs a random worker's process every ~``every`` seconds, each once the previous kill was
    recovered from and while the last committed epoch is before ``stop_before``."""

    def __init__(self, cluster: Any, every: float, stop_before: int, seed: int, pairs: bool = False) -> None:
        super().__init__(name="kill-soak killer", daemon=True)
        self.cluster, self.every, self.stop_before, self.pairs = cluster, every, stop_before, pairs
        self.rng = random.Random(seed)
        self.kills: list[Kill] = []
        self.committed: int | None = None
        self.recoveries = 0
        self.done = threading.Event()
        self.lock = threading.Lock()

    def committed_epoch(self, record: dj.EpochRecord) -> None:
        """``on_epoch``: the run committed ``record``."""
        with self.lock:
            self.committed = record.epoch
            self.recoveries = max(self.recoveries, record.recoveries)

    def _pause(self) -> float:
        return self.every * self.rng.uniform(0.5, 1.5)

    def run(self) -> None:
        next_at = time.monotonic() + self._pause()
        while not self.done.wait(0.05):
            with self.lock:
                ready = self.committed is not None and self.recoveries >= len(self.kills)
                ready = ready and self.committed < self.stop_before and time.monotonic() >= next_at
                committed = self.committed
            if not ready:
                continue
            worker = self.rng.choice(sorted(self.cluster.workers))
            victims = [worker, *([self._successor(worker)] if self.pairs else [])]
            pids = [self.cluster.workers[name].pid for name in victims if name is not None]
            if None in pids or len(pids) != len(victims):  # a worker is (re)starting
                continue
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            self.kills.append(Kill(time.time(), worker, pids[0], committed))
            next_at = time.monotonic() + self._pause()

    def _successor(self, worker: str) -> str | None:
        """The worker after ``worker`` in the ring of worker addresses: where tier 0 puts its replicas."""
        addresses = {name: nanny.worker_address for name, nanny in self.cluster.workers.items()}
        ring = sorted(a for a in addresses.values() if a)
        if addresses.get(worker) not in ring or len(ring) < 2:
            return None
        after = ring[(ring.index(addresses[worker]) + 1) % len(ring)]
        return next(name for name, address in addresses.items() if address == after)


def open_files(process: psutil.Process) -> list[str]:
    """The regular files ``process`` has open, but ``/proc`` files (read by Dask's system monitor
    and by psutil, now and then)."""
    return sorted(file.path for file in process.open_files() if not file.path.startswith("/proc/"))


def process_stats(process: psutil.Process) -> dict[str, float]:
    """RSS in MB, open files (see :func:`open_files`), file descriptors and threads of ``process``."""
    with process.oneshot():
        return {
            "rss_mb": process.memory_info().rss / 2**20,
            "open_files": len(open_files(process)),
            "fds": process.num_fds(),
            "threads": process.num_threads(),
        }


def slope_per_1000(epochs: list[int], values: list[float]) -> float | None:
    """Least-squares growth of ``values`` per 1000 epochs (``None`` below three points)."""
    if len(set(epochs)) < 3:
        return None
    return float(np.polyfit(np.asarray(epochs, float), np.asarray(values, float), 1)[0] * 1000)


@dataclass
class Run:
    """What one run left: its history, when each epoch was committed, its final workspaces, kills
    and process samples."""

    epochs: int
    wall_seconds: float
    history: list[dj.EpochRecord]
    committed_at: list[tuple[float, int, int]]
    workspaces: dict[str, dict[str, np.ndarray]]
    kills: list[Kill] = field(default_factory=list)
    samples: dict[str, list[tuple[int, dict[str, float]]]] = field(default_factory=dict)
    originals: set[int] = field(default_factory=set)
    """The pids of the worker processes when the run started."""
    restores: dict[str, int] = field(default_factory=dict)
    """Recoveries by where they restored from (``memory`` or ``prefix``)."""


def registered_workers(cluster: Any) -> list[tuple[str, int]]:
    """``(name, pid)`` of every worker process the scheduler has registered (up and serving)."""
    for _ in range(10):
        try:
            return sorted((w.name, w.pid) for w in list(cluster.scheduler.workers.values()))
        except RuntimeError:  # changed while copied, by the scheduler (on its event loop)
            continue
    return []


def sample(cluster: Any, samples: dict[str, list[tuple[int, dict[str, Any]]]], record: dj.EpochRecord) -> None:
    """Append the stats of the driver (with the recoveries so far) and of every registered worker
    process (``name:pid``) at ``record``'s epoch."""
    gc.collect()
    epoch, names = record.epoch, collections.Counter(thread.name for thread in threading.enumerate())
    process = psutil.Process()
    driver = process_stats(process) | {"thread_names": names, "open_paths": open_files(process)}
    driver["recoveries"] = record.recoveries
    samples.setdefault("driver", []).append((epoch, driver))
    for name, pid in registered_workers(cluster):
        try:
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            stats = process_stats(process)
        except psutil.Error:  # killed since
            continue
        samples.setdefault(f"{name}:{pid}", []).append((epoch, stats))


def run(
    session: dj.DaskSession,
    cluster: Any,
    job: dj.Job,
    prefix: str,
    args: argparse.Namespace,
    kill: bool,
) -> Run:
    """One run of ``job`` on ``prefix``; with ``kill``, under a :class:`Killer`."""
    stop_before = args.epochs - KILL_MARGIN
    killer = Killer(cluster, args.kill_every, stop_before, args.seed, pairs=args.kill_pairs) if kill else None
    committed_at: list[tuple[float, int, int]] = []
    samples: dict[str, list[tuple[int, dict[str, float]]]] = {}

    def on_epoch(record: dj.EpochRecord) -> None:
        committed_at.append((time.time(), record.epoch, record.recoveries))
        if killer is not None:
            killer.committed_epoch(record)
        if record.epoch >= args.warmup and (record.epoch - args.warmup) % args.every == 0:
            sample(cluster, samples, record)

    tier0 = {"in_memory": True, "durable_every": args.durable_every} if args.in_memory else {}
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=args.keep_last or None, **tier0)
    runner = dj.JobRunner(job, manager, max_epochs=args.epochs, max_failures=10_000, on_epoch=on_epoch, progress=False)
    originals = {pid for _, pid in registered_workers(cluster)}
    restores = Restores()
    logging.getLogger("daskjobs").addHandler(restores)
    started = time.perf_counter()
    if killer is not None:
        killer.start()
    try:
        epochs = runner.train(session)
    finally:
        logging.getLogger("daskjobs").removeHandler(restores)
        if killer is not None:
            killer.done.set()
            killer.join()
    wall = time.perf_counter() - started
    workspaces = {
        node: {blob_name(b): session.fetch(blob_name(b), node) for b in range(args.blobs)} for node in job.nodes()
    }
    kills = killer.kills if killer is not None else []
    history = list(runner.history)
    return Run(epochs, wall, history, committed_at, workspaces, kills, samples, originals, restores.found)


class Restores(logging.Handler):
    """Counts the runner's recoveries by where they restored from: cluster memory, or the prefix."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.found = {"memory": 0, "prefix": 0}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "restoring all nodes from epoch" in message:
            self.found["memory" if "in cluster memory" in message else "prefix"] += 1


def differences(mine: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]) -> list[str]:
    """``node/blob`` of every blob that is not bit-equal (dtype, shape and bytes) in both."""
    found = []
    for node in sorted(set(mine) | set(theirs)):
        a, b = mine.get(node, {}), theirs.get(node, {})
        for blob in sorted(set(a) | set(b)):
            x, y = a.get(blob), b.get(blob)
            same = isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
            if not (same and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()):
                found.append(f"{node}/{blob}")
    return found


def commit_differences(killed: str, reference: str) -> tuple[list[int], list[str]]:
    """The epochs committed under both prefixes, and ``epoch:node/blob`` of every blob not bit-equal."""
    epochs = sorted({i.epoch for i in dj.list_checkpoints(killed)} & {i.epoch for i in dj.list_checkpoints(reference)})
    found = []
    for epoch in epochs:
        a, b = dj.open_checkpoint(killed, epoch), dj.open_checkpoint(reference, epoch)
        mine = {node: a[node].read() for node in a}
        theirs = {node: b[node].read() for node in b}
        found += [f"{epoch}:{where}" for where in differences(mine, theirs)]
    return epochs, found


def verify(prefix: str) -> dict[str, Any]:
    """``daskjobs checkpoints verify prefix`` (this interpreter, this environment): exit code and
    the epochs it reported OK."""
    done = subprocess.run(
        [sys.executable, "-m", "daskjobs", "checkpoints", "verify", prefix],
        capture_output=True,
        text=True,
        timeout=600,
    )
    ok = [int(line.split()[1].rstrip(":")) for line in done.stdout.splitlines() if ": OK" in line]
    return {"returncode": done.returncode, "epochs_ok": ok, "stderr": done.stderr.strip()[-2000:]}


def next_steps(stamps: str, kills: list[Kill], served: dict[str, str]) -> list[float | None]:
    """Per kill, seconds until the killed worker's (first) node finished its next step (its stamps)."""
    found = []
    for kill in kills:
        with open(os.path.join(stamps, served[kill.worker])) as lines:
            after = [float(when) for _, when in (line.split() for line in lines) if float(when) > kill.at]
        found.append(min(after) - kill.at if after else None)
    return found


def next_commits(committed_at: list[tuple[float, int, int]], kills: list[Kill]) -> list[float | None]:
    """Per kill (the ``k``-th), seconds until the first commit of an epoch run after ``k`` recoveries."""
    return [
        min((t - kill.at for t, _, recoveries in committed_at if recoveries > k), default=None)
        for k, kill in enumerate(kills)
    ]


def intervals(committed_at: list[tuple[float, int, int]]) -> list[float]:
    times = [t for t, _, _ in committed_at]
    return [b - a for a, b in itertools.pairwise(times)]


def summarise(samples: list[tuple[int, dict[str, float]]]) -> dict[str, Any]:
    """First and last sample and the RSS slope of one process, and every sample's ``[epoch, RSS MB,
    file descriptors, threads]``."""
    at = [epoch for epoch, _ in samples]
    first, last = samples[0], samples[-1]
    row: dict[str, Any] = {"samples": len(samples), "first_epoch": first[0], "last_epoch": last[0]}
    row["rss_growth_mb_per_1000_epochs"] = slope_per_1000(at, [s["rss_mb"] for _, s in samples])
    row["series"] = [[epoch, round(s["rss_mb"], 2), s["fds"], s["threads"]] for epoch, s in samples]
    for key in ("rss_mb", "open_files", "fds", "threads", "thread_names", "open_paths"):
        if key in first[1]:
            row[f"{key}_first"], row[f"{key}_last"] = first[1][key], last[1][key]
    return row


def soak(args: argparse.Namespace) -> dict[str, Any]:
    nodes = [f"n{i:02d}" for i in range(args.nodes)]
    workers = max(1, min(args.workers, args.nodes))
    spec = {f"w{j:02d}": nodes[j::workers] for j in range(workers)} if workers < args.nodes else {n: [n] for n in nodes}
    folder = tempfile.mkdtemp(prefix="daskjobs-kill-soak-")
    prefixes = {name: os.path.join(folder, name) for name in ("reference", "killed")}
    runs: dict[str, Run] = {}
    started = time.perf_counter()
    try:
        with dj.node_cluster(spec, nthreads=args.threads) as cluster, dj.DaskSession(cluster) as session:
            for name in ("reference", "killed"):
                stamps = os.path.join(folder, f"stamps-{name}")
                os.mkdir(stamps)
                job = define_job(nodes, args.blobs, args.size, stamps, args.pause)
                runs[name] = run(session, cluster, job, prefixes[name], args, kill=name == "killed")
        killed, reference = runs["killed"], runs["reference"]
        commit_epochs, commit_diffs = commit_differences(prefixes["killed"], prefixes["reference"])
        verified = verify(prefixes["killed"])
        served = {worker: served[0] for worker, served in spec.items()}
        to_step = next_steps(os.path.join(folder, "stamps-killed"), killed.kills, served)
        to_commit = next_commits(killed.committed_at, killed.kills)
        if args.keep_prefixes:
            for name, path in prefixes.items():
                shutil.copytree(path, os.path.join(args.keep_prefixes, name))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    workspace_diffs = differences(killed.workspaces, reference.workspaces)
    recoveries = killed.history[-1].recoveries if killed.history else 0
    killed_pids = {kill.pid for kill in killed.kills}
    driver = summarise(killed.samples["driver"]) if killed.samples.get("driver") else None
    recovered = [row for row in killed.samples.get("driver", []) if row[1]["recoveries"] > 0]
    driver_recovered = summarise(recovered) if recovered else None
    reference_driver = summarise(reference.samples["driver"]) if reference.samples.get("driver") else None
    survivors, replacements = {}, {}
    for name, rows in killed.samples.items():
        pid = None if name == "driver" else int(name.split(":")[1])
        if pid in killed.originals and pid not in killed_pids:
            survivors[name] = summarise(rows)
        elif pid is not None and pid not in killed.originals and rows[REPLACEMENT_WARMUP:]:
            replacements[name] = summarise(rows[REPLACEMENT_WARMUP:])
    equal = not workspace_diffs and not commit_diffs
    verified_ok = verified["returncode"] == 0 and bool(verified["epochs_ok"])
    return {
        "nodes": args.nodes,
        "blobs_per_node": args.blobs,
        "blob_elements": args.size,
        "workers": workers,
        "threads_per_worker": args.threads,
        "kill_every_s": args.kill_every,
        "keep_last": args.keep_last or None,
        "in_memory": args.in_memory,
        "durable_every": args.durable_every if args.in_memory else None,
        "kill_pairs": args.kill_pairs,
        "restored_from": killed.restores,
        "seed": args.seed,
        "epochs": killed.epochs,
        "history_epochs_in_order": [r.epoch for r in killed.history] == list(range(1, killed.epochs + 1)),
        "kills": len(killed.kills),
        "recoveries": recoveries,
        "kill_log": [
            {"worker": k.worker, "pid": k.pid, "committed": k.committed, "next_step_s": s, "next_commit_s": c}
            for k, s, c in zip(killed.kills, to_step, to_commit, strict=True)
        ],
        "wall_seconds": {"reference": reference.wall_seconds, "killed": killed.wall_seconds},
        "median_epoch_interval_ms": {
            "reference": 1000 * statistics.median(intervals(reference.committed_at)),
            "killed": 1000 * statistics.median(intervals(killed.committed_at)),
        },
        "kill_to_next_step_s": _spread([s for s in to_step if s is not None]),
        "kill_to_next_commit_s": _spread([c for c in to_commit if c is not None]),
        "equal": equal,
        "workspace_blobs_compared": sum(len(blobs) for blobs in reference.workspaces.values()),
        "workspace_differences": workspace_diffs,
        "commit_epochs_compared": commit_epochs,
        "commit_differences": commit_diffs[:50],
        "verify": verified,
        "verified_ok": verified_ok,
        "driver": driver,
        "driver_after_first_recovery": driver_recovered,
        "reference_driver": reference_driver,
        "workers_never_killed": survivors,
        "worker_replacements": replacements,
        "total_seconds": time.perf_counter() - started,
        "ok": equal and verified_ok and recoveries >= len(killed.kills),
    }


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": statistics.median(values), "max": max(values)}


def _worst(rows: dict[str, dict[str, Any]]) -> str:
    slopes = [
        r["rss_growth_mb_per_1000_epochs"] for r in rows.values() if r["rss_growth_mb_per_1000_epochs"] is not None
    ]
    return f"{max(slopes):.2f}" if slopes else "n/a"


def table(result: dict[str, Any]) -> str:
    ref, kil = result["median_epoch_interval_ms"]["reference"], result["median_epoch_interval_ms"]["killed"]
    step, commit = result["kill_to_next_step_s"], result["kill_to_next_commit_s"]
    survivors, replacements = result["workers_never_killed"], result["worker_replacements"]

    def first_last(row: dict[str, Any], key: str, fmt: str = "") -> str:
        return f"{row[key + '_first']:{fmt}} → {row[key + '_last']:{fmt}}"

    def process_row(row: dict[str, Any] | None) -> str:
        if not row:
            return "n/a"
        slope = row["rss_growth_mb_per_1000_epochs"]
        growth = "n/a" if slope is None else f"{slope:.1f}"
        return (
            f"epochs {row['first_epoch']} → {row['last_epoch']}: RSS {first_last(row, 'rss_mb', '.1f')} MB "
            f"({growth} MB/1000 epochs), open files {first_last(row, 'open_files')}, "
            f"fds {first_last(row, 'fds')}, threads {first_last(row, 'threads')}"
        )

    def seconds(spread: dict[str, float | None]) -> str:
        return "n/a" if spread["median"] is None else f"median {spread['median']:.2f} s, max {spread['max']:.2f} s"

    rows = [
        (
            "size",
            f"{result['nodes']} nodes x {result['blobs_per_node']} blobs x {result['blob_elements']} float64, "
            f"{result['workers']} worker processes",
        ),
        ("epochs", f"{result['epochs']} (history in order: {result['history_epochs_in_order']})"),
        (
            "kills / recoveries",
            f"{result['kills']} / {result['recoveries']} (a kill every ~{result['kill_every_s']} s"
            f"{', two workers each' if result['kill_pairs'] else ''})",
        ),
        (
            "restored from memory / from the prefix",
            f"{result['restored_from']['memory']} / {result['restored_from']['prefix']}",
        ),
        (
            "wall time reference / killed",
            f"{result['wall_seconds']['reference']:.1f} s / {result['wall_seconds']['killed']:.1f} s",
        ),
        ("median epoch interval reference / killed", f"{ref:.1f} ms / {kil:.1f} ms"),
        ("kill → killed node's next step done", seconds(step)),
        ("kill → next epoch committed", seconds(commit)),
        (
            "final workspaces equal",
            f"{not result['workspace_differences']} ({result['workspace_blobs_compared']} blobs, exact bytes)",
        ),
        ("commits equal", f"{not result['commit_differences']} (epochs {result['commit_epochs_compared']})"),
        ("checkpoints verify", f"exit {result['verify']['returncode']}, epochs OK {result['verify']['epochs_ok']}"),
        ("driver, reference run", process_row(result["reference_driver"])),
        ("driver, kill run", process_row(result["driver"])),
        ("driver, kill run after its first recovery", process_row(result["driver_after_first_recovery"])),
        ("workers never killed: count, worst slope", f"{len(survivors)}, {_worst(survivors)} MB/1000 epochs"),
        ("replacement workers: count, worst slope", f"{len(replacements)}, {_worst(replacements)} MB/1000 epochs"),
        ("result", "OK" if result["ok"] else "DIFFERS"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--blobs", type=int, default=20, help="arrays per node")
    parser.add_argument("--size", type=int, default=1000, help="float64 elements per array")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=16, help="worker processes (each serving nodes/workers nodes)")
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills (0.5-1.5x at random)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds each step sleeps (stretches a short run)")
    parser.add_argument("--keep-last", type=int, default=5, help="retention of both runs (0: keep all)")
    parser.add_argument("--warmup", type=int, default=20, help="committed epochs before the first process sample")
    parser.add_argument("--every", type=int, default=10, help="committed epochs between process samples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times and victims")
    parser.add_argument("--keep-prefixes", help="copy both runs' checkpoint prefixes into this (existing) folder")
    parser.add_argument("--in-memory", action="store_true", help="tier 0: every epoch in cluster memory too")
    parser.add_argument("--durable-every", type=int, default=10, help="with --in-memory: durable every N epochs")
    parser.add_argument("--kill-pairs", action="store_true", help="kill a worker and its replica holder together")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.epochs <= KILL_MARGIN:
        parser.error(f"--epochs must be more than {KILL_MARGIN}")
    result = soak(args)
    print(table(result), file=sys.stderr)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
