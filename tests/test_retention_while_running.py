"""Retention while a runner holds the lock: the commit un-commits, the driver deletes the groups.

With the writer lock held, retention un-commits the dropped epochs together with the new commit
(one fsync of the commit folder), written while the next epoch runs, and their groups are
deleted in the background: by the driver right after, or, on a cluster, by each node with its
next checkpoint's flush. Checkpointing every epoch needs no deletion on the epoch's critical
path. What is left when the run ends is deleted before the lock is released; a crash leaves only
uncommitted debris, which the next run removes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.commits import RetiredEpoch
from daskjobs.checkpoint._protocol.retention import RetiredGroups

NODES = ("ps", "trainer_0")


def make_job(name: str = "retained") -> dj.Job:
    with dj.Cluster(), dj.Job(name=name) as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(w=np.zeros(64), step=np.int64(0)))
                dj.Task(lambda ws: ws.update(w=ws["w"] + 1.0, step=ws["step"] + 1), name="update")
    return job


def group_epochs(prefix: str) -> dict[str, set[int]]:
    """The epochs of the group folders on disk, per node."""
    found: dict[str, set[int]] = {node: set() for node in NODES}
    for name in os.listdir(prefix):
        node, _, epoch = name.rpartition(".")
        if node in found and epoch.isdigit():
            found[node].add(int(epoch))
    return found


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_at_every_epoch_the_kept_groups_and_a_few_retired_ones_are_on_disk(session, prefix, keep_last):
    """At ``on_epoch(e)`` (right after epoch ``e`` committed) the commits are exactly the last
    ``keep_last``. On disk beside them: the epochs after ``e`` being written (one, or two where
    nodes flush in the background) and retired groups the background deletion has not reached
    yet; at the end exactly the kept ones."""
    seen: list[tuple[int, list[int], dict[str, set[int]]]] = []

    def on_epoch(record: dj.EpochRecord) -> None:
        committed = [info.epoch for info in dj.list_checkpoints(prefix)]
        seen.append((record.epoch, committed, group_epochs(prefix)))

    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=keep_last)
    dj.JobRunner(make_job(), manager, max_epochs=8, progress=False, on_epoch=on_epoch).train(session)
    for epoch, committed, groups in seen:
        kept = list(range(max(0, epoch - keep_last + 1), epoch + 1))
        assert committed == kept
        for node in NODES:
            ahead = 2 if session.background_flushes else 1
            assert set(kept) <= groups[node] <= set(range(epoch + ahead + 1)), (epoch, node, groups[node])
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == list(range(9 - keep_last, 9))
    assert group_epochs(prefix) == {node: set(range(9 - keep_last, 9)) for node in NODES}


@contextlib.contextmanager
def four_epochs_committed_by_hand(prefix: str) -> Iterator[tuple[dj.MultiNodeCheckpointManager, object]]:
    """A manager holding the lock (``writing``, as a runner's does) that saved and committed epochs 0-3
    with ``keep_last=1``, and its commit pipeline."""
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1)
    manager.set_params(nodes=list(NODES), job_name="retained")
    with manager.writing("retained") as pipeline:
        with dj.LocalSession() as session:
            for node in NODES:
                session.feed("w", np.arange(4.0), node=node)
            for epoch in range(4):
                session.run_group(manager.save(epoch), job="retained", epoch=epoch)
                manager.write_checkpoint_metadata(epoch)
        yield manager, pipeline


def test_groups_retired_but_not_yet_deleted_are_debris_the_next_run_removes(prefix):
    """A manager that holds the lock and commits without a runner leaves the retired groups on
    disk, uncommitted, while it holds the lock; leaving ``writing`` (or the next run's cleanup)
    deletes exactly those."""
    with four_epochs_committed_by_hand(prefix):
        assert [info.epoch for info in dj.list_checkpoints(prefix)] == [3]
        assert group_epochs(prefix) == {node: {0, 1, 2, 3} for node in NODES}
        with pytest.raises(dj.errors.CheckpointLockedError, match="locked by another writer"):
            CheckpointStore(prefix).cleanup_uncommitted()  # not while a writer holds the prefix
    assert group_epochs(prefix) == {node: {3} for node in NODES}
    assert CheckpointStore(prefix).read_lock() is None
    assert CheckpointStore(prefix).cleanup_uncommitted() == []


def test_a_lost_lock_stops_the_run_from_writing_on(prefix):
    """After another holder took the prefix, no node writes its group and nothing is deleted."""
    job = make_job()
    with job, dj.Node("trainer_0"):

        def intrude(ws):
            if ws.epoch == 4:
                with open(os.path.join(prefix, "__daskjobs__", "lock.json"), "w") as file:
                    file.write('{"host": "elsewhere", "pid": 7, "job": "intruder", "token": "x"}')

        dj.Task(intrude, name="intrude")
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1)
    with pytest.raises(dj.errors.CheckpointLockedError):
        dj.JobRunner(job, manager, max_epochs=8, progress=False).train()
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [3]
    # epoch 3 was committed before epoch 4 ran; retired groups the background deletion had not
    # reached when the lock went stay (uncommitted debris). The trainer's save of epoch 4 found the
    # lock gone (its step replaced it just before); the ps node's save may have run before that step
    groups = {node: {e for e in epochs if e >= 3} for node, epochs in group_epochs(prefix).items()}
    assert groups["trainer_0"] == {3}
    assert groups["ps"] in ({3}, {3, 4})


def test_tidy_deletes_in_the_background_and_the_final_tidy_waits_for_it(prefix):
    """While the next epoch runs (``meanwhile``) a thread deletes the retired groups; leaving
    ``writing`` joins that thread first, so nothing is deleted after the lock is released."""
    with four_epochs_committed_by_hand(prefix) as (manager, pipeline):
        pipeline.meanwhile()
        deadline = time.monotonic() + 30
        while group_epochs(prefix) != {node: {3} for node in NODES} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert group_epochs(prefix) == {node: {3} for node in NODES}
    assert not manager.retention.retired
    assert CheckpointStore(prefix).read_lock() is None


def test_retired_groups_are_handed_to_their_nodes_and_others_stay_pending():
    """On a cluster each node deletes its own retired groups: a group of a node the hooks do
    not cover stays with the driver, which deletes it at the end of the run."""
    retired = RetiredGroups()
    retired.add(RetiredEpoch(3, {"ps": {"save_id": "x"}, "trainer_0": None}))
    retired.add(RetiredEpoch(4, {"ps": None, "gone": {"save_id": "y"}}))
    handed = retired.hand_out(["ps", "trainer_0"])
    assert handed == {"ps": ((3, {"save_id": "x"}), (4, None)), "trainer_0": ((3, None),)}
    assert retired.hand_out(["ps", "trainer_0"]) == {"ps": (), "trainer_0": ()}
    assert retired.hand_out(["gone"]) == {"gone": ((4, {"save_id": "y"}),)}
    assert not retired
