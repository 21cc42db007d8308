"""Jobs whose steps end badly, each in its own way (``driveronly`` is importable where the driver runs only)."""

import sys

import numpy as np
from driveronly import bump

import daskjobs as dj


def init(ws):
    ws["x"] = np.zeros(2)


def uses_a_driver_only_module(ws):
    bump(ws)


def exits(ws):
    sys.exit(3)


def interrupts(ws):
    raise KeyboardInterrupt("the step gave up")


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.handle = open(__file__)  # noqa: SIM115 - an open file never pickles


def raises_unpicklable(ws):
    raise Unpicklable("a failure that cannot travel")


def _job(step):
    with dj.Job(name="broken") as job:
        with job.init_group, dj.Node("ps"):
            dj.Task(init)
        with dj.Node("ps"):
            dj.Task(step)
            dj.epoch_limiter(job, 3)
    return job


def missing_module():
    return _job(uses_a_driver_only_module)


def system_exit():
    return _job(exits)


def keyboard_interrupt():
    return _job(interrupts)


def unpicklable_exception():
    return _job(raises_unpicklable)
