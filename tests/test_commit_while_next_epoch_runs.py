"""A runner writes the commit record of epoch ``e`` while epoch ``e + 1`` runs.

The nodes saved epoch ``e`` inside its own graph; the driver's commit (record, fsync, retention)
then overlaps the next epoch instead of delaying it. Whatever ends the loop commits the waiting
epoch first, the next save reuses its chunks (delta) although it is not committed yet, and a
commit that fails is retried and then decided by ``on_save_error`` like any save error.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointWriteError, TaskFailedError

NODES = ("ps", "trainer_0")
BLOB = 8192  # float64 elements: 64 KiB


def commit_file(prefix: str, epoch: int) -> str:
    return os.path.join(prefix, "__daskjobs__", "commits", f"epoch-{epoch:012d}.json")


def make_job(
    name: str = "overlap", *, fail_at: int | None = None, block_commit_of: tuple[str, int] | None = None
) -> dj.Job:
    """``a`` changes in even epochs, ``b`` in odd ones. ``fail_at``: a step raises in that epoch.
    ``block_commit_of=(prefix, epoch)``: a step of that epoch puts a directory where its commit
    record goes (a real, lasting write failure of that one commit)."""

    def update(ws):
        name = "a" if ws.epoch % 2 == 0 else "b"
        ws[name] = ws[name] + 1.0
        if ws.epoch == fail_at:
            raise RuntimeError(f"step fails in epoch {ws.epoch}")

    with dj.Cluster(), dj.Job(name=name) as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(a=np.zeros(BLOB), b=np.zeros(BLOB)))
                dj.Task(update, name="update")
    if block_commit_of is not None:
        prefix, epoch = block_commit_of

        def block(ws):
            if ws.epoch == epoch:
                os.makedirs(commit_file(prefix, epoch))

        with job, dj.Node("ps"):
            dj.Task(block, name="block")
    return job


def committed(prefix: str) -> list[int]:
    return [info.epoch for info in dj.list_checkpoints(prefix)]


def expected(epoch: int) -> dict[str, np.ndarray]:
    """Each node's blobs after ``epoch`` (epoch 0 is the state init left)."""
    evens = sum(1 for e in range(1, epoch + 1) if e % 2 == 0)
    return {"a": np.full(BLOB, float(evens)), "b": np.full(BLOB, float(epoch - evens))}


def check_epoch(prefix: str, epoch: int) -> None:
    view = dj.open_checkpoint(prefix, epoch)
    for node in NODES:
        for name, want in expected(epoch).items():
            np.testing.assert_array_equal(view[node][name], want)


def test_on_epoch_sees_its_epoch_committed(session, prefix):
    seen: list[tuple[int, list[int]]] = []
    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(
        make_job(), manager, max_epochs=5, progress=False, on_epoch=lambda r: seen.append((r.epoch, committed(prefix)))
    )
    assert runner.train(session) == 5
    assert seen == [(e, list(range(e + 1))) for e in range(1, 6)]


