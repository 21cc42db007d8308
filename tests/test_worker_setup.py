"""The worker processes daskjobs starts: the configured preloads run beside daskjobs' own, signals to
the whole job leave them alive, and why a worker left is read from the scheduler's log."""

from __future__ import annotations

import signal

import dask.config
import pytest

import daskjobs as dj
from daskjobs.session._losses import departure


def _dispositions() -> tuple[object, object]:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_node_cluster_workers_run_the_configured_preloads_and_ignore_job_signals(tmp_path):
    """A preload named in the Dask config (with its argv) runs in every worker process, and so does
    daskjobs' own: the workers ignore SIGINT and SIGTERM (the driver stops the job and closes them)."""
    marker = tmp_path / "preloaded"
    preload = tmp_path / "user_preload.py"
    preload.write_text(
        "import click, pathlib\n"
        "@click.command()\n@click.argument('word')\n"
        "def dask_setup(worker, word):\n"
        f"    pathlib.Path({str(marker)!r}, worker.name).write_text(word)\n"
    )
    marker.mkdir()
    config = {"distributed.worker.preload": [str(preload)], "distributed.worker.preload-argv": [["hello"]]}
    with dask.config.set(config), dj.node_cluster(["a", "b"]) as cluster, dj.DaskSession(cluster) as session:
        dispositions = session.client.run(_dispositions)
    assert sorted(p.name for p in marker.iterdir()) == ["a", "b"]
    assert {p.read_text() for p in marker.iterdir()} == {"hello"}
    assert set(dispositions.values()) == {(signal.SIG_IGN, signal.SIG_IGN)}


def _events(*messages: dict) -> list[tuple[float, dict]]:
    return [(float(i), m) for i, m in enumerate([{"action": "add-worker"}, *messages])]


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        (_events({"action": "closing-worker", "reason": "worker-lifetime-reached"}), "its --lifetime ran out"),
        (_events({"action": "remove-worker", "expected": True}, {"action": "retired"}), "it was retired"),
        (  # its lifetime ran out, its closing reason not logged yet: it retired itself
            _events({"action": "remove-worker", "expected": True, "stimulus_id": "worker-close-gracefully-17.5"}),
            "its --lifetime ran out",
        ),
        (
            _events(
                {"action": "remove-worker", "expected": True},
                {"action": "closing-worker", "reason": "scheduler-remove-worker"},
            ),
            "it was retired",
        ),
        (
            _events(
                {"action": "closing-worker", "reason": "signal-15"}, {"action": "remove-worker", "expected": False}
            ),
            "it was sent SIGTERM (a preemption or spot notice)",
        ),
        (_events({"action": "remove-worker", "expected": False}), None),  # SIGKILL, a crash, a lost connection
        (_events({"action": "closing-worker", "reason": "worker-handle-scheduler-connection-broken"}), None),
        (_events(), None),  # the worker has not left at all
        (  # the address used again by a new worker that was then killed: the old retirement does not count
            _events(
                {"action": "remove-worker", "expected": True}, {"action": "add-worker"}, {"action": "remove-worker"}
            ),
            None,
        ),
    ],
    ids=[
        "lifetime",
        "retired",
        "lifetime-unlogged",
        "retired-closed",
        "sigterm",
        "killed",
        "connection-broken",
        "still-there",
        "reused",
    ],
)
def test_why_a_worker_left_is_read_from_its_event_log(events, expected):
    assert departure(events) == expected
