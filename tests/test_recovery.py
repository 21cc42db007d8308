"""Worker faults on a process-based cluster: detect, restore every node from the last commit, end equal."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from jobs import two_coupled_nodes

import daskjobs as dj
from daskjobs.errors import NodeLostError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def define_job(kill_marker: str | None = None, kill_epoch: int = 3) -> dj.Job:
    """Two coupled nodes; with ``kill_marker``, node b's worker kills itself once, in ``kill_epoch``."""

    def reach(point: str) -> None:
        if kill_marker is not None and point == f"epoch-{kill_epoch}" and not os.path.exists(kill_marker):
            Path(kill_marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)

    return two_coupled_nodes("recovery", reach)


def reference(epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """Final blobs of an uninterrupted in-process run."""
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), max_epochs=epochs, progress=False).train(session)
        return session.fetch("weights", "a"), session.fetch("history", "b")


@pytest.fixture(scope="module")
def cluster():
    with dj.node_cluster(["a", "b"], nthreads=2) as made:
        yield made


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_worker_killed_mid_epoch_is_recovered(cluster, tmp_path, async_save):
    """A worker dying inside epoch 3 is detected; all nodes restore the last commit (epoch 2; with
    async saves epoch 1, epoch 2's save was still in flight) and the run ends equal, with one
    history record per epoch (those run again replace the lost ones)."""
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(
        define_job(str(tmp_path / "killed")),
        dj.MultiNodeCheckpointManager(prefix, async_save=async_save),
        max_epochs=6,
        max_failures=2,
        progress=False,
    )
    with dj.DaskSession(cluster) as session:
        assert runner.train(session) == 6
        weights, history = session.fetch("weights", "a"), session.fetch("history", "b")
    expected_weights, expected_history = reference(6)
    assert np.array_equal(weights, expected_weights)
    assert np.array_equal(history, expected_history)
    assert (tmp_path / "killed").exists()
    assert [r.epoch for r in runner.history] == [1, 2, 3, 4, 5, 6]
    recovered_from = 2 if async_save else 3
    assert [r.recoveries for r in runner.history] == [int(e >= recovered_from) for e in range(1, 7)]
    view = dj.open_checkpoint(prefix)
    assert np.array_equal(view["b"]["history"], expected_history)


def test_worker_killed_between_epochs_is_recovered(cluster, tmp_path):
    """A worker restarted while idle (empty workspace, new incarnation) is never used silently."""
    prefix = str(tmp_path / "ckpt")
    with dj.DaskSession(cluster) as session:
        worker_b = next(
            addr for addr, info in session.client.scheduler_info()["workers"].items() if info["name"] == "b"
        )
        pid_b = session.client.run(os.getpid, workers=[worker_b])[worker_b]

        def kill_after_epoch_two(record):
            if record.epoch == 2:
                os.kill(pid_b, signal.SIGKILL)

        runner = dj.JobRunner(
            define_job(),
            dj.MultiNodeCheckpointManager(prefix),
            max_epochs=5,
            max_failures=1,
            on_epoch=kill_after_epoch_two,
            progress=False,
        )
        assert runner.train(session) == 5
        history = session.fetch("history", "b")
    assert np.array_equal(history, reference(5)[1])
    # the kill comes with the commit of epoch 2, while a later epoch runs: that one is recovered
    recovered = [r.epoch for r in runner.history if r.recoveries > 0]
    assert recovered == list(range(recovered[0], 6))
    assert 3 <= recovered[0] <= 5


def test_node_loss_without_checkpoints_is_an_error(cluster, tmp_path):
    """Without a checkpoint manager a lost node raises NodeLostError naming it."""
    runner = dj.JobRunner(define_job(str(tmp_path / "killed")), max_epochs=5, progress=False)
    with dj.DaskSession(cluster) as session, pytest.raises(NodeLostError, match="'b'"):
        runner.train(session)


@pytest.mark.parametrize("manager", [False, True], ids=["no-manager", "max-failures-0"])
def test_the_session_stays_usable_after_a_node_loss_error(cluster, tmp_path, manager):
    """After NodeLostError (no manager, or max_failures=0) the same session runs on: a plain run on
    the lost node, and a new runner that resumes (with a manager) or starts afresh, with no
    recovery counted and the final blobs of an unbroken run."""
    prefix = str(tmp_path / "ckpt")

    def runner(job: dj.Job) -> dj.JobRunner:
        checkpoints = dj.MultiNodeCheckpointManager(prefix) if manager else None
        return dj.JobRunner(job, checkpoints, max_epochs=5, max_failures=0, progress=False)

    with dj.DaskSession(cluster) as session:
        with pytest.raises(NodeLostError, match="'b'"):
            runner(define_job(str(tmp_path / "killed"))).train(session)
        session.wait_for_nodes(["b"], timeout=30)
        session.run(dj.Task(lambda ws: ws.__setitem__("probe", 1), node="b"))
        assert session.fetch("probe", node="b") == 1
        again = runner(define_job())
        assert again.train(session) == 5
        history = session.fetch("history", "b")
    assert np.array_equal(history, reference(5)[1])
    assert [r.recoveries for r in again.history] == [0] * len(again.history)
    assert [r.epoch for r in again.history] == (list(range(3, 6)) if manager else list(range(1, 6)))
