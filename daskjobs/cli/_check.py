"""``daskjobs check TARGET``: prove that a job resumes exactly (see :mod:`daskjobs.testing`).

The job runs twice uninterrupted and once per interruption point and mode, each run in a new
process; every committed epoch of every run is compared with the first. Exit code 0 when every
run equals it, 1 when anything diverges or a run fails, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import textwrap
from collections.abc import Iterator
from typing import Any

from .._model.job import Job
from ..errors import JobDefinitionError
from ._common import FAILED, OK, CommandFailed, Subparsers, UsageError, add_verbose, load_target, positive_int, say

_DEFAULT_MODES = ("stop", "kill")


def add_check_parser(subparsers: Subparsers) -> None:
    """Register ``daskjobs check``."""
    parser = subparsers.add_parser(
        "check",
        help="prove that a job resumes exactly: interrupt it, resume it, compare every epoch",
        description=(
            "Run the job twice without interruption (references A and B) and once per interruption point and "
            "mode, each then resumed to the end, every run in a new process against its own temporary "
            "checkpoint prefix; compare every committed epoch of every run with A (every blob of every node, "
            "the stop values, the metrics). Prints one line per run as it finishes, then the first divergence, "
            "the step (task and node) whose output first diverged where it can tell, and the likely causes. "
            "TARGET is package.module:name or path/to/file.py:name, as for `daskjobs run`."
        ),
        epilog="exit codes: 0 every run equals reference A, 1 a run diverges or fails, 2 usage error",
    )
    parser.add_argument("target", metavar="TARGET", help="package.module:name or path/to/file.py:name")
    parser.add_argument(
        "--max-epochs", type=positive_int, metavar="N", help="stop every run after epoch N at the latest"
    )
    parser.add_argument(
        "--interrupt-at",
        type=positive_int,
        action="append",
        metavar="K",
        help="interrupt after epoch K (repeatable; default: epoch 1, the middle epoch and the last but one)",
    )
    parser.add_argument(
        "--mode",
        choices=("stop", "kill", "lose-node", "shrink", "grow"),
        action="append",
        help="stop: graceful stop, then a new process resumes; kill: the driver SIGKILLed mid-epoch, then a new "
        "process resumes; lose-node: a node's worker killed mid-epoch, the run recovers (clusters only); "
        "shrink: on a local pool of two workers, one SIGKILLed for good mid-epoch, the run goes on on the "
        "other; grow: on a local pool of one worker, a second joins and nodes move onto it (shrink and grow "
        "start their own pools: not with --scheduler). Repeatable; default: stop and kill",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--scheduler", metavar="ADDRESS", help="run on this Dask scheduler (its workers serve the nodes)"
    )
    where.add_argument("--local", action="store_true", help="run each driver process on a LocalSession, no cluster")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="checkpoint every run with tier 0 (every epoch in cluster memory, and durable too): lose-node "
        "runs are restored from the workers' memory",
    )
    parser.add_argument("--nthreads", type=positive_int, default=2, help="threads per node of the local cluster")
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS", help="deadline of each run's process"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_verbose(parser)
    parser.set_defaults(handler=check_job)


def check_job(args: argparse.Namespace) -> int:
    """Carry out ``daskjobs check``; returns the exit code."""
    from ..testing import check_resume

    modes = tuple(dict.fromkeys(args.mode or _DEFAULT_MODES))
    if "lose-node" in modes and args.local:
        raise UsageError("--mode lose-node kills a node's worker: it needs a cluster, not --local")
    elastic = [mode for mode in modes if mode in ("shrink", "grow")]
    if elastic and args.scheduler:
        raise UsageError(
            f"--mode {' / '.join(elastic)} runs on local pool clusters that the check starts: "
            "it cannot be combined with --scheduler"
        )
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    job = load_target(args.target)  # a TARGET that is no job is a usage error, before any run starts
    if not job.stop_conditions and args.max_epochs is None:
        raise CommandFailed(
            f"job {job.name!r} ({args.target}) has no stop condition, so it would never stop: "
            "pass --max-epochs N (or give the job a stop condition)"
        )
    with _session(args, job) as session:
        if not args.json:
            where = "LocalSession" if session is None else f"the Dask cluster at {session.client.scheduler.address}"
            say(
                f"daskjobs check of job {job.name!r} ({args.target}) on {where}, a new process per run: "
                "one line per run as it finishes"
            )
        try:
            report = check_resume(
                args.target,
                max_epochs=args.max_epochs,
                interrupt_at=args.interrupt_at,
                modes=modes,
                session=session,
                timeout=args.timeout,
                on_run=None if args.json else lambda run, divergences: say(f"  {run.line(divergences)}"),
                in_memory=args.in_memory,
            )
        except JobDefinitionError as exc:  # the arguments do not fit the job (e.g. --interrupt-at past its end)
            raise UsageError(str(exc)) from None
    if args.json:
        say(json.dumps(report.to_dict(), indent=2))
    else:
        say("\n".join([*textwrap.wrap(report.verdict(), 100, subsequent_indent="  "), *report.first_lines()]))
    return OK if report.ok else FAILED


@contextlib.contextmanager
def _session(args: argparse.Namespace, job: Job) -> Iterator[Any]:
    """What the runs run on: LocalSessions, a scheduler's address, or a new ``node_cluster`` of the job's nodes."""
    from ..session import DaskSession, node_cluster

    if args.local:
        yield None
    elif args.scheduler:
        try:
            connected = DaskSession(args.scheduler)
        except OSError as exc:
            raise CommandFailed(
                f"cannot reach the Dask scheduler at {args.scheduler} ({exc}); is `dask scheduler` running there, "
                "with one `daskjobs worker` per node?"
            ) from exc
        with connected as session:
            yield session
    else:
        if not args.json:
            print(f"starting a local Dask cluster with one worker per node: {', '.join(job.nodes())}", flush=True)
        with node_cluster(job, nthreads=args.nthreads) as cluster, DaskSession(cluster) as session:
            yield session
