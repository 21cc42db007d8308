"""A process that imports what a run needs once and forks a fresh driver process per run.

Starting Python and importing numpy, Dask, Zarr and daskjobs takes about a second; a check with
a string target makes a dozen driver processes. ``python -m daskjobs.testing._zygote`` imports
them once (and nothing of the job: no user module, no thread, no session), then says ``{"ready": true}`` on
stdout, reads one request per line on stdin, ``{"spec": ..., "log": ...}``, forks, and answers on stdout with two lines:
``{"pid": N}`` once the child runs and ``{"exit": CODE}`` when it ended (``-9``: killed by
SIGKILL). The child is what ``python -m daskjobs.testing._child SPEC`` would be: a new process,
the leader of its own process group, its output in the log file, the job's module imported
afresh. The zygote ends when its stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from . import _child


def _fork(spec: str, log: str) -> int:
    """Fork a child running ``spec``; return its pid (in the parent)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
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
    """Say ``{"ready": true}``, then serve fork requests until stdin closes."""
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


if __name__ == "__main__":
    sys.exit(main())
