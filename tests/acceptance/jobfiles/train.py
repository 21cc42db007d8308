"""A job file as users write it: plain top-level functions, a helper module and a package next to it.

``daskjobs run train.py:job`` trains a linear model held by node ``ps`` on data held by node
``trainer``; every epoch the trainer computes a gradient, the ps applies it. Knobs come from the
environment of the driver (the module's top level runs there only; the steps carry the values):

``JOB_EPOCHS``        epochs to run (default 8)
``JOB_STEP_SECONDS``  seconds each gradient step sleeps (default 0.3), so that signals meet a running epoch
``JOB_MARKS``         a folder where each finished gradient step leaves a file ``epoch-<n>``
``JOB_BALLAST_MB``    MiB of constant data the trainer also holds (default 0): from 16 MiB on, an
                    asynchronous save snapshots the workspace by forking a writer process
"""

import os
import time
from pathlib import Path

import numpy as np
from helpers import loss_of, make_data
from mathlib import descend

import daskjobs as dj

EPOCHS = int(os.environ.get("JOB_EPOCHS", "8"))
STEP_SECONDS = float(os.environ.get("JOB_STEP_SECONDS", "0.3"))
MARKS = os.environ.get("JOB_MARKS")
BALLAST_MB = int(os.environ.get("JOB_BALLAST_MB", "0"))
FEATURES = 6


def init_ps(ws):
    ws["weights"] = np.zeros(FEATURES)
    ws["step_size"] = 0.4


def init_trainer(ws):
    ws["x"], ws["y"] = make_data(64, FEATURES)
    ws["rng"] = np.random.default_rng(7).bit_generator.state
    if BALLAST_MB:
        ws["ballast"] = np.ones(BALLAST_MB << 18, dtype=np.float32)


def publish(ws):
    ws["weights_out"] = ws["weights"].copy()


def gradient(ws):
    rng = np.random.default_rng()
    rng.bit_generator.state = ws["rng"]
    rows = rng.choice(len(ws["x"]), size=32, replace=False)
    x, y = ws["x"][rows], ws["y"][rows]
    error = x @ ws["weights_in"] - y
    ws["grad"] = x.T @ error / len(error)
    ws["rng"] = rng.bit_generator.state
    ws.log("loss", loss_of(error))
    time.sleep(STEP_SECONDS)
    if MARKS:
        Path(MARKS, f"epoch-{ws.epoch}").touch()


def apply(ws):
    ws["weights"] = descend(ws["weights"], ws["grad_in"], ws["step_size"])


with dj.Job(name="acceptance") as job:
    with job.init_group:
        with dj.Node("ps"):
            dj.Task(init_ps)
        with dj.Node("trainer"):
            dj.Task(init_trainer)
    with dj.Node("ps"):
        weights = dj.Task(publish, outputs="weights_out").outputs()[0]
    with dj.Node("trainer"):
        grad = dj.Task(gradient, inputs={"weights_in": weights}, outputs="grad").outputs()[0]
    with dj.Node("ps"):
        dj.Task(apply, inputs={"grad_in": grad})
        dj.epoch_limiter(job, EPOCHS)
