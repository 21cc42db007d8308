"""SPEC §6 recovery: a node's worker is SIGKILLed while the job runs; time until the next epoch completes.

Runs a small checkpointed job on ``node_cluster`` (Nanny workers restart in ~0.8 s), kills one
worker after some epochs and reports, per trial, the time from the kill to the end of the first
epoch run after it (on the restarted worker, after the restore), and how much of it that epoch
took. Target: next epoch running within 2 s plus restore time.

The end of an epoch is stamped by the killed node's own step (wall clock, same host): the
runner's ``on_epoch`` comes later, once the epoch is committed.

    python benchmarks/recovery.py [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time

import numpy as np

import daskjobs as dj


def define_job(stamps: str) -> dj.Job:
    """Two nodes; node b appends ``<epoch> <wall time>`` to ``stamps`` at the end of each epoch's step."""

    def step_b(ws):
        ws["weights"] = ws["weights"] + 1
        with open(stamps, "a") as out:
            out.write(f"{ws.epoch} {time.time()}\n")

    with dj.Cluster(), dj.Job(name="recovery-bench") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("weights", np.zeros(1 << 16)))
                dj.Task(step_b if node == "b" else (lambda ws: ws.__setitem__("weights", ws["weights"] + 1)))
    return job


def trial(cluster: object, kill_after: int = 3) -> dict[str, float]:
    stamps = os.path.join(tempfile.mkdtemp(prefix="daskjobs-recovery-stamps-"), "stamps")
    with dj.DaskSession(cluster) as session:
        worker = next(a for a, w in session.client.scheduler_info()["workers"].items() if w["name"] == "b")
        pid = session.client.run(os.getpid, workers=[worker])[worker]
        marks: dict[str, float] = {}

        def on_epoch(record: dj.EpochRecord) -> None:
            if record.epoch == kill_after and "killed" not in marks:
                marks["killed"] = time.time()
                os.kill(pid, signal.SIGKILL)

        manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp(prefix="daskjobs-recovery-"))
        runner = dj.JobRunner(define_job(stamps), manager, max_epochs=kill_after + 6, on_epoch=on_epoch, progress=False)
        runner.train(session)
    with open(stamps) as found:
        ends = [(int(epoch), float(when)) for epoch, when in (line.split() for line in found)]
    epoch, done = min(((e, t) for e, t in ends if t > marks["killed"]), key=lambda item: item[1])
    recovered = next(r for r in runner.history if r.recoveries and r.epoch == epoch)
    total = done - marks["killed"]
    return {
        "kill_to_next_epoch_done_s": total,
        "next_epoch_s": recovered.seconds,
        "detect_and_restore_s": total - recovered.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("daskjobs").setLevel(logging.WARNING)
    with dj.node_cluster(["a", "b"], nthreads=1) as cluster:
        results = [trial(cluster) for _ in range(args.trials)]
    median = {key: round(statistics.median(r[key] for r in results), 3) for key in results[0]}
    print(f"{'kill -> next epoch done':>26} {'of which the epoch':>20}")
    for r in results:
        print(f"{r['kill_to_next_epoch_done_s']:>24.3f} s {r['next_epoch_s']:>18.3f} s")
    print(json.dumps({"trials": args.trials, "median": median, "target": "next epoch running within 2 s + restore"}))


if __name__ == "__main__":
    main()
