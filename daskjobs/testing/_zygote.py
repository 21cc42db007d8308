"""A process that imports what a run needs once and forks a fresh driver process per run.

Starting Python and importing numpy, Dask, Zarr and daskjobs takes about a second; a check with a
string target makes a dozen driver processes. ``python -m daskjobs.testing._zygote`` imports them
once (nothing of the job: no user module, no thread, no session), says ``{"ready": true}`` on
stdout, then reads one request per line on stdin, ``{"spec": ..., "log": ...}``, forks, and
answers with two lines: ``{"pid": N}`` once the child runs and ``{"exit": CODE}`` when it ended
(``-9``: killed by SIGKILL). It ends when its stdin closes. :class:`Zygote` is the parent's end.

The child is what ``python -m daskjobs.testing._child SPEC`` would be: a new process, the leader of
its own process group, its output in the log file, the job's module imported afresh, Python's and
NumPy's global random generators seeded afresh. Only its hash seed is the zygote's: the check runs
reference B in a zygote of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal, overload

from ..errors import ResumeCheckError

_READY = 120.0
"""Seconds a zygote may take to import daskjobs (on a loaded machine) before it is given up."""


def _fork(spec: str, log: str) -> int:
    """Fork a child running ``spec``; return its pid (in the parent)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        from . import _child

        os.setsid()
        random.seed()  # a new process seeds its global generators afresh: so does a fork
        sys.modules["numpy"].random.seed()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        code = _child.main([spec])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(**message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    """Import what a run needs, say ``{"ready": true}``, then serve fork requests until stdin closes."""
    from . import _child  # noqa: F401 - the imports every run needs, made once

    _answer(ready=True)
    while line := sys.stdin.readline():
        request = json.loads(line)
        if threading.active_count() != 1:  # a fork must not copy a half-held lock of another thread
            _answer(error=f"the zygote runs {threading.active_count()} threads; it cannot fork safely")
            return 1
        pid = _fork(request["spec"], request["log"])
        _answer(pid=pid)
        _, status = os.waitpid(pid, 0)
        _answer(exit=os.waitstatus_to_exitcode(status))
    return 0


class Zygote:
    """The parent's end of a zygote process: ``run`` forks one child and waits for its end.

    The zygote starts (imports) in the background; the first :meth:`run` waits for it. Use
    :meth:`close` when done (it closes the zygote's stdin; the zygote exits).
    """

    def __init__(self, env: dict[str, str], log: Path, what: str) -> None:
        self.log, self.what = log, what
        self._pending = b""
        with open(log, "wb") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "daskjobs.testing._zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                env=env,
                start_new_session=True,
                bufsize=0,
            )
        assert self._process.stdin is not None  # a pipe
        assert self._process.stdout is not None  # a pipe
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        self._ready = False

    def alive(self) -> bool:
        return self._process.poll() is None

    def wait_ready(self) -> None:
        """Wait until the zygote imported what it needs (it starts in the background)."""
        if self._ready:
            return
        line = self._line(time.monotonic() + _READY)
        if not line or "ready" not in json.loads(line):
            self.close()
            raise ResumeCheckError(
                f"the process that starts the runs of {self.what} did not start:\n{self._log_tail()}"
            )
        self._ready = True

    def run(self, spec: Path, log: Path, timeout: float) -> int | None:
        """Fork a child for ``spec`` (its output in ``log``); its exit code (``-9``: SIGKILLed), or
        ``None`` when it did not end within ``timeout`` seconds (its process group is killed then)."""
        self.wait_ready()
        deadline = time.monotonic() + timeout
        self._stdin.write((json.dumps({"spec": str(spec), "log": str(log)}) + "\n").encode())
        pid = self._answer("pid", deadline)
        try:
            code = self._answer("exit", deadline)
        except BaseException:
            kill_group(pid)
            self._reap()
            raise
        kill_group(pid)  # what the child left in its process group
        if code is None:
            self._reap()
        return code

    def close(self) -> None:
        """End the zygote (and, if it does not end at once, its process group)."""
        if not self._ready:  # never used: it need not finish its imports
            kill_group(self._process.pid)
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            kill_group(self._process.pid)
            self._process.wait(10)
        self._stdout.close()

    @overload
    def _answer(self, key: Literal["pid"], deadline: float) -> int: ...

    @overload
    def _answer(self, key: Literal["exit"], deadline: float) -> int | None: ...

    def _answer(self, key: str, deadline: float) -> int | None:
        """The zygote's next answer, ``key``'s value; ``None`` when no ``"exit"`` came before ``deadline``."""
        line = self._line(deadline)
        if line is None and key == "exit":
            return None
        answer = json.loads(line) if line else {"error": "it did not answer"}
        if key not in answer:
            self.close()
            raise ResumeCheckError(
                f"no process could be started for {self.what}: {answer.get('error')}\n{self._log_tail()}"
            )
        return int(answer[key])

    def _reap(self) -> None:
        """After the child was killed: take the zygote's report of its end, or give the zygote up."""
        if not self._line(time.monotonic() + 10):
            kill_group(self._process.pid)

    def _line(self, deadline: float) -> bytes | None:
        """The next line the zygote writes, or ``None`` if none comes before ``deadline`` (``b""``: it ended)."""
        fd = self._stdout.fileno()
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

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def kill_group(pid: int) -> None:
    """Kill what is left of the process group that ``pid`` leads."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
