"""Jobs for the tests of ``daskjobs check`` / ``dj.testing``: some resume exactly, each of the others
has one kind of defect. Tests copy this file into a temp folder and name its functions as targets
(``path/check_jobs.py:global_rng``), as a user names a job file.

Every job runs for ``EPOCHS`` epochs, its epoch group GLOBAL.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np

import daskjobs as dj

EPOCHS = 4

STATE: dict[str, object] = {}
"""Module state of the jobs that fail."""


def _job(name: str, init, step, *, epochs: int = EPOCHS) -> dj.Job:
    with dj.Cluster(), dj.Job(name=name) as job, dj.Node("a"):
        with job.init_group:
            dj.Task(init, name="init")
        dj.Task(step, name="step", workspace_type=dj.WorkspaceType.GLOBAL)
        dj.epoch_limiter(job, epochs)
    return job


# -- jobs that resume exactly ------------------------------------------------------------------
def _init_a(ws):
    ws["rng"] = np.random.default_rng(7).bit_generator.state  # a Generator's state: a JSON value
    ws["w"] = np.zeros((3, 2), dtype=np.float32)
    ws["meta"] = {"seen": [], "name": "exact"}


def _step_a(ws):
    rng = np.random.default_rng()
    rng.bit_generator.state = ws["rng"]
    ws["w"] = ws["w"] + rng.normal(size=(3, 2)).astype(np.float32)
    ws["rng"] = rng.bit_generator.state
    ws["meta"] = {**ws["meta"], "seen": [*ws["meta"]["seen"], ws.epoch]}
    ws.log("loss", float(np.abs(ws["w"]).sum()))


def _init_b(ws):
    ws["count"] = np.int64(0)
    ws["flags"] = np.array([True, False])


def _step_b(ws):
    ws["count"] = ws["count"] + 1
    ws["flags"] = ~ws["flags"]
    ws["label"] = np.array(f"epoch {ws.epoch}")
    ws.log("loss", float(ws["count"]))


def _init_model(ws):
    ws["v"] = np.zeros(2)


def _process(ws, batch):
    x, y = batch
    ws["v"] = ws["v"] + x.mean(axis=0) / 100
    ws.log("batch", float(y.sum()))


def exact():
    """Resumes exactly: arrays of several dtypes, JSON values and a Generator's state (node a), counters
    and strings (node b), a shuffled ArrayReader fed through pipe (node c), metrics on every node."""
    x = np.arange(200.0).reshape(100, 2)
    with dj.Cluster(), dj.Job(name="exact") as job:
        for node, init, step in (("a", _init_a, _step_a), ("b", _init_b, _step_b)):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init, name="init")
                dj.Task(step, name="step", workspace_type=dj.WorkspaceType.GLOBAL)
        with dj.Node("c"):
            with job.init_group:
                data = dj.ArrayReader(x, np.arange(100), batch_size=10, shuffle=True, seed=3, num_passes=2, name="data")
                dj.Task(_init_model, name="init")
            limited = dj.ReaderWithLimit(data, num_iter=4)
            dj.pipe(limited, _process)
            job.add_stop_condition(limited.data_finished())  # after 5 epochs: the limiter stops it first
        with dj.Node("a"):
            dj.epoch_limiter(job, EPOCHS)
    return job


# -- defects -----------------------------------------------------------------------------------
def _seed(ws):
    np.random.seed(0)
    ws["x"] = np.zeros(3)


def _draw(ws):
    ws["x"] = ws["x"] + np.random.normal(size=3)


COUNTER = {"n": 0}


def _reset_counter(ws):
    COUNTER["n"] = 0
    ws["n"] = np.int64(0)


def _count(ws):
    COUNTER["n"] += 1
    ws["n"] = np.int64(COUNTER["n"])


def _no_time(ws):
    ws["t"] = np.float64(0.0)


def _stamp(ws):
    ws["t"] = np.float64(time.time())


PROGRESS = {"epoch": 0}


def _reset_progress(ws):
    PROGRESS["epoch"] = 0
    ws["m"] = np.int64(0)


def _resync(ws):
    if PROGRESS["epoch"] != ws.epoch - 1:  # this process did not run the epoch before: a blob no run of A has
        ws["resynced_at"] = np.int64(ws.epoch)
    PROGRESS["epoch"] = ws.epoch
    ws["m"] = ws["m"] + 1


SCHEDULE = {"n": 0}


def _reset_schedule(ws):
    SCHEDULE["n"] = 0
    ws["w"] = np.zeros(2)


def _decay(ws):
    SCHEDULE["n"] += 1
    ws["w"] = ws["w"] + 1
    ws.log("lr", 0.1 * 0.5 ** SCHEDULE["n"])


def _zero_average(ws):
    ws["avg"] = np.float64(0.0)


def _average(ws):
    for i in range(25):
        time.sleep(int.from_bytes(os.urandom(2), "little") / 65535 * 0.002)
        with ws.lock:  # no lost update, but the order of the updates is whatever the threads make it
            ws["avg"] = 0.99 * ws["avg"] + 0.01 * (ws.instance_id + 1) * (i + 1)


def _no_draw(ws):
    ws["r"] = np.float64(0.0)


def _draw_unseeded(ws):
    ws["r"] = np.float64(random.random())  # Python's generator, seeded by the process


DEFECTS = {
    # node: (what it does wrong, init, step, instances)
    "a": ("seeds the global random generator in init and draws from it every epoch", _seed, _draw, None),
    "b": ("counts epochs in a module global that init resets", _reset_counter, _count, None),
    "c": ("stores the wall-clock time", _no_time, _stamp, None),
    "ps": ("creates a blob when its module state disagrees with the workspace", _reset_progress, _resync, None),
    "trainer_0": ("4 instances update one running average in lock order", _zero_average, _average, 4),
    "trainer_1": ("logs a learning rate from a module-global schedule", _reset_schedule, _decay, None),
    "local": ("draws from Python's global random generator, never seeded", _no_draw, _draw_unseeded, None),
}


def defects(*nodes: str) -> dj.Job:
    """One node per defect (all of ``DEFECTS``, or ``nodes``); the nodes do not exchange data."""
    with dj.Cluster(), dj.Job(name="defects") as job:
        for node in nodes or DEFECTS:
            _, init, step, instances = DEFECTS[node]
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init, name="init")
                dj.Task(step, name="step", num_instances=instances, workspace_type=dj.WorkspaceType.GLOBAL)
        with dj.Node(next(iter(nodes or DEFECTS))):
            dj.epoch_limiter(job, EPOCHS)
    return job


def global_rng():
    """Only the global random generator defect (node a)."""
    return defects("a")


def _nothing(ws):
    ws["u"] = np.zeros(2)
    ws["names"] = np.array([""])


def _unseeded_numpy(ws):
    ws["u"] = np.random.random(2)  # NumPy's global generator, seeded by the process


def _set_order(ws):
    ws["names"] = np.array(list({f"name-{i}" for i in range(12)}))  # the order of a set depends on the hash seed


def unreproducible():
    """Differs from run to run in new processes only: an unseeded NumPy draw (node a), the iteration
    order of a set of strings (node b)."""
    with dj.Cluster(), dj.Job(name="unreproducible") as job:
        for node, step in (("a", _unseeded_numpy), ("b", _set_order)):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(_nothing, name="init")
                dj.Task(step, name="step", workspace_type=dj.WorkspaceType.GLOBAL)
        with dj.Node("a"):
            dj.epoch_limiter(job, EPOCHS)
    return job


# -- runs that fail --------------------------------------------------------------------------------
def _fail_in_epoch_3(ws):
    if ws.epoch == 3:
        raise ZeroDivisionError("division by zero on purpose")
    ws["n"] = ws["n"] + 1


def failing():
    """Fails in epoch 3 of every run."""
    return _job("failing", _get_ready, _fail_in_epoch_3)


def _needs_init(ws):
    if STATE.get("ready") is None:
        raise RuntimeError("the init group did not run in this process")
    ws["n"] = ws["n"] + 1


def _get_ready(ws):
    STATE["ready"] = True
    ws["n"] = np.int64(0)


def fails_when_resumed():
    """Needs module state that only the init group sets: a resumed run in a new process fails."""
    return _job("fails-when-resumed", _get_ready, _needs_init)


def _slowly(ws):
    time.sleep(1.0)
    ws["n"] = ws["n"] + 1


def slow():
    """A second per epoch, 30 epochs."""
    return _job("slow", _get_ready, _slowly, epochs=30)


def endless():
    """No stop condition."""
    with dj.Cluster(), dj.Job(name="endless") as job, dj.Node("a"):
        dj.Task(_slowly, name="step")
    return job


not_a_job = 42
