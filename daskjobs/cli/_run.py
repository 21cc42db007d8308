"""``daskjobs run TARGET``: run a job from the command line, checkpointed and resumable.

TARGET is ``package.module:name`` or ``path/to/file.py:name``, naming a :class:`~daskjobs.Job`
or a callable (without arguments) that returns one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._model.job import Job
from ..errors import JobInterruptedError
from ..runner._progress import announce_dashboard, epoch_line, shows_bar
from ._common import (
    OK,
    CommandFailed,
    Subparsers,
    UsageError,
    add_storage_options,
    add_verbose,
    count,
    epoch_number,
    leave_when_abandoned,
    load_target,
    positive_float,
    positive_int,
    say,
)

if TYPE_CHECKING:
    from ..runner._history import EpochRecord

logger = logging.getLogger("daskjobs")


def add_run_parser(subparsers: Subparsers) -> None:
    """Register ``daskjobs run``."""
    parser = subparsers.add_parser(
        "run",
        help="run a job (module:name or file.py:name), checkpointed and resumable",
        description=(
            "Run a daskjobs Job. TARGET is package.module:name or path/to/file.py:name, naming a Job or a "
            "callable that returns one. By default the job runs on a local Dask cluster with one worker per "
            "node (--workers N: a local pool of N workers that the nodes are spread over); with --checkpoint it "
            "saves every epoch and a re-run resumes from the latest commit."
        ),
    )
    parser.add_argument("target", metavar="TARGET", help="package.module:name or path/to/file.py:name")
    parser.add_argument("--checkpoint", metavar="PREFIX", help="checkpoint prefix (a path or fsspec URL)")
    add_storage_options(parser)
    parser.add_argument("--keep-last", type=positive_int, metavar="N", help="keep only the newest N committed epochs")
    parser.add_argument("--async-save", action="store_true", help="write each checkpoint while the next epoch runs")
    parser.add_argument(
        "--resume-from",
        type=epoch_number,
        metavar="N",
        help="resume from committed epoch N (default: the latest); the epochs after N are deleted when the "
        "first new epoch commits",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start from epoch 0 on a prefix that holds this job's commits; they are deleted when the new "
        "epoch 0 commits (not before)",
    )
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="keep every epoch's checkpoint in the cluster's memory (each node's snapshot on its worker and "
        "--replicas other workers): a lost worker is restored from there, reading nothing from the prefix; "
        "--checkpoint gets a durable commit every --durable-every epochs (without --checkpoint: memory only, "
        "no resume after the driver is lost)",
    )
    parser.add_argument(
        "--durable-every",
        type=positive_int,
        metavar="N",
        help="with --in-memory and --checkpoint: commit every N-th epoch under the prefix too (default 10); a "
        "re-run after the driver is lost repeats fewer than 2*N epochs",
    )
    parser.add_argument(
        "--replicas",
        type=count,
        metavar="N",
        help="with --in-memory: workers besides a node's own that hold its snapshot (default 1)",
    )
    parser.add_argument(
        "--durable-interval",
        type=positive_float,
        metavar="SECONDS",
        help="with --in-memory and --checkpoint: also commit under the prefix an epoch at least this long "
        "after the last durable one",
    )
    parser.add_argument("--max-epochs", type=positive_int, metavar="N", help="stop after epoch N at the latest")
    parser.add_argument(
        "--max-failures",
        type=count,
        default=3,
        metavar="N",
        help="node losses to recover from by restoring the last commit (default 3; needs --checkpoint or "
        "--in-memory; workers leaving on purpose, e.g. retired or preempted, do not count)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run on this Dask scheduler: its pool workers (plain `dask worker`s) get the nodes, pinned ones "
        "(`daskjobs worker --node NAME`) keep theirs",
    )
    where.add_argument("--local", action="store_true", help="run in this process (LocalSession), no cluster")
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="run on a local pool cluster of N worker processes (any N >= 1: the nodes are spread over them)",
    )
    parser.add_argument(
        "--nthreads", type=positive_int, default=2, help="threads per worker of the local cluster (default 2)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbose(parser)
    parser.set_defaults(handler=run_job)


def run_job(args: argparse.Namespace) -> int:
    """Carry out ``daskjobs run``; returns the exit code."""
    from ..checkpoint import MultiNodeCheckpointManager
    from ..runner._runner import JobRunner

    needs_prefix = [
        flag
        for flag, given in (
            ("--keep-last", args.keep_last is not None),
            ("--async-save", args.async_save),
            ("--resume-from", args.resume_from is not None),
            ("--fresh", args.fresh),
            ("--storage-option", bool(args.storage_options)),
        )
        if given
    ]
    if args.fresh and args.resume_from is not None:
        raise UsageError("--fresh starts from epoch 0 and --resume-from N from epoch N: give one of them")
    if needs_prefix and not args.checkpoint:
        verb = "needs" if len(needs_prefix) == 1 else "need"
        raise UsageError(f"{', '.join(needs_prefix)} {verb} a checkpoint prefix: add --checkpoint PREFIX")
    _check_in_memory(args)
    _check_workers(args)
    job = load_target(args.target)
    if not job.stop_conditions and args.max_epochs is None:
        raise CommandFailed(
            f"job {job.name!r} ({args.target}) has no stop condition, so it would never stop: "
            "pass --max-epochs N (or give the job a stop condition)"
        )
    manager = None
    if args.checkpoint or args.in_memory:
        manager = MultiNodeCheckpointManager(
            args.checkpoint,
            storage_options=dict(args.storage_options),
            keep_last=args.keep_last,
            async_save=args.async_save,
            in_memory=args.in_memory,
            durable_every=args.durable_every,
            replicas=args.replicas,
            durable_interval=args.durable_interval,
        )
        if args.resume_from is not None:
            _check_resumable(manager.store, args.resume_from)
        if args.fresh:
            manager.start_fresh()
    runner = JobRunner(
        job,
        manager,
        resume_from_epoch=args.resume_from,
        max_epochs=args.max_epochs,
        max_failures=args.max_failures,
        progress=False if args.no_progress else None,
        on_epoch=None if args.no_progress or shows_bar(None) else _epoch_printer(manager is not None),
    )
    with _session(job, args) as session:
        try:
            last = runner.train(session)
        except (KeyboardInterrupt, JobInterruptedError) as exc:
            leave_when_abandoned(exc)
            raise
    say(_final_line(job, runner, last, manager))
    return OK


def _epoch_printer(committed: bool) -> Callable[[EpochRecord], None]:
    """Without a progress bar (no terminal: CI, batch logs): one line per committed epoch on stdout."""
    return lambda record: say(epoch_line(record, committed=committed))


def _check_in_memory(args: argparse.Namespace) -> None:
    """``--durable-every``, ``--replicas`` and ``--durable-interval`` need ``--in-memory`` (the durable ones
    a ``--checkpoint`` too); ``--in-memory`` writes its durable commits in the background already."""
    tier0 = [
        flag
        for flag, value in (
            ("--durable-every", args.durable_every),
            ("--replicas", args.replicas),
            ("--durable-interval", args.durable_interval),
        )
        if value is not None
    ]
    if tier0 and not args.in_memory:
        raise UsageError(f"{', '.join(tier0)}: options of checkpoints in cluster memory; add --in-memory")
    durable = [flag for flag in tier0 if flag != "--replicas"]
    if durable and not args.checkpoint:
        raise UsageError(f"{', '.join(durable)}: options of durable commits; add --checkpoint PREFIX")
    if args.in_memory and args.async_save:
        raise UsageError("--in-memory writes its durable commits in the background already: drop --async-save")


def _check_workers(args: argparse.Namespace) -> None:
    """``--workers N``: at least 1, and a local cluster of its own (not with --scheduler or --local)."""
    if args.workers is None:
        return
    if args.workers < 1:
        raise UsageError(f"--workers {args.workers}: a pool needs at least one worker (N >= 1)")
    for flag, given in (("--scheduler", args.scheduler), ("--local", args.local)):
        if given:
            raise UsageError(f"--workers starts a local pool cluster: it cannot be combined with {flag}")


def _check_resumable(store: Any, epoch: int) -> None:
    """A usage error unless ``epoch`` is committed under the store's prefix (nothing is created)."""
    committed = store.committed_epochs()
    if epoch not in committed:
        have = ", ".join(map(str, committed)) if committed else "none"
        raise UsageError(f"--resume-from {epoch}: epoch {epoch} is not committed under {store.url}; committed: {have}")


