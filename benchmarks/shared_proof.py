"""SPEC §3 "Shared storage": what proving the prefix shared adds to a ``train()`` on a node_cluster.

Before a run writes or loads anything, the driver writes a probe file, every node's worker reads it
and writes its own (one group run), and the driver reads those back and removes them all
(``MultiNodeCheckpointManager.check_shared``). Per node count this measures, interleaved, ``--runs``
times each, on a ``node_cluster`` of worker processes and a local-disk prefix:

* ``proof``: ``check_shared`` alone;
* ``no-op group``: a group of one empty task per node (the round trip the proof rides on);
* ``train``, ``train without proof``: a whole fresh ``train()`` of a job of N nodes to epoch 1
  (init, epoch-0 save, one epoch and its save), with the proof and with it replaced by nothing.

Medians in milliseconds; the added cost is (train) - (train without proof). ``--s3`` also counts the
S3 requests of one proof against a moto server (workers as threads of this process, so that every
request goes through this process's s3fs and its ``CALL:`` debug log). Prints a table and one JSON
line per node count.

    python benchmarks/shared_proof.py [--nodes 2,8] [--runs 15] [--s3]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

import daskjobs as dj
from daskjobs.checkpoint import MultiNodeCheckpointManager


def init(ws: dj.Workspace) -> None:
    ws["w"] = np.zeros(1024)


def step(ws: dj.Workspace) -> None:
    ws["w"] = ws["w"] + 1


def idle(ws: dj.Workspace) -> None:
    """An empty step."""


def define_job(nodes: list[str]) -> dj.Job:
    with dj.Cluster(), dj.Job(name="shared-proof") as job:
        for node in nodes:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init)
                dj.Task(step)
    return job


def no_op_group(nodes: list[str]) -> dj.TaskGroup:
    group = dj.TaskGroup(dj.WorkspaceType.PRIVATE)
    for node in nodes:
        dj.Task(idle, group=group, node=node)
    return group


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def measure(count: int, runs: int, root: Path) -> dict[str, float]:
    nodes = [f"n{i}" for i in range(count)]
    samples: dict[str, list[float]] = {"proof": [], "no-op group": [], "train": [], "train without proof": []}
    proof = MultiNodeCheckpointManager.check_shared
    with dj.node_cluster(nodes, nthreads=1) as cluster, dj.DaskSession(cluster) as session:
        manager = MultiNodeCheckpointManager(str(root / "proof"))
        manager.set_params(nodes)
        manager.store.check_writable()

        def train(with_proof: bool) -> None:
            prefix = root / uuid.uuid4().hex
            MultiNodeCheckpointManager.check_shared = proof if with_proof else lambda self, session: None
            try:
                runner = dj.JobRunner(
                    define_job(nodes), MultiNodeCheckpointManager(str(prefix)), max_epochs=1, progress=False
                )
                runner.train(session)
            finally:
                MultiNodeCheckpointManager.check_shared = proof
                shutil.rmtree(prefix)

        kinds: dict[str, Callable[[], object]] = {
            "proof": lambda: manager.check_shared(session),
            "no-op group": lambda: session.run(no_op_group(nodes)),
            "train": lambda: train(True),
            "train without proof": lambda: train(False),
        }
        for call in kinds.values():  # warm-up: placement checks, imports, first pickles
            call()
        for _ in range(runs):
            for kind, call in kinds.items():
                samples[kind].append(timed(call))
    return {kind: statistics.median(values) for kind, values in samples.items()}


def count_s3_requests(count: int) -> int:
    """S3 requests of one proof over ``count`` nodes, against a moto server on 127.0.0.1."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
        bucket = f"proof-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        nodes = [f"n{i}" for i in range(count)]
        manager = MultiNodeCheckpointManager(f"s3://{bucket}/ckpt", storage_options=options)
        manager.set_params(nodes)
        calls: list[str] = []

        class Counter(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage().startswith("CALL:"):
                    calls.append(record.getMessage())

        with dj.node_cluster(nodes, processes=False) as cluster, dj.DaskSession(cluster) as session:
            session.run(no_op_group(nodes))
            logger = logging.getLogger("s3fs")
            handler, level = Counter(), logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            try:
                manager.check_shared(session)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
        return len(calls)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,8", help="comma-separated node counts")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--s3", action="store_true", help="also count the S3 requests of one proof (moto)")
    parser.add_argument("--dir", default=None, help="folder for the prefixes (default: a temp folder)")
    args = parser.parse_args()
    counts = [int(c) for c in args.nodes.split(",")]
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for count in counts:
            medians = measure(count, args.runs, Path(folder))
            added = medians["train"] - medians["train without proof"]
            result = {"nodes": count, "runs": args.runs, **{k: round(v, 2) for k, v in medians.items()}}
            result["added"] = round(added, 2)
            if args.s3:
                result["s3_requests"] = count_s3_requests(count)
            results.append(result)
    header = f"{'nodes':>5} {'proof ms':>9} {'no-op group ms':>15} {'train ms':>9} {'w/o proof ms':>13} {'added ms':>9}"
    print(header + (f" {'S3 requests':>12}" if args.s3 else ""))
    for r in results:
        line = f"{r['nodes']:>5} {r['proof']:>9.2f} {r['no-op group']:>15.2f} {r['train']:>9.2f}"
        line += f" {r['train without proof']:>13.2f} {r['added']:>9.2f}"
        print(line + (f" {r['s3_requests']:>12}" if args.s3 else ""))
    for r in results:
        print(json.dumps({"benchmark": "shared_proof", **r}))


if __name__ == "__main__":
    main()
