"""Best-k retention by a logged metric, and open_checkpoint(prefix, epoch="best")."""

from __future__ import annotations

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointNotFoundError, JobDefinitionError

LOSS = {1: 5.0, 2: 3.0, 3: 1.0, 4: 2.0, 5: 4.0, 6: 6.0, 7: 0.5, 8: 7.0}
"""Per-epoch loss: down, up, a new best late, then up again."""


def metric_job(values: dict[int, float] = LOSS, name: str = "loss", skip: frozenset[int] = frozenset()) -> dj.Job:
    """Two nodes; epoch ``e`` logs ``values[e]`` (the mean of two loggings) unless ``e`` is in ``skip``."""
    with dj.Job(name="bestk") as job:
        with job.init_group:
            for node in ("a", "b"):
                dj.Task(lambda ws: ws.__setitem__("w", np.zeros(3)), node=node)

        def step(ws, offset):
            ws["w"] = ws["w"] + 1
            if ws.epoch not in skip:
                ws.log(name, values[ws.epoch] + offset)

        dj.Task(lambda ws: step(ws, -0.5), node="a")
        dj.Task(lambda ws: step(ws, 0.5), node="b")
    return job


def run(prefix: str, epochs: int = 8, job: dj.Job | None = None, **options) -> dj.JobRunner:
    runner = dj.JobRunner(
        job or metric_job(), dj.MultiNodeCheckpointManager(prefix, **options), max_epochs=epochs, progress=False
    )
    runner.train(None)
    return runner


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        ({"keep_best": 2, "best_metric": "loss"}, [3, 7, 8]),
        ({"keep_best": 2}, [3, 7, 8]),  # SPEC §1.7: best_metric="loss", best_mode="min" by default
        ({"keep_best": 1, "best_metric": "loss"}, [7, 8]),
        ({"keep_best": 3, "best_metric": "loss", "best_mode": "max"}, [1, 6, 8]),
        ({"keep_best": 2, "best_metric": "loss", "keep_last": 2}, [3, 7, 8]),
        ({"keep_best": 2, "best_metric": "loss", "keep_last": 3}, [3, 6, 7, 8]),
        ({"keep_best": 2, "best_metric": "loss", "best_mode": "max", "keep_last": 2}, [6, 7, 8]),
        ({"keep_best": 1, "best_metric": "loss", "keep_every": 4}, [0, 4, 7, 8]),
        ({"keep_best": 20, "best_metric": "loss"}, [1, 2, 3, 4, 5, 6, 7, 8]),
    ],
)
def test_retention_keeps_best_union_newest(prefix, options, kept):
    runner = run(prefix, **options)
    infos = dj.list_checkpoints(prefix)
    assert [i.epoch for i in infos] == kept
    assert [r.metrics["loss"] for r in runner.history] == [LOSS[e] for e in range(1, 9)]
    for info in infos:
        assert info.metrics == ({"loss": LOSS[info.epoch]} if info.epoch else {})
        assert info.record["best"] == {"metric": "loss", "mode": options.get("best_mode", "min")}
        dj.open_checkpoint(prefix, info.epoch).verify()


def test_retention_tracks_best_at_every_commit(prefix):
    """After each commit the kept set is exactly the best 2 so far plus the newest."""
    seen: list[list[int]] = []
    manager = dj.MultiNodeCheckpointManager(prefix, keep_best=2, best_metric="loss")

    def look(record):
        seen.append([i.epoch for i in dj.list_checkpoints(prefix)])

    runner = dj.JobRunner(metric_job(), manager, max_epochs=8, progress=False, on_epoch=look)
    runner.train(None)
    assert seen == [[1], [1, 2], [2, 3], [3, 4], [3, 4, 5], [3, 4, 6], [3, 7], [3, 7, 8]]


def test_epochs_without_the_metric_never_count_as_best(prefix):
    job = metric_job(skip=frozenset({3, 7}))
    run(prefix, job=job, keep_best=2, best_metric="loss")
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [2, 4, 8]
    assert dj.open_checkpoint(prefix, "best").epoch == 4


def test_other_metric_name_keeps_only_newest(prefix):
    run(prefix, keep_best=2, best_metric="accuracy")
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [8]


def test_resumed_run_ranks_epochs_committed_before(prefix):
    run(prefix, epochs=4, keep_best=2, best_metric="loss")
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [3, 4]
    run(prefix, epochs=8, keep_best=2, best_metric="loss")
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [3, 7, 8]


@pytest.mark.parametrize("async_save", [False, True])
def test_open_best_uses_the_recorded_metric_and_mode(prefix, async_save):
    run(prefix, keep_best=2, best_metric="loss", best_mode="max", keep_last=3, async_save=async_save)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [6, 7, 8]
    view = dj.open_checkpoint(prefix, epoch="best")
    assert view.epoch == 8
    assert view["a"]["w"].tolist() == [8.0] * 3
    assert dj.open_checkpoint(prefix, "best", mode="min").epoch == 7
    assert dj.open_checkpoint(prefix, "best", metric="loss", mode="min").epoch == 7


def test_open_best_without_retention_defaults_to_min_loss(prefix):
    run(prefix)
    assert dj.open_checkpoint(prefix, "best").epoch == 7
    assert dj.open_checkpoint(prefix, "best", mode="max").epoch == 8
    assert dj.open_checkpoint(prefix, "best", metric="loss", mode="max")["b"]["w"].tolist() == [8.0] * 3


def test_open_best_names_a_missing_metric(prefix):
    run(prefix, epochs=2)
    with pytest.raises(CheckpointNotFoundError, match="'accuracy'"):
        dj.open_checkpoint(prefix, "best", metric="accuracy")
    with pytest.raises(JobDefinitionError, match="'sideways'"):
        dj.open_checkpoint(prefix, "best", mode="sideways")
    with pytest.raises(JobDefinitionError, match="'latest'"):
        dj.open_checkpoint(prefix, "latest")


def test_open_best_on_an_empty_prefix(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        dj.open_checkpoint(str(tmp_path), "best")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": -1, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": 1.5, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": True, "best_metric": "loss"}, "keep_best"),
        ({"keep_best": 2, "best_metric": ""}, "best_metric"),
        ({"keep_best": 2, "best_metric": "loss", "best_mode": "lowest"}, "best_mode"),
    ],
)
def test_invalid_best_options(prefix, options, message):
    with pytest.raises(JobDefinitionError, match=message):
        dj.MultiNodeCheckpointManager(prefix, **options)


def test_best_k_on_every_session_kind(prefix, session):
    """Metrics logged on worker processes reach the commit records and retention."""
    manager = dj.MultiNodeCheckpointManager(prefix, keep_best=2, best_metric="loss", keep_last=1)
    dj.JobRunner(metric_job(), manager, max_epochs=8, progress=False).train(session)
    assert [(i.epoch, i.metrics) for i in dj.list_checkpoints(prefix)] == [
        (3, {"loss": 1.0}),
        (7, {"loss": 0.5}),
        (8, {"loss": 7.0}),
    ]
    assert dj.open_checkpoint(prefix, "best")["b"]["w"].tolist() == [7.0] * 3


def test_best_metric_without_keep_best_is_recorded_for_open_best(prefix):
    run(prefix, best_metric="loss", best_mode="max")
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == list(range(9))
    assert dj.open_checkpoint(prefix, "best").epoch == 8
