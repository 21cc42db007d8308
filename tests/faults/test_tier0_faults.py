"""The fault catalogue of checkpoints in cluster memory (tier 0, SPEC §3): worker processes SIGKILLed
at each point of a run — the init group and epoch 0's save, an epoch's steps, the boundary between
two epochs, the background write of a durable epoch from its snapshot, the last epoch (whose
durable commit ends the run) — either the worker of node ``b`` alone (its nodes come back from the
snapshots in memory) or together with the worker holding its replicas (every node comes back from
the newest durable commit, or from scratch). Every case ends with the workspaces, and every durable
commit, equal to an uninterrupted run's. The bigger part of the catalogue is marked ``matrix``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_tier0_cluster import EPOCHS, assert_durable_commits_equal, assert_equal, blobs, define_job

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PHASES = ("init", "steps", "boundary", "durable-write", "last")
TARGETS = ("worker", "pair")
DEFAULT = {("steps", "worker"), ("boundary", "pair"), ("durable-write", "worker")}
"""The cases the default test run keeps: a recovery from memory in the middle of an epoch and while
a durable epoch is written, and a fall back to the durable tier between epochs."""

DURABLE_EVERY = 3
STRIKE_AT = 5
"""The epoch whose run is struck (``durable-write``: the epoch after durable epoch 3, still written)."""


def cases() -> list:
    return [
        pytest.param(
            phase, target, marks=() if (phase, target) in DEFAULT else pytest.mark.matrix, id=f"{phase}-{target}"
        )
        for phase in PHASES
        for target in TARGETS
    ]


@pytest.fixture(scope="module")
def cluster():
    with dj.node_cluster(["a", "b"]) as made:
        yield made


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), progress=False).train(session)
        return blobs(session)


class SlowStore(CheckpointStore):
    """A local store on which node b's background write of durable epoch 3 takes a while."""

    def write_node_unsynced(self, node, epoch, blobs, *, save_id, **kwargs):
        if node == "b" and epoch == DURABLE_EVERY:
            time.sleep(2.0)
        return super().write_node_unsynced(node, epoch, blobs, save_id=save_id, **kwargs)


def kill_init(mark: str, victims: list[int]):
    """An init step of node b that, once, kills the ``victims`` (worker pids) and its own worker."""

    def init(ws):
        if not Path(mark).exists():
            Path(mark).touch()
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    return init


class Strike(dj.RunnerHooks):
    """Kills the ``pids`` once, at ``phase`` of epoch :data:`STRIKE_AT` (or of the last epoch)."""

    def __init__(self, phase: str, pids: list[int]) -> None:
        self.phase, self.pids, self.struck = phase, pids, False
        self.epoch = EPOCHS if phase == "last" else STRIKE_AT

    def _kill(self) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGKILL)

    def before_epoch(self, epoch: int) -> None:
        if self.phase == "boundary" and epoch == self.epoch and not self.struck:
            self.struck = True
            self._kill()

    def epoch_running(self, epoch: int) -> None:
        if self.phase in ("steps", "durable-write", "last") and epoch == self.epoch and not self.struck:
            self.struck = True
            threading.Timer(0.05, self._kill).start()


@pytest.mark.parametrize(("phase", "target"), cases())
def test_a_killed_worker_in_any_phase_ends_equal(cluster, tmp_path, reference, phase, target):
    """Node b's worker (``worker``), or both workers (``pair``: b's replicas are on a's worker), is
    SIGKILLed at ``phase``: the run recovers (from memory, else from the durable tier or from
    scratch) and ends equal to an uninterrupted run, every durable commit too."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=DURABLE_EVERY)
    if phase == "durable-write":
        manager.store = SlowStore(prefix)
    with dj.DaskSession(cluster) as session:
        client = session.client
        pids = client.run(os.getpid)
        b_pid = pids[
            next(a for a, info in client.scheduler_info(n_workers=-1)["workers"].items() if info["name"] == "b")
        ]
        victims = [b_pid] if target == "worker" else sorted(pids.values(), key=lambda p: p != b_pid)
        job = define_job()
        if phase == "init":
            with job.init_group, dj.Node("b"):
                dj.Task(kill_init(str(tmp_path / "init-killed"), [p for p in victims if p != b_pid]), name="kill")
            hooks = dj.RunnerHooks()
        else:
            hooks = Strike(phase, victims)
        runner = dj.JobRunner(job, manager, max_failures=2, progress=False, hooks=hooks)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert [r.epoch for r in runner.history] == list(range(1, EPOCHS + 1))
    assert runner.history[-1].recoveries == 1
    assert_durable_commits_equal(prefix)
    assert max(info.epoch for info in dj.list_checkpoints(prefix)) == EPOCHS
