"""Public hooks into a run (``JobRunner(hooks=...)``, ``request_stop``, ``commit_saved``).

A :class:`~daskjobs.RunnerHooks` hears, in order, each epoch about to run, running, saved and
committed; ``request_stop`` is the graceful stop a signal gives (the running epoch finishes and is
committed, then the run raises as for that signal), and a second request abandons the epoch as a
second signal does; ``commit_saved`` commits what the run saved before the next epoch starts.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import JobDefinitionError, JobInterruptedError

NODES = ("ps", "trainer_0")


def make_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="hooked") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)), name="init")
                dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


def committed(prefix: str) -> list[int]:
    return [info.epoch for info in dj.list_checkpoints(prefix)]


class Recorder(dj.RunnerHooks):
    """Every event with the commits on disk when it came."""

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix, self.events = prefix, []

    def _seen(self, event: str, epoch: int) -> None:
        self.events.append((event, epoch))

    def before_epoch(self, epoch: int) -> None:
        self._seen("before", epoch)

    def epoch_running(self, epoch: int) -> None:
        self._seen("running", epoch)

    def epoch_saved(self, epoch: int) -> None:
        self._seen("saved", epoch)

    def epoch_committed(self, epoch: int) -> None:
        assert self.prefix is None or epoch in committed(self.prefix)
        self._seen("committed", epoch)


def test_hooks_hear_every_epoch_in_order(session, prefix):
    """Each epoch is about to run, runs, is saved, in that order; each epoch (0 too) is committed once,
    in order, after it was saved, and a commit is on disk when its hook hears of it."""
    hooks = Recorder(prefix)
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False, hooks=hooks)
    assert runner.train(session) == 4
    per_epoch = [[e for e, n in hooks.events if n == epoch] for epoch in range(5)]
    assert per_epoch[0] == ["saved", "committed"]
    assert all(events == ["before", "running", "saved", "committed"] for events in per_epoch[1:])
    assert [n for e, n in hooks.events if e == "committed"] == [0, 1, 2, 3, 4]
    assert [n for e, n in hooks.events if e == "before"] == [1, 2, 3, 4]


def test_hooks_without_a_checkpoint_manager_hear_no_commits(session):
    hooks = Recorder()
    assert dj.JobRunner(make_job(), max_epochs=2, progress=False, hooks=hooks).train(session) == 2
    assert hooks.events == [("before", 1), ("running", 1), ("saved", 1), ("before", 2), ("running", 2), ("saved", 2)]


def test_hooks_must_be_runner_hooks():
    with pytest.raises(JobDefinitionError, match=r"hooks must be a dj\.RunnerHooks"):
        dj.JobRunner(make_job(), hooks=object())


class StopAt(Recorder):
    def __init__(self, prefix: str, at: int, signum: int) -> None:
        super().__init__(prefix)
        self.at, self.signum, self.runner = at, signum, None

    def epoch_saved(self, epoch: int) -> None:
        super().epoch_saved(epoch)
        if epoch == self.at:
            self.runner.request_stop(self.signum)


@pytest.mark.parametrize(
    ("signum", "raised"), [(signal.SIGTERM, JobInterruptedError), (signal.SIGINT, KeyboardInterrupt)]
)
def test_request_stop_is_the_graceful_stop_of_a_signal(session, prefix, signum, raised):
    """Asked for from a hook after epoch 2 ran: epoch 2 is committed, nothing after it runs, the
    lock is released, and the run raises what that signal makes it raise, naming epoch 2."""
    hooks = StopAt(prefix, 2, signum)
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False, hooks=hooks)
    hooks.runner = runner
    with pytest.raises(raised, match="stopped after the running epoch; epoch 2 is committed") as caught:
        runner.train(session)
    assert committed(prefix) == [0, 1, 2]
    assert [r.epoch for r in runner.history] == [1, 2]
    assert getattr(caught.value, "epoch", 2) == 2
    assert dj.checkpoint.CheckpointStore(prefix).read_lock() is None
    resumed = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False)
    assert resumed.train(session) == 4
    assert [r.epoch for r in resumed.history] == [3, 4]


def test_request_stop_from_another_thread(prefix):
    """A stop asked for from another thread while an epoch runs: that epoch is committed, then the
    run raises; a second request abandons the running epoch (on the main thread, where the run
    handles signals), nothing of it committed."""
    started, release = threading.Event(), threading.Event()

    def step(ws):
        ws["n"] = ws["n"] + 1
        if ws.epoch == 2 and ws.node == "ps":
            started.set()
            assert release.wait(30)

    job = make_job()
    with job, dj.Node("ps"):
        dj.Task(step, name="slow")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)

    def ask() -> None:
        assert started.wait(30)
        runner.request_stop()
        release.set()

    asker = threading.Thread(target=ask)
    asker.start()
    with pytest.raises(JobInterruptedError, match="epoch 2 is committed"):
        runner.train(dj.LocalSession())
    asker.join()
    assert committed(prefix) == [0, 1, 2]


def test_a_second_request_abandons_the_running_epoch(prefix):
    started, release = threading.Event(), threading.Event()

    def step(ws):
        if ws.epoch == 2 and ws.node == "ps":
            started.set()
            release.wait(30)

    job = make_job()
    with job, dj.Node("ps"):
        dj.Task(step, name="slow")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)

    def ask_twice() -> None:
        assert started.wait(30)
        runner.request_stop()
        runner.request_stop()

    asker = threading.Thread(target=ask_twice)
    asker.start()
    try:
        with pytest.raises(JobInterruptedError, match="abandoned the running epoch; epoch 1 is committed"):
            runner.train(dj.LocalSession())
    finally:
        release.set()
        asker.join()
    assert committed(prefix) == [0, 1]


class CommitFirst(Recorder):
    """Before epoch ``at`` starts, everything saved is committed."""

    def __init__(self, prefix: str, at: int) -> None:
        super().__init__(prefix)
        self.at, self.runner, self.found = at, None, None

    def before_epoch(self, epoch: int) -> None:
        super().before_epoch(epoch)
        if epoch == self.at:
            self.runner.commit_saved()
            self.found = committed(self.prefix)


def test_commit_saved_commits_before_the_next_epoch_starts(session, prefix):
    """On a cluster an epoch's commit is written two epochs later; ``commit_saved`` from a hook
    writes every commit due before the next epoch starts."""
    hooks = CommitFirst(prefix, 3)
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=5, progress=False, hooks=hooks)
    hooks.runner = runner
    assert runner.train(session) == 5
    assert hooks.found == [0, 1, 2]
    assert [n for e, n in hooks.events if e == "committed"] == [0, 1, 2, 3, 4, 5]
    runner.commit_saved()  # outside train: nothing to do


class Failing(dj.RunnerHooks):
    def epoch_running(self, epoch: int) -> None:
        if epoch == 2:
            raise RuntimeError("hook fails")


def test_a_failing_hook_ends_the_run_with_nothing_of_its_epoch_committed(session, prefix):
    runner = dj.JobRunner(
        make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False, hooks=Failing()
    )
    with pytest.raises(RuntimeError, match="hook fails"):
        runner.train(session)
    assert committed(prefix) == [0, 1]
    assert dj.checkpoint.CheckpointStore(prefix).read_lock() is None
