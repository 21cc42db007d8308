"""Async saves, retention, object-store prefixes and inspection, through the runner."""

from __future__ import annotations

import os

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointLockedError, CheckpointWriteError


def define_job(epochs: int | None, *, node: str = "a", break_storage: tuple[str, int] | None = None) -> dj.Job:
    """Weights grow by the epoch number each epoch; a second node holds a growing history.

    ``epochs`` adds an epoch limiter; ``None`` leaves stopping to the runner's ``max_epochs``.
    """
    with dj.Cluster(), dj.Job(name="features") as job:
        with dj.Node(node):
            with job.init_group:
                dj.Task(lambda ws: ws.update(weights=np.zeros((64, 32), dtype=np.float32), seen=np.int64(0)))

            def step(ws):
                if break_storage is not None and ws.epoch == break_storage[1]:
                    os.rename(break_storage[0], break_storage[0] + ".away")
                    with open(break_storage[0], "w") as blocker:
                        blocker.write("storage is gone")
                ws["weights"] = ws["weights"] + np.float32(ws.epoch)
                ws["seen"] = ws["seen"] + 1

            dj.Task(step)
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("history", np.zeros(0)))
            dj.Task(lambda ws: ws.__setitem__("history", np.append(ws["history"], ws.epoch)))
        if epochs is not None:
            dj.epoch_limiter(job, epochs, node=node)
    return job


def final_state(prefix: str, storage_options=None) -> tuple[int, np.ndarray, np.ndarray]:
    view = dj.open_checkpoint(prefix, storage_options=storage_options)
    return view.epoch, view["a"]["weights"], view["b"]["history"]


def triangular(n: int) -> float:
    return n * (n + 1) / 2


def test_async_save_commits_the_same_checkpoints(session, prefix, tmp_path):
    """An async run commits the same epochs with the same contents as a synchronous one."""
    sync_prefix = str(tmp_path / "sync")
    dj.JobRunner(define_job(5), dj.MultiNodeCheckpointManager(sync_prefix), progress=False).train(dj.LocalSession())
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True)
    runner = dj.JobRunner(define_job(5), manager, progress=False)
    assert runner.train(session) == 5
    assert manager.flush(session) is None  # nothing left in flight
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4, 5]
    for epoch in range(6):
        mine, theirs = dj.open_checkpoint(prefix, epoch), dj.open_checkpoint(sync_prefix, epoch)
        assert np.array_equal(mine["a"]["weights"], theirs["a"]["weights"])
        assert np.array_equal(mine["b"]["history"], theirs["b"]["history"])
        assert mine.record["stop_values"] == theirs.record["stop_values"]
    epoch, weights, history = final_state(prefix)
    assert epoch == 5
    assert weights[0, 0] == triangular(5)
    assert history.tolist() == [1, 2, 3, 4, 5]


def test_resuming_a_stopped_job_runs_no_epoch(prefix):
    """Resuming from a commit whose stop condition was true runs no further epoch (Caffe2 ran one)."""
    dj.JobRunner(define_job(3), dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    runner = dj.JobRunner(define_job(3), dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(None) == 3
    assert runner.history == []
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]


def test_async_save_resumes(prefix):
    """A job saved asynchronously resumes from its latest commit and finishes equal."""
    dj.JobRunner(
        define_job(None), dj.MultiNodeCheckpointManager(prefix, async_save=True), max_epochs=3, progress=False
    ).train(None)
    runner = dj.JobRunner(
        define_job(None), dj.MultiNodeCheckpointManager(prefix, async_save=True), max_epochs=6, progress=False
    )
    assert runner.train(None) == 6
    assert [r.epoch for r in runner.history] == [4, 5, 6]
    assert final_state(prefix)[1][5, 5] == triangular(6)


def test_async_save_error_surfaces_at_the_next_save(prefix):
    """Storage vanishing under a background write stops the run at the next save; nothing later commits.

    Which error depends on whether epoch 2's background write was still running when the prefix
    vanished (CheckpointWriteError for epoch 2) or had finished (then the lock re-check before its
    commit finds the prefix gone: CheckpointLockedError).
    """
    job = define_job(6, break_storage=(prefix, 3))
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix, async_save=True), save_retries=0, progress=False)
    with pytest.raises((CheckpointWriteError, CheckpointLockedError), match=r"epoch 2|lock"):
        runner.train(None)
    os.remove(prefix)
    os.rename(prefix + ".away", prefix)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1]


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "expected"),
    [
        (3, None, [18, 19, 20]),
        (2, 5, [0, 5, 10, 15, 19, 20]),
        (None, 7, [0, 7, 14, 20]),
        (None, None, list(range(21))),
    ],
)
def test_retention(prefix, keep_last, keep_every, expected):
    """Retention keeps exactly the newest keep_last and every keep_every-th epoch, never foreign files."""
    os.makedirs(prefix)
    for name in ("README.txt", "a.notanepoch", "other-job.3"):
        with open(os.path.join(prefix, name), "w") as foreign:
            foreign.write("not ours")
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=keep_last, keep_every=keep_every)
    assert dj.JobRunner(define_job(20), manager, progress=False).train(None) == 20
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == expected
    groups = sorted(n for n in os.listdir(prefix) if n.startswith(("a.", "b.")) and n != "a.notanepoch")
    assert groups == sorted(f"{node}.{e}" for node in "ab" for e in expected)
    assert {"README.txt", "a.notanepoch", "other-job.3"} <= set(os.listdir(prefix))
    assert final_state(prefix)[2].tolist() == list(range(1, 21))


