"""Where the runs of a check happen: in this process (:class:`InProcess`) or each in a fresh child
process (:class:`Children`), every one under a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._model.job import Job
from ..errors import ResumeCheckError
from ..runner import JobRunner
from ..session import DaskSession, LocalSession
from ..session._plugin import wait_for_steps
from ._runs import Action, Outcome, perform
from ._zygote import Zygote

_GRACE = 10.0
"""Seconds a run in this process gets, after its deadline asked it to stop, before it is abandoned."""
_DASK_HASH_SEED = "6640"
"""The ``PYTHONHASHSEED`` a Dask cluster started in this process puts into its environment."""
_LOG_LINES = 15
"""Lines of a failed child's output its error shows."""


class InProcess:
    """Runs in this process, each on a new session (a LocalSession, or a DaskSession on ``client``)."""

    def __init__(
        self,
        make_job: Callable[[], Job],
        client: Any,
        timeout: float,
        max_epochs: int | None,
        *,
        in_memory: bool = False,
    ) -> None:
        self.make_job, self.client, self.timeout, self.max_epochs = make_job, client, timeout, max_epochs
        self.in_memory = in_memory

    def run(self, name: str, prefix: str, action: Action, *, fresh: bool = False, client: Any = None) -> Outcome:
        """Carry out ``action`` as run ``name`` against ``prefix`` (``fresh`` changes nothing here),
        on the cluster of ``client`` when given.

        Raises
        ------
        ResumeCheckError
            The run failed, or did not finish within the deadline.
        """
        job = self.make_job()
        client = client or self.client
        with (
            LocalSession() if client is None else DaskSession(client) as session,
            _deadline(self.timeout) as watch,
        ):
            try:
                return perform(
                    job, prefix, action, session, max_epochs=self.max_epochs, watch=watch, in_memory=self.in_memory
                )
            except (Exception, KeyboardInterrupt) as exc:
                if watch.expired:
                    raise ResumeCheckError(
                        f"run {name} of job {job.name!r} did not finish within its deadline of {self.timeout:g} s "
                        "(timeout=); it was stopped",
                        name,
                    ) from None
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise ResumeCheckError(
                    f"run {name} of job {job.name!r} failed: {type(exc).__name__}: {exc}", name
                ) from exc


class _Watch:
    """A deadline for a run in this process: at the deadline it asks the runner for a graceful stop
    (after its running epoch); when the runner trains on the main thread, where it handles
    signals, a SIGINT :data:`_GRACE` seconds later abandons the running epoch (a second signal,
    as from a terminal)."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self.runner: JobRunner | None = None
        self._timers = [threading.Timer(seconds, self._stop), threading.Timer(seconds + _GRACE, self._abandon)]
        for timer in self._timers:
            timer.daemon = True
            timer.start()

    def __call__(self, runner: JobRunner) -> None:
        self.runner = runner

    def _stop(self) -> None:
        self.expired = True
        if self.runner is not None:
            self.runner.request_stop()

    def _abandon(self) -> None:
        if self.runner is not None:
            self.runner.request_stop(signal.SIGINT)  # the second request abandons the running epoch

    def cancel(self) -> None:
        for timer in self._timers:
            timer.cancel()


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[_Watch]:
    watch = _Watch(seconds)
    try:
        yield watch
    finally:
        watch.cancel()


class Children:
    """Runs each in a fresh driver process, on a new LocalSession or on the cluster of ``client``.

    The processes are forked by a :class:`~._zygote.Zygote` that imported daskjobs once; each is a
    new process that imports the job afresh, the leader of its own process group, killed (with its
    group) at its deadline. A run asked for ``fresh`` gets a zygote of its own, a new interpreter
    with its own hash seed (reference B: a job whose results depend on the iteration order of sets
    of strings is not reproducible), also when a Dask cluster started in this process fixed
    ``PYTHONHASHSEED`` for its workers. Use as a context manager: leaving it ends the zygotes.
    """

    def __init__(
        self, target: str, client: Any, root: Path, timeout: float, max_epochs: int | None, *, in_memory: bool = False
    ) -> None:
        self.target, self.client, self.timeout, self.max_epochs = target, client, timeout, max_epochs
        self.in_memory = in_memory
        self.folder = root / "processes"
        self.folder.mkdir()
        self._count = 0
        self._zygote: Zygote | None = None
        self._spare: Zygote | None = None
        """The zygote of the next ``fresh`` run, started early (it imports while other runs run)."""

    def __enter__(self) -> Children:
        self._zygote, self._spare = self._new_zygote(), self._new_zygote(fresh=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for zygote in (self._zygote, self._spare):
            if zygote is not None:
                zygote.close()

    def _new_zygote(self, *, fresh: bool = False) -> Zygote:
        self._count += 1
        env = _environment()
        if fresh and env.get("PYTHONHASHSEED") == _DASK_HASH_SEED:  # Dask set it here for its workers, not you
            env["PYTHONHASHSEED"] = "random"
        return Zygote(env, self.folder / f"zygote-{self._count:03d}.log", self.target)

    def run(self, name: str, prefix: str, action: Action, *, fresh: bool = False, client: Any = None) -> Outcome:
        """Carry out ``action`` as run ``name`` against ``prefix`` in a new process (on the cluster of
        ``client`` when given).

        Raises
        ------
        ResumeCheckError
            The process failed, died otherwise than the action says, or missed its deadline.
        """
        self._count += 1
        stem = self.folder / f"{self._count:03d}"
        client = client or self.client
        spec = {
            "target": self.target,
            "prefix": prefix,
            "action": asdict(action),
            "max_epochs": self.max_epochs,
            "in_memory": self.in_memory,
            "address": None if client is None else client.scheduler.address,
            "result": f"{stem}.result.json",
        }
        Path(f"{stem}.json").write_text(json.dumps(spec))
        if fresh:
            zygote, self._spare = self._spare or self._new_zygote(fresh=True), None
        elif self._zygote is None or not self._zygote.alive():
            zygote = self._zygote = self._new_zygote()
        else:
            zygote = self._zygote
        zygote.wait_ready()
        started = time.perf_counter()
        try:
            code = zygote.run(Path(f"{stem}.json"), Path(f"{stem}.log"), self.timeout)
        finally:
            if fresh:
                zygote.close()
        seconds = time.perf_counter() - started
        if code is None:
            raise ResumeCheckError(
                f"run {name} ({self.target}) did not finish within its deadline of {self.timeout:g} s (timeout=); "
                f"its process was killed. Its last output:\n{_tail(stem)}",
                name,
            )
        result = _result(stem)
        if action.kind == "kill" and code == -signal.SIGKILL:
            if client is not None:  # its steps may still run on the workers: let them end first
                wait_for_steps(client, "daskjobs-", self.timeout)
            return Outcome(None, True, seconds=seconds)
        if code == 0 and result and "outcome" in result:
            return Outcome(**{**result["outcome"], "seconds": seconds})
        error = result.get("error") if result else None
        what = f"failed: {error}" if error else f"ended with exit code {code} and no result"
        raise ResumeCheckError(f"run {name} ({self.target}) {what}. Its last output:\n{_tail(stem)}", name)


def _environment() -> dict[str, str]:
    """This process's environment, with this daskjobs first on the path of the child."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the daskjobs package
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _result(stem: Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(f"{stem}.result.json").read_text())
    except (OSError, ValueError):
        return None


def _tail(stem: Path) -> str:
    try:
        lines = Path(f"{stem}.log").read_text(errors="replace").splitlines()
    except OSError:
        return "(none)"
    return "\n".join(lines[-_LOG_LINES:]) or "(none)"
