"""Node loss in every phase (SPEC §4): a real worker process is SIGKILLed at a chosen point; the run
recovers (counting towards ``max_failures``) and ends equal to an uninterrupted run, with every
committed epoch intact.

Kill points: steps of the init, epoch, download and exit groups, and the checkpoint store's own
``write_node`` / ``read_node`` on the node (a store subclass shipped to the workers), so saves
(synchronous, asynchronous, the final flush), resume loads and the restore of a recovery are hit
where they do their I/O. A marker file makes each kill fire once.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import dask
import numpy as np
import pytest
from jobs import two_coupled_nodes

import daskjobs as dj
from daskjobs.checkpoint._node.fork import in_snapshot_writer
from daskjobs.checkpoint._protocol.store import CheckpointStore
from daskjobs.errors import NodeLostError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

EPOCHS = 5
VICTIM = "b"


def kill_once(markers: str | None, point: str) -> None:
    """SIGKILL this worker process the first time ``point`` is reached (from a forked snapshot
    writer: its worker, which takes the writer with it)."""
    if markers is None or not Path(markers, f"arm-{point}").exists() or Path(markers, point).exists():
        return
    Path(markers, point).touch()
    os.kill(os.getppid() if in_snapshot_writer() else os.getpid(), signal.SIGKILL)


class KillingStore(CheckpointStore):
    """A checkpoint store whose node-side writes and reads can kill their worker once."""

    markers: str | None = None

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if node == VICTIM:
            kill_once(self.markers, f"save-{epoch}")
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)

    def write_node_unsynced(self, node, epoch, blobs, *, save_id, **kwargs):
        if node == VICTIM:
            kill_once(self.markers, f"save-{epoch}")
        return super().write_node_unsynced(node, epoch, blobs, save_id=save_id, **kwargs)

    def read_node(self, node, epoch, entry, names=None, **kwargs):
        if node == VICTIM:
            kill_once(self.markers, f"load-{epoch}")
        return super().read_node(node, epoch, entry, names, **kwargs)


def define_job(markers: str | None = None) -> dj.Job:
    """Two coupled nodes with download and exit groups; node b's steps may kill its worker once."""
    return two_coupled_nodes("phases", functools.partial(kill_once, markers), download_and_exit=True)


BLOBS = [("a", "weights"), ("b", "history"), ("b", "downloaded"), ("b", "exited")]


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    """Final blobs of an uninterrupted in-process run."""
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), max_epochs=EPOCHS, progress=False).train(session)
        return [session.fetch(blob, node) for node, blob in BLOBS]


@pytest.fixture(scope="module")
def cluster():
    # SpecCluster closes a worker's nanny for good when the restarted worker has not come back
    # within lost-worker-timeout; on a loaded machine a restart can take longer than that.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "300s"}),
        dj.node_cluster(["a", "b"], nthreads=2) as made,
    ):
        yield made


def manager_for(prefix: str, markers: str, **options) -> dj.MultiNodeCheckpointManager:
    manager = dj.MultiNodeCheckpointManager(prefix, **options)
    store = KillingStore(prefix)
    store.markers = markers
    manager.store = store
    return manager


PHASES = {
    # name: (kill points armed, manager options, failures expected)
    "init": (["init"], {}, 1),
    "save-epoch-0": (["save-0"], {}, 1),
    "epoch": (["epoch-3"], {}, 1),
    "save": (["save-3"], {}, 1),
    "async-save": (["save-3"], {"async_save": True, "async_snapshot": "copy"}, 1),
    "async-final-flush": ([f"save-{EPOCHS}"], {"async_save": True, "async_snapshot": "copy"}, 1),
    "async-save-fork": (["save-3"], {"async_save": True, "async_snapshot": "fork"}, 1),
    "async-final-flush-fork": ([f"save-{EPOCHS}"], {"async_save": True, "async_snapshot": "fork"}, 1),
    "recovery-restore": (["epoch-3", "load-2"], {}, 2),
    "download": (["download"], {}, 1),
    "exit": (["exit"], {}, 1),
}


def check_committed(prefix: str, last: int) -> None:
    epochs = [i.epoch for i in dj.list_checkpoints(prefix)]
    assert epochs == list(range(last + 1))
    for epoch in epochs:
        assert dj.open_checkpoint(prefix, epoch).verify() > 0


@pytest.mark.representative(  # a step (init, exit), a sync, async and forked save, a restore; the rest: -m matrix
    "init", "save", "async-final-flush", "async-save-fork", "recovery-restore", "exit"
)
@pytest.mark.parametrize("phase", list(PHASES))
def test_node_lost_in_phase_is_recovered(cluster, reference, tmp_path, phase):
    """A worker killed in ``phase`` is recovered from; the final workspaces equal an uninterrupted run."""
    points, options, failures = PHASES[phase]
    markers = tmp_path / "markers"
    markers.mkdir()
    for point in points:
        (markers / f"arm-{point}").touch()
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(
        define_job(str(markers)),
        manager_for(prefix, str(markers), **options),
        max_epochs=EPOCHS,
        max_failures=failures,
        progress=False,
    )
    with dj.DaskSession(cluster) as session:
        assert runner.train(session) == EPOCHS
        final = [session.fetch(blob, node) for node, blob in BLOBS]
    assert all((markers / point).exists() for point in points)
    for got, expected in zip(final, reference, strict=True):
        assert np.array_equal(got, expected)
    check_committed(prefix, EPOCHS)
    assert [r.epoch for r in runner.history][-1] == EPOCHS


def test_node_lost_during_resume_load_is_recovered(cluster, reference, tmp_path):
    """Loss while loading the epoch to resume from: the load is retried and the run ends equal."""
    prefix = str(tmp_path / "ckpt")
    markers = tmp_path / "markers"
    markers.mkdir()
    with dj.DaskSession(cluster) as session:
        dj.JobRunner(define_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(session)
    (markers / "arm-load-3").touch()
    runner = dj.JobRunner(
        define_job(str(markers)), manager_for(prefix, str(markers)), max_epochs=EPOCHS, max_failures=1, progress=False
    )
    with dj.DaskSession(cluster) as session:
        assert runner.train(session) == EPOCHS
        final = [session.fetch(blob, node) for node, blob in BLOBS]
    assert (markers / "load-3").exists()
    for got, expected in zip(final, reference, strict=True):
        assert np.array_equal(got, expected)
    check_committed(prefix, EPOCHS)
    assert [r.epoch for r in runner.history] == [4, 5]


@pytest.mark.parametrize("phase", ["epoch", "recovery-restore"])
def test_past_max_failures_is_node_lost_naming_node_and_last_commit(cluster, tmp_path, phase):
    """One failure fewer allowed than needed: NodeLostError naming node b and the last committed epoch;
    the session stays usable and nothing committed changed."""
    points, options, failures = PHASES[phase]
    markers = tmp_path / "markers"
    markers.mkdir()
    for point in points:
        (markers / f"arm-{point}").touch()
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(
        define_job(str(markers)),
        manager_for(prefix, str(markers), **options),
        max_epochs=EPOCHS,
        max_failures=failures - 1,
        progress=False,
    )
    with dj.DaskSession(cluster) as session:
        with pytest.raises(NodeLostError, match="last committed epoch 2") as info:
            runner.train(session)
        assert info.value.nodes == [VICTIM]
        check_committed(prefix, 2)
        again = dj.JobRunner(define_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=EPOCHS, progress=False)
        assert again.train(session) == EPOCHS