def test_file_url_prefix_full_cycle(tmp_path):
    """A file:// URL prefix behaves like the plain path it names."""
    url = f"file://{tmp_path / 'ckpt'}"
    dj.JobRunner(define_job(3), dj.MultiNodeCheckpointManager(url), progress=False).train(None)
    assert [i.epoch for i in dj.list_checkpoints(str(tmp_path / "ckpt"))] == [0, 1, 2, 3]
    assert final_state(url)[2].tolist() == [1, 2, 3]


def test_memory_prefix_full_cycle():
    """A memory:// prefix saves, resumes from an earlier epoch and finishes equal."""
    prefix = f"memory://daskjobs-{os.getpid()}-{id(object())}/ckpt"
    dj.JobRunner(define_job(4), dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    runner = dj.JobRunner(define_job(4), dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=2, progress=False)
    assert runner.train(None) == 4
    assert [r.epoch for r in runner.history] == [3, 4]
    epoch, weights, history = final_state(prefix)
    assert (epoch, float(weights[1, 1]), history.tolist()) == (4, triangular(4), [1, 2, 3, 4])


def test_s3_prefix_full_cycle(s3_prefix):
    """An s3:// prefix (moto on loopback) saves, locks, resumes and verifies like a local one."""
    url, options = s3_prefix
    manager = dj.MultiNodeCheckpointManager(url, storage_options=options, keep_last=2)
    dj.JobRunner(define_job(None), manager, max_epochs=3, progress=False).train(None)
    assert [i.epoch for i in dj.list_checkpoints(url, storage_options=options)] == [2, 3]
    runner = dj.JobRunner(
        define_job(None), dj.MultiNodeCheckpointManager(url, storage_options=options), max_epochs=5, progress=False
    )
    assert runner.train(None) == 5
    assert [r.epoch for r in runner.history] == [4, 5]
    view = dj.open_checkpoint(url, storage_options=options)
    assert view.verify() > 0
    assert float(view["a"]["weights"][3, 3]) == triangular(5)
    assert manager.store.read_lock() is None


def test_open_checkpoint_views(prefix):
    """open_checkpoint gives verified arrays, lazy dask arrays, and names nodes and blobs."""
    dj.JobRunner(define_job(2), dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    view = dj.open_checkpoint(prefix)
    assert (view.epoch, view.job, view.nodes) == (2, "features", ["a", "b"])
    assert sorted(view["a"]) == ["epoch_limiter.0.remaining", "seen", "weights"]
    lazy = view["a"].lazy("weights")
    assert lazy.shape == (64, 32)
    assert np.array_equal(lazy.compute(), view["a"]["weights"])
    with pytest.raises(KeyError, match="missing"):
        view["a"]["missing"]
    with pytest.raises(KeyError, match="nowhere"):
        view["nowhere"]
    assert "<table>" in view._repr_html_()
    with pytest.raises(dj.errors.CheckpointNotFoundError):
        dj.open_checkpoint(prefix, epoch=99)


def _frozen_then_changed_job() -> dj.Job:
    """A big blob changed in epoch 3 only, a small one every epoch."""

    def step(ws):
        ws["n"] = ws["n"] + 1
        if ws.epoch == 3:
            ws["frozen"] = ws["frozen"] + 1

    with dj.Cluster(), dj.Job(name="bytes") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(frozen=np.arange(100_000.0), n=np.int64(0)))
        dj.Task(step)
    return job


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_history_reports_each_epochs_own_bytes(session, tmp_path, async_save):
    """SPEC §1.7/§1.8: runner.history's bytes written and reused are those of the epoch's own
    commit, also when the save runs in the background (its figures come with its commit), and
    on_epoch sees them; an unchanged big blob is reused."""
    prefix = str(tmp_path / "ckpt")
    seen = {}
    runner = dj.JobRunner(
        _frozen_then_changed_job(),
        dj.MultiNodeCheckpointManager(prefix, async_save=async_save),
        max_epochs=5,
        progress=False,
        on_epoch=lambda record: seen.__setitem__(record.epoch, (record.bytes_written, record.bytes_reused)),
    )
    runner.train(session)
    committed = {
        i.epoch: (i.record["manifests"]["a"]["bytes_written"], i.record["manifests"]["a"]["bytes_reused"])
        for i in dj.list_checkpoints(prefix)
    }
    history = {r.epoch: (r.bytes_written, r.bytes_reused) for r in runner.history}
    assert history == {e: committed[e] for e in range(1, 6)}
    assert seen == history
    assert committed[3][0] >= 800_000  # the big blob changed in epoch 3
    assert history[4][1] >= 800_000  # reused by epoch 4 (async: from epoch 3, written while epoch 4 ran)


def _one_blob_per_epoch_job() -> dj.Job:
    """Three blobs of 800 000 bytes; epoch ``e`` changes only blob ``"abc"[e % 3]``."""

    def step(ws):
        name = "abc"[ws.epoch % 3]
        ws[name] = ws[name] + 1

    with dj.Cluster(), dj.Job(name="rotating") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update({name: np.zeros(100_000) for name in "abc"}))
        dj.Task(step)
    return job


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_delta_compares_with_the_epoch_before(session, tmp_path, async_save):
    """SPEC §1.7: a chunk equal to the previous epoch's is reused. With ``async_save`` the previous
    epoch is still being written when the next one's save starts; it is compared with all the
    same, so a blob that changed only in epoch N-1 is not written again in epoch N."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save, keep_last=2)
    runner = dj.JobRunner(_one_blob_per_epoch_job(), manager, max_epochs=6, progress=False)
    runner.train(session)
    history = {r.epoch: (r.bytes_written, r.bytes_reused) for r in runner.history}
    assert history == dict.fromkeys(range(1, 7), (800_000, 1_600_000))
    view = dj.open_checkpoint(prefix)
    assert view.verify() == 2_400_000
    assert [view["a"][name][0] for name in "abc"] == [2.0, 2.0, 2.0]
