"""Prove that a job resumes exactly: testing helpers for users' own test suites.

daskjobs guarantees that what it checkpoints comes back bit for bit. Whether a *job* resumes
exactly also depends on its steps keeping all of their state in workspaces: no global random
generator, no module globals, no wall-clock time, no float sums in whatever order concurrent
tasks finish. :func:`check_resume` runs a job uninterrupted twice and interrupted at chosen
epochs (a graceful stop, a killed driver process, a lost node), resumes each, and compares every
committed epoch of every run with the first; :func:`assert_resumes_exactly` does the same in a
test. ``daskjobs check TARGET`` is the command-line form.

It sits on the runner (it imports the runner, sessions and checkpoints); only the command line
imports it.

Examples
--------
In a test suite::

    import daskjobs as dj

    def test_training_resumes_exactly():
        dj.testing.assert_resumes_exactly("jobs/train.py:make_job", modes=("stop", "kill"))
"""

from __future__ import annotations

from typing import Any

from ._check import MODES, Target, check_resume
from ._report import LIKELY_CAUSES, CheckedRun, Divergence, FirstStep, ResumeReport

__all__ = [
    "LIKELY_CAUSES",
    "MODES",
    "CheckedRun",
    "Divergence",
    "FirstStep",
    "ResumeReport",
    "assert_resumes_exactly",
    "check_resume",
]


def assert_resumes_exactly(target: Target, **kwargs: Any) -> ResumeReport:
    """:func:`check_resume` ``(target, **kwargs)``, raising ``AssertionError`` unless it is ok.

    The error (a :class:`~daskjobs.errors.ResumeDivergenceError`) carries the report's summary:
    every run, the first divergence and its likely causes. Returns the report when it is ok.

    Raises
    ------
    ResumeDivergenceError
        A run differs from reference A (also an ``AssertionError``, as pytest expects).
    ResumeCheckError
        A run failed or missed its deadline.

    Examples
    --------
    >>> import daskjobs as dj
    >>> def make_job():
    ...     with dj.Cluster(), dj.Job(name="count") as job:
    ...         with job.init_group:
    ...             _ = dj.Task(lambda ws: ws.__setitem__("n", 0))
    ...         _ = dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    ...         dj.epoch_limiter(job, 3)
    ...     return job
    >>> assert_resumes_exactly(make_job).ok
    True
    """
    report = check_resume(target, **kwargs)
    report.raise_for_divergence()
    return report
