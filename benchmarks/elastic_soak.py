"""SPEC §6 Elastic placement (b): a shrink-and-grow soak on plain ``dask worker`` processes.

A job of ``--nodes`` nodes (default 8) with ``--blobs`` arrays each (default 10, ``--size`` float64
elements) runs ``--epochs`` epochs (default 700) with a checkpoint every epoch (local disk,
``keep_last=3``, ``max_failures`` high enough) on a ``dask scheduler`` and ``--workers`` (default 4)
plain ``dask worker`` processes — no resources: a pool. Every ~``--every`` seconds (default 10,
uniformly 0.5 to 1.5 times that) one worker serving nodes is SIGKILLed with its whole process group (nanny
included) and never replaced, down to one worker; then ``--workers - 1`` new workers join, one every
~``--every`` seconds. Each node's step is deterministic (every blob ``w`` becomes
``w * 0.5 + epoch + node + blob``) and sleeps ``--pause`` seconds (default 0.05).

Measured: per kill, the time from the kill to the loss noticed (the runner's recovery line), to the
nodes placed again, and to the first commit of an epoch run after the recovery (``on_epoch`` of a
record counting that recovery); per join, the time to the first move of nodes onto the new worker;
the final placement; equality with an uninterrupted run (every blob of every node's final workspace,
exact bytes, against a ``LocalSession`` run of the same job) and of the last commit. Target: equal,
kill → next epoch committed ≤ 2 s plus restore time.

Exits 1 when the run differs from the reference or an event did not happen before the job ended.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/elastic_soak.py [--nodes 8] [--blobs 10] [--workers 4] [--every 10]``
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
from _report import write_json
from distributed import Client

import daskjobs as dj


def blob_name(index: int) -> str:
    return f"w{index:02d}"


@dataclass(frozen=True)
class Init:
    """Blob ``b`` of node ``node`` is ``arange(size) * (node + 1) + b``."""

    node: int
    blobs: int
    size: int

    def __call__(self, ws: dj.Workspace) -> None:
        for b in range(self.blobs):
            ws[blob_name(b)] = np.arange(self.size, dtype=np.float64) * (self.node + 1) + b


@dataclass(frozen=True)
class Step:
    """Every blob ``w`` becomes ``w * 0.5 + epoch + node + b``, after ``pause`` seconds."""

    node: int
    blobs: int
    pause: float

    def __call__(self, ws: dj.Workspace) -> None:
        time.sleep(self.pause)
        for b in range(self.blobs):
            name = blob_name(b)
            ws[name] = ws[name] * 0.5 + (ws.epoch + self.node + b)


def define_job(nodes: list[str], blobs: int, size: int, pause: float, epochs: int) -> dj.Job:
    with dj.Cluster(), dj.Job(name="elastic-soak") as job:
        for index, node in enumerate(nodes):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(Init(index, blobs, size), name="init")
                dj.Task(Step(index, blobs, pause), name="step")
        with dj.Node(nodes[0]):
            dj.epoch_limiter(job, epochs)
    return job


class Marks(logging.Handler):
    """Times of the driver's recovery, placement and move lines (``daskjobs`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lost: list[float] = []
        self.placed: list[float] = []
        self.moved: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "lost; restoring all nodes" in message:
            self.lost.append(record.created)
        elif "moved node(s)" in message:
            self.moved.append(record.created)
        elif "placement now" in message:
            self.placed.append(record.created)


