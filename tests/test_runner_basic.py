"""JobRunner without a checkpoint manager: Caffe2's reader pipeline, loop control and stop conditions."""

from __future__ import annotations

import re

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import StopConditionError, TaskFailedError

EMPTY = np.zeros(0, dtype=np.int64)
EXPECTED_TOTALS = [103, 115, 136, 145]


def append(ws, name, value):
    """Append ``value`` to the int array blob ``name`` under the node lock."""
    with ws.lock:
        ws[name] = np.append(ws[name], np.int64(value))


def runner(job, **kwargs):
    return dj.JobRunner(job, progress=False, **kwargs)


# -- the Caffe2 reader pipeline ---------------------------------------------------------------------------


def init_reader(ws):
    ws["data"] = np.arange(10)
    ws["cursor"] = 0
    ws["total"] = 100
    ws["totals"] = EMPTY


def reset_limit(ws):
    ws["limit"] = 3
    ws["data_finished"] = False


def read_at_most_limit(ws):
    while int(ws["limit"]) > 0:
        ws["limit"] = ws["limit"] - 1
        cursor = int(ws["cursor"])
        if cursor >= ws["data"].size:
            ws["data_finished"] = True
            return
        ws["total"] = ws["total"] + ws["data"][cursor]
        ws["cursor"] = cursor + 1


def record_total(ws):
    append(ws, "totals", ws["total"])


def build_reader_job(nodes):
    with dj.Job(name="reader") as job:
        for node in nodes:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init_reader)
                dj.Task(read_at_most_limit, task_init=reset_limit, task_exit=record_total, outputs="total")
                job.add_stop_condition("data_finished")
    return job


@pytest.mark.parametrize("nodes", [["trainer_0"], ["trainer_0", "trainer_1", "trainer_2"]])
def test_reader_pipeline_totals(session, nodes):
    """Reading at most 3 of 10 items per epoch gives totals 103, 115, 136, 145 and stops after epoch 4."""
    job = build_reader_job(nodes)
    run = runner(job)
    assert run.train(session) == 4
    for node in nodes:
        assert session.fetch("totals", node=node).tolist() == EXPECTED_TOTALS
        assert session.fetch("cursor", node=node) == 10
        assert session.blobs(node) == ["cursor", "data", "total", "totals"]
    assert [r.epoch for r in run.history] == [1, 2, 3, 4]
    keys = ["data_finished"] + [f"data_finished#{i}" for i in range(1, len(nodes))]
    assert [r.stop_values for r in run.history] == [dict.fromkeys(keys, e == 4) for e in (1, 2, 3, 4)]
    assert int(job.epoch_group.tasks()[0].outputs()[0].fetch()) == 145


def test_reader_pipeline_private_epoch_counter_is_per_run(session):
    """The per-run counter created in task_init never persists in the node's workspace."""
    job = build_reader_job(["trainer_1"])
    runner(job).train(session)
    assert "limit" not in session.blobs("trainer_1")
    assert "data_finished" not in session.blobs("trainer_1")


# -- loop control -----------------------------------------------------------------------------------------


def init_counter(ws):
    ws["n"] = 0
    ws["epochs"] = EMPTY


def count_epoch(ws):
    ws["n"] = ws["n"] + 1
    append(ws, "epochs", -1 if ws.epoch is None else ws.epoch)


def counting_job(node="a", name="job"):
    with dj.Job(name=name) as job, dj.Node(node):
        with job.init_group:
            dj.Task(init_counter)
        dj.Task(count_epoch)
    return job


def test_do_while_runs_one_epoch_when_already_stopped(session):
    """A stop condition already true before the first epoch still lets one epoch run."""

    def init(ws):
        init_counter(ws)
        ws["stop"] = True

    with dj.Job() as job, dj.Node("a"):
        with job.init_group:
            dj.Task(init)
        dj.Task(count_epoch)
        job.add_stop_condition("stop")
    run = runner(job)
    assert run.train(session) == 1
    assert session.fetch("n", node="a") == 1
    assert [r.stop_values for r in run.history] == [{"stop": True}]


