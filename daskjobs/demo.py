"""The bundled demo: parameter-server logistic regression on shuffled minibatches, checkpointed every epoch.

A ``ps`` node holds the model; each ``trainer_<i>`` node reads its own data shard through an
``ArrayReader`` (shuffled afresh every pass) limited to a few minibatches per epoch
(``ReaderWithLimit``) and ``pipe``-d into an SGD step. Each epoch the ps publishes its weights,
every trainer takes its minibatch steps from them (weights and results travel along ``inputs``
edges, worker to worker), and the ps averages the trainers' models with momentum. The job stops
once the training loss reaches a target, or when the trainers' data runs out (``data_finished``),
or after ``max_epochs``. The readers' positions are checkpointed with the model, so re-running it
against the same checkpoint directory resumes exactly where it was, without re-reading a batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._model.job import Job, epoch_limiter
from ._model.node import Cluster, Node
from ._model.task import SetupNets, Task, TaskOutput, final_output
from ._model.values import check_count
from .data import ArrayReader, ReaderWithLimit, pipe

if TYPE_CHECKING:
    from ._model.workspace import Workspace

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class DemoConfig:
    """Size and hyper-parameters of the demo problem."""

    trainers: int = 2
    samples: int = 5000
    """Samples per trainer shard."""
    features: int = 16
    batch_size: int = 100
    batches_per_epoch: int = 2
    """Minibatches each trainer reads per epoch."""
    passes: int = 10
    """Passes over its shard after which a trainer's data is finished."""
    learning_rate: float = 0.05
    momentum: float = 0.9
    target_loss: float = 0.34
    """Stop once an epoch's mean training loss is below this."""
    max_epochs: int = 200

    def __post_init__(self) -> None:
        for name in ("trainers", "samples", "features", "batch_size", "batches_per_epoch", "passes", "max_epochs"):
            check_count(getattr(self, name), f"DemoConfig.{name}")

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


def _publish(ws: Workspace) -> None:
    ws["model"] = ws["weights"]


def _reset_stats(ws: Workspace) -> None:
    ws["stats"] = np.zeros(2)


@dataclass(frozen=True)
class _SgdStep:
    """The trainers' processor: one SGD step of the local model on a minibatch ``(x, y)``."""

    learning_rate: float

    def __call__(self, ws: Workspace, batch: tuple[np.ndarray, np.ndarray]) -> None:
        x, y = batch
        w = ws["model"]
        z = x @ w[:-1] + w[-1]
        error = 1.0 / (1.0 + np.exp(-z)) - y
        loss = float(np.sum(np.logaddexp(0, z) - y * z))
        ws["model"] = w - self.learning_rate * np.concatenate([x.T @ error, [error.sum()]]) / len(y)
        ws["stats"] = ws["stats"] + [loss, len(y)]


@dataclass(frozen=True)
class _Apply:
    trainers: int
    momentum: float
    target_loss: float

    def __call__(self, ws: Workspace) -> None:
        average = sum(ws[f"model_{i}"] for i in range(self.trainers)) / self.trainers
        stats = sum(ws[f"stats_{i}"] for i in range(self.trainers))
        ws["velocity"] = self.momentum * ws["velocity"] + (average - ws["weights"])
        ws["weights"] = ws["weights"] + ws["velocity"]
        loss = stats[0] / stats[1] if stats[1] else float(ws["loss"])
        ws["loss"] = np.float64(loss)
        ws["converged"] = bool(loss < self.target_loss)
        ws.log("loss", loss)  # the epoch's metric: the loss the stop condition compares


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
            publish = Task(_publish, outputs="model", name="publish")
        inputs = {}
        data_finished = []
        for i in range(config.trainers):
            with Node(f"trainer_{i}"):
                with job.init_group:
                    shard = ArrayReader(
                        *make_shard(1 + i, config.samples, config.features),
                        batch_size=config.batch_size,
                        shuffle=True,
                        seed=i,
                        num_passes=config.passes,
                        name="shard",
                    )
                job.epoch_group.add_local_setup(SetupNets(init_nets=[_reset_stats]))
                limited = ReaderWithLimit(shard, num_iter=config.batches_per_epoch)
                train = pipe(limited, _SgdStep(config.learning_rate), name="train")
                train.add_input("model", publish.outputs()[0])
                inputs[f"model_{i}"], inputs[f"stats_{i}"] = train.add_outputs(["model", "stats"])
                data_finished.append(limited.data_finished())
        with Node("ps"):
            apply = Task(
                _Apply(config.trainers, config.momentum, config.target_loss),
                inputs=inputs,
                outputs=["loss", "converged"],
                name="apply",
            )
            job.add_stop_condition(apply.outputs()[1])
            for finished in data_finished:
                job.add_stop_condition(finished)
            epoch_limiter(job, config.max_epochs)
            with job.download_group:
                weights = final_output("weights")
            with job.exit_group:
                evaluate = Task(_Evaluate(config.features), outputs="test_accuracy", name="evaluate")
    return DemoJob(job, apply.outputs()[0], weights, evaluate.outputs()[0])


def demo_job() -> Job:
    """The demo's :class:`~daskjobs.Job` in its default configuration, as a command-line target.

    ``daskjobs run daskjobs.demo:demo_job`` trains it; ``daskjobs check daskjobs.demo:demo_job``
    proves that it resumes exactly.
    """
    return build_demo_job().job