def test_the_next_save_reuses_the_chunks_of_the_epoch_waiting_for_its_commit(session, prefix):
    """Epoch ``e`` changes one of two equal blobs: it writes that one and reuses the other from
    epoch ``e - 1``, whose commit was still to be written when epoch ``e``'s save started."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(make_job(), manager, max_epochs=6, progress=False)
    runner.train(session)
    size = BLOB * 8 * len(NODES)
    for record in runner.history:
        assert (record.bytes_written, record.bytes_reused) == (size, size), record
    for epoch in range(7):
        check_epoch(prefix, epoch)


def test_a_failing_epoch_leaves_the_epoch_before_committed(session, prefix):
    manager = dj.MultiNodeCheckpointManager(prefix)
    with pytest.raises(TaskFailedError, match="epoch 4"):
        dj.JobRunner(make_job(fail_at=4), manager, max_epochs=6, progress=False).train(session)
    assert committed(prefix) == [0, 1, 2, 3]
    check_epoch(prefix, 3)
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)
    assert runner.train(session) == 6
    assert [r.epoch for r in runner.history] == [4, 5, 6]
    check_epoch(prefix, 6)


def test_a_commit_that_keeps_failing_stops_the_job_and_keeps_the_last_commit(session, prefix):
    job = make_job(block_commit_of=(prefix, 3))
    manager = dj.MultiNodeCheckpointManager(prefix)
    with pytest.raises(CheckpointWriteError, match="epoch 3"):
        dj.JobRunner(job, manager, max_epochs=6, progress=False, save_retries=1).train(session)
    assert committed(prefix) == [0, 1, 2]
    check_epoch(prefix, 2)
    os.rmdir(commit_file(prefix, 3))
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)
    assert runner.train(session) == 6
    assert [r.epoch for r in runner.history] == [3, 4, 5, 6]
    check_epoch(prefix, 6)


def test_with_on_save_error_warn_a_failed_commit_is_skipped_and_the_next_epochs_commit(session, prefix, caplog):
    job = make_job(block_commit_of=(prefix, 3))
    manager = dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(job, manager, max_epochs=6, progress=False, save_retries=1, on_save_error="warn")
    assert runner.train(session) == 6
    assert committed(prefix) == [0, 1, 2, 4, 5, 6]
    assert "epoch 3" in caplog.text
    for epoch in (4, 5, 6):  # epoch 4 reused chunks of epoch 3's group, which was never committed
        check_epoch(prefix, epoch)
    assert [r.epoch for r in runner.history] == [1, 2, 3, 4, 5, 6]
    assert runner.history[3].bytes_reused > 0


def test_a_failed_commit_can_be_tried_again(prefix):
    """The nodes' entries stay with the manager until the commit succeeds (a retry used to find none)."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(nodes=["n"], job_name="retry")
    with dj.LocalSession() as session:
        session.feed("w", np.arange(4.0), node="n")
        session.run_group(manager.save(0), job="retry", epoch=0)
        os.makedirs(commit_file(prefix, 0))
        with pytest.raises(CheckpointWriteError, match="epoch 0"):
            manager.write_checkpoint_metadata(0)
        os.rmdir(commit_file(prefix, 0))
        manager.write_checkpoint_metadata(0)
    assert committed(prefix) == [0]
    np.testing.assert_array_equal(dj.open_checkpoint(prefix, 0)["n"]["w"], np.arange(4.0))


@pytest.mark.parametrize("limit", ["max_epochs", "epoch_limiter"])
def test_a_checkpointed_run_runs_no_more_groups_than_a_plain_one(session, prefix, monkeypatch, limit):
    """Epoch 0 is saved at the end of the init group's graph and every epoch in its own; the last
    epoch (known in advance here) is made durable in its graph, so ending the run asks nothing more.
    On a cluster one group comes first: the proof that every node sees the prefix (SPEC §3)."""
    labels: list[str] = []
    run_group = session.run_group

    def counted(group, **kwargs):
        labels.append(group.label)
        return run_group(group, **kwargs)

    monkeypatch.setattr(session, "run_group", counted)

    def train(manager):
        job = make_job()
        if limit == "epoch_limiter":
            dj.epoch_limiter(job, 4)
        labels.clear()
        dj.JobRunner(job, manager, max_epochs=4 if limit == "max_epochs" else None, progress=False).train(session)
        return list(labels)

    plain = train(None)
    proof = [] if session.in_process else ["checkpoint_probe"]
    assert train(dj.MultiNodeCheckpointManager(prefix)) == [*proof, *plain]
    assert committed(prefix) == [0, 1, 2, 3, 4]
    for epoch in range(5):
        check_epoch(prefix, epoch)


def test_a_run_ended_by_its_stop_condition_commits_every_epoch(session, prefix):
    """The last epoch was not known in advance: ending the run waits for its flush and commits it."""
    job = make_job()
    with job, dj.Node("ps"):
        stop = dj.Task(lambda ws: ws.__setitem__("stop", np.bool_(ws.epoch >= 3)), outputs=["stop"], name="stop")
    job.add_stop_condition(stop.outputs()[0])
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(session) == 3
    assert committed(prefix) == [0, 1, 2, 3]
    check_epoch(prefix, 3)