@pytest.mark.parametrize("max_epochs", [1, 3])
def test_max_epochs_without_stop_condition(session, max_epochs):
    """max_epochs alone runs exactly that many epochs, numbered from 1."""
    job = counting_job()
    run = runner(job, max_epochs=max_epochs)
    assert run.train(session) == max_epochs
    assert session.fetch("epochs", node="a").tolist() == list(range(1, max_epochs + 1))
    assert [r.epoch for r in run.history] == list(range(1, max_epochs + 1))
    assert all(r.stop_values == {} for r in run.history)


def test_stop_condition_before_max_epochs(session):
    """A stop condition that becomes true before max_epochs ends the loop first."""
    job = counting_job()
    dj.epoch_limiter(job, 2, node="a")
    assert runner(job, max_epochs=5).train(session) == 2
    assert session.fetch("n", node="a") == 2


def test_max_epochs_before_stop_condition(session):
    """max_epochs ends the loop when the stop condition is not yet true."""
    job = counting_job()
    dj.epoch_limiter(job, 10, node="a")
    assert runner(job, max_epochs=3).train(session) == 3
    assert session.fetch("n", node="a") == 3


def test_no_stop_condition_and_no_max_epochs(session):
    """A job that could never stop raises ValueError before its init group runs."""
    job = counting_job(name="forever")
    with pytest.raises(ValueError, match="'forever' has no stop condition and no max_epochs"):
        runner(job).train(session)
    assert session.blobs("a") == []


def test_stop_condition_outside_the_epoch_group_warns(session, caplog):
    """An init-group output as stop condition never changes (a snapshot): one warning names it; the
    epoch-group condition beside it still stops the job."""
    global_ = dj.WorkspaceType.GLOBAL
    with dj.Job(name="fixed", epoch_group=dj.TaskGroup(global_)) as job, dj.Node("a"):
        with job.init_group:
            fixed = dj.Task(lambda ws: ws.update(done=False), outputs="done", workspace_type=global_)
        dj.Task(lambda ws: ws.update(done=True))
        job.add_stop_condition(fixed.outputs()[0])
        dj.epoch_limiter(job, 2)
    with caplog.at_level("WARNING", logger="daskjobs"):
        assert runner(job).train(session) == 2
    warned = [r.getMessage() for r in caplog.records if "outside the epoch group" in r.getMessage()]
    assert len(warned) == 1
    assert "stop conditions ['done'] of job 'fixed'" in warned[0]
    assert session.fetch("done", node="a")
    caplog.clear()
    with caplog.at_level("WARNING", logger="daskjobs"):
        runner(counting_job(name="fine"), max_epochs=1).train(session)
    assert not [r for r in caplog.records if "outside the epoch group" in r.getMessage()]


@pytest.mark.parametrize(
    "bad",
    [
        0,
        -1,
        1.5,
        "3",
        True,
    ],
)
def test_runner_rejects_bad_max_epochs(bad):
    """A max_epochs that is not a positive int raises ValueError."""
    with pytest.raises(ValueError, match="max_epochs"):
        runner(counting_job(), max_epochs=bad)


def test_runner_rejects_non_job():
    """A JobRunner needs a Job."""
    with pytest.raises(ValueError, match="needs a Job"):
        dj.JobRunner("job")


@pytest.mark.parametrize("num_epochs", [1, 2, 5])
def test_epoch_limiter_exact_epochs(session, num_epochs):
    """epoch_limiter runs exactly num_epochs epochs from scratch."""
    job = counting_job()
    output = dj.epoch_limiter(job, num_epochs, node="a")
    run = runner(job)
    assert run.train(session) == num_epochs
    assert session.fetch("epochs", node="a").tolist() == list(range(1, num_epochs + 1))
    assert output.fetch() == np.True_
    name = output.names[0]
    assert [r.stop_values for r in run.history] == [{name: e == num_epochs} for e in range(1, num_epochs + 1)]


def test_two_epoch_limiters_earliest_wins(session):
    """With two epoch limiters the smaller count stops the job."""
    job = counting_job()
    dj.epoch_limiter(job, 4, node="a")
    dj.epoch_limiter(job, 2, node="b")
    assert runner(job).train(session) == 2
    assert session.fetch("n", node="a") == 2


# -- stop condition values ------------------------------------------------------------------------------


def stop_job(value_step):
    with dj.Job() as job, dj.Node("a"):
        with job.init_group:
            dj.Task(init_counter)
        task = dj.Task([count_epoch, value_step], outputs="halt", name="halt_task")
        job.add_stop_condition(task.outputs()[0])
    return job


