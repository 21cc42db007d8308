"""Run a daskjobs job on SLURM or PBS through dask-jobqueue: one batch job (one worker) per node.

A daskjobs node runs on the one worker that provides its resource ``dj.node_resource(node)``.
dask-jobqueue starts identical workers, so :func:`add_node_workers` adds one worker spec per
node to the cluster, each with that node's ``--resources`` and named after the node.

Usage (on the login node, with ``pip install dask-jobqueue``)::

    python jobqueue_nodes.py train.py:job /shared/checkpoints/train
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable
from typing import Any

import daskjobs as dj


def add_node_workers(cluster: Any, nodes: Iterable[str], nthreads: int) -> None:
    """Give a dask-jobqueue ``cluster`` (built with ``processes=1``) one worker per node.

    Each worker is a batch job named after its node that provides ``nthreads`` units of the
    node's resource (so up to ``nthreads`` of the node's tasks run at once); start them with
    ``cluster.scale(len(nodes))``.
    """
    for node in nodes:
        spec = copy.deepcopy(cluster.new_spec)
        extra = list(spec["options"].get("worker_extra_args") or [])
        spec["options"]["worker_extra_args"] = [*extra, "--resources", f"{dj.node_resource(node)}={nthreads}"]
        cluster.worker_spec[node] = spec


def main(target: str, prefix: str) -> int:
    """Start one SLURM job per node of the job named by ``target`` and train it, checkpointed."""
    from dask_jobqueue import SLURMCluster  # or PBSCluster: the same options

    from daskjobs.cli import load_job

    job = load_job(target)
    cluster = SLURMCluster(cores=2, processes=1, memory="8GB", walltime="02:00:00")
    add_node_workers(cluster, job.nodes(), nthreads=2)
    cluster.scale(len(job.nodes()))
    with dj.DaskSession(cluster) as session:
        session.wait_for_nodes(job.nodes(), timeout=600)  # batch jobs may queue for a while
        last = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix)).train(session)
    print(f"last epoch {last}, committed under {prefix}")
    cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
