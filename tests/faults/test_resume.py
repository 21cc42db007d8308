"""Resume faults: finished jobs stay finished, bad or failing resumes destroy nothing, our errors are ours.

Every case asserts the exact error type and that ``list_checkpoints`` and every committed byte
are unchanged where nothing should change.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint._protocol.retention import Retention
from daskjobs.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
    TaskFailedError,
)


def committed_bytes(prefix: str) -> dict[str, bytes]:
    """Every file of every committed epoch (commit records and node groups), by relative path."""
    epochs = {i.epoch: i.nodes for i in dj.list_checkpoints(prefix)}
    root = Path(prefix)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        top = rel.split("/")[0]
        node, _, epoch = top.rpartition(".")
        in_group = epoch.isdigit() and int(epoch) in epochs and node in epochs[int(epoch)]
        if path.is_file() and (in_group or rel.startswith("__daskjobs__/commits/")):
            files[rel] = path.read_bytes()
    return files


def state(prefix: str) -> tuple[list[int], dict[str, bytes]]:
    return [i.epoch for i in dj.list_checkpoints(prefix)], committed_bytes(prefix)


def define(*, limiter: int | None = None, stop_at: int | None = None, fail_at: int | None = None) -> dj.Job:
    """One node ``a`` counting epochs in ``n`` (and a 1000-element array ``w``)."""
    with dj.Cluster(), dj.Job(name="resume") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(n=np.int64(0), w=np.zeros(1000)))

        def step(ws):
            if fail_at is not None and ws.epoch == fail_at:
                raise RuntimeError(f"step broke in epoch {ws.epoch}")
            ws["n"] = ws["n"] + 1
            ws["w"] = ws["w"] + ws.epoch
            ws["done"] = stop_at is not None and ws.epoch >= stop_at

        dj.Task(step)
        if stop_at is not None:
            job.add_stop_condition("done")
        if limiter is not None:
            dj.epoch_limiter(job, limiter)
    return job


def train(prefix: str, job: dj.Job | None = None, **kwargs) -> tuple[int, dj.JobRunner, int]:
    """Train on a fresh LocalSession; return (last epoch, runner, final n)."""
    runner = dj.JobRunner(job or define(), dj.MultiNodeCheckpointManager(prefix), progress=False, **kwargs)
    with dj.LocalSession() as session:
        last = runner.train(session)
        return last, runner, int(session.fetch("n", "a"))


# -- finished means finished -----------------------------------------------------------------------------

FINISHED = {
    "max_epochs": ({}, {"max_epochs": 3}),
    "stop_condition": ({"stop_at": 3}, {}),
    "epoch_limiter": ({"limiter": 3}, {}),
    "stop_before_max": ({"stop_at": 3}, {"max_epochs": 9}),
}


@pytest.mark.parametrize("how", list(FINISHED))
def test_rerunning_a_finished_job_runs_no_epoch(prefix, how):
    """However the job ended, re-running it (three times) runs nothing, returns the last epoch, changes nothing."""
    job_kwargs, runner_kwargs = FINISHED[how]
    assert train(prefix, define(**job_kwargs), **runner_kwargs)[0] == 3
    before = state(prefix)
    for _ in range(3):
        last, runner, n = train(prefix, define(**job_kwargs), **runner_kwargs)
        assert (last, runner.history, n) == (3, [], 3)
        assert state(prefix) == before


def test_resuming_at_or_past_max_epochs_runs_nothing(prefix):
    """An explicit resume from an epoch >= max_epochs returns that epoch without running one."""
    train(prefix, max_epochs=4)
    before = state(prefix)
    for epoch, max_epochs in [(4, 4), (4, 2), (3, 3)]:
        last, runner, n = train(prefix, max_epochs=max_epochs, resume_from_epoch=epoch)
        assert (last, runner.history, n) == (epoch, [], epoch)
    assert state(prefix) == before


def test_raising_max_epochs_continues(prefix):
    """A job that ended on max_epochs continues when run again with a larger max_epochs."""
    train(prefix, max_epochs=3)
    last, runner, n = train(prefix, max_epochs=5)
    assert (last, [r.epoch for r in runner.history], n) == (5, [4, 5], 5)


# -- resume never destroys before it has succeeded -------------------------------------------------------

BAD_TYPES = [True, False, 1.0, "1", np.float64(1), np.bool_(True), [1], 1 + 0j]


@pytest.mark.parametrize("value", BAD_TYPES, ids=repr)
def test_resume_argument_of_a_wrong_type_is_refused_at_construction(prefix, value):
    """Not an int: a TypeError (and ValueError) subclass of daskjobs' errors, at once."""
    with pytest.raises(TypeError, match="resume_from_epoch") as info:
        dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=value, max_epochs=2)
    assert isinstance(info.value, JobDefinitionError)
    assert not os.path.exists(prefix)


