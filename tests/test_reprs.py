"""Notebook reprs (``_repr_html_``) of Job, TaskGroup, JobRunner, managers and checkpoint views."""

from __future__ import annotations

import numpy as np
import pytest

import daskjobs as dj


def small_job() -> dj.Job:
    with dj.Job(name="shown") as job, dj.Node("trainer_0"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("weights", np.zeros((2, 3), dtype=np.float32)), name="make")

        def step(ws):
            ws["weights"] = ws["weights"] + 1
            ws.log("loss", 1.0 / ws.epoch)

        dj.Task(step, name="train")
        dj.epoch_limiter(job, 25)
    return job


def test_job_and_group_reprs():
    job = small_job()
    text = job._repr_html_()
    assert "shown" in text
    assert "epoch_limiter.0.stop" in text
    assert "trainer_0" in text
    group = job.epoch_group._repr_html_()
    assert "TaskGroup" in group
    assert "train" in group
    assert "epoch_limiter.0.stop" in group


def test_runner_repr_shows_last_20_epochs_with_metrics(prefix):
    manager = dj.MultiNodeCheckpointManager(prefix, keep_best=2, best_metric="loss", keep_last=1)
    runner = dj.JobRunner(small_job(), manager, progress=False)
    assert "0 epochs run" in runner._repr_html_()
    runner.train(None)
    text = runner._repr_html_()
    assert "JobRunner" in text
    assert "shown" in text
    assert "25 epochs run, last 20 shown" in text
    assert "<th>loss</th>" in text
    assert "<th>stop:epoch_limiter.0.stop</th>" in text
    assert "<td>6</td>" in text
    assert "<td>5</td>" not in text
    assert f"<td>{1 / 25:.4g}</td>" in text
    assert prefix in text
    assert "dashboard" not in text


@pytest.mark.cluster
def test_runner_repr_links_the_dashboard(shared_cluster):
    with dj.DaskSession(shared_cluster) as session:
        runner = dj.JobRunner(small_job(), max_epochs=2, progress=False)
        runner.train(session)
    assert runner.dashboard_link == shared_cluster.dashboard_link
    assert f'href="{shared_cluster.dashboard_link}"' in runner._repr_html_()


def test_manager_and_checkpoint_view_reprs(prefix):
    manager = dj.MultiNodeCheckpointManager(prefix, keep_best=2, best_metric="loss", keep_last=1)
    assert "0 committed epochs" in manager._repr_html_()
    dj.JobRunner(small_job(), manager, progress=False).train(None)
    text = manager._repr_html_()
    assert prefix in text
    assert "keep_best=2 by min loss" in text
    assert "2 committed epochs (24, 25); latest 25" in text
    assert f"loss={1 / 25:.6g}" in text
    view = dj.open_checkpoint(prefix, "best")
    shown = view._repr_html_()
    assert "epoch 1" not in shown
    assert "epoch 25" in shown
    assert "<td>weights</td><td>float32</td><td>(2, 3)</td><td>24</td>" in shown
    assert f"loss={1 / 25:.6g}" in shown
    assert "epoch_limiter.0.stop=True" in shown


def test_checkpoint_view_repr_names_json_blobs(tmp_path):
    from daskjobs.checkpoint._format.records import make_commit_record
    from daskjobs.checkpoint._protocol.store import CheckpointStore

    store = CheckpointStore(str(tmp_path))
    entry = store.write_node("n", 2, {"config": {"a": 1.0}, "labels": np.array(["abc", "de"])}, save_id="s")
    store.commit(make_commit_record("j", 2, {"n": entry}, {}, {}, metrics={"loss": 0.5}))
    shown = dj.open_checkpoint(str(tmp_path))._repr_html_()
    assert "<td>config</td><td>JSON</td><td></td><td>9</td>" in shown
    assert "<td>labels</td><td>&lt;U3</td><td>(2,)</td><td>24</td>" in shown
    assert "loss=0.5" in shown


@pytest.mark.parametrize(
    ("node", "shown"),
    [
        (dj.Node("ps"), "Node('ps')"),
        (dj.Node("trainer_1", GPU=2), "Node('trainer_1', GPU=2)"),
        (dj.Node("a.b:c", **{"GPU": 1, "my-disk": 0.5}), "Node('a.b:c', GPU=1, **{'my-disk': 0.5})"),
    ],
    ids=["name", "resources", "resource-not-an-identifier"],
)
def test_node_repr_is_the_expression_that_makes_it(node, shown):
    """A Node's repr quotes its name like a str and evaluates to an equal node with the same resources."""
    assert repr(node) == shown
    again = eval(shown, {"Node": dj.Node})
    assert again == node
    assert again.kwargs() == node.kwargs()
