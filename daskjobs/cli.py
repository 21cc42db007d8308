"""The ``daskjobs`` command line.

Each subcommand is one function decorated with :func:`subcommand`: it receives the argparse
subparsers object, adds its parser and sets ``handler`` (a function ``args -> exit code``) as
a default. :func:`main` builds the parser from every registered subcommand.

Examples
--------
::

    daskjobs --version
    daskjobs worker tcp://127.0.0.1:8786 --node ps --node trainer --nthreads 4
    daskjobs demo --checkpoint-dir /tmp/demo
    daskjobs checkpoints list /tmp/demo
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence

from ._version import __version__
from .errors import DaskJobsError
from .session._placement import worker_resources

Subparsers = argparse._SubParsersAction
_SUBCOMMANDS: list[Callable[[Subparsers], None]] = []


def subcommand(add: Callable[[Subparsers], None]) -> Callable[[Subparsers], None]:
    """Register ``add(subparsers)``, which adds one subcommand's parser, in the ``daskjobs`` command."""
    _SUBCOMMANDS.append(add)
    return add


def _resources(text: str) -> dict[str, float]:
    """Parse ``"GPU=1,MEM=2"`` into a resource dict."""
    pairs = [p for p in text.replace(",", " ").split() if p]
    try:
        return {name: float(amount) for name, amount in (p.split("=") for p in pairs)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT[,NAME=AMOUNT...], got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


@subcommand
def worker_command(subparsers: Subparsers) -> None:
    """``daskjobs worker``: a Dask worker serving the given nodes."""
    parser = subparsers.add_parser(
        "worker",
        help="start a Dask worker that serves one or more daskjobs nodes",
        description=(
            "Start a Dask worker (behind a nanny that restarts it if it dies) that serves the given nodes: "
            "it provides each node's placement resource and is named after the node(s). Start exactly one "
            "such worker per node. Runs `python -m distributed.cli.dask_worker` in place of this process."
        ),
    )
    parser.add_argument("scheduler", metavar="SCHEDULER_ADDRESS", help="e.g. tcp://127.0.0.1:8786")
    parser.add_argument(
        "--node", dest="nodes", action="append", required=True, metavar="NAME", help="a node to serve (repeatable)"
    )
    parser.add_argument(
        "--nthreads", type=_positive_int, default=2, help="threads, and concurrent tasks per node (default 2)"
    )
    parser.add_argument(
        "--resources", type=_resources, default={}, metavar="NAME=N,...", help="extra resources, e.g. GPU=1"
    )
    parser.add_argument("--host", help="interface address to listen on (default: chosen by Dask)")
    parser.add_argument("--local-directory", help="directory for the worker's files")
    parser.add_argument("--tls-ca-file", metavar="PATH", help="CA certificate(s) for TLS (tls:// schedulers)")
    parser.add_argument("--tls-cert", metavar="PATH", help="this worker's TLS certificate (may include its key)")
    parser.add_argument("--tls-key", metavar="PATH", help="this worker's TLS private key")
    parser.add_argument("--dry-run", action="store_true", help="print the dask worker command instead of running it")
    parser.set_defaults(handler=run_worker)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``dask worker`` command line that serves ``args.nodes``."""
    resources = worker_resources(args.nodes, args.nthreads, args.resources)
    argv = [sys.executable, "-m", "distributed.cli.dask_worker", args.scheduler]
    argv += ["--name", "+".join(args.nodes), "--nthreads", str(args.nthreads), "--nworkers", "1"]
    argv += ["--resources", ",".join(f"{name}={amount:g}" for name, amount in resources.items())]
    argv += ["--no-dashboard"]
    if args.host:
        argv += ["--host", args.host, "--dashboard-address", f"{args.host}:0"]
    if args.local_directory:
        argv += ["--local-directory", args.local_directory]
    for option in ("tls_ca_file", "tls_cert", "tls_key"):
        if getattr(args, option, None):
            argv += ["--" + option.replace("_", "-"), getattr(args, option)]
    return argv


def run_worker(args: argparse.Namespace) -> int:
    """Replace this process with the Dask worker (or print its command with ``--dry-run``)."""
    argv = worker_argv(args)
    if not args.dry_run:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(argv[0], argv)  # never returns
    print(shlex.join(argv))
    return 0


@subcommand
def demo_command(subparsers: Subparsers) -> None:
    """``daskjobs demo``: the bundled parameter-server training job."""
    from .demo import add_demo_parser

    add_demo_parser(subparsers)


@subcommand
def checkpoints_command(subparsers: Subparsers) -> None:
    """``daskjobs checkpoints``: list, show, verify, prune and unlock checkpoint prefixes."""
    from .checkpoint._inspect import add_checkpoints_parser

    add_checkpoints_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    """The ``daskjobs`` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="daskjobs", description="Epoch-checkpointed jobs on Dask: cluster and checkpoint tools."
    )
    parser.add_argument("--version", action="version", version=f"daskjobs {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``daskjobs`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except DaskJobsError as exc:
        print(f"daskjobs {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