def test_negative_resume_argument_is_refused(prefix):
    with pytest.raises(ValueError, match="non-negative"):
        dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=-1, max_epochs=2)


def test_numpy_integer_resume_argument_is_accepted(prefix):
    train(prefix, max_epochs=3)
    last, runner, _ = train(prefix, max_epochs=3, resume_from_epoch=np.int64(1))
    assert (last, [r.epoch for r in runner.history]) == (3, [2, 3])


@pytest.mark.parametrize("epoch", [5, 99, 10**11])
def test_resume_from_an_uncommitted_epoch_changes_nothing(prefix, epoch):
    """CheckpointNotFoundError naming the epoch; commits, bytes, debris and lock all untouched."""
    train(prefix, max_epochs=4)
    os.makedirs(os.path.join(prefix, "a.5"))  # debris that cleanup would remove
    before = state(prefix)
    with pytest.raises(CheckpointNotFoundError, match=f"epoch {epoch}"):
        train(prefix, max_epochs=9, resume_from_epoch=epoch)
    assert state(prefix) == before
    assert os.path.isdir(os.path.join(prefix, "a.5"))
    assert dj.MultiNodeCheckpointManager(prefix).store.read_lock() is None


def test_resume_from_an_empty_prefix_creates_nothing(tmp_path):
    prefix = str(tmp_path / "none")
    with pytest.raises(CheckpointNotFoundError):
        train(prefix, max_epochs=3, resume_from_epoch=0)
    assert not os.path.exists(prefix)


def chunk_files(prefix: str, epoch: int, blob: str = "w") -> list[Path]:
    group = Path(prefix) / f"a.{epoch}" / blob
    return sorted(p for p in group.rglob("*") if p.is_file() and p.name != "zarr.json")


CORRUPTIONS = {
    "flipped": lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0xFF]) + p.read_bytes()[1:]),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-8]),
    "missing": lambda p: p.unlink(),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_resume_target_raises_corrupt_and_keeps_every_commit(prefix, kind):
    """Resuming an older, corrupt epoch raises CheckpointCorruptError (not TaskFailedError); nothing changes."""
    train(prefix, max_epochs=5)
    CORRUPTIONS[kind](chunk_files(prefix, 2)[0])
    before = state(prefix)
    with pytest.raises(CheckpointCorruptError, match=r"epoch 2.*'a'|'a'.*epoch 2") as info:
        train(prefix, max_epochs=5, resume_from_epoch=2)
    assert not isinstance(info.value, TaskFailedError)
    assert "'w'" in str(info.value)
    assert state(prefix) == before
    assert train(prefix, max_epochs=5)[0] == 5


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_latest_raises_corrupt_on_every_session_kind(session, prefix, kind):
    """The same on a DaskSession: the error crosses the process boundary as itself."""
    train(prefix, max_epochs=3)
    CORRUPTIONS[kind](chunk_files(prefix, 3)[0])
    before = state(prefix)
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), max_epochs=5, progress=False)
    with pytest.raises(CheckpointCorruptError, match="'w'"):
        runner.train(session)
    assert state(prefix) == before
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(["a"])
    with pytest.raises(CheckpointCorruptError, match="epoch 3"):
        session.run_group(manager.load(3))


def test_crash_in_the_first_epoch_after_an_older_resume_keeps_every_commit(prefix):
    """Resume from 2 of 0..5, the first epoch fails: all six commits unchanged; a plain re-run resumes from 5."""
    train(prefix, max_epochs=5)
    before = state(prefix)
    with pytest.raises(TaskFailedError):
        train(prefix, define(fail_at=3), max_epochs=8, resume_from_epoch=2)
    assert state(prefix) == before
    last, runner, n = train(prefix, max_epochs=6)
    assert (last, [r.epoch for r in runner.history], n) == (6, [6], 6)


