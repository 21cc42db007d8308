"""Run a daskjobs job on SLURM or PBS through dask-jobqueue, on a pool of identical workers.

dask-jobqueue starts identical workers, which is what daskjobs needs: workers without daskjobs node
resources form a pool, and daskjobs places the job's nodes on them itself, moves them when batch
jobs end or start, and restores every node from the last commit when a worker is lost. The cluster
can be adaptive: ``cluster.adapt(minimum=..., maximum=...)``.

Usage (on the login node, with ``pip install dask-jobqueue``)::

    python jobqueue_pool.py train.py:job /shared/checkpoints/train
"""

from __future__ import annotations

import sys

import daskjobs as dj

WORKER_OPTIONS = {"cores": 2, "processes": 1, "memory": "8GB", "walltime": "02:00:00"}
"""One worker process with 2 threads per batch job; give its job scripts what your steps need."""


def main(target: str, prefix: str) -> int:
    """Train the job named by ``target`` on an adaptive SLURM pool, checkpointed under ``prefix``."""
    from dask_jobqueue import SLURMCluster  # or PBSCluster: the same options

    from daskjobs.cli import load_job

    job = load_job(target)
    cluster = SLURMCluster(**WORKER_OPTIONS)
    cluster.adapt(minimum=1, maximum=len(job.nodes()))  # batch jobs come and go: the nodes follow
    with dj.DaskSession(cluster) as session:
        session.wait_for_nodes(job.nodes(), timeout=600)  # batch jobs may queue for a while
        last = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_failures=3).train(session)
    print(f"last epoch {last}, committed under {prefix}")
    cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