class Cluster:
    """A ``dask scheduler`` and plain ``dask worker`` processes, each in its own process group."""

    def __init__(self, folder: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.folder, self.address = folder, f"tcp://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]
        self._start([*scheduler, "--port", str(port), "--no-dashboard"])

    def _start(self, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.folder, f"process-{len(self.processes)}.log"), "w")  # noqa: SIM115
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.processes.append(process)
        return process

    def add_worker(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--nthreads", "1"]
        return self._start([*argv, "--no-dashboard", "--host", "127.0.0.1"])

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


class Chaos(threading.Thread):
    """Kills a worker serving nodes every ~``every`` s (without replacement) down to one, then adds
    ``joins`` workers, one every ~``every`` s; each event only once the previous kill was recovered."""

    def __init__(self, cluster: Cluster, client: Client, workers: list, every: float, joins: int, seed: int) -> None:
        super().__init__(name="elastic-soak chaos", daemon=True)
        self.cluster, self.client, self.workers, self.every, self.joins = cluster, client, workers, every, joins
        self.rng = random.Random(seed)
        self.kills: list[float] = []
        self.joined: list[float] = []
        self.recovered: list[float] = []
        """Time of the first commit of an epoch run after each recovery (``on_epoch``)."""
        self.recoveries = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def committed(self, record: dj.EpochRecord) -> None:
        """``on_epoch``: an epoch was committed."""
        with self.lock:
            while record.recoveries > len(self.recovered) and len(self.recovered) < len(self.kills):
                self.recovered.append(time.time())
            self.recoveries = max(self.recoveries, record.recoveries)

    def _serving_pids(self) -> set[int]:
        """The process-group leaders (``dask worker`` commands) of the workers serving nodes now."""
        table = self.client.scheduler_info(n_workers=-1)["workers"]
        serving = [a for a, w in table.items() if any(v > 0 for r, v in w["resources"].items() if "node" in r)]
        return set(self.client.run(os.getppid, workers=serving, on_error="ignore").values())

    def run(self) -> None:
        while not self.stop.wait(self.every * self.rng.uniform(0.5, 1.5)):
            with self.lock:
                if len(self.recovered) < len(self.kills):  # the last kill is not recovered from yet
                    continue
            alive = [w for w in self.workers if w.poll() is None]
            if len(alive) > 1 and not self.joined:
                victims = [w for w in alive if w.pid in self._serving_pids()]
                victim = self.rng.choice(victims or alive)
                os.killpg(victim.pid, signal.SIGKILL)
                self.kills.append(time.time())
            elif len(self.joined) < self.joins:
                self.workers.append(self.cluster.add_worker())
                self.joined.append(time.time())
            else:
                return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--blobs", type=int, default=10)
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=700)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--pause", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    nodes = [f"n{i}" for i in range(args.nodes)]
    marks = Marks()
    logger = logging.getLogger("daskjobs")
    logger.addHandler(marks)
    logger.setLevel(logging.INFO)
    folder = tempfile.mkdtemp(prefix="daskjobs-elastic-soak-")
    cluster = Cluster(folder)
    try:
        workers = [cluster.add_worker() for _ in range(args.workers)]
        with Client(cluster.address, timeout=60, set_as_default=False) as client:
            client.wait_for_workers(args.workers, timeout=120)
            chaos = Chaos(cluster, client, workers, args.every, args.workers - 1, args.seed)
            job = define_job(nodes, args.blobs, args.size, args.pause, args.epochs)
            manager = dj.MultiNodeCheckpointManager(os.path.join(folder, "ckpt"), keep_last=3)
            runner = dj.JobRunner(job, manager, max_failures=args.workers, on_epoch=chaos.committed, progress=False)
            with dj.DaskSession(client) as session:
                started = time.time()
                chaos.start()
                last = runner.train(session)
                elapsed = time.time() - started
                chaos.stop.set()
                final = {n: {b: session.fetch(blob_name(b), n) for b in range(args.blobs)} for n in nodes}
                placement = session.placement
        reference_job = define_job(nodes, args.blobs, args.size, 0.0, args.epochs)
        with dj.LocalSession() as local:
            dj.JobRunner(reference_job, progress=False).train(local)
            expected = {n: {b: local.fetch(blob_name(b), n) for b in range(args.blobs)} for n in nodes}
        view = dj.open_checkpoint(os.path.join(folder, "ckpt"))
        committed_equal = all(
            view[n][blob_name(b)].tobytes() == expected[n][b].tobytes() for n in nodes for b in range(args.blobs)
        )
    finally:
        cluster.close()
    equal = all(final[n][b].tobytes() == expected[n][b].tobytes() for n in nodes for b in range(args.blobs))
    per_kill = []
    for i, killed in enumerate(chaos.kills):
        lost = next((t for t in marks.lost if t >= killed), None)
        placed = next((t for t in marks.placed if lost is not None and t >= lost), None)
        done = chaos.recovered[i] if i < len(chaos.recovered) else None
        per_kill.append(
            {
                "kill_to_loss_noticed_s": None if lost is None else lost - killed,
                "kill_to_placed_again_s": None if placed is None else placed - killed,
                "kill_to_next_epoch_committed_s": None if done is None else done - killed,
            }
        )
    per_join = [next((t - joined for t in marks.moved if t >= joined), None) for joined in chaos.joined]
    latencies = [k["kill_to_next_epoch_committed_s"] for k in per_kill if k["kill_to_next_epoch_committed_s"]]
    complete = len(chaos.kills) == args.workers - 1 and len(chaos.joined) == args.workers - 1
    print(f"{'kill':>4} {'noticed s':>10} {'placed s':>10} {'committed s':>12}", file=sys.stderr)
    for i, k in enumerate(per_kill, 1):
        cells = [k["kill_to_loss_noticed_s"], k["kill_to_placed_again_s"], k["kill_to_next_epoch_committed_s"]]
        print(f"{i:>4} " + " ".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells), file=sys.stderr)
    print(f"joins: first move onto the new worker after {per_join} s", file=sys.stderr)
    print(
        f"last epoch {last}, {elapsed:.1f} s; equal to an uninterrupted run: {equal} (last commit: {committed_equal}); "
        f"workers at the end {len(set(placement.values()))}; all events happened: {complete}",
        file=sys.stderr,
    )
    write_json(
        {
            "nodes": args.nodes,
            "blobs": args.blobs,
            "size": args.size,
            "workers": args.workers,
            "epochs": last,
            "seconds": elapsed,
            "kills": per_kill,
            "joins_to_first_move_s": per_join,
            "median_kill_to_next_epoch_committed_s": statistics.median(latencies) if latencies else None,
            "recoveries": runner.history[-1].recoveries if runner.history else None,
            "equal": equal,
            "last_commit_equal": committed_equal,
            "final_workers": len(set(placement.values())),
            "all_events_happened": complete,
            "target": "equal to an uninterrupted run; kill -> next epoch committed <= 2 s + restore",
        },
        args.json,
    )
    shutil.rmtree(folder, ignore_errors=True)
    return 0 if equal and committed_equal and complete else 1


if __name__ == "__main__":
    sys.exit(main())
