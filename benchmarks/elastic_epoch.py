"""SPEC §6 Elastic placement (a): an epoch on a pool of plain workers vs the same job on pinned workers.

The same job — ``--nodes`` nodes (default 4), each with one tiny step (a counter) — runs on two local
clusters of ``--workers`` worker processes (default 2, ``--nthreads`` threads each) alive side by side:

* ``pinned``: ``node_cluster`` with each worker pinned to ``nodes / workers`` of the nodes (the
  fixed shape: every node's resource given at start-up);
* ``pool``: workers without node resources (``pool_cluster``, as ``daskjobs run --workers`` starts
  them); the session places the nodes on them itself (the same split, by nodes per thread).

Per epoch, each variant runs the job's epoch group (``DaskSession.run_group``, what ``JobRunner``
does) followed by the runner's epoch-boundary call ``session.rebalance()`` (a pool session's check
for workers that joined). Epochs of the two variants are interleaved (one of each in turn, the
order alternating) in ``--rounds`` rounds (default 7) of ``--epochs`` epochs (default 200) each; a
round's figure is the median epoch of each variant, and the result is the median over rounds of the
ratio pool / pinned. Target: at most 1.05.

Then (c): the same job, with an epoch limiter, run as a notebook runs it: ``Client()`` (a default
``LocalCluster``, its dashboard on 127.0.0.1) and ``dj.JobRunner(job).train(client)``, with no other
set-up; reported: it ran (its last epoch and every node's counter), its wall time and where the
nodes went.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/elastic_epoch.py [--nodes 4] [--workers 2] [--rounds 7] [--epochs 200]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _report import write_json
from distributed import Client

import daskjobs as dj
from daskjobs.session._pool import pool_cluster


def _init(ws: dj.Workspace) -> None:
    ws["count"] = 0


def _count(ws: dj.Workspace) -> None:
    ws["count"] = ws["count"] + 1


def define_job(nodes: list[str]) -> dj.Job:
    """Every node: a counter blob created in the init group, increased by one step per epoch."""
    with dj.Cluster(), dj.Job(name="elastic-epoch") as job:
        for node in nodes:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(_init, name="init")
                dj.Task(_count, name="count")
    return job


def notebook_run(nodes: list[str], epochs: int) -> dict[str, object]:
    """(c): the job on ``Client()`` with no set-up but the job itself."""
    job = define_job(nodes)
    with job.epoch_group, dj.Node(nodes[0]):
        dj.epoch_limiter(job, epochs)
    started = time.perf_counter()
    client = Client(dashboard_address="127.0.0.1:0")
    with client, dj.DaskSession(client) as session:
        last = dj.JobRunner(job, progress=False).train(session)
        counts = [int(session.fetch("count", node=n)) for n in nodes]
        workers = len(client.scheduler_info()["workers"])
        per_worker = sorted(list(session.placement.values()).count(a) for a in set(session.placement.values()))
    client.cluster.close()
    return {
        "last_epoch": last,
        "counts": counts,
        "ran": last == epochs and counts == [epochs] * len(nodes),
        "seconds": time.perf_counter() - started,
        "workers": workers,
        "nodes_per_worker": per_worker,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nthreads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    nodes = [f"n{i}" for i in range(args.nodes)]
    split = {f"w{w}": nodes[w :: args.workers] for w in range(args.workers)}
    job = define_job(nodes)
    with (
        dj.node_cluster(split, nthreads=args.nthreads) as pinned_cluster,
        pool_cluster(args.workers, nthreads=args.nthreads) as pool_cluster_,
        dj.DaskSession(pinned_cluster) as pinned,
        dj.DaskSession(pool_cluster_) as pool,
    ):
        sessions = {"pinned": pinned, "pool": pool}
        for session in sessions.values():
            session.start_job_run(job.name)
            session.run_group(job.init_group, job=job.name)
        per_worker = sorted(list(pool.placement.values()).count(a) for a in set(pool.placement.values()))
        epoch = 0
        rounds = []
        for _ in range(args.rounds):
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for i in range(args.epochs):
                epoch += 1
                order = list(sessions) if i % 2 == 0 else list(reversed(sessions))
                for name in order:
                    session = sessions[name]
                    start = time.perf_counter()
                    session.run_group(job.epoch_group, job=job.name, epoch=epoch)
                    session.rebalance()
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(t) for name, t in times.items()}
            rounds.append(
                {**{f"{k}_ms": v * 1e3 for k, v in medians.items()}, "ratio": medians["pool"] / medians["pinned"]}
            )
        counts = {name: [int(s.fetch("count", node=n)) for n in nodes] for name, s in sessions.items()}
    assert all(c == [epoch] * len(nodes) for c in counts.values()), counts
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"{'round':>5} {'pinned ms':>10} {'pool ms':>10} {'pool/pinned':>12}", file=sys.stderr)
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5} {r['pinned_ms']:>10.2f} {r['pool_ms']:>10.2f} {r['ratio']:>12.3f}", file=sys.stderr)
    print(
        f"median ratio pool / pinned: {ratio:.3f} (target <= 1.05); pool nodes per worker {per_worker}", file=sys.stderr
    )
    notebook = notebook_run(nodes, 20)
    print(
        f"(c) Client() and JobRunner(job).train(client): ran {notebook['ran']} (last epoch {notebook['last_epoch']}), "
        f"{notebook['seconds']:.1f} s with starting the cluster; {notebook['workers']} workers, nodes per worker "
        f"{notebook['nodes_per_worker']}",
        file=sys.stderr,
    )
    write_json(
        {
            "nodes": args.nodes,
            "workers": args.workers,
            "nthreads": args.nthreads,
            "epochs_per_round": args.epochs,
            "rounds": rounds,
            "median_ratio": ratio,
            "median_pinned_ms": statistics.median(r["pinned_ms"] for r in rounds),
            "median_pool_ms": statistics.median(r["pool_ms"] for r in rounds),
            "pool_nodes_per_worker": per_worker,
            "notebook_client": notebook,
            "target": "pool <= 1.05 x pinned; a job on Client() runs with no set-up",
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
