"""Caffe2's checkpoint behaviours (checkpoint_test.py), with exact numbers, on every session kind."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np
import pytest
from processes import dead_pid

import daskjobs as dj
from daskjobs.errors import CheckpointError, CheckpointLockedError, CheckpointWriteError, TaskFailedError

TOTALS = [100, 103, 115, 136, 145]
"""``total`` after epoch 0 (init) .. 4: 100 plus the data 0..9 read three items per epoch."""


def build_pipeline(job: dj.Job, node: str, *, fail_at: int | None = None) -> dj.TaskOutput:
    """Caffe2's reader pipeline on ``node``: returns the output holding ``total`` after each epoch."""
    with dj.Node(node):
        with job.init_group:
            dj.Task(lambda ws: ws.update(data=np.arange(10), cursor=np.int64(0), total=np.int64(100)), name="init")

        def start(ws):
            ws["remaining"] = np.int64(3)
            ws["data_finished"] = False

        def read(ws):
            if fail_at is not None and ws.epoch == fail_at:
                raise RuntimeError(f"reader broke in epoch {ws.epoch}")
            while ws["remaining"] > 0:
                ws["remaining"] = ws["remaining"] - 1
                cursor = int(ws["cursor"])
                if cursor >= len(ws["data"]):
                    ws["data_finished"] = True
                    return
                ws["total"] = ws["total"] + ws["data"][cursor]
                ws["cursor"] = np.int64(cursor + 1)

        reader = dj.Task(read, task_init=start, outputs="data_finished", name="reader")
        job.add_stop_condition(reader.outputs()[0])
        return dj.final_output("total")


def make_job(nodes=("trainer_0",), name="pipeline", **kwargs) -> tuple[dj.Job, list[dj.TaskOutput]]:
    with dj.Cluster(), dj.Job(name=name) as job:
        outputs = [build_pipeline(job, node, **kwargs) for node in nodes]
    return job, outputs


def test_fresh_run_saves_every_epoch(session, prefix):
    """A fresh run stops when the data runs out after 4 epochs, committing epochs 0..4."""
    job, (total,) = make_job()
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(session) == 4
    assert int(total.fetch()) == 145
    assert [r.epoch for r in runner.history] == [1, 2, 3, 4]
    assert [r.stop_values for r in runner.history][-2:] == [{"data_finished": False}, {"data_finished": True}]
    infos = dj.list_checkpoints(prefix)
    assert [i.epoch for i in infos] == [0, 1, 2, 3, 4]
    assert infos[-1].stop_values == {"data_finished": True}
    assert infos[-1].job == "pipeline"
    assert infos[-1].nodes == ["trainer_0"]


def test_state_after_loading_each_epoch(session, prefix):
    """Loading epoch e restores exactly the total after e epochs."""
    job, _ = make_job()
    manager = dj.MultiNodeCheckpointManager(prefix)
    dj.JobRunner(job, manager, progress=False).train(session)
    for epoch, expected in enumerate(TOTALS):
        session.run_group(manager.load(epoch))
        assert int(session.fetch("total", "trainer_0")) == expected
        assert int(session.fetch("cursor", "trainer_0")) == min(3 * epoch, 10)
        assert int(dj.open_checkpoint(prefix, epoch)["trainer_0"]["total"]) == expected


@pytest.mark.parametrize("resume_from", [1, 2, 3, 4])
def test_resume_from_every_epoch(session, prefix, resume_from):
    """Resuming from any saved epoch with a fresh manager reaches the same final state."""
    job, _ = make_job()
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(dj.LocalSession())
    job, _ = make_job()
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=resume_from, progress=False)
    assert runner.train(session) == 4
    assert int(session.fetch("total", "trainer_0")) == 145
    assert [r.epoch for r in runner.history] == list(range(resume_from + 1, 5))
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]


def test_rerun_resumes_from_latest_without_extra_epoch(session, prefix):
    """Re-running a finished job resumes from its last commit, whose stop value was true: no epoch runs."""
    job, _ = make_job()
    manager = dj.MultiNodeCheckpointManager(prefix)
    dj.JobRunner(job, manager, progress=False).train(session)
    job, _ = make_job()
    runner = dj.JobRunner(job, manager, progress=False)
    with dj.LocalSession() as fresh:
        assert runner.train(fresh) == 4
        assert runner.history == []
        assert int(fresh.fetch("total", "trainer_0")) == 145


