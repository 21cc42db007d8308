"""runner.history_frame(), runner.plot() and the history helpers behind them."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.runner._history import EpochRecord, history_frame, history_rows, plot_history


def logging_job(epochs: int = 4) -> dj.Job:
    """One node logging ``loss = 1/epoch`` and ``accuracy = epoch/10`` twice per epoch, limited to ``epochs``."""
    with dj.Job(name="hist") as job, dj.Node("trainer"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("w", np.zeros(1000)))

        def step(ws):
            ws["w"] = ws["w"] + 1
            for offset in (-0.25, 0.25):
                ws.log("loss", 1 / ws.epoch + offset)
            ws.log("accuracy", ws.epoch / 10)

        dj.Task(step)
        dj.epoch_limiter(job, epochs)
    return job


@pytest.fixture
def runner(prefix) -> dj.JobRunner:
    runner = dj.JobRunner(logging_job(), dj.MultiNodeCheckpointManager(prefix), progress=False)
    runner.train(None)
    return runner


def test_history_frame_one_row_per_epoch(runner):
    frame = runner.history_frame()
    assert list(frame.columns) == [
        "epoch",
        "seconds",
        "checkpoint_seconds",
        "bytes_written",
        "bytes_reused",
        "recoveries",
        "stop:epoch_limiter.0.stop",
        "accuracy",
        "loss",
    ]
    assert frame["epoch"].tolist() == [1, 2, 3, 4]
    assert frame["loss"].tolist() == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert frame["accuracy"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert frame["stop:epoch_limiter.0.stop"].tolist() == [False, False, False, True]
    assert (frame["seconds"] > 0).all()
    assert (frame["checkpoint_seconds"] > 0).all()
    assert (frame["bytes_written"] + frame["bytes_reused"] >= 8000).all()
    assert frame["recoveries"].tolist() == [0, 0, 0, 0]
    assert frame.to_dict("records") == history_rows(runner.history)


def test_metrics_reach_commit_records(runner, prefix):
    infos = dj.list_checkpoints(prefix)
    assert [i.epoch for i in infos] == [0, 1, 2, 3, 4]
    assert infos[0].metrics == {}
    assert [i.metrics["loss"] for i in infos[1:]] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert [i.record["metrics"] for i in infos[1:]] == [r.metrics for r in runner.history]


def test_history_frame_of_a_run_without_metrics_or_checkpoints():
    with dj.Job(name="plain") as job:
        dj.Task(lambda ws: None)
    runner = dj.JobRunner(job, max_epochs=2, progress=False)
    assert list(runner.history_frame().columns) == [
        "epoch",
        "seconds",
        "checkpoint_seconds",
        "bytes_written",
        "bytes_reused",
        "recoveries",
    ]
    assert runner.history_frame().empty
    runner.train(None)
    frame = runner.history_frame()
    assert frame["epoch"].tolist() == [1, 2]
    assert frame["bytes_written"].tolist() == [0, 0]


@pytest.mark.parametrize("name", ["val/loss", "train loss", "lößs", "__x", "a" * 128])
def test_any_printable_metric_name_is_logged(prefix, name):
    """SPEC §1.10 puts no rule on metric names (TensorBoard-style ``val/loss`` included): any 1-128
    printable characters reach history, the progress of a run and the commit record."""
    with dj.Job(name="names") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", 0))
        dj.Task(lambda ws: ws.log(name, float(ws.epoch)))
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    runner.train(None)
    assert [r.metrics for r in runner.history] == [{name: 1.0}, {name: 2.0}]
    assert dj.list_checkpoints(prefix)[-1].metrics == {name: 2.0}


@pytest.mark.parametrize("name", ["", "a" * 129, "tab\there", 7])
def test_a_metric_name_that_cannot_label_fails_the_step(name):
    with dj.Job(name="names") as job:
        dj.Task(lambda ws: ws.log(name, 1.0))
    with pytest.raises(dj.errors.TaskFailedError, match="metric name") as failed:
        dj.JobRunner(job, max_epochs=1, progress=False).train(None)
    assert isinstance(failed.value.__cause__, dj.errors.JobDefinitionError)


@pytest.mark.parametrize(
    ("value", "builtin"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (10**400, ValueError),
        ("0.5", TypeError),
        (1j, TypeError),
        (True, TypeError),
        (np.zeros(2), TypeError),
    ],
    ids=["nan", "inf", "huge-int", "str", "complex", "bool", "array"],
)
def test_a_metric_value_that_is_not_a_finite_float_fails_the_step(value, builtin):
    """A refused metric value is a daskjobs error of the matching builtin, and so is the run's error."""
    with dj.Job(name="values") as job:
        dj.Task(lambda ws: ws.log("loss", value))
    with pytest.raises(builtin, match="metric 'loss'") as failed:
        dj.JobRunner(job, max_epochs=1, progress=False).train(None)
    assert isinstance(failed.value, dj.errors.TaskFailedError)
    assert isinstance(failed.value.__cause__, dj.errors.DaskJobsError)
    assert isinstance(failed.value.__cause__, builtin)