def set_halt(value):
    def step(ws):
        ws["halt"] = value

    return step


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (np.int64(1), "dtype int64 and shape ()"),
        (np.array([1.0]), "dtype float64 and shape (1,)"),
        (np.array([True, True]), "dtype bool and shape (2,)"),
        (np.zeros((0,), dtype=bool), "dtype bool and shape (0,)"),
    ],
    ids=["int", "float-array", "two-bools", "no-bools"],
)
def test_non_boolean_stop_condition(session, value, kind):
    """A stop condition that is not one boolean raises TypeError naming the condition after epoch 1."""
    job = stop_job(set_halt(value))
    with pytest.raises(TypeError, match=f"stop condition 'halt' must be .* got array of {re.escape(kind)}$"):
        runner(job).train(session)
    assert session.fetch("n", node="a") == 1


def test_non_boolean_stop_condition_is_stop_condition_error(session):
    """The error for a non-boolean stop condition is a StopConditionError."""
    with pytest.raises(StopConditionError):
        runner(stop_job(set_halt(2.5))).train(session)


@pytest.mark.parametrize("value", [True, np.bool_(True), np.array([True]), np.array([[True]])])
def test_boolean_stop_condition_forms(session, value):
    """A bool, a numpy bool and one-element bool arrays all stop the job."""
    assert runner(stop_job(set_halt(value))).train(session) == 1


def test_raising_stop_condition_task(session):
    """A stop-condition task whose step raises gives TaskFailedError naming job, epoch group, node, task and epoch."""

    def halt_after_two(ws):
        if ws.epoch == 2:
            raise ZeroDivisionError("cannot decide at epoch 2")
        ws["halt"] = False

    with dj.Job(name="deciding") as job, dj.Node("b"):
        with job.init_group:
            dj.Task(init_counter)
        task = dj.Task([count_epoch, halt_after_two], outputs="halt", name="decide")
        job.add_stop_condition(task.outputs()[0])
    with pytest.raises(TaskFailedError) as info:
        runner(job).train(session)
    error = info.value
    assert (error.job, error.group, error.node, error.task, error.epoch) == ("deciding", "epoch", "b", "b/decide", 2)
    assert str(error) == (
        "task 'b/decide' failed in the epoch group of job 'deciding' on node 'b', epoch 2: "
        "ZeroDivisionError: cannot decide at epoch 2"
    )
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert 'raise ZeroDivisionError("cannot decide at epoch 2")' in error.remote_traceback


def test_missing_stop_condition_blob(session):
    """A blob-name stop condition whose blob never exists fails the epoch with TaskFailedError naming it."""
    job = counting_job()
    with dj.Node("a"):
        job.add_stop_condition("never_written")
    with pytest.raises(TaskFailedError, match="'never_written'") as info:
        runner(job).train(session)
    assert (info.value.group, info.value.epoch) == ("epoch", 1)
    assert isinstance(info.value.__cause__, KeyError)


# -- after the loop -------------------------------------------------------------------------------------


class RecordingUpload:
    """An upload builder that records the epoch and the manager it was given."""

    def build(self, epoch, checkpoint_manager):
        def upload(ws):
            append(ws, "order", 100 + epoch + (0 if checkpoint_manager is None else 1000))

        with dj.TaskGroup() as group, dj.Node("a"):
            dj.Task(upload)
        return group


def test_upload_download_exit_order(session):
    """After the loop the upload group runs with the last epoch, then download, then exit."""

    def init(ws):
        ws["order"] = EMPTY

    def epoch_step(ws):
        append(ws, "order", ws.epoch)

    def download(ws):
        append(ws, "order", 200)

    def exit_step(ws):
        append(ws, "order", 300)

    with dj.Job() as job, dj.Node("a"):
        with job.init_group:
            dj.Task(init)
        dj.Task(epoch_step)
        with job.download_group:
            dj.Task(download)
        with job.exit_group:
            dj.Task(exit_step)
        dj.epoch_limiter(job, 2)
    assert runner(job, upload_task_group_builder=RecordingUpload()).train(session) == 2
    assert session.fetch("order", node="a").tolist() == [1, 2, 102, 200, 300]


