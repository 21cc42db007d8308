"""What every ``daskjobs`` subcommand shares: argument types, usage errors and exit codes.

Exit codes (SPEC §5): 0 success; 1 the job or a check failed; 2 a usage error (bad arguments,
a target that is not a job, a prefix that does not exist or holds no daskjobs checkpoints);
130 / 143 after a graceful stop on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

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


def positive_int(text: str) -> int:
    """``argparse`` type: an integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
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