def test_metrics_logged_in_the_init_group_are_epoch_0s(prefix):
    """The init group is epoch 0: what its steps log is the metrics of epoch 0's commit."""
    with dj.Job(name="init-metrics") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.log("loss", 4.0))
            dj.Task(lambda ws: ws.log("loss", 2.0))
        dj.Task(lambda ws: ws.log("loss", 1.0))
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=1, progress=False).train(None)
    assert [(i.epoch, i.metrics) for i in dj.list_checkpoints(prefix)] == [(0, {"loss": 3.0}), (1, {"loss": 1.0})]


def test_metric_named_like_a_column_keeps_both():
    record = EpochRecord(1, 0.5, 0.1, 10, 0, {"done": True}, {"seconds": 3.0, "stop:done": 1.0, "loss": 2.0})
    (row,) = history_rows([record])
    assert row["seconds"] == 0.5
    assert row["metric:seconds"] == 3.0
    assert row["stop:done"] is True
    assert row["metric:stop:done"] == 1.0
    assert row["loss"] == 2.0


@pytest.mark.slow
def test_plot_is_a_figure_of_metrics_and_times(runner):
    from matplotlib.figure import Figure

    figure = runner.plot()
    assert isinstance(figure, Figure)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["accuracy", "loss", "time per epoch"]
    loss = figure.axes[1].lines[0]
    assert loss.get_xdata().tolist() == [1, 2, 3, 4]
    assert loss.get_ydata().tolist() == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    epoch_line, checkpoint_line = figure.axes[2].lines
    assert epoch_line.get_ydata().tolist() == [r.seconds for r in runner.history]
    assert checkpoint_line.get_ydata().tolist() == [r.checkpoint_seconds for r in runner.history]
    assert "hist" in figure.get_suptitle()
    figure.savefig(__import__("io").BytesIO(), format="png")


def test_plot_skips_epochs_without_a_metric():
    records = [
        EpochRecord(1, 0.1, 0.0, 0, 0, {}, {"loss": 1.0}),
        EpochRecord(2, 0.1, 0.0, 0, 0, {}, {}),
        EpochRecord(3, 0.1, 0.0, 0, 0, {}, {"loss": 0.5}),
    ]
    figure = plot_history(records)
    assert figure.axes[0].lines[0].get_xdata().tolist() == [1, 3]
    assert [a.get_title() for a in plot_history([]).axes] == ["time per epoch"]


@pytest.mark.parametrize(
    ("hidden", "call", "name"),
    [
        (("pandas",), lambda: history_frame([]), "pandas"),
        (("matplotlib", "matplotlib.figure"), lambda: plot_history([]), "matplotlib"),
    ],
)
def test_missing_optional_dependency_names_the_extra(monkeypatch, hidden, call, name):
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match=rf"needs {name}.*pip install \"daskjobs\[notebook\]\""):
        call()