def test_interrupted_run_resumes_from_latest_commit(session, prefix):
    """A task failing in epoch 3 commits nothing of it; the re-run resumes after epoch 2."""
    job, _ = make_job(fail_at=3)
    with pytest.raises(TaskFailedError) as info:
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(session)
    assert info.value.epoch == 3
    assert info.value.node == "trainer_0"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2]
    job, _ = make_job()
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(dj.LocalSession()) == 4
    assert [r.epoch for r in runner.history] == [3, 4]
    assert int(dj.open_checkpoint(prefix)["trainer_0"]["total"]) == 145


NODES3 = ("trainer_0", "trainer_1", "trainer_2")


def test_partial_load_across_nodes(session, prefix):
    """load_blobs_from_checkpoints loads the named blobs of every node for saved epochs, nothing otherwise."""
    job, outputs = make_job(NODES3)
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(dj.LocalSession()) == 4
    assert [int(o.fetch()) for o in outputs] == [145, 145, 145]
    for node in NODES3:
        session.feed("total", -1, node=node)
        session.feed("cursor", -1, node=node)
    for epoch in range(1, 5):
        assert runner.load_blobs_from_checkpoints(["total", "no_such_blob"], epoch, session) is True
        assert [int(session.fetch("total", n)) for n in NODES3] == [TOTALS[epoch]] * 3
        assert [int(session.fetch("cursor", n)) for n in NODES3] == [-1] * 3
    session.feed("total", -7, node="trainer_0")
    assert runner.load_blobs_from_checkpoints(["total"], 5, session) is False
    assert int(session.fetch("total", "trainer_0")) == -7


def test_partial_load_is_all_or_nothing(session, prefix):
    """If one node lacks the epoch, no node is loaded (Caffe2 half-loaded)."""
    job, _ = make_job(NODES3[:2])
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(dj.LocalSession())
    for node in NODES3:
        session.feed("total", -1, node=node)
    manager = dj.MultiNodeCheckpointManager(prefix)
    assert manager.load_blobs_locally(list(NODES3), ["total"], 2, session) is False
    assert [int(session.fetch("total", n)) for n in NODES3] == [-1, -1, -1]


class RecordingUploader(dj.UploadTaskGroupBuilder):
    """Records the epoch it was built with into the trainer's workspace."""

    def build(self, epoch, checkpoint_manager):
        assert checkpoint_manager is not None
        with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(lambda ws: ws.__setitem__("uploaded_epoch", np.int64(epoch)), node="trainer_0")
        return group


def test_upload_download_exit_order(session, prefix):
    """After the loop: upload (given the last epoch), then download, then exit, each once."""
    with dj.Cluster(), dj.Job(name="pipeline") as job:
        build_pipeline(job, "trainer_0")
        with job.download_group:
            dj.Task(
                lambda ws: ws.__setitem__("downloaded", ws["total"] * 2 + ws["uploaded_epoch"] * 0),
                node="trainer_0",
                workspace_type=dj.WorkspaceType.GLOBAL,
            )
        with job.exit_group:
            dj.Task(
                lambda ws: ws.__setitem__("exited", ws["downloaded"] + 1),
                node="trainer_0",
                workspace_type=dj.WorkspaceType.GLOBAL,
            )
    runner = dj.JobRunner(
        job, dj.MultiNodeCheckpointManager(prefix), upload_task_group_builder=RecordingUploader(), progress=False
    )
    assert runner.train(session) == 4
    assert int(session.fetch("uploaded_epoch", "trainer_0")) == 4
    assert int(session.fetch("downloaded", "trainer_0")) == 290
    assert int(session.fetch("exited", "trainer_0")) == 291


