"""Custom metadata handlers: what the runner asks them, and a handler whose answer is wrong.

A handler that says "start from scratch" on a prefix with commits makes the runner save epochs
that are committed already: a save error, decided by ``on_save_error``, that changes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from prefix_files import files

import daskjobs as dj
from daskjobs.checkpoint import CommitRecordHandler
from daskjobs.errors import CheckpointWriteError


def define() -> dj.Job:
    """One node counting epochs in ``n``."""
    with dj.Cluster(), dj.Job(name="handled") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    return job


class CountingHandler(CommitRecordHandler):
    """The built-in handler, recording its ``last_epoch`` calls; ``scratch``: always answers ``None``."""

    def __init__(self, store, *, scratch: bool = False):
        super().__init__(store)
        self.asked: list[int | None] = []
        self.scratch = scratch

    def last_epoch(self, user_epoch=None):
        self.asked.append(user_epoch)
        return None if self.scratch else super().last_epoch(user_epoch)


def runner(prefix: str, *, scratch: bool = False, **kwargs) -> tuple[dj.JobRunner, CountingHandler]:
    handler = CountingHandler(dj.MultiNodeCheckpointManager(prefix).store, scratch=scratch)
    manager = dj.MultiNodeCheckpointManager(prefix, metadata_handler=handler)
    return dj.JobRunner(define(), manager, progress=False, **kwargs), handler


@pytest.mark.parametrize("resume_from_epoch", [None, 1])
def test_the_handler_is_asked_for_the_epoch_to_resume_once(prefix, resume_from_epoch):
    """One ``last_epoch`` call per train(), with or without resume_from_epoch."""
    runner(prefix, max_epochs=2)[0].train(None)
    again, handler = runner(prefix, max_epochs=3, resume_from_epoch=resume_from_epoch)
    assert again.train(None) == 3
    assert handler.asked == [resume_from_epoch]
    assert again.history[0].epoch == (3 if resume_from_epoch is None else 2)


def test_a_handler_starting_over_a_commit_raises_a_write_error(session, prefix):
    """on_save_error='raise': CheckpointWriteError naming epoch 0 and why, before the init group; nothing changes."""
    runner(prefix, max_epochs=2)[0].train(session)
    before = files(prefix)
    again, _ = runner(prefix, scratch=True, max_epochs=3)
    with pytest.raises(CheckpointWriteError, match=r"epoch 0 is already committed.*never overwritten") as info:
        again.train(session)
    assert "the last committed checkpoint is intact" in str(info.value)
    assert again.history == []
    assert files(prefix) == before
    assert not (Path(prefix) / "__daskjobs__" / "lock.json").exists()


def test_a_handler_starting_over_a_commit_warns_and_runs(session, prefix, caplog):
    """on_save_error='warn': one warning per epoch that cannot be saved (not retried); the job runs on."""
    runner(prefix, max_epochs=2)[0].train(session)
    before = files(prefix)
    again, _ = runner(prefix, scratch=True, max_epochs=3, on_save_error="warn")
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert again.train(session) == 3
    assert int(session.fetch("n", node="a")) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3
    for epoch, message in enumerate(warnings):
        assert f"epoch {epoch} is already committed" in message
        assert "on_save_error='warn'" in message
    assert {k: v for k, v in files(prefix).items() if k in before} == before
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]
    assert int(dj.open_checkpoint(prefix)["a"]["n"]) == 3
