"""A node's worker process killed while a job runs on a ``node_cluster`` (the OOM killer, a crash) is
reported by daskjobs alone: the runner recovers and logs one line, and no Dask ERROR (the
scheduler's "marked as failed because 1 workers died" or "Couldn't gather keys", a peer worker's
"Worker stream died during communication" with its traceback) reaches the driver's output or the
worker processes' (which share its stderr), whenever the worker dies."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

EPOCHS = 8


def define_job(marker: Path | None = None) -> dj.Job:
    """ps publishes weights, worker computes a step from them, ps applies it: data flows both ways
    every epoch. With ``marker``, node worker's step SIGKILLs its own process once, in epoch 4."""
    with dj.Cluster(), dj.Job(name="two-nodes") as job:
        with dj.Node("ps"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("weights", np.zeros(4)), name="init_ps")
            publish = dj.Task(lambda ws: ws.__setitem__("published", ws["weights"].copy()), outputs="published")
        with dj.Node("worker"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("target", np.arange(4.0)), name="init_worker")

            def gradient(ws):
                if marker is not None and ws.epoch == 4 and not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)
                ws["step"] = 0.5 * (ws["target"] - ws["published"])

            grad = dj.Task(gradient, inputs={"published": publish.outputs()[0]}, outputs="step")
        with dj.Node("ps"):
            apply = lambda ws: ws.__setitem__("weights", ws["weights"] + ws["step"])  # noqa: E731
            dj.Task(apply, inputs={"step": grad.outputs()[0]})
            dj.epoch_limiter(job, EPOCHS)
    return job


def worker_pid(session: dj.DaskSession, name: str) -> int:
    client = session.client
    address = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == name)
    return client.run(os.getpid, workers=[address])[address]


@pytest.mark.representative("0-after-a-commit", "0-mid-epoch", "0-in-its-step")  # the second trials: -m matrix
@pytest.mark.parametrize("moment", ["after-a-commit", "mid-epoch", "in-its-step"])
@pytest.mark.parametrize("trial", range(2))
def test_a_killed_worker_is_recovered_without_a_dask_error(tmp_path, capfd, caplog, moment, trial):
    """SIGKILL node worker's process after epoch 3's commit (from on_epoch), from another thread
    while an epoch runs, or from its own step: one recovery, the unbroken result, and no ERROR
    line or traceback on stdout/stderr (of this process and of the worker processes) or in the
    driver's log records."""
    expected = dj.LocalSession()
    dj.JobRunner(define_job(), max_epochs=EPOCHS, progress=False).train(expected)
    marker = tmp_path / "killed" if moment == "in-its-step" else None
    with dj.node_cluster(["ps", "worker"], nthreads=1) as cluster, dj.DaskSession(cluster) as session:
        pid = worker_pid(session, "worker")
        killer = None

        def on_epoch(record: dj.EpochRecord) -> None:
            nonlocal killer
            if record.epoch != 3 or moment == "in-its-step":
                return
            if moment == "after-a-commit":
                os.kill(pid, signal.SIGKILL)
            else:
                killer = threading.Timer(0.1 + 0.05 * trial, os.kill, (pid, signal.SIGKILL))
                killer.start()

        manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp(dir=tmp_path))
        runner = dj.JobRunner(define_job(marker), manager, progress=False, on_epoch=on_epoch)
        with caplog.at_level(logging.INFO):
            assert runner.train(session) == EPOCHS
        if killer is not None:
            killer.join()
        assert np.array_equal(session.fetch("weights", "ps"), expected.fetch("weights", "ps"))
    expected.close()
    assert runner.history[-1].recoveries == 1
    out, err = capfd.readouterr()
    shown = [line for line in (out + err).splitlines() if "ERROR" in line or "Traceback" in line]
    assert shown == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize(
    ("message", "args", "dropped"),
    [
        ("Worker stream died during communication: %s", ("tcp://127.0.0.1:1",), True),  # fetching from a dead peer
        ("failed during get data with %s -> %s", ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), True),  # sending to one
        ("Compute Failed\nKey: %s", ("user-task",), False),
        ("some other worker error %s", ("x",), False),
    ],
)
def test_a_worker_process_drops_the_errors_of_a_peer_lost_in_a_transfer(message, args, dropped):
    """In worker processes daskjobs starts, Dask's ERRORs about a peer that died while data went to
    or came from it are dropped (daskjobs reports the lost node); every other ERROR stays."""
    from daskjobs.session._worker_process import _DropPeerLoss

    record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, message, args, None)
    assert _DropPeerLoss().filter(record) is not dropped


async def _heartbeat_answered_by(answer, close_worker: bool) -> None:
    """A real in-process scheduler and worker; the scheduler answers the worker's heartbeat with
    ``answer`` (fault injection: a slow or failing answer) while the worker closes or keeps running."""
    from distributed import Scheduler, Worker

    async with Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0") as scheduler:
        worker = await Worker(scheduler.address, host="127.0.0.1")
        answer_normally = scheduler.handlers["heartbeat_worker"]

        async def heartbeat_worker(*args, **kwargs):
            await answer()
            return answer_normally(*args, **kwargs)

        scheduler.handlers["heartbeat_worker"] = heartbeat_worker
        beat = asyncio.create_task(worker.heartbeat())
        await asyncio.sleep(0.1)  # the heartbeat is in flight
        if close_worker:
            await worker.close()
        await asyncio.wait_for(beat, 10)
        if not close_worker:
            await worker.close()


async def _slow() -> None:
    await asyncio.sleep(0.5)


async def _refused() -> None:
    raise ConnectionRefusedError("the scheduler's side failed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("answer", "close_worker", "logged"),
    [(_slow, True, False), (_refused, False, True)],
    ids=["cut-by-its-own-close", "failed-while-running"],
)
def test_a_heartbeat_cut_by_the_worker_closing_is_not_an_error(caplog, answer, close_worker, logged):
    """A worker that closes while its heartbeat is in flight (its driver is done after a second
    Ctrl-C; its nanny got a signal) cuts that heartbeat: no ERROR with a traceback for it. A
    heartbeat that fails while the worker runs is still logged."""
    from daskjobs.session._worker_process import quiet_compute_failures

    quiet_compute_failures()
    logging.getLogger("distributed.worker").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR, logger="distributed.worker"):
            asyncio.run(_heartbeat_answered_by(answer, close_worker))
    finally:
        logging.getLogger("distributed.worker").removeHandler(caplog.handler)
    failed = [r for r in caplog.records if r.getMessage().startswith("Failed to communicate with scheduler")]
    assert len(failed) == (1 if logged else 0), [r.getMessage() for r in caplog.records]
