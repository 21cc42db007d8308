"""The epoch progress bar: when it shows, its total, start and text, and the per-epoch log line."""

from __future__ import annotations

import logging
import re
import sys

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.runner._history import EpochRecord
from daskjobs.runner._notebook import in_jupyter
from daskjobs.runner._progress import EpochProgress, _bar_class, describe, known_total


def counting_job(limit: int | None = None, stop_at: int | None = None) -> dj.Job:
    """Logs ``loss``; stops by ``epoch_limiter(limit)`` and/or a blob true from epoch ``stop_at``."""
    with dj.Job(name="bar") as job, dj.Node("trainer"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))

        def step(ws):
            ws["n"] = ws["n"] + 1
            ws.log("loss", 1.0 / ws.epoch)
            ws["converged"] = stop_at is not None and ws.epoch >= stop_at

        dj.Task(step)
        job.add_stop_condition("converged")
        if limit is not None:
            dj.epoch_limiter(job, limit)
    return job


def counts(text: str) -> list[str]:
    return re.findall(r"\| (\d+/\d+) \[", text)


@pytest.mark.parametrize(
    ("limit", "max_epochs", "total"),
    [(4, None, 4), (6, 3, 3), (2, 5, 2), (None, 3, 3)],
)
def test_total_is_the_smallest_known_limit(capsys, limit, max_epochs, total):
    job = counting_job(limit)
    assert job.epoch_limit == limit
    last = dj.JobRunner(job, max_epochs=max_epochs, progress=True).train(None)
    assert last == total
    err = capsys.readouterr().err
    assert counts(err)[-1] == f"{total}/{total}"
    assert "job bar" in err
    assert "loss=" in err
    assert "converged=0" in err
    assert "ckpt" in err


def test_no_total_without_a_known_limit(capsys):
    dj.JobRunner(counting_job(stop_at=3), progress=True).train(None)
    err = capsys.readouterr().err
    assert not counts(err)
    assert "3epoch" in err.replace(" ", "")
    assert "converged=1" in err


def test_stop_before_the_total_completes_the_bar(capsys):
    dj.JobRunner(counting_job(limit=10, stop_at=3), progress=True).train(None)
    assert counts(capsys.readouterr().err)[-1] == "3/3"


def test_resume_starts_at_the_resumed_epoch(capsys, prefix):
    dj.JobRunner(counting_job(limit=6), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(None)
    capsys.readouterr()
    dj.JobRunner(counting_job(limit=6), dj.MultiNodeCheckpointManager(prefix), progress=True).train(None)
    seen = counts(capsys.readouterr().err)
    assert seen[0] == "3/6"
    assert seen[-1] == "6/6"


def test_quiet_by_default_when_stderr_is_not_a_terminal(capsys):
    assert not sys.stderr.isatty()
    dj.JobRunner(counting_job(limit=2), progress=None).train(None)
    dj.JobRunner(counting_job(limit=2), progress=False).train(None)
    assert capsys.readouterr().err == ""


def test_shown_by_default_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    dj.JobRunner(counting_job(limit=2), progress=None).train(None)
    assert counts(capsys.readouterr().err)[-1] == "2/2"


def test_one_info_line_per_epoch(caplog):
    with caplog.at_level(logging.INFO, logger="daskjobs"):
        dj.JobRunner(counting_job(limit=3), progress=False).train(None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert len(lines) == 3
    assert "'loss': 0.5" in lines[1]
    assert "'converged': False" in lines[1]


def test_describe_shows_times_metrics_stops_and_recoveries():
    record = EpochRecord(7, 1.5, 0.25, 10, 20, {"done": True}, {"loss": 0.123456}, recoveries=1)
    assert describe(record) == "epoch 7 1.50s ckpt 0.25s loss=0.1235 done=1 recoveries=1"


def test_known_total():
    assert known_total() is None
    assert known_total(None, None) is None
    assert known_total(5, None) == 5
    assert known_total(5, 3) == 3


def test_not_jupyter_in_a_plain_process():
    assert in_jupyter() is False


@pytest.mark.slow
def test_widget_in_jupyter_text_without_ipywidgets(monkeypatch):
    from tqdm.notebook import tqdm as notebook_tqdm
    from tqdm.std import tqdm as text_tqdm

    assert _bar_class(True) is notebook_tqdm
    assert _bar_class(False) is text_tqdm
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert _bar_class(True) is text_tqdm


def test_progress_writes_dashboard_link(capsys):
    bar = EpochProgress(True, "x", start=1, total=2, dashboard="http://127.0.0.1:8787/status")
    bar.update(EpochRecord(1, 0.1, 0.0, 0, 0, {}, {}))
    bar.close()
    assert "Dask dashboard: http://127.0.0.1:8787/status" in capsys.readouterr().err


def test_bar_stands_at_the_last_finished_epoch(capsys):
    """An epoch run again after a recovery (async save: the last recorded epoch was not committed) counts once."""
    bar = EpochProgress(True, "x", start=1, total=4)
    for epoch in (1, 2, 3, 3, 4):
        bar.update(EpochRecord(epoch, 0.1, 0.0, 0, 0, {}, {}, recoveries=int(epoch == 3)))
    bar.close()
    assert counts(capsys.readouterr().err)[-1] == "4/4"


@pytest.mark.parametrize(
    ("size", "expected"),
    [((0, 0), {"ncols": 100, "nrows": 24}), ((80, 0), {"nrows": 24}), ((80, 24), {})],
)
def test_bare_terminal_gets_a_size(monkeypatch, size, expected):
    """A pty that reports 0 columns or rows would make tqdm print nothing."""
    import os

    from daskjobs.runner._progress import _bare_terminal_size

    monkeypatch.setattr(sys.stderr, "fileno", lambda: 2, raising=False)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size(size))
    assert _bare_terminal_size() == expected


def test_widget_completes_when_a_stop_condition_ends_early():
    """In Jupyter the widget's own maximum follows, so an early stop is not shown as a failed (red) bar."""
    from tqdm.notebook import tqdm as notebook_tqdm

    bar = EpochProgress(False, "x", start=1, total=None)
    bar._bar = notebook_tqdm(total=10, initial=0, desc="job x", unit="epoch", leave=True)
    for epoch in (1, 2, 3):
        bar.update(EpochRecord(epoch, 0.1, 0.0, 0, 0, {"done": epoch == 3}, {}))
    bar.complete()
    widget = bar._bar.container.children[1]
    assert (bar._bar.total, widget.max, widget.value) == (3, 3, 3)
    bar.close()
    assert widget.bar_style != "danger"
