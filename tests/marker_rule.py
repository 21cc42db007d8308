"""The marker rule of the fast lane (tests/README.md, "Markers"): a test that starts a Python
process — the CLI or a child driver as a subprocess, ``dask scheduler`` or ``daskjobs worker``,
a Dask cluster of worker processes — is marked ``slow`` or ``cluster``, so that ``python -m
pytest -m "not cluster and not slow"`` runs in this process only.

:class:`ProcessWatch` listens to the interpreter's audit events for subprocesses whose program
is this Python installation's (``sys.executable`` or a script beside it: ``daskjobs``, ``dask``)
and counts the Dask nannies made while a test sets up and runs (a process cluster's workers
are started by multiprocessing, which raises no audit event). ``tests/conftest.py`` fails an
unmarked test that started one. A fork of the test process (a forked snapshot writer) or a
quick system tool (``mount``, ``uname``) costs milliseconds and is allowed.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from distributed import Nanny

STARTS = frozenset({"subprocess.Popen", "os.posix_spawn"})
"""Audit events that start a program (the first argument names it)."""

EXEMPT = frozenset({"slow", "cluster", "soak", "matrix"})
"""Markers that keep a test out of the fast lane."""

PYTHON_BIN = Path(sys.executable).parent
"""Where this Python's interpreter and console scripts (``daskjobs``, ``dask``) are."""


def is_python(program: object) -> bool:
    """Whether ``program`` (an audit event's first argument) is this Python or one of its scripts."""
    if isinstance(program, bytes):
        program = os.fsdecode(program)
    if not isinstance(program, str):
        return False
    path = Path(program)
    return path.name.startswith("python") or path.parent == PYTHON_BIN


class ProcessWatch:
    """The Python processes the current test started, from audit events and new Dask nannies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watching = False
        self._started: list[str] = []
        self._nannies: set[int] = set()
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple) -> None:
        if event in STARTS and self._watching and args and is_python(args[0]):
            with self._lock:
                self._started.append(f"{event} {args[0]!r}")

    def start(self) -> None:
        """Begin a test: forget what earlier tests started."""
        with self._lock:
            self._started = []
        self._nannies = {id(nanny) for nanny in list(Nanny._instances)}
        self._watching = True

    def stop(self) -> list[str]:
        """End a test: what it started, one entry per process."""
        self._watching = False
        nannies = [nanny for nanny in list(Nanny._instances) if id(nanny) not in self._nannies]
        with self._lock:
            return self._started + ["a Dask nanny (a worker process)"] * len(nannies)


def needs_marker(markers: set[str]) -> bool:
    """Whether a test with these markers is in the fast lane (so must not start a process)."""
    return not markers & EXEMPT
