"""The ``daskjobs`` command line (also ``python -m daskjobs``), the top of the package.

Subcommands: ``run`` (a job from ``module:name`` or ``file.py:name``, :mod:`._run`), ``check``
(prove that such a job resumes exactly, :mod:`._check`), ``worker`` (a Dask worker serving nodes,
:mod:`._worker`), ``checkpoints list|show|verify|prune|unlock`` (:mod:`._checkpoints`) and
``demo`` (:mod:`._demo`); what they share is in :mod:`._common`. It may import every other part
of daskjobs; nothing imports it but ``python -m daskjobs``.

Exit codes: 0 success; 1 the job or a check failed (one paragraph naming what and where; the
traceback only with ``-v``); 2 a usage error (nothing is done or created); 130 / 143 after a
graceful stop on SIGINT / SIGTERM. Output piped into a command that closes early (``| head``) ends
quietly with the code of what was done: ``run`` goes on without printing, the others stop.

Examples
--------
::

    daskjobs --version
    daskjobs run train.py:job --checkpoint /tmp/ckpt --max-epochs 10
    daskjobs check train.py:job --local
    daskjobs worker tcp://127.0.0.1:8786 --node ps --node trainer --nthreads 4
    daskjobs checkpoints list /tmp/ckpt
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback
from collections.abc import Sequence
from types import FrameType

from .._version import __version__
from ..errors import ConfigError, DaskJobsError, JobInterruptedError
from ..runner._targets import load_job
from ._check import add_check_parser
from ._checkpoints import add_checkpoints_parser
from ._common import (
    FAILED,
    OK,
    SIGINT_EXIT,
    SIGTERM_EXIT,
    USAGE,
    CommandFailed,
    Terminated,
    UsageError,
    end_output,
)
from ._demo import add_demo_parser
from ._run import add_run_parser
from ._worker import add_worker_parser, worker_argv

__all__ = ["build_parser", "load_job", "main", "worker_argv"]


def build_parser() -> argparse.ArgumentParser:
    """The ``daskjobs`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="daskjobs",
        description="Epoch-checkpointed jobs on Dask: run jobs, check that they resume exactly, serve nodes, "
        "inspect checkpoints.",
        epilog="exit codes: 0 success, 1 the job or a check failed, 2 usage error, 130/143 stopped by SIGINT/SIGTERM",
    )
    parser.add_argument("--version", action="version", version=f"daskjobs {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more, show tracebacks of failures")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (add_run_parser, add_check_parser, add_worker_parser, add_checkpoints_parser, add_demo_parser):
        add(subparsers)
    return parser


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"stopped by signal {signal.Signals(signum).name}")


def _configure_logging(verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if verbose < 2 else "%(asctime)s %(name)s %(message)s"))
    logger = logging.getLogger("daskjobs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbose == 1 else logging.DEBUG if verbose > 1 else logging.WARNING)
    logger.propagate = False
    if not verbose:  # an interrupted gather leaves "Task exception was never retrieved" noise from asyncio
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``daskjobs`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    name = f"daskjobs {args.command}" + (f" {args.action}" if getattr(args, "action", None) else "")
    verbose = args.verbose
    previous = signal.getsignal(signal.SIGTERM)
    if argv is None:  # the console script: SIGTERM outside a graceful runner stops with exit 143, not a kill
        _configure_logging(verbose)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away (``| head``) is seen below
        return code
    except BrokenPipeError:  # stdout's reader went away: what was printed was all it wanted
        end_output()
        return OK
    except (UsageError, ConfigError) as exc:  # bad input: nothing was done
        print(f"{name}: error: {exc}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt as exc:
        _ignore_further_signals(argv is None)
        _print_stop(name, "SIGINT", exc, args)
        return SIGINT_EXIT
    except (JobInterruptedError, Terminated) as exc:
        _ignore_further_signals(argv is None)
        _print_stop(name, "SIGTERM", exc, args)
        return SIGTERM_EXIT
    except (DaskJobsError, CommandFailed, OSError) as exc:
        _report(name, exc, verbose)
        return FAILED
    except Exception as exc:
        _report(name, exc, verbose, kind=True)
        return FAILED
    finally:
        if argv is None and signal.getsignal(signal.SIGTERM) is _terminated:
            signal.signal(signal.SIGTERM, previous)


def _ignore_further_signals(own_process: bool) -> None:
    """After a stop, the process only prints and exits: a further SIGINT/SIGTERM must not turn exit
    code 130/143 into death by signal during interpreter shutdown (SIGKILL still works)."""
    if own_process:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _print_stop(name: str, signal_name: str, error: BaseException, args: argparse.Namespace) -> None:
    """One line saying the command stopped, unless a runner already logged what it committed (its
    interruption errors carry ``abandoned``)."""
    if not hasattr(error, "abandoned"):
        print(f"{name}: stopped by {signal_name}; {_resume_hint(args)}", file=sys.stderr)


def _resume_hint(args: argparse.Namespace) -> str:
    if args.command == "run" and getattr(args, "checkpoint", None):
        return "run the same command again to resume from the last committed epoch"
    if args.command == "run":
        return "nothing was checkpointed (no --checkpoint)"
    return "what was committed stays committed"


def _report(name: str, exc: BaseException, verbose: int, *, kind: bool = False) -> None:
    """One paragraph naming what failed and where; the traceback (and the remote one) with ``-v``."""
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
        remote = getattr(exc, "remote_traceback", "")
        if remote:
            print(f"traceback on the worker:\n{remote}", file=sys.stderr)
    message = (
        f"{type(exc).__name__}: {exc}"
        if kind or (isinstance(exc, OSError) and not isinstance(exc, DaskJobsError))
        else str(exc)
    )
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in message:
        message += f": {type(cause).__name__}: {cause}"
    hint = "" if verbose else " (run with -v for the traceback)"
    print(f"{name}: error: {message}{hint}", file=sys.stderr)
