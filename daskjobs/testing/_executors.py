"""Where the runs of a check happen: in this process (:class:`InProcess`) or each in a fresh child
process (:class:`Children`), every one under a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import daskjobs

from .._model.job import Job
from ..errors import ResumeCheckError
from ..runner import JobRunner
from ..session import DaskSession, LocalSession
from ..session._plugin import wait_for_steps
from ._runs import Action, Outcome, perform

_GRACE = 10.0
"""Seconds a run in this process gets, after its deadline asked it to stop, before it is abandoned."""
_READY = 120.0
"""Seconds the zygote may take to import daskjobs (on a loaded machine) before it is given up."""
_LOG_LINES = 15
"""Lines of a failed child's output its error shows."""


class InProcess:
    """Runs in this process, each on a new session (a LocalSession, or a DaskSession on ``client``)."""

    def __init__(self, make_job: Callable[[], Job], client: Any, timeout: float, max_epochs: int | None) -> None:
        self.make_job, self.client, self.timeout, self.max_epochs = make_job, client, timeout, max_epochs

    def run(self, name: str, prefix: str, action: Action) -> Outcome:
        """Carry out ``action`` as run ``name`` against ``prefix``.

        Raises
        ------
        ResumeCheckError
            The run failed, or did not finish within the deadline.
        """
        job = self.make_job()
        with (
            LocalSession() if self.client is None else DaskSession(self.client) as session,
            _deadline(self.timeout) as watch,
        ):
            try:
                return perform(job, prefix, action, session, max_epochs=self.max_epochs, watch=watch)
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
            self.runner._signals.requested = signal.SIGTERM

    def _abandon(self) -> None:
        runner, main = self.runner, threading.main_thread()
        if runner is not None and signal.getsignal(signal.SIGINT) == runner._signals._handle and main.ident:
            signal.pthread_kill(main.ident, signal.SIGINT)

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

    The processes are forked by a zygote (:mod:`._zygote`) that imported daskjobs once; each is
    a new process that imports the job afresh, the leader of its own process group, killed
    (with its group) at its deadline. Use as a context manager: leaving it ends the zygote.
    """

    def __init__(self, target: str, client: Any, root: Path, timeout: float, max_epochs: int | None) -> None:
        self.target, self.client, self.timeout, self.max_epochs = target, client, timeout, max_epochs
        self.folder = root / "processes"
        self.folder.mkdir()
        self._count = 0
        self._zygote: subprocess.Popen | None = None
        self._pending = b""
        self._pid: int | None = None

    def __enter__(self) -> Children:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            with contextlib.suppress(OSError):
                zygote.stdin.close()  # type: ignore[union-attr]
            try:
                zygote.wait(10)
            except subprocess.TimeoutExpired:
                _kill_group(zygote.pid)
                zygote.wait(10)
            zygote.stdout.close()  # type: ignore[union-attr]

    def run(self, name: str, prefix: str, action: Action) -> Outcome:
        """Carry out ``action`` as run ``name`` against ``prefix`` in a new process.

        Raises
        ------
        ResumeCheckError
            The process failed, died otherwise than the action says, or missed its deadline.
        """
        self._count += 1
        stem = self.folder / f"{self._count:03d}"
        spec = {
            "target": self.target,
            "prefix": prefix,
            "action": asdict(action),
            "max_epochs": self.max_epochs,
            "address": None if self.client is None else self.client.scheduler.address,
            "result": f"{stem}.result.json",
        }
        Path(f"{stem}.json").write_text(json.dumps(spec))
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        zygote = self._start()
        request = (json.dumps({"spec": f"{stem}.json", "log": f"{stem}.log"}) + "\n").encode()
        zygote.stdin.write(request)  # type: ignore[union-attr]
        self._pid = pid = self._answer(zygote, "pid", deadline, name)
        try:
            code = self._answer(zygote, "exit", deadline, name)
        except BaseException:
            self._kill_and_reap(zygote)
            raise
        finally:
            _kill_group(pid)
            self._pid = None
        seconds = time.perf_counter() - started
        result = _result(stem)
        if action.kind == "kill" and code == -signal.SIGKILL:
            if self.client is not None:  # its steps may still run on the workers: let them end first
                wait_for_steps(self.client, "daskjobs-", max(deadline - time.monotonic(), 1.0))
            return Outcome(None, True, seconds=seconds)
        if code == 0 and result and "outcome" in result:
            return Outcome(**{**result["outcome"], "seconds": seconds})
        error = result.get("error") if result else None
        what = f"failed: {error}" if error else f"ended with exit code {code} and no result"
        raise ResumeCheckError(f"run {name} ({self.target}) {what}. Its last output:\n{_tail(stem)}", name)

    def _start(self) -> subprocess.Popen:
        if self._zygote is None or self._zygote.poll() is not None:
            with open(self.folder / "zygote.log", "wb") as log:
                self._zygote = subprocess.Popen(
                    [sys.executable, "-m", "daskjobs.testing._zygote"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=_environment(),
                    start_new_session=True,
                    bufsize=0,
                )
            self._pending = b""
            line = self._line(self._zygote, time.monotonic() + _READY)
            if not line or "ready" not in json.loads(line):
                log = (self.folder / "zygote.log").read_text(errors="replace")[-2000:]
                self._abandon_zygote()
                raise ResumeCheckError(f"the process that starts the runs of {self.target} did not start:\n{log}")
        return self._zygote

    def _answer(self, zygote: subprocess.Popen, key: str, deadline: float, name: str) -> int:
        """The zygote's next answer (``pid`` or ``exit``), waiting until ``deadline``.

        Past the deadline the run's process group is killed; the zygote then reports its end.
        """
        line = self._line(zygote, deadline)
        if line is None and key == "exit":
            raise ResumeCheckError(
                f"run {name} ({self.target}) did not finish within its deadline of {self.timeout:g} s (timeout=); "
                f"its process was killed. Its last output:\n{_tail(self.folder / f'{self._count:03d}')}",
                name,
            )
        answer = json.loads(line) if line else {"error": "it did not answer"}
        if key not in answer:
            self._abandon_zygote()
            log = (self.folder / "zygote.log").read_text(errors="replace")[-2000:]
            raise ResumeCheckError(f"run {name}: no process could be started: {answer.get('error')}\n{log}", name)
        return int(answer[key])

    def _line(self, zygote: subprocess.Popen, deadline: float) -> bytes | None:
        """The next line the zygote writes, or ``None`` if none comes before ``deadline`` (``b""``: it ended)."""
        fd = zygote.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _kill_and_reap(self, zygote: subprocess.Popen) -> None:
        """Kill the running child's group and take the zygote's report of its end (or give up the zygote)."""
        if self._pid is not None:
            _kill_group(self._pid)
        if not self._line(zygote, time.monotonic() + 10):
            self._abandon_zygote()

    def _abandon_zygote(self) -> None:
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            _kill_group(zygote.pid)
            zygote.wait(10)


def _environment() -> dict[str, str]:
    """This process's environment, with this daskjobs first on the path of the child."""
    root = str(Path(daskjobs.__file__).resolve().parents[1])
    paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _kill_group(pid: int) -> None:
    """Kill what is left of the process group that ``pid`` leads."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


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
