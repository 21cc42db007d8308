"""SPEC §6 recovery: a node's worker is SIGKILLed between epochs; time until the next epoch completes.

Runs a small checkpointed job on ``node_cluster`` (Nanny workers restart in ~0.8 s), kills one
worker after some epochs and reports, per trial, the time from the kill to the end of the next
epoch, and how much of it the restore took. Target: next epoch running within 2 s plus restore time.

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


def define_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="recovery-bench") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("weights", np.zeros(1 << 16)))
                dj.Task(lambda ws: ws.__setitem__("weights", ws["weights"] + 1))
    return job


def trial(cluster: object, kill_after: int = 3) -> dict[str, float]:
    with dj.DaskSession(cluster) as session:
        worker = next(a for a, w in session.client.scheduler_info()["workers"].items() if w["name"] == "b")
        pid = session.client.run(os.getpid, workers=[worker])[worker]
        marks: dict[str, float] = {}

        def on_epoch(record: dj.EpochRecord) -> None:
            if record.epoch == kill_after:
                marks["killed"] = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
            elif "killed" in marks and "next_epoch_done" not in marks:
                marks["next_epoch_done"] = time.perf_counter()
                marks["next_epoch_seconds"] = record.seconds + record.checkpoint_seconds

        class Restore(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "restoring all nodes" in record.getMessage():
                    marks["restore_started"] = time.perf_counter()

        handler = Restore()
        logging.getLogger("daskjobs").addHandler(handler)
        try:
            manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp(prefix="daskjobs-recovery-"))
            dj.JobRunner(define_job(), manager, max_epochs=kill_after + 3, on_epoch=on_epoch, progress=False).train(
                session
            )
        finally:
            logging.getLogger("daskjobs").removeHandler(handler)
    total = marks["next_epoch_done"] - marks["killed"]
    return {
        "kill_to_next_epoch_done_s": total,
        "next_epoch_s": marks["next_epoch_seconds"],
        "detect_and_restore_s": total - marks["next_epoch_seconds"],
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
