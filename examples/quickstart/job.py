"""A job file for ``daskjobs run``: plain top-level functions, and a helper module next to it.

One ``trainer`` node fits a linear model by gradient descent on data that ``toydata.py`` (the
helper module beside this file) makes. Run it from the repository's root::

    daskjobs run examples/quickstart/job.py:job --local --checkpoint quickstart-ckpt

``daskjobs run`` sends this file and ``toydata.py`` to the workers with the steps, so workers
that never saw either file run them.
"""

from __future__ import annotations

import numpy as np
from toydata import make_problem, mean_squared_error

import daskjobs as dj

EPOCHS = 20


def init(ws: dj.Workspace) -> None:
    """Init group: the data and the weights, created once and checkpointed with every epoch."""
    ws["x"], ws["y"] = make_problem(rows=512, features=4, seed=0)
    ws["w"] = np.zeros(4)


def step(ws: dj.Workspace) -> None:
    """Epoch group: one gradient step; the loss goes to the history and the commit record."""
    error = ws["x"] @ ws["w"] - ws["y"]
    ws["w"] = ws["w"] - 0.2 * ws["x"].T @ error / len(error)
    ws.log("loss", mean_squared_error(ws["x"], ws["y"], ws["w"]))


def make_job(epochs: int = EPOCHS) -> dj.Job:
    """The job: ``epochs`` epochs of :func:`step` on the ``trainer`` node."""
    with dj.Job(name="quickstart") as job, dj.Node("trainer"):
        with job.init_group:
            dj.Task(init)
        dj.Task(step)
        dj.epoch_limiter(job, epochs)
    return job


job = make_job()
