"""Faults of a save that strike on a node's worker, after the node's save hook returned (SPEC §3, §2.7).

A catalogue, each fault injected once into a real worker process while it writes over a retired
group (retention, on a local disk: the node's background thread writes a small workspace whole,
then the process's syncer fsyncs it and renames its staging folder into place):

* ``sync-eio``: the background fsync of node a's group fails with EIO;
* ``rename-eio``: renaming the staging folder into place fails with EIO;
* ``write-enospc``: the background write itself finds the disk full (ENOSPC);
* ``worker-killed``: node a's worker is SIGKILLed in the middle of writing over the retired group.

The first three go through the run's retry policy (``save_retries``) like an error in the hook: the
node writes the epoch again, durably, and the run goes on with no recovery. The kill is a lost
node: the run recovers from the last commit. Either way the run completes, every committed epoch
verifies and holds what an uninterrupted run holds, and the run itself leaves none of daskjobs' own
debris (no ``*.tmp-*`` folder, no uncommitted group) while a foreign file and folder stay untouched.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

NODES = ("a", "b")
EPOCHS = 8
VICTIM = 5
"""The epoch whose save by node a the fault strikes (by then every save writes over a retired group)."""


def expected(epoch: int) -> np.ndarray:
    w = np.arange(6.0)
    for _ in range(epoch):
        w = w * 1.5 + 1
    return w


@pytest.fixture(scope="module")
def cluster():
    """Each node on a worker process of its own (a killed one is restarted by its nanny)."""
    with dj.node_cluster({"w0": ["a"], "w1": ["b"]}, processes=True) as made:
        yield made


def _victim_path(prefix: str) -> re.Pattern[str]:
    """Paths of node a's group of the victim epoch, or of its staging folder."""
    return re.compile(rf"{re.escape(prefix)}/a\.{VICTIM}(\.tmp-[0-9a-f]{{32}})?(/|$)")


def _fail_syncs(prefix: str) -> None:
    """On this worker: the process's background syncs of the victim group fail with EIO (the batch's
    sync and the syncer's retry of it), once."""
    from daskjobs.checkpoint._storage import durable

    real, victim, fired = durable.sync_paths, _victim_path(prefix), []

    def failing(paths, many=False):
        if any(victim.match(p) for p in paths) and len(fired) < 2:
            fired.append(paths)
            if len(fired) == 2:
                durable.sync_paths = real
            raise OSError(errno.EIO, "Input/output error (injected)", paths[0])
        real(paths, many=many)

    durable.sync_paths = failing


def _fail_rename(prefix: str) -> None:
    """On this worker: renaming the victim group's staging folder into place fails with EIO, once."""
    from daskjobs.checkpoint._storage import durable

    real, victim = durable.Staged.publish, _victim_path(prefix)

    def failing(staged):
        if victim.match(staged.target):
            durable.Staged.publish = real
            raise OSError(errno.EIO, "Input/output error (injected)", staged.target)
        return real(staged)

    durable.Staged.publish = failing


def _kill_while_writing_over(prefix: str) -> None:
    """On this worker: the process is SIGKILLed at the first file it writes into the victim group's
    staging folder (the retired group it writes over), once."""
    from daskjobs.checkpoint._storage import files

    real = files.write_file
    staging = re.compile(rf"{re.escape(prefix)}/a\.{VICTIM}\.tmp-[0-9a-f]{{32}}/")

    def killing(path, parts, **kwargs):
        if staging.match(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, parts, **kwargs)

    files.write_file = killing


class FullDiskStore(CheckpointStore):
    """A local store on which node a's background write of the victim epoch finds the disk full, once
    (``flag``: a file created when it struck)."""

    flag = ""

    def write_node_unsynced(self, node, epoch, blobs, **kwargs):
        if node == "a" and epoch == VICTIM:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().write_node_unsynced(node, epoch, blobs, **kwargs)


ARMING = {"sync-eio": _fail_syncs, "rename-eio": _fail_rename, "worker-killed": _kill_while_writing_over}


