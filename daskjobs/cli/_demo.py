"""``daskjobs demo``: train the bundled demo job (:mod:`daskjobs.demo`), checkpointing every epoch."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from typing import TYPE_CHECKING

from ..demo import DemoConfig, build_demo_job
from ._common import UsageError

if TYPE_CHECKING:
    from ..runner import EpochRecord
    from ..session import Session


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``daskjobs demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train the bundled parameter-server demo, checkpointing every epoch",
        description=(
            "Train the bundled demo: parameter-server logistic regression. A 'ps' node holds the model; "
            "each 'trainer_<i>' node reads its own data shard (an ArrayReader, shuffled every pass, a few "
            "minibatches per epoch through ReaderWithLimit and pipe) and sends its model to the ps, which "
            "averages them. The job stops once the training loss reaches its target, when the data runs out, "
            "or after --max-epochs. Every epoch is committed under --checkpoint-dir: run the command again "
            "and it resumes where it was, without re-reading a batch."
        ),
        epilog="examples: daskjobs demo; daskjobs demo --local --fresh; daskjobs demo --scheduler tcp://127.0.0.1:8786",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="daskjobs-demo-checkpoints",
        metavar="PREFIX",
        help="checkpoint prefix (path or fsspec URL); re-running resumes from it (default: %(default)s)",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run on this existing Dask scheduler (its workers serve the nodes) instead of an embedded cluster",
    )
    parser.add_argument("--local", action="store_true", help="run in-process (LocalSession) instead of a cluster")
    parser.add_argument("--fresh", action="store_true", help="delete the checkpoint directory first")
    parser.add_argument(
        "--trainers",
        type=int,
        default=DemoConfig.trainers,
        metavar="N",
        help="trainer nodes, each with its own data shard (default: %(default)s)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=DemoConfig.samples,
        metavar="N",
        help="samples per trainer (default: %(default)s)",
    )
    parser.add_argument(
        "--max-epochs",
        type=int,
        default=DemoConfig.max_epochs,
        metavar="N",
        help="stop after epoch N at the latest (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-last", type=int, default=3, metavar="N", help="committed epochs to keep (default: %(default)s)"
    )
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo as ``daskjobs demo`` does; returns the process exit code."""
    from ..checkpoint import MultiNodeCheckpointManager
    from ..runner import JobRunner
    from ..session import DaskSession, LocalSession, node_cluster

    for flag in ("trainers", "samples", "max_epochs", "keep_last"):  # before anything is deleted or created
        value = getattr(args, flag)
        if value < 1:
            raise UsageError(f"argument --{flag.replace('_', '-')}: expected a positive integer, got {value}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config = DemoConfig(trainers=args.trainers, samples=args.samples, max_epochs=args.max_epochs)
    if args.fresh:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    demo = build_demo_job(config)
    manager = MultiNodeCheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)

    def report(record: EpochRecord) -> None:
        print(
            f"epoch {record.epoch:4d}  loss {record.metrics['loss']:.6f}  "
            f"epoch {record.seconds * 1000:7.1f} ms  checkpoint {record.checkpoint_seconds * 1000:7.1f} ms",
            flush=True,
        )

    runner = JobRunner(demo.job, manager, on_epoch=report, progress=False)
    started = time.perf_counter()
    session: Session
    if args.local:
        with LocalSession() as session:
            last = runner.train(session)
    elif args.scheduler:
        with DaskSession(args.scheduler) as session:
            last = runner.train(session)
    else:
        print(f"starting a local Dask cluster with one worker per node: {config.nodes()}", flush=True)
        with node_cluster(config.nodes(), nthreads=1) as cluster, DaskSession(cluster) as session:
            print(f"dashboard: {cluster.dashboard_link}", flush=True)
            last = runner.train(session)
    resumed = (
        f" (resumed from epoch {runner.history[0].epoch - 1})" if runner.history and runner.history[0].epoch > 1 else ""
    )
    if not runner.history:
        print(f"the job had already finished at epoch {last}; use --fresh to train again")
    print(
        f"finished at epoch {last}{resumed} in {time.perf_counter() - started:.1f} s: "
        f"test accuracy {float(demo.test_accuracy.fetch()):.4f}; checkpoints in {manager.store.url}"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m daskjobs.demo")
    add_demo_parser(parser.add_subparsers(required=True))
    namespace = parser.parse_args(["demo", *sys.argv[1:]])
    sys.exit(namespace.handler(namespace))
