"""A small job for ``daskjobs run``: a ``ps`` node holds a linear model, a ``trainer`` node fits it.

Each epoch the trainer computes the gradient of its (fixed, seeded) data at the ps's weights and
the ps takes a step; the job stops when the loss falls below ``1e-3``. Try::

    daskjobs run examples/train.py:job --checkpoint ckpt-demo
"""

from __future__ import annotations

import numpy as np

import daskjobs as dj

FEATURES = 8


def make_job(learning_rate: float = 0.5, tolerance: float = 1e-3) -> dj.Job:
    """The job: ``ps`` owns ``weights``; ``trainer`` owns the data; stop when ``loss < tolerance``."""

    def init_ps(ws: dj.Workspace) -> None:
        ws["weights"] = np.zeros(FEATURES)
        ws["converged"] = np.bool_(False)

    def init_trainer(ws: dj.Workspace) -> None:
        rng = np.random.default_rng(0)
        ws["x"] = rng.normal(size=(256, FEATURES))
        ws["y"] = ws["x"] @ np.linspace(-1, 1, FEATURES)

    def gradient(ws: dj.Workspace) -> None:
        error = ws["x"] @ ws["weights_in"] - ws["y"]
        ws["grad"] = ws["x"].T @ error / len(error)
        ws.log("loss", float(np.mean(error**2)))

    def apply(ws: dj.Workspace) -> None:
        ws["weights"] = ws["weights"] - learning_rate * ws["grad_in"]
        ws["converged"] = np.bool_(np.linalg.norm(ws["grad_in"]) ** 2 < tolerance)

    with dj.Job(name="linear") as job:
        with job.init_group:
            with dj.Node("ps"):
                dj.Task(init_ps)
            with dj.Node("trainer"):
                dj.Task(init_trainer)
        with dj.Node("ps"):
            weights = dj.Task(lambda ws: None, outputs="weights").outputs()[0]
        with dj.Node("trainer"):
            grad = dj.Task(gradient, inputs={"weights_in": weights}, outputs="grad").outputs()[0]
        with dj.Node("ps"):
            converged = dj.Task(apply, inputs={"grad_in": grad}, outputs="converged").outputs()[0]
        job.add_stop_condition(converged)
    return job


job = make_job()