def make_job(prefix: str, fault: str) -> dj.Job:
    def step(ws):
        ws["w"] = ws["w"] * 1.5 + 1

    def arm(ws):
        # Before the hook that saves the victim epoch, once a run: the epoch run again after a kill
        # (every group is written in a staging folder) must not be struck again.
        if ws.epoch == VICTIM and fault in ARMING and not os.path.exists(f"{prefix}-armed"):
            os.close(os.open(f"{prefix}-armed", os.O_CREAT | os.O_EXCL))
            ARMING[fault](prefix)

    with dj.Cluster(), dj.Job(name="worker-faults") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("w", np.arange(6.0)), name="init")
                dj.Task(step, name="step")
        with dj.Node("a"):
            dj.Task(arm, name="arm")
    return job


class Commits(dj.RunnerHooks):
    def __init__(self) -> None:
        self.committed: list[int] = []

    def epoch_committed(self, epoch: int) -> None:
        self.committed.append(epoch)


def foreign(prefix: Path) -> dict[str, bytes]:
    """A user's file and folders under the prefix, one named like a staging folder of node a."""
    made = {
        "notes.txt": b"mine",
        "mydata.2024/x.bin": b"\x00\x01",
        f"a.{VICTIM}.tmp-{'0' * 32}/w/c.0": b"not daskjobs'",
    }
    for name, data in made.items():
        (prefix / name).parent.mkdir(parents=True, exist_ok=True)
        (prefix / name).write_bytes(data)
    return made


@pytest.mark.parametrize("fault", ["sync-eio", "rename-eio", "write-enospc", "worker-killed"])
def test_a_fault_in_a_workers_background_save_leaves_a_complete_run_and_no_debris(cluster, tmp_path, caplog, fault):
    prefix = tmp_path / "ckpt"
    prefix.mkdir()
    users = foreign(prefix)
    manager = dj.MultiNodeCheckpointManager(str(prefix), keep_last=2)
    if fault == "write-enospc":
        manager.store = FullDiskStore(str(prefix))
        manager.store.flag = str(tmp_path / "disk-full")
    commits = Commits()
    runner = dj.JobRunner(make_job(str(prefix), fault), manager, max_epochs=EPOCHS, progress=False, hooks=commits)
    with caplog.at_level(logging.WARNING, logger="daskjobs"), dj.DaskSession(cluster) as session:
        assert runner.train(session) == EPOCHS

    committed = [info.epoch for info in dj.list_checkpoints(str(prefix))]
    assert committed == [EPOCHS - 1, EPOCHS]
    for epoch in committed:
        view = dj.open_checkpoint(str(prefix), epoch)
        assert view.verify() == len(NODES) * 6 * 8  # bytes verified: every chunk of every node
        for node in NODES:
            np.testing.assert_array_equal(view[node]["w"], expected(epoch))
    ours = sorted(p.name for p in prefix.iterdir() if p.name not in ("notes.txt", "mydata.2024", "__daskjobs__"))
    assert ours == sorted([f"{n}.{e}" for n in NODES for e in committed] + [f"a.{VICTIM}.tmp-{'0' * 32}"])
    assert list((prefix / "__daskjobs__").rglob("*.tmp-*")) == []
    assert {name: (prefix / name).read_bytes() for name in users} == users
    assert commits.committed == list(range(EPOCHS + 1))  # each epoch once, in order, the victim too
    if fault == "worker-killed":  # a lost node: every node restored from the epoch before the victim
        assert [r.recoveries for r in runner.history] == [0] * (VICTIM - 1) + [1] * (EPOCHS - VICTIM + 1)
        assert [r.epoch for r in runner.history] == list(range(1, EPOCHS + 1))
    else:  # written again by the node, durably: no recovery
        assert [r.recoveries for r in runner.history] == [0] * EPOCHS
        assert any("injected" in r.getMessage() for r in caplog.records)  # the fault struck, and was retried
        assert f"could not make the checkpoint of epoch {VICTIM} durable" in caplog.text
        assert "writing it again" in caplog.text
