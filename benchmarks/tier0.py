"""SPEC §6 Tier 0: checkpoints in cluster memory, what they cost and how fast a lost worker comes back.

Three parts (``--part``, default all):

* ``overhead`` (a): the tiny 2-node job of ``save_every_epoch.py`` (2 nodes x 2 tasks, a node
  per worker process) and the 64-node job of ``scale_nodes.py`` (2 worker processes, one thread
  per node), each without checkpoints and with tier 0 (``in_memory=True``, a snapshot of every
  node in memory every epoch with one replica (``--replicas``), a durable commit every 10 epochs on
  local disk).
  An epoch's cost is the time between the ends of consecutive epochs (``RunnerHooks.epoch_saved``:
  the epoch's run, its snapshots, the commit of the epoch before) averaged over a window of
  ``--epochs`` epochs that holds whole cycles of ``durable_every`` (so a durable epoch's share is
  in it), after ``--warmup`` epochs. Runs alternate, ``--rounds`` rounds; the figure of a variant
  is the median over its runs. Target: tier 0 ≤ 1.1x no checkpoints, for both jobs. Also the CPU
  time of the same window (user + system, of the driver's process, which holds the scheduler, and
  of the workers' processes) per epoch: on a machine other jobs share, the wall-clock ratio moves
  with their load, what tier 0 adds to the work of the processes much less.
* ``recovery`` (b, d): a 2-node job, twice: on a ``node_cluster`` (pinned: a nanny restarts a
  killed worker, and its node waits for it) and on two pool workers (the lost node moves to the
  other worker at once); ``--mib`` MiB per node, durable every 10; a node's worker is SIGKILLed in the middle of an
  epoch; measured: the time from the kill to the commit (in memory) of the epoch run again, the
  bytes restored from memory, and every read under the prefix by the driver and every worker
  process from the kill to that commit (an audit hook counting opens for reading and listings:
  target 0). The time has parts: noticing the loss, waiting for the node's new worker (pinned:
  the nanny's restart, ~1 s here), the restore (the snapshot's transfer) and the epoch run again. Also (d) the
  tier-0 bytes held (``tier0_bytes`` of the last record, and what the workers actually hold,
  asked from each worker) against (1 + replicas) x the workspace bytes.
* the kill soak (c) is ``kill_soak.py --in-memory --durable-every 10`` (and ``--kill-pairs``).

Prints tables (stderr) and JSON (stdout, or ``--json FILE``). The machine's load average is in the
JSON: the figures are medians on a machine other jobs share.

``--split`` adds, interleaved with those runs, tier 0 without a replica, without the durable epochs
between the first and the last, and with neither: what the replica and the durable epochs each add.

Run: ``python benchmarks/tier0.py [--part overhead|recovery] [--rounds 5] [--epochs 40] [--split]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import psutil
from _report import write_json
from save_every_epoch import define_job as tiny_job
from scale_nodes import define_job as scale_job

import daskjobs as dj
from daskjobs.session._pool import pool_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prefix_reads import ROOT_VARIABLE, reads_everywhere, watch

DURABLE_EVERY = 10
ONLY_FIRST_AND_LAST = 10**9
"""``durable_every`` of the split's runs without durable epochs between the first and the last."""