@pytest.mark.parametrize("async_save", [False, True])
def test_older_resume_retires_newer_commits_once_the_first_new_epoch_commits(prefix, async_save, caplog):
    """Resume from 2 of 0..5 with different work: 3.. are rewritten, one warning lists the retired epochs."""
    train(prefix, max_epochs=5)
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save)
    with dj.LocalSession() as session, caplog.at_level(logging.WARNING, logger="daskjobs"):
        runner = dj.JobRunner(define(), manager, resume_from_epoch=2, max_epochs=4, progress=False)
        assert runner.train(session) == 4
    warnings = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    assert len(warnings) == 1
    assert "[3, 4, 5]" in warnings[0]
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]
    view = dj.open_checkpoint(prefix)
    assert view.verify() > 0
    assert int(view["a"]["n"]) == 4
    assert np.array_equal(view["a"]["w"], np.full(1000, 10.0))
    assert not os.path.exists(os.path.join(prefix, "a.5"))


# -- our errors are ours ---------------------------------------------------------------------------------


def test_unwritable_prefix_with_warn_runs_without_checkpoints(session, tmp_path, caplog):
    """on_save_error='warn': one warning before init, the job runs and returns, nothing is created."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    prefix = str(blocker / "ckpt")
    runner = dj.JobRunner(
        define(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, on_save_error="warn", progress=False
    )
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert runner.train(session) == 3
    assert int(session.fetch("n", "a")) == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "without checkpoints" in warnings[0].getMessage()
    assert [r.checkpoint_bytes for r in runner.history] == [0, 0, 0]


def test_unwritable_prefix_with_raise_fails_before_init(session, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(str(blocker / "ckpt")), max_epochs=3, progress=False)
    with pytest.raises(CheckpointWriteError, match=r"file\.txt"):
        runner.train(session)
    assert "a" not in session.nodes() or session.blobs("a") == []


def test_failing_retention_is_a_warning_not_a_failed_save(prefix, caplog, monkeypatch):
    """Retention that raises after a commit logs a warning; every epoch is still committed."""

    def broken(self, store, newest, **options):
        raise OSError("retention storage hiccup")

    monkeypatch.setattr(Retention, "apply", broken)
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert train(prefix, max_epochs=3)[0] == 3
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]
    assert "retention" in caplog.text
    assert "hiccup" in caplog.text


def test_user_step_errors_are_still_task_failures(session, prefix):
    """A user step raising a daskjobs error (e.g. opening a missing checkpoint) is a TaskFailedError."""

    def step(ws):
        dj.open_checkpoint(prefix + "-missing", 3)

    with dj.Cluster(), dj.Job(name="user") as job, dj.Node("a"):
        dj.Task(step)
    with pytest.raises(TaskFailedError) as info:
        dj.JobRunner(job, max_epochs=1, progress=False).train(session)
    assert isinstance(info.value.__cause__, dj.errors.CheckpointError)


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_first_save_after_an_older_resume_keeps_every_commit(prefix, monkeypatch, async_save):
    """The first new epoch's save fails (its data goes to staging, never over a kept commit): all commits intact."""
    from daskjobs.checkpoint._protocol.store import CheckpointStore

    train(prefix, max_epochs=5)
    before = state(prefix)
    original = CheckpointStore.write_node

    def failing(self, node, epoch, blobs, **kwargs):
        if epoch == 3:
            raise CheckpointWriteError(f"disk full while writing node {node!r} epoch {epoch}")
        return original(self, node, epoch, blobs, **kwargs)

    monkeypatch.setattr(CheckpointStore, "write_node", failing)
    runner = dj.JobRunner(
        define(),
        dj.MultiNodeCheckpointManager(prefix, async_save=async_save),
        resume_from_epoch=2,
        max_epochs=8,
        save_retries=1,
        progress=False,
    )
    with pytest.raises(CheckpointWriteError, match="epoch 3"):
        runner.train(None)
    assert state(prefix) == before
    monkeypatch.undo()
    last, runner, n = train(prefix, max_epochs=6)
    assert (last, [r.epoch for r in runner.history], n) == (6, [6], 6)