@contextlib.contextmanager
def _session(job: Job, args: argparse.Namespace) -> Iterator[Any]:
    """The session ``run`` asked for: in-process, on a scheduler, on a new pool cluster or ``node_cluster``."""
    from ..session import DaskSession, LocalSession, node_cluster
    from ..session._pool import pool_cluster

    if args.local:
        with LocalSession() as session:
            yield session
    elif args.scheduler:
        try:
            connected = DaskSession(args.scheduler)
        except ValueError as exc:  # an address that does not parse, or tls:// without TLS settings
            raise UsageError(f"--scheduler {args.scheduler}: {exc}") from None
        except OSError as exc:
            raise CommandFailed(
                f"{exc} Start it with `dask scheduler`, and workers with `dask worker {args.scheduler}` (or "
                f"`daskjobs worker {args.scheduler}`)."
            ) from None
        with connected as session:
            _print_dashboard(session.dashboard_link)
            yield session
    elif args.workers is not None:
        plural = "es" if args.workers > 1 else ""
        say(f"starting a local Dask cluster of {args.workers} pool worker process{plural}")
        with pool_cluster(args.workers, nthreads=args.nthreads) as cluster, DaskSession(cluster) as session:
            _print_dashboard(cluster.dashboard_link)
            yield session
    else:
        nodes = job.nodes()
        say(f"starting a local Dask cluster with one worker per node: {', '.join(nodes)}")
        with node_cluster(job, nthreads=args.nthreads) as cluster, DaskSession(cluster) as session:
            _print_dashboard(cluster.dashboard_link)
            yield session


def _print_dashboard(link: str | None) -> None:
    """The dashboard link, once: a progress bar of the run does not show it again."""
    if link:
        say(f"dashboard: {link}")
        announce_dashboard(link)


def _final_line(job: Job, runner: Any, last: int, manager: Any) -> str:
    ran = (
        f"ran epochs {runner.history[0].epoch}-{runner.history[-1].epoch}"
        if len(runner.history) > 1
        else f"ran epoch {runner.history[0].epoch}"
        if runner.history
        else "no epoch ran: the job had already finished"
    )
    if manager is None:
        where = "no checkpoint (pass --checkpoint PREFIX to keep one)"
    elif not manager.durable:
        where = "kept in cluster memory only (no --checkpoint: nothing to resume from)"
    else:
        committed = manager.store.committed_epochs()
        if last in committed:
            where = f"committed under {manager.store.url}"
        else:
            newest = committed[-1] if committed else None
            where = f"not committed; newest committed epoch under {manager.store.url}: {newest}"
    return f"job {job.name!r}: last epoch {last}, {where}; {ran}"