def test_copy_uploader_makes_a_valid_checkpoint(session, prefix, tmp_path):
    """The ready uploader copies the final epoch to another prefix that opens and verifies."""
    destination = str(tmp_path / "uploaded")
    job, _ = make_job(NODES3[:2])
    runner = dj.JobRunner(
        job,
        dj.MultiNodeCheckpointManager(prefix),
        progress=False,
        upload_task_group_builder=dj.CopyCheckpointUploader(destination),
    )
    assert runner.train(session) == 4
    view = dj.open_checkpoint(destination)
    assert view.epoch == 4
    assert view.nodes == ["trainer_0", "trainer_1"]
    assert int(view["trainer_1"]["total"]) == 145
    assert view.verify() > 0


def test_manager_reuse_across_runners(session, prefix):
    """One manager serves two runners in turn; the second resumes where the first stopped."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    job, _ = make_job()
    assert dj.JobRunner(job, manager, progress=False).train(session) == 4
    job2, _ = make_job()
    assert dj.JobRunner(job2, manager, progress=False).train(dj.LocalSession()) == 4
    assert manager.blob_list()["trainer_0"] == sorted(["cursor", "data", "total"])


def test_epoch_limiter_resumes_to_the_same_absolute_epoch(session, prefix):
    """epoch_limiter's counter is checkpointed: resuming from epoch 2 of 5 runs epochs 3, 4 and 5."""

    def define():
        with dj.Cluster(), dj.Job(name="limited") as job, dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
            dj.epoch_limiter(job, 5)
        return job

    assert dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), progress=False).train(session) == 5
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=2, progress=False)
    with dj.LocalSession() as fresh:
        assert runner.train(fresh) == 5
        assert int(fresh.fetch("n", "a")) == 5
    assert [r.epoch for r in runner.history] == [3, 4, 5]


def test_unknown_resume_epoch_is_an_error(prefix):
    """Asking to resume from an epoch that was never committed raises CheckpointNotFoundError."""
    job, _ = make_job()
    with pytest.raises(dj.errors.CheckpointNotFoundError, match="epoch 7"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), resume_from_epoch=7, progress=False).train(None)


def test_other_job_on_the_same_prefix_is_refused(prefix):
    """A prefix holds one job: another job name or node set is refused before anything runs."""
    job, _ = make_job(name="first")
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    job, _ = make_job(name="second")
    with pytest.raises(CheckpointError, match="first"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    job, _ = make_job(("trainer_0", "trainer_1"), name="first")
    with pytest.raises(CheckpointError, match="trainer_1"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)


def test_a_manager_without_a_job_name_takes_the_prefix_job(prefix):
    """Caffe2-style use of a bare manager (``set_params(nodes)``, no job name): the prefix's job is
    not refused for its name; the nodes are still checked, and later commits keep the job's name."""
    job, _ = make_job(name="first")
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(["trainer_0"])
    assert manager.get_resume_from_epoch_id() == 4
    assert manager.get_resume_from_epoch_id(2) == 2
    with dj.LocalSession() as session:
        session.run(manager.init(["trainer_0"], retrieve_from_epoch=4))
        session.run(manager.load(4))
        session.run(manager.save(5))
        manager.write_checkpoint_metadata(5)
    assert [(i.epoch, i.job) for i in dj.list_checkpoints(prefix)][-2:] == [(4, "first"), (5, "first")]
    other = dj.MultiNodeCheckpointManager(prefix)
    other.set_params(["trainer_1"])
    with pytest.raises(CheckpointError, match="trainer_1"):
        other.get_resume_from_epoch_id()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_invalid_stop_value_keeps_the_epochs_before_it_committed(session, prefix, async_save):
    """A stop condition giving an int in epoch 3 raises StopConditionError; epoch 3 is not
    committed, and epoch 2, saved before (its flush or async write reported in epoch 3's graph),
    still is, on every session."""
    with dj.Cluster(), dj.Job(name="stops") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("k", 0))

        def step(ws):
            ws["k"] = ws["k"] + 1
            ws["stop"] = False if ws["k"] < 3 else 1

        job.add_stop_condition(dj.Task(step, outputs="stop").outputs()[0])
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix, async_save=async_save), progress=False)
    with pytest.raises(dj.errors.StopConditionError, match="stop"):
        runner.train(session)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2]
    assert dj.open_checkpoint(prefix).verify() > 0


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_failing_task_keeps_the_epochs_before_it_committed(session, prefix, async_save, fail_at):
    """Node b's step raises in epoch ``fail_at``: TaskFailedError, and every epoch before it is
    committed (node a's save hook already reported the earlier flush or async write: it is not
    lost), on every session; a re-run resumes from the epoch before and ends like an unbroken run."""

    def build(fail):
        with dj.Cluster(), dj.Job(name="fails") as job:
            for node in ("a", "b"):
                with job.init_group, dj.Node(node):
                    dj.Task(lambda ws: ws.__setitem__("k", 0))

                def step(ws, node=node):
                    ws["k"] = ws["k"] + 1
                    if fail and node == "b" and ws.epoch == fail_at:
                        raise ZeroDivisionError("node b fails")

                with dj.Node(node):
                    dj.Task(step)
            with dj.Node("a"):
                dj.epoch_limiter(job, 5)
        return job

    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save)
    with pytest.raises(TaskFailedError, match="node b fails"):
        dj.JobRunner(build(True), manager, progress=False).train(session)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == list(range(fail_at))
    assert dj.open_checkpoint(prefix).verify() > 0
    runner = dj.JobRunner(build(False), dj.MultiNodeCheckpointManager(prefix, async_save=async_save), progress=False)
    assert runner.train(session) == 5
    assert [r.epoch for r in runner.history] == list(range(fail_at, 6))
    assert [int(dj.open_checkpoint(prefix)[n]["k"]) for n in ("a", "b")] == [5, 5]