def cluster_cpu() -> float:
    """CPU seconds (user + system) this process (the driver, with a ``node_cluster``'s scheduler) and
    its child processes (the nannies and workers) have used so far."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


class EpochEnds(dj.RunnerHooks):
    """Stamps the end of every epoch (its run, snapshots and the previous epoch's commit), and the
    CPU time used when the epochs in ``marks`` end."""

    def __init__(self, marks: tuple[int, ...] = ()) -> None:
        self.ends: list[float] = []
        self.cpu: dict[int, float] = {}
        self.marks = marks

    def epoch_saved(self, epoch: int) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) - 1 in self.marks:
            self.cpu[len(self.ends) - 1] = cluster_cpu()


@dataclass(frozen=True)
class Setting:
    """What a run keeps: nothing (``replicas`` ``None``: no checkpoints), or tier 0 with ``replicas``
    and a durable commit every ``durable_every`` epochs (``None``: at the first and last epoch only)."""

    replicas: int | None = None
    durable_every: int | None = DURABLE_EVERY

    def manager(self, prefix: str) -> dj.MultiNodeCheckpointManager | None:
        if self.replicas is None:
            return None
        every = self.durable_every or ONLY_FIRST_AND_LAST
        return dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=every, replicas=self.replicas)


def epoch_cost(
    session: dj.Session, job: dj.Job, epochs: int, warmup: int, setting: Setting, folder: str
) -> tuple[float, float]:
    """Mean seconds per epoch of one run, epochs ``warmup``..``warmup + epochs``, and the CPU seconds
    per epoch of the driver's and the workers' processes in that window."""
    prefix = tempfile.mkdtemp(dir=folder)
    hooks = EpochEnds(marks=(warmup, warmup + epochs))
    runner = dj.JobRunner(job, setting.manager(prefix), max_epochs=warmup + epochs + 2, progress=False, hooks=hooks)
    runner.train(session)
    shutil.rmtree(prefix, ignore_errors=True)
    window = hooks.ends[warmup : warmup + epochs + 1]
    cpu = (hooks.cpu[warmup + epochs] - hooks.cpu[warmup]) / epochs
    return (window[-1] - window[0]) / (len(window) - 1), cpu


def settings(args: argparse.Namespace) -> dict[str, Setting]:
    """The variants a run of the overhead part measures, interleaved: no checkpoints and tier 0 as
    asked; with ``--split`` also tier 0 without a replica and without the durable epochs between the
    first and the last, and with neither (so what each part costs is in the same run)."""
    found = {"no checkpoints": Setting(), "tier 0": Setting(args.replicas)}
    if args.split:
        found["tier 0, no replica"] = Setting(0)
        found["tier 0, durable first and last only"] = Setting(args.replicas, None)
        found["tier 0, neither"] = Setting(0, None)
    return found


def overhead(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    nodes = [f"n{i:03d}" for i in range(args.nodes)]
    setups = {
        "tiny": (lambda: dj.node_cluster(["a", "b"], nthreads=2), tiny_job),
        f"{args.nodes}-node": (
            lambda: dj.node_cluster({"w0": nodes[0::2], "w1": nodes[1::2]}, nthreads=-(-args.nodes // 2)),
            lambda: scale_job(nodes),
        ),
    }
    variants = settings(args)
    for name, (make_cluster, make_job) in setups.items():
        costs: dict[str, list[float]] = {variant: [] for variant in variants}
        cpus: dict[str, list[float]] = {variant: [] for variant in variants}
        with make_cluster() as cluster, dj.DaskSession(cluster) as session:
            epoch_cost(session, make_job(), 5, 2, Setting(args.replicas), folder)  # warm-up
            for number in range(args.rounds):
                order = list(variants) if number % 2 == 0 else list(variants)[::-1]
                for variant in order:
                    cost, cpu = epoch_cost(session, make_job(), args.epochs, args.warmup, variants[variant], folder)
                    costs[variant].append(cost)
                    cpus[variant].append(cpu)
        medians = {variant: 1000 * statistics.median(values) for variant, values in costs.items()}
        cpu_medians = {variant: 1000 * statistics.median(values) for variant, values in cpus.items()}
        result[name] = {
            "ms_per_epoch": medians,
            "runs_ms": {variant: [round(1000 * v, 3) for v in values] for variant, values in costs.items()},
            "ratio": medians["tier 0"] / medians["no checkpoints"],
            "ratios": {variant: ms / medians["no checkpoints"] for variant, ms in medians.items()},
            "cpu_ms_per_epoch": cpu_medians,
            "cpu_runs_ms": {variant: [round(1000 * v, 3) for v in values] for variant, values in cpus.items()},
            "cpu_ratio": cpu_medians["tier 0"] / cpu_medians["no checkpoints"],
            "target": 1.1,
            "replicas": args.replicas,
        }
    return result


def _consume(ws: dj.Workspace) -> None:
    time.sleep(0.2)
    ws["w"] = ws["w"] + 1.0


def recovery_job(mib: int) -> dj.Job:
    with dj.Cluster(), dj.Job(name="tier0-recovery") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws, n=mib: ws.__setitem__("w", np.zeros(max(1, n << 17))))
                dj.Task(_consume)
    return job


def held_on_workers(dask_worker: Any) -> int:
    """``client.run`` target: bytes of tier-0 snapshots this worker holds (keys ``...-tier0-...``)."""
    total = 0
    for key in list(dask_worker.data):
        if "-tier0-" in str(key) and "-restore-" not in str(key):
            ts = dask_worker.state.tasks.get(key)
            total += ts.nbytes if ts is not None and ts.nbytes else 0
    return total


def recovery(args: argparse.Namespace, folder: str, kind: str) -> dict[str, Any]:
    """``kind``: ``pinned`` (a worker per node; the lost node waits for its worker's nanny to restart
    it) or ``pool`` (two pool workers; the lost node moves to the other at once)."""
    trials = []
    os.environ[ROOT_VARIABLE] = folder
    watch(folder)
    preload = dask.config.set({"distributed.worker.preload": ["prefix_reads"]})
    make = (lambda: dj.node_cluster(["a", "b"], nthreads=2)) if kind == "pinned" else (lambda: pool_cluster(2))
    with preload, make() as cluster, dj.DaskSession(cluster) as session:
        client = session.client
        for _ in range(args.trials):
            prefix = tempfile.mkdtemp(dir=folder)
            marks: dict[str, Any] = {}

            class Kill(dj.RunnerHooks):
                def epoch_running(self, epoch: int) -> None:
                    if epoch < 4:  # what the workers hold in the middle of the epoch
                        held = marks.setdefault("held", [])
                        threading.Timer(0.1, lambda: held.append(sum(client.run(held_on_workers).values()))).start()
                    if epoch == 4 and "killed" not in marks:
                        worker = session.placement["b"]
                        pid = client.run(os.getpid, workers=[worker])[worker]
                        reads_everywhere(client)

                        def strike() -> None:
                            marks["killed"] = time.perf_counter()
                            os.kill(pid, signal.SIGKILL)

                        threading.Timer(0.05, strike).start()

            def on_epoch(record: dj.EpochRecord, marks: dict[str, Any] = marks) -> None:
                if record.recoveries and "committed" not in marks:
                    marks["committed"] = time.perf_counter()
                    marks["reads"] = reads_everywhere(client)
                    marks["restored"] = record

            manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=DURABLE_EVERY)
            job = recovery_job(args.mib)
            runner = dj.JobRunner(
                job, manager, max_epochs=8, max_failures=1, progress=False, hooks=Kill(), on_epoch=on_epoch
            )
            runner.train(session)
            record = marks["restored"]
            workspace = 2 * max(1, args.mib << 17) * 8
            trials.append(
                {
                    "kill_to_next_commit_s": marks["committed"] - marks["killed"],
                    "epoch_run_again_s": record.seconds,
                    "restored_from": next(r.epoch for r in runner.history if r.recoveries) - 1,
                    "prefix_reads": sum(len(found) for found in marks["reads"].values()),
                    "prefix_reads_where": {where: found[:5] for where, found in marks["reads"].items()},
                    "tier0_bytes_recorded": sum((runner.history[2].tier0_bytes or {}).values()),
                    "tier0_bytes_on_workers": marks["held"],
                    "tier0_bytes_on_workers_max": max(marks["held"]),
                    "workspace_bytes": workspace,
                }
            )
            shutil.rmtree(prefix, ignore_errors=True)
    median = {
        key: statistics.median(t[key] for t in trials)
        for key in ("kill_to_next_commit_s", "epoch_run_again_s", "prefix_reads")
    }
    replicas = 1
    workspace = trials[0]["workspace_bytes"]
    return {
        "mib_per_node": args.mib,
        "trials": trials,
        "median": median,
        "bytes_limit": (1 + replicas) * workspace * 1.1,
        "bytes_ratio_recorded": trials[0]["tier0_bytes_recorded"] / ((1 + replicas) * workspace),
        "bytes_ratio_on_workers": statistics.median(b for t in trials for b in t["tier0_bytes_on_workers"])
        / ((1 + replicas) * workspace),
        "bytes_ratio_on_workers_max": max(t["tier0_bytes_on_workers_max"] for t in trials)
        / ((1 + replicas) * workspace),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("overhead", "recovery", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each variant, interleaved (overhead)")
    parser.add_argument("--epochs", type=int, default=40, help="epochs per measured window (overhead)")
    parser.add_argument("--warmup", type=int, default=5, help="epochs of a run not counted (overhead)")
    parser.add_argument("--nodes", type=int, default=64, help="nodes of the big job (overhead)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="replicas of each snapshot (overhead; 0: only the node's own worker holds it, which a graceful "
        "departure moves and a crash loses)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="also tier 0 without a replica, without durable epochs between the first and the last, and with "
        "neither (overhead): where its cost goes",
    )
    parser.add_argument("--trials", type=int, default=5, help="kills (recovery)")
    parser.add_argument("--mib", type=int, default=16, help="MiB per node (recovery)")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="daskjobs-tier0-")
    result: dict[str, Any] = {"load_average": os.getloadavg()}
    try:
        if args.part in ("overhead", "all"):
            result["overhead"] = overhead(args, folder)
            for name, row in result["overhead"].items():
                ms = row["ms_per_epoch"]
                cpu = row["cpu_ms_per_epoch"]
                print(
                    f"(a) {name:>8} (replicas={row['replicas']}): no checkpoints {ms['no checkpoints']:.2f} ms, "
                    f"tier 0 {ms['tier 0']:.2f} ms "
                    f"per epoch: {row['ratio']:.3f}x (target <= 1.1); CPU of all processes {cpu['no checkpoints']:.2f} "
                    f"ms vs {cpu['tier 0']:.2f} ms per epoch: {row['cpu_ratio']:.3f}x",
                    file=sys.stderr,
                )
                for variant, ratio in row["ratios"].items() if args.split else ():
                    print(
                        f"    {variant:>36}: {ms[variant]:.2f} ms per epoch, {ratio:.3f}x; CPU {cpu[variant]:.2f} ms",
                        file=sys.stderr,
                    )
        if args.part in ("recovery", "all"):
            result["recovery"] = {}
            for kind in ("pinned", "pool"):
                found = result["recovery"][kind] = recovery(args, folder, kind)
                median = found["median"]
                print(
                    f"(b) {kind:>6}: kill -> next epoch committed: {median['kill_to_next_commit_s']:.3f} s (the epoch "
                    f"run again {median['epoch_run_again_s']:.3f} s), prefix reads {median['prefix_reads']} (target 0)",
                    file=sys.stderr,
                )
                print(
                    f"(d) {kind:>6}: tier-0 bytes / ((1 + replicas) x workspace): recorded "
                    f"{found['bytes_ratio_recorded']:.3f}, held on the workers while an epoch runs "
                    f"{found['bytes_ratio_on_workers']:.3f} (median; at most "
                    f"{found['bytes_ratio_on_workers_max']:.3f}) (target <= 1.1)",
                    file=sys.stderr,
                )
        result["load_average_after"] = os.getloadavg()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
