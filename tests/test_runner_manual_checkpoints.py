"""``runner.save_checkpoints`` and ``runner.load_blobs_from_checkpoints`` on a runner that has not
trained: the manager is set up for the job first, and the writer lock held, as ``train()`` does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

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


def test_save_checkpoints_holds_the_writer_lock(session, prefix):
    """Outside train() the save takes the prefix's lock and gives it back; a prefix another writer
    holds is refused with CheckpointLockedError naming the holder, and nothing is written."""
    from daskjobs.checkpoint import CheckpointStore
    from daskjobs.errors import CheckpointLockedError

    for node in NODES:
        session.feed("n", np.int64(1), node=node)
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), progress=False, save_retries=0)
    runner.save_checkpoints(1, session)
    assert CheckpointStore(prefix).read_lock() is None
    other = CheckpointStore(prefix)
    other.acquire_lock({"host": "elsewhere", "pid": 1, "job": "other"})
    with pytest.raises(CheckpointLockedError, match="elsewhere"):
        runner.save_checkpoints(2, session)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [1]
    assert not any(p.name.startswith(("a.2", "b.2")) for p in Path(prefix).iterdir())
    other.release_lock()
    runner.save_checkpoints(2, session)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [1, 2]