def _ending_badly(failure: str | None) -> dj.Job:
    """Node a counts; in epoch 4 its step raises (``"task"``) or its stop value is an int (``"stop"``)."""
    with dj.Cluster(), dj.Job(name="ends") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("w", np.zeros(3000)))

        def step(ws):
            if failure == "task" and ws.epoch == 4:
                raise ZeroDivisionError("epoch 4 fails")
            ws["w"] = ws["w"] + (np.arange(3000) % 7 == ws.epoch % 7)
            ws["stop"] = 1 if failure == "stop" and ws.epoch == 4 else ws.epoch >= 6

        job.add_stop_condition(dj.Task(step, outputs="stop").outputs()[0])
    return job


@pytest.mark.parametrize("callback", [True, False], ids=["on_epoch", "no-on_epoch"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("failure", ["task", "stop"])
def test_epochs_committed_on_the_way_out_of_a_failed_run_get_on_epoch_and_bytes(
    session, tmp_path, async_save, failure, callback
):
    """Epoch 4 fails; epoch 3, whose save (asynchronous, or its commit) was still open, is committed
    on the way out. Like every committed epoch it gets its on_epoch call, and its history record
    the bytes its commit reports (with or without an on_epoch): exactly those of an unbroken run."""
    unbroken: list[dj.EpochRecord] = []
    clean = dj.MultiNodeCheckpointManager(str(tmp_path / "clean"), async_save=async_save)
    dj.JobRunner(_ending_badly(None), clean, max_epochs=3, progress=False, on_epoch=unbroken.append).train(session)
    calls: list[dj.EpochRecord] = []
    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"), async_save=async_save)
    runner = dj.JobRunner(_ending_badly(failure), manager, progress=False, on_epoch=calls.append if callback else None)
    with pytest.raises(TaskFailedError if failure == "task" else dj.errors.StopConditionError):
        runner.train(session)
    assert [i.epoch for i in dj.list_checkpoints(str(tmp_path / "ckpt"))] == [0, 1, 2, 3]
    assert [r.epoch for r in runner.history] == [1, 2, 3]
    figures = [(r.epoch, r.bytes_written, r.bytes_reused) for r in unbroken]
    assert [(r.epoch, r.bytes_written, r.bytes_reused) for r in calls] == (figures if callback else [])
    assert [(r.epoch, r.bytes_written, r.bytes_reused) for r in runner.history] == figures
    assert all(written + reused >= 24000 for _, written, reused in figures)


def test_unwritable_prefix_is_detected_before_init(session, tmp_path):
    """A prefix that cannot be created fails with CheckpointWriteError before the init group runs."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    job, _ = make_job()
    with pytest.raises(CheckpointWriteError, match=r"file\.txt"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(str(blocker / "ckpt")), progress=False).train(session)
    assert "trainer_0" not in session.nodes() or session.blobs("trainer_0") == []


def _vanish_prefix_at(prefix: str, epoch_to_break: int, epoch_to_mend: int | None):
    def step(ws):
        if ws.epoch == epoch_to_break:
            os.rename(prefix, prefix + ".away")
            with open(prefix, "w") as blocker:
                blocker.write("storage is gone")
        if ws.epoch == epoch_to_mend:
            os.remove(prefix)
            os.rename(prefix + ".away", prefix)

    return step


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_failing_save(prefix, policy, caplog):
    """A save that keeps failing raises CheckpointWriteError ("raise") or is logged and skipped ("warn")."""
    with dj.Cluster(), dj.Job(name="pipeline") as job:
        build_pipeline(job, "local")
        with dj.Node("local"):
            dj.Task(_vanish_prefix_at(prefix, 2, 4 if policy == "warn" else None), name="storage")
    runner = dj.JobRunner(
        job, dj.MultiNodeCheckpointManager(prefix), on_save_error=policy, save_retries=1, progress=False
    )
    if policy == "raise":
        with pytest.raises(CheckpointWriteError, match="epoch 2"):
            runner.train(None)
        os.remove(prefix)
        os.rename(prefix + ".away", prefix)
        assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1]
        assert int(dj.open_checkpoint(prefix)["local"]["total"]) == 103
    else:
        assert runner.train(None) == 4
        assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 4]
        assert "could not write the checkpoint of epoch 2" in caplog.text


def test_second_runner_on_a_locked_prefix_is_refused(prefix):
    """While a runner holds the prefix, another train() fails with CheckpointLockedError naming the holder."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.store.check_writable()
    manager.store.acquire_lock({"host": "elsewhere", "pid": 4242, "job": "pipeline", "started": "now"})
    job, _ = make_job()
    with pytest.raises(CheckpointLockedError, match="elsewhere"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    assert dj.list_checkpoints(prefix) == []
    manager.store.release_lock()
    assert dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None) == 4


def test_uncommitted_leftovers_are_ignored_and_removed(prefix):
    """A node group without a commit record (a crashed save) is never loaded and is cleaned up."""
    job, _ = make_job()
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    commits = dj.MultiNodeCheckpointManager(prefix).store
    record = commits.read_commit(4)
    commits.uncommit(4)
    assert os.path.isdir(os.path.join(prefix, "trainer_0.4"))
    assert json.loads(json.dumps(record))["epoch"] == 4
    shutil.copy(__file__, os.path.join(prefix, "notes.py"))
    job, _ = make_job()
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(None) == 4
    assert [r.epoch for r in runner.history] == [4]
    assert os.path.exists(os.path.join(prefix, "notes.py"))


def test_unknown_db_type_is_refused(prefix):
    """db_type other than 'zarr' raises ValueError at once."""
    with pytest.raises(ValueError, match="db_type"):
        dj.MultiNodeCheckpointManager(prefix, db_type="leveldb")
    with pytest.raises(ValueError, match="db_type"):
        dj.CheckpointManager(prefix, "trainer_0", db_type="minidb")


def test_single_node_manager(session, prefix):
    """CheckpointManager handles exactly one node and refuses more."""
    job, _ = make_job()
    manager = dj.CheckpointManager(prefix, "trainer_0")
    assert dj.JobRunner(job, manager, progress=False).train(session) == 4
    assert manager.blob_list() == ["cursor", "data", "total"]
    assert manager.get_ckpt_db_name("trainer_0", 3) == dj.db_name(3, "trainer_0", manager.store.url)
    with pytest.raises(ValueError, match="only node"):
        manager.init(["trainer_0", "trainer_1"])


def test_naming():
    """Checkpoint names follow Caffe2: '<node>.<epoch>' under the prefix."""
    assert dj.get_ckpt_filename("trainer_0", 5) == "trainer_0.5"
    assert dj.db_name(5, "trainer_0", "T") == "T/trainer_0.5"
    assert dj.db_name(5, "trainer_0", "T", path_prefix="U/x_") == "U/x_trainer_0.5"


def test_concurrent_runner_is_refused_while_the_first_trains(prefix):
    """A second train() on a prefix another runner is training on is refused; the first finishes intact."""
    import threading

    started, release = threading.Event(), threading.Event()

    def slow(ws):
        started.set()
        release.wait(timeout=30)

    with dj.Cluster(), dj.Job(name="pipeline") as job:
        build_pipeline(job, "trainer_0")
        dj.Task(slow, node="trainer_0", name="slow")
    results = []
    first = threading.Thread(
        target=lambda: results.append(
            dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
        )
    )
    first.start()
    try:
        assert started.wait(timeout=30)
        other, _ = make_job()
        with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
            dj.JobRunner(other, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
        assert dj.list_checkpoints(prefix)[0].epoch == 0
        assert int(dj.open_checkpoint(prefix, 0)["trainer_0"]["total"]) == 100
    finally:
        release.set()
        first.join(timeout=60)
    assert results == [4]
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]


def test_stale_lock_of_a_dead_local_process_is_broken(prefix):
    """A lock left by a process of this host that no longer exists is taken over with a warning."""
    store = dj.MultiNodeCheckpointManager(prefix).store
    store.check_writable()
    store.acquire_lock({"host": socket.gethostname(), "pid": dead_pid(), "job": "pipeline", "started": ""})
    job, _ = make_job()
    assert dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None) == 4
    assert store.read_lock() is None


def test_a_committed_epoch_is_never_overwritten(prefix):
    """Saving an epoch that is already committed is refused; its data stays intact and verifies."""
    job, _ = make_job()
    manager = dj.MultiNodeCheckpointManager(prefix)
    dj.JobRunner(job, manager, progress=False).train(None)
    with pytest.raises(CheckpointError, match="already committed"):
        manager.save(3)
    assert int(dj.open_checkpoint(prefix, 3)["trainer_0"]["total"]) == 136
    assert dj.open_checkpoint(prefix, 3).verify() > 0


def test_finish_hooks_run_on_each_node_in_the_same_run(session):
    """run_group(finish=...) runs each hook on its node after the node's tasks; results come back by node."""

    def seen(state):
        return {"node": state.node, "n": int(state.scope.blobs["n"])}

    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        for node in ("a", "b"):
            dj.Task(lambda ws: ws.__setitem__("n", 7 if ws.node == "a" else 8), node=node)
    run = session.run_group(group, finish={"a": seen, "b": seen})
    assert run.finished == {"a": {"node": "a", "n": 7}, "b": {"node": "b", "n": 8}}


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_outside_the_epoch_graph_still_work(session, prefix, async_save):
    """A checkpointed node that runs no epoch task is saved by a group of its own; results are equal."""
    with dj.Cluster(), dj.Job(name="pipeline", nodes_to_checkpoint=["trainer_0", "trainer_1"]) as job:
        build_pipeline(job, "trainer_0")
        with dj.Node("trainer_1"), job.init_group:
            dj.Task(lambda ws: ws.__setitem__("frozen", np.arange(4)))
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save)
    assert dj.JobRunner(job, manager, progress=False).train(session) == 4
    view = dj.open_checkpoint(prefix)
    assert int(view["trainer_0"]["total"]) == 145
    assert view["trainer_1"]["frozen"].tolist() == [0, 1, 2, 3]
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]


def test_history_reports_bytes_and_metrics(prefix):
    """Each epoch record carries the bytes its commit wrote and the epoch's metric means."""
    with dj.Cluster(), dj.Job(name="pipeline") as job:
        build_pipeline(job, "trainer_0")
        with dj.Node("trainer_0"):
            dj.Task(lambda ws: ws.log("loss", 1.0 / ws.epoch), name="loss")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(None) == 4
    assert [r.metrics for r in runner.history] == [{"loss": 1.0}, {"loss": 0.5}, {"loss": 1 / 3}, {"loss": 0.25}]
    assert all(r.bytes_written + r.bytes_reused == 10 * 8 + 8 + 8 for r in runner.history)
