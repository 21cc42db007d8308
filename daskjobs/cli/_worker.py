"""``daskjobs worker``: a ``dask worker`` for daskjobs, in the pool or pinned to nodes.

Without ``--node`` it is a pool worker: sessions place nodes on it at run time. With ``--node`` it
serves those nodes (pinned). Either way it runs daskjobs' worker preload
(:mod:`daskjobs.session._worker_process`): its worker process ignores SIGINT and SIGTERM, so that
a signal to the whole process group (``scancel``, systemd, ``kill -TERM -PGID``) reaches the nanny,
which closes the worker gracefully: a planned departure, not a failure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from dask.utils import parse_timedelta

from .._model.values import validate_name
from ..errors import JobDefinitionError
from ..session import _worker_process
from ..session._placement import worker_resources
from ._common import OK, Subparsers, UsageError, positive_int

TLS_OPTIONS = ("tls_ca_file", "tls_cert", "tls_key")
"""Dask's TLS options, passed through to ``dask worker`` under the same names."""


def _resources(text: str) -> dict[str, float]:
    """Parse ``"GPU=1,MEM=2"`` into a resource dict."""
    pairs = [p for p in text.replace(",", " ").split() if p]
    try:
        return {name: float(amount) for name, amount in (p.split("=") for p in pairs)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT[,NAME=AMOUNT...], got {text!r}") from None


def _duration(text: str) -> str:
    """``argparse`` type: a duration Dask understands (``"30s"``, ``"1h"``, ``"90"`` seconds)."""
    try:
        parse_timedelta(text, default="s")
    except (ValueError, KeyError, TypeError):
        raise argparse.ArgumentTypeError(f"expected a duration such as 30s, 10m or 1h, got {text!r}") from None
    return text


def _node_name(text: str) -> str:
    """``argparse`` type: a valid node name (a usage error otherwise, exit code 2)."""
    try:
        return validate_name(text, "node")
    except JobDefinitionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_worker_parser(subparsers: Subparsers) -> None:
    """Register ``daskjobs worker``."""
    parser = subparsers.add_parser(
        "worker",
        help="start a Dask worker for daskjobs: a pool worker, or one pinned to --node NAME",
        description=(
            "Start a Dask worker (behind a nanny that restarts it if it dies). Without --node it is a pool "
            "worker: jobs place their nodes on the pool's workers themselves, and move them when workers "
            "leave or join. With --node it serves the given nodes (pinned): it provides each node's placement "
            "resource and is named after the node(s); start exactly one such worker per pinned node. SIGTERM "
            "or SIGINT to its whole process group closes it gracefully, which a running job takes as a planned "
            "departure. Runs `python -m distributed.cli.dask_worker` in place of this process."
        ),
    )
    parser.add_argument("scheduler", metavar="SCHEDULER_ADDRESS", help="e.g. tcp://127.0.0.1:8786 or tls://host:8786")
    parser.add_argument(
        "--node",
        dest="nodes",
        type=_node_name,
        action="append",
        default=[],
        metavar="NAME",
        help="a node to serve, pinned to this worker (repeatable; none: a pool worker)",
    )
    parser.add_argument(
        "--nthreads", type=positive_int, default=2, help="threads, and concurrent tasks per node (default 2)"
    )
    parser.add_argument(
        "--resources", type=_resources, default={}, metavar="NAME=N,...", help="extra resources, e.g. GPU=1"
    )
    parser.add_argument("--host", help="interface address to listen on (default: chosen by Dask)")
    parser.add_argument("--local-directory", help="directory for the worker's files")
    lifetime = parser.add_argument_group(
        "lifetime",
        "Dask's lifetime options (dask-jobqueue's walltime rotation): a worker leaving at the end of its "
        "lifetime is a planned departure; the job waits for the node's new worker and restores it",
    )
    lifetime.add_argument(
        "--lifetime", type=_duration, metavar="DURATION", help="close gracefully after this long, e.g. 1h or 30m"
    )
    lifetime.add_argument(
        "--lifetime-stagger", type=_duration, metavar="DURATION", help="random +/- variation of the lifetime, e.g. 5m"
    )
    lifetime.add_argument(
        "--lifetime-restart",
        action="store_true",
        help="start a new worker process when the lifetime ends (instead of leaving)",
    )
    tls = parser.add_argument_group("TLS", "Dask's TLS options, for a tls:// scheduler")
    tls.add_argument("--tls-ca-file", metavar="PATH", help="CA certificate(s) file to verify peers")
    tls.add_argument("--tls-cert", metavar="PATH", help="the worker's certificate file")
    tls.add_argument("--tls-key", metavar="PATH", help="the worker's private key file")
    parser.add_argument("--dry-run", action="store_true", help="print the dask worker command instead of running it")
    parser.set_defaults(handler=run_worker)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``dask worker`` command line that serves ``args.nodes`` (none: a pool worker)."""
    resources = worker_resources(args.nodes, args.nthreads, args.resources)
    argv = [sys.executable, "-m", "distributed.cli.dask_worker", args.scheduler]
    if args.nodes:
        argv += ["--name", "+".join(args.nodes)]
    argv += ["--nthreads", str(args.nthreads), "--nworkers", "1"]
    if resources:
        argv += ["--resources", ",".join(f"{name}={amount:g}" for name, amount in resources.items())]
    argv += ["--preload", _worker_process.__name__, "--no-dashboard"]
    if args.host:
        argv += ["--host", args.host, "--dashboard-address", f"{args.host}:0"]
    if args.local_directory:
        argv += ["--local-directory", args.local_directory]
    for option in ("lifetime", "lifetime_stagger"):
        value = getattr(args, option, None)
        if value:
            argv += ["--" + option.replace("_", "-"), value]
    if getattr(args, "lifetime_restart", False):
        argv += ["--lifetime-restart"]
    for option in TLS_OPTIONS:
        path = getattr(args, option, None)
        if path:
            flag = "--" + option.replace("_", "-")
            if not os.path.isfile(path):
                raise UsageError(f"{flag} {path}: no such file")
            argv += [flag, path]
    return argv


def run_worker(args: argparse.Namespace) -> int:
    """Replace this process with the Dask worker (or print its command with ``--dry-run``)."""
    argv = worker_argv(args)
    if not args.dry_run:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(argv[0], argv)  # never returns
    print(shlex.join(argv))
    return OK
