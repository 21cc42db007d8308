"""What every ``daskjobs`` subcommand shares: argument types, usage errors and exit codes.

Exit codes (SPEC §5): 0 success; 1 the job or a check failed; 2 a usage error (bad arguments,
a target that is not a job, a prefix that does not exist or holds no daskjobs checkpoints);
130 / 143 after a graceful stop on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Any, NoReturn

OK = 0
FAILED = 1
USAGE = 2
SIGINT_EXIT = 130
SIGTERM_EXIT = 143

Subparsers = argparse._SubParsersAction


class UsageError(Exception):
    """The command line asks for something impossible: exit code 2, nothing done, nothing created."""


class Terminated(BaseException):
    """SIGTERM arrived outside a runner's graceful handling: exit code 143 (a ``BaseException``, so that
    no ``except Exception`` in between swallows or re-labels it)."""


class CommandFailed(Exception):
    """The command failed for a reason its message names (exit code 1); ``__cause__`` holds the original error."""


def say(text: str) -> None:
    """Print ``text`` on stdout now; once stdout's reader went away (``daskjobs run ... | head``),
    print nothing more and go on (see :func:`end_output`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        end_output()


def end_output() -> None:
    """Point stdout at ``os.devnull``: its reader went away, so nothing more printed (nor the flush
    at exit) raises ``BrokenPipeError`` or prints Python's "Exception ignored" note."""
    with contextlib.suppress(OSError, ValueError):  # no file descriptor (a captured stdout): nothing to redirect
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def positive_int(text: str) -> int:
    """``argparse`` type: an integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def count(text: str) -> int:
    """``argparse`` type: an integer ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def epoch_number(text: str) -> int:
    """``argparse`` type: an epoch number (an integer ≥ 0)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an epoch number (an integer >= 0), got {text!r}")
    return value


def storage_option(text: str) -> tuple[str, Any]:
    """``argparse`` type: ``KEY=VALUE``; VALUE is parsed as JSON when it parses, else kept as a string.

    Examples
    --------
    >>> storage_option("anon=true"), storage_option("endpoint_url=http://127.0.0.1:9000")
    (('anon', True), ('endpoint_url', 'http://127.0.0.1:9000'))
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option KEY=VALUE`` (fsspec options of the prefix)."""
    parser.add_argument(
        "--storage-option",
        dest="storage_options",
        type=storage_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option of the prefix, e.g. endpoint_url=http://... or anon=true "
        "(repeatable; VALUE is parsed as JSON when it parses)",
    )


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """Add ``-v``: more logging, and the traceback of a failure."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="log more, and show the traceback of a failure",
    )


def leave_when_abandoned(error: BaseException) -> None:
    """After a runner's interruption (see ``daskjobs.runner._interrupt``; the runner logged its message):
    a second SIGINT/SIGTERM (an ``abandoned`` one) ends the process at once, with exit code 130 /
    143; after a graceful stop, so does the next signal, while the command cleans up.

    The runner has already released the lock and touched nothing committed. What is left, the
    steps of the abandoned epoch still running in threads or worker processes and the local
    cluster's graceful shutdown, would keep the process for seconds; the cluster's worker
    processes and forked writers end with this process.
    """
    code = SIGINT_EXIT if isinstance(error, KeyboardInterrupt) else SIGTERM_EXIT
    if getattr(error, "abandoned", False):
        _leave(code)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: _leave(code))


def _leave(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    _release_process_resources(deadline=0.5)
    os._exit(code)


def _release_process_resources(deadline: float) -> None:
    """What a normal exit would do for the local cluster, in at most ``deadline`` seconds: kill its
    worker processes, and unlink the semaphores their queues use (else multiprocessing's resource
    tracker reports them as leaked, on stderr)."""
    import multiprocessing
    import multiprocessing.util

    for child in multiprocessing.active_children():
        child.kill()
    run_finalizers = multiprocessing.util._run_finalizers  # type: ignore[attr-defined]  # private: not in typeshed
    finalizers = threading.Thread(target=run_finalizers, args=(0,), daemon=True)
    finalizers.start()
    finalizers.join(deadline)


def load_target(target: str) -> Any:
    """The job ``TARGET`` names (see :func:`daskjobs.runner._targets.load_job`): a TARGET that names
    no job is a usage error (exit 2), one whose import or callable raised a failure (exit 1)."""
    from ..errors import TargetError, TargetLoadError
    from ..runner._targets import load_job

    try:
        return load_job(target)
    except TargetError as exc:
        raise UsageError(str(exc)) from None
    except TargetLoadError as exc:
        raise CommandFailed(str(exc)) from exc.__cause__