def test_download_and_exit_run_without_upload(session):
    """Without an upload builder the download and exit groups still run once each, in order."""

    def init(ws):
        ws["order"] = EMPTY

    with dj.Job() as job, dj.Node("a"):
        with job.init_group:
            dj.Task(init)
        with job.download_group:
            dj.Task(lambda ws: append(ws, "order", 200))
        with job.exit_group:
            dj.Task(lambda ws: append(ws, "order", 300))
    assert runner(job, max_epochs=3).train(session) == 3
    assert session.fetch("order", node="a").tolist() == [200, 300]


def test_ws_epoch_per_group(session):
    """ws.epoch is None in init, download and exit groups and the epoch number in the epoch group."""

    def record(ws):
        append(ws, "epochs", -1 if ws.epoch is None else ws.epoch)

    with dj.Job() as job, dj.Node("c"):
        with job.init_group:
            dj.Task([lambda ws: ws.__setitem__("epochs", EMPTY), record])
        dj.Task(record)
        with job.download_group:
            dj.Task(record)
        with job.exit_group:
            dj.Task(record)
    runner(job, max_epochs=3).train(session)
    assert session.fetch("epochs", node="c").tolist() == [-1, 1, 2, 3, -1, -1]


# -- history and resuming -------------------------------------------------------------------------------


def test_history_records(session):
    """runner.history holds one record per epoch with timings, no checkpoint data and no recoveries."""
    job = counting_job()
    limiter = dj.epoch_limiter(job, 3, node="a")
    run = runner(job)
    run.train(session)
    assert len(run.history) == 3
    for number, record in enumerate(run.history, start=1):
        assert isinstance(record, dj.EpochRecord)
        assert record.epoch == number
        assert record.seconds >= 0
        assert (record.checkpoint_seconds, record.checkpoint_bytes, record.recoveries) == (0.0, 0, 0)
        assert record.stop_values == {limiter.names[0]: number == 3}


def test_history_resets_on_each_train(session):
    """A second train() call replaces the history of the first."""
    job = counting_job()
    run = runner(job, max_epochs=2)
    run.train(session)
    run.train(session)
    assert [r.epoch for r in run.history] == [1, 2]
    assert session.fetch("epochs", node="a").tolist() == [1, 2]


def test_resume_without_manager_skips_init(session):
    """resume_from_epoch without a manager skips the init group and starts at the next epoch."""
    session.feed("n", 0, node="a")
    session.feed("epochs", EMPTY, node="a")
    job = counting_job()
    with job.init_group:
        dj.Task(lambda ws: ws.__setitem__("init_ran", 1), node="a")
    run = runner(job, resume_from_epoch=5, max_epochs=7)
    assert run.train(session) == 7
    assert session.fetch("epochs", node="a").tolist() == [6, 7]
    assert [r.epoch for r in run.history] == [6, 7]
    assert session.blobs("a") == ["epochs", "n"]


@pytest.mark.parametrize("resume", [5, 6])
def test_resume_without_manager_at_or_past_max_epochs_runs_nothing(session, resume):
    """Resuming (no manager) from an epoch >= max_epochs runs no epoch and returns that epoch."""
    session.feed("n", 0, node="a")
    session.feed("epochs", EMPTY, node="a")
    run = runner(counting_job(), resume_from_epoch=resume, max_epochs=5)
    assert run.train(session) == resume
    assert session.fetch("epochs", node="a").tolist() == []
    assert run.history == []


def test_train_with_no_session_uses_local_session():
    """train(None) runs the job in a LocalSession of its own and returns the last epoch."""
    job = counting_job()
    dj.epoch_limiter(job, 3, node="a")
    assert runner(job).train(None) == 3
    assert runner(counting_job(), max_epochs=2)(None) == 2


def test_epoch_limiter_resumes_with_a_redefined_job(session):
    """A job defined again and resumed in the same workspaces stops at the same absolute epoch."""

    def define():
        job = counting_job()
        dj.epoch_limiter(job, 5, node="a")
        return job

    assert runner(define(), max_epochs=2).train(session) == 2
    resumed = runner(define(), resume_from_epoch=2)
    assert resumed.train(session) == 5
    assert [r.epoch for r in resumed.history] == [3, 4, 5]
    assert session.fetch("epochs", node="a").tolist() == [1, 2, 3, 4, 5]
