"""A manager subclass that overrides Caffe2's ``save(epoch)`` gets it called for every save.

The runner saves inside the epoch's graph only with the manager's own ``save``; an override
(a user's hook, a fault injected in a test) runs as the group it returns, as in Caffe2.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointWriteError


class CountingManager(dj.MultiNodeCheckpointManager):
    """Records the epochs it saves; refuses to save ``fail_at``."""

    def __init__(self, *args, fail_at: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved: list[int] = []
        self.fail_at = fail_at

    def save(self, epoch):
        self.saved.append(epoch)
        if epoch == self.fail_at:
            raise OSError("disk on fire")
        return super().save(epoch)


def make_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="subclassed") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(w=np.zeros(4)))
                dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1.0), name="update")
    return job


def committed(prefix: str) -> list[int]:
    return [info.epoch for info in dj.list_checkpoints(prefix)]


def test_an_overridden_save_is_called_for_every_epoch(session, prefix):
    manager = CountingManager(prefix)
    assert dj.JobRunner(make_job(), manager, max_epochs=3, progress=False).train(session) == 3
    assert manager.saved == [0, 1, 2, 3]
    assert committed(prefix) == [0, 1, 2, 3]
    np.testing.assert_array_equal(dj.open_checkpoint(prefix, 3)["b"]["w"], np.full(4, 3.0))


def test_a_failing_overridden_save_stops_the_job_and_keeps_the_commits_before(session, prefix):
    manager = CountingManager(prefix, fail_at=2)
    runner = dj.JobRunner(make_job(), manager, max_epochs=4, progress=False, save_retries=1)
    with pytest.raises(CheckpointWriteError, match=r"epoch 2.*disk on fire"):
        runner.train(session)
    assert manager.saved == [0, 1, 2, 2]
    assert committed(prefix) == [0, 1]
