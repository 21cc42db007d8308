"""A manager subclass that overrides Caffe2's ``save(epoch)``, ``init(...)`` or ``load(epoch)``
gets it called, and the group it returns run, where Caffe2's runner runs it.

The runner saves inside the epoch's graph, registers the nodes without running the init group's
checks and loads a resume's record once only with the manager's own methods; an override (a
user's hook, a fault injected in a test) runs as the group it returns, as in Caffe2.
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


class HookedManager(dj.MultiNodeCheckpointManager):
    """Records its init and load calls; each group it returns gains a task marking the workspace."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def _marked(self, group: dj.TaskGroup, blob: str) -> dj.TaskGroup:
        with group:
            for node in self.nodes():
                dj.Task(lambda ws, blob=blob: ws.__setitem__(blob, np.ones(1)), node=node, name=f"mark_{blob}")
        return group

    def init(self, nodes=None, retrieve_from_epoch=None, path_prefix=None, path_type=None):
        self.calls.append(("init", retrieve_from_epoch))
        return self._marked(super().init(nodes, retrieve_from_epoch, path_prefix, path_type), "inited")

    def load(self, epoch, path_prefix=None, path_type=None):
        self.calls.append(("load", epoch))
        return super().load(epoch, path_prefix, path_type)


def test_overridden_init_and_load_run_on_a_fresh_run_and_a_resume(session, prefix):
    fresh = HookedManager(prefix)
    assert dj.JobRunner(make_job(), fresh, max_epochs=2, progress=False).train(session) == 2
    assert fresh.calls == [("init", None)]
    assert {"inited", "w"} <= set(session.blobs("a"))
    resumed = HookedManager(prefix)
    assert dj.JobRunner(make_job(), resumed, max_epochs=4, progress=False).train(session) == 4
    assert resumed.calls == [("init", 2), ("load", 2)]
    assert committed(prefix) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(dj.open_checkpoint(prefix, 4)["a"]["w"], np.full(4, 4.0))
