"""``runner.save_checkpoints`` and ``runner.load_blobs_from_checkpoints`` on a runner that has not
trained: the manager is set up for the job first, as ``train()`` does."""

from __future__ import annotations

import numpy as np

import daskjobs as dj

NODES = ["a", "b"]


def define() -> dj.Job:
    """Nodes ``a`` and ``b`` counting epochs in ``n``."""
    with dj.Cluster(), dj.Job(name="manual") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)), name="init")
                dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


def test_save_checkpoints_before_train_commits_the_epoch_for_the_job(session, prefix):
    """The epoch is committed with the job's name and nodes, and a later train() resumes from it."""
    for value, node in enumerate(NODES, start=5):
        session.feed("n", np.int64(value), node=node)
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), progress=False, save_retries=0)
    runner.save_checkpoints(4, session, {"done": False})
    (info,) = dj.list_checkpoints(prefix)
    assert (info.epoch, info.job, sorted(info.nodes)) == (4, "manual", NODES)
    view = dj.open_checkpoint(prefix)
    assert (int(view["a"]["n"]), int(view["b"]["n"])) == (5, 6)
    assert view.record["stop_values"] == {"done": False}
    again = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)
    assert again.train(session) == 6
    assert [r.epoch for r in again.history] == [5, 6]
    assert (int(session.fetch("n", node="a")), int(session.fetch("n", node="b"))) == (7, 8)


def test_load_blobs_from_checkpoints_before_train(session, prefix):
    """A fresh runner (and manager) loads blobs of a committed epoch into every node."""
    dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(None)
    fresh = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert fresh.load_blobs_from_checkpoints(["n"], 2, session) is True
    assert [int(session.fetch("n", node=n)) for n in NODES] == [2, 2]
