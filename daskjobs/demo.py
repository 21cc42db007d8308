"""The bundled demo: parameter-server logistic regression, checkpointed every epoch.

A ``ps`` node holds the model; ``trainer_<i>`` nodes hold deterministic data shards. Each
epoch the ps publishes its look-ahead weights, every trainer computes the gradient of its shard
(the weights and gradients travel along ``inputs`` edges, worker to worker), and the ps applies
a Nesterov-momentum step and checks convergence. The job stops on convergence or after
``max_epochs``; re-running it against the same checkpoint directory resumes where it was.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._model.job import Job, epoch_limiter
from ._model.node import Cluster, Node
from ._model.task import Task, TaskOutput, final_output

if TYPE_CHECKING:
    from ._workspace import Workspace
    from .history import EpochRecord

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class DemoConfig:
    """Size and hyper-parameters of the demo problem."""

    trainers: int = 2
    samples: int = 5000
    """Samples per trainer shard."""
    features: int = 16
    learning_rate: float = 1.0
    momentum: float = 0.9
    tolerance: float = 1e-5
    """Stop once the loss improves by less than this fraction."""
    max_epochs: int = 200

    def nodes(self) -> list[str]:
        """The node names the demo uses."""
        return ["ps", *(f"trainer_{i}" for i in range(self.trainers))]


def _true_model(features: int) -> tuple[np.ndarray, float]:
    return np.random.default_rng(0).normal(size=features), 0.3


def make_shard(seed: int, samples: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic labelled sample of the demo's logistic model."""
    weights, bias = _true_model(features)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-(x @ weights + bias)))
    return x, (rng.uniform(size=samples) < p).astype(np.float32)


# Steps are module-level callables so that worker processes import them by reference.
@dataclass(frozen=True)
class _InitPs:
    features: int

    def __call__(self, ws: Workspace) -> None:
        ws["weights"] = np.zeros(self.features + 1)
        ws["velocity"] = np.zeros(self.features + 1)
        ws["loss"] = np.float64(np.inf)


@dataclass(frozen=True)
class _InitTrainer:
    seed: int
    samples: int
    features: int

    def __call__(self, ws: Workspace) -> None:
        ws["x"], ws["y"] = make_shard(self.seed, self.samples, self.features)


@dataclass(frozen=True)
class _Publish:
    momentum: float

    def __call__(self, ws: Workspace) -> None:
        ws["lookahead"] = ws["weights"] + self.momentum * ws["velocity"]


def _gradient(ws: Workspace) -> None:
    x, y, w = ws["x"], ws["y"], ws["lookahead"]
    z = x @ w[:-1] + w[-1]
    error = 1.0 / (1.0 + np.exp(-z)) - y
    ws["partial"] = np.concatenate([x.T @ error, [error.sum(), np.logaddexp(0, z).sum() - y @ z, len(y)]])


@dataclass(frozen=True)
class _Apply:
    learning_rate: float
    momentum: float
    tolerance: float

    def __call__(self, ws: Workspace) -> None:
        total = sum(ws[name] for name in ws if name.startswith("partial_"))
        count = total[-1]
        gradient, loss = total[:-2] / count, total[-2] / count
        ws["velocity"] = self.momentum * ws["velocity"] - self.learning_rate * gradient
        ws["weights"] = ws["weights"] + ws["velocity"]
        previous = float(ws["loss"])
        ws["converged"] = bool(abs(previous - loss) < self.tolerance * abs(loss))
        ws["loss"] = np.float64(loss)


@dataclass(frozen=True)
class _Evaluate:
    features: int

    def __call__(self, ws: Workspace) -> None:
        x, y = make_shard(999, 4000, self.features)
        w = ws["weights"]
        ws["test_accuracy"] = np.float64(np.mean(((x @ w[:-1] + w[-1]) > 0) == (y > 0.5)))


@dataclass(frozen=True)
class DemoJob:
    """The demo job and the outputs a caller reads."""

    job: Job
    loss: TaskOutput
    weights: TaskOutput
    test_accuracy: TaskOutput


def build_demo_job(config: DemoConfig | None = None) -> DemoJob:
    """Define the parameter-server training job.

    Examples
    --------
    >>> import daskjobs as dj
    >>> demo = build_demo_job(DemoConfig(samples=200, max_epochs=3))
    >>> dj.JobRunner(demo.job, progress=False).train(None)
    3
    """
    config = config or DemoConfig()
    with Cluster(), Job(name="ps-logistic-regression") as job:
        with Node("ps"):
            Task(_InitPs(config.features), group=job.init_group, name="init_model")
            publish = Task(_Publish(config.momentum), outputs="lookahead", name="publish")
        partials = {}
        for i in range(config.trainers):
            with Node(f"trainer_{i}"):
                Task(_InitTrainer(1 + i, config.samples, config.features), group=job.init_group, name="load_shard")
                gradient = Task(_gradient, outputs="partial", inputs={"lookahead": publish.outputs()[0]})
                partials[f"partial_{i}"] = gradient.outputs()[0]
        with Node("ps"):
            apply = Task(
                _Apply(config.learning_rate, config.momentum, config.tolerance),
                inputs=partials,
                outputs=["loss", "converged"],
                name="apply",
            )
            job.add_stop_condition(apply.outputs()[1])
            epoch_limiter(job, config.max_epochs)
            with job.download_group:
                weights = final_output("weights")
            with job.exit_group:
                evaluate = Task(_Evaluate(config.features), outputs="test_accuracy", name="evaluate")
    return DemoJob(job, apply.outputs()[0], weights, evaluate.outputs()[0])


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``daskjobs demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train the bundled parameter-server demo, checkpointing every epoch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="daskjobs-demo-checkpoints",
        help="checkpoint prefix (path or fsspec URL); re-running resumes from it",
    )
    parser.add_argument("--scheduler", help="run on this existing Dask scheduler instead of an embedded cluster")
    parser.add_argument("--local", action="store_true", help="run in-process (LocalSession) instead of a cluster")
    parser.add_argument("--fresh", action="store_true", help="delete the checkpoint directory first")
    parser.add_argument("--trainers", type=int, default=DemoConfig.trainers)
    parser.add_argument("--samples", type=int, default=DemoConfig.samples, help="samples per trainer")
    parser.add_argument("--max-epochs", type=int, default=DemoConfig.max_epochs)
    parser.add_argument("--keep-last", type=int, default=3, help="committed epochs to keep")
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo as ``daskjobs demo`` does; returns the process exit code."""
    from .checkpoint import MultiNodeCheckpointManager
    from .runner import JobRunner
    from .session import DaskSession, LocalSession, node_cluster

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    config = DemoConfig(trainers=args.trainers, samples=args.samples, max_epochs=args.max_epochs)
    if args.fresh:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    demo = build_demo_job(config)
    manager = MultiNodeCheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)

    def report(record: EpochRecord) -> None:
        print(
            f"epoch {record.epoch:4d}  loss {float(demo.loss.fetch()):.6f}  "
            f"epoch {record.seconds * 1000:7.1f} ms  checkpoint {record.checkpoint_seconds * 1000:7.1f} ms",
            flush=True,
        )

    runner = JobRunner(demo.job, manager, on_epoch=report, progress=False)
    started = time.perf_counter()
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
