"""Checks of a run's inputs before it starts: the epoch to resume from, whether the job can stop,
whether every node of the job has a worker, and the values its stop conditions produce."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._config import config_timeout
from ..errors import DefinitionTypeError, JobDefinitionError, NodePlacementError, StopConditionError

if TYPE_CHECKING:
    from .._model.job import Job
    from ..session import Session


def resume_epoch(value: object) -> int | None:
    """``resume_from_epoch`` checked: ``None`` or a non-negative int (numpy integers accepted)."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise DefinitionTypeError(
            f"resume_from_epoch must be a non-negative int naming a committed epoch (or None), "
            f"got {type(value).__name__} {value!r}"
        )
    epoch = operator.index(value)
    if epoch < 0:
        raise DefinitionTypeError(f"resume_from_epoch must be a non-negative int, got {epoch}")
    return epoch


def stop_value(name: str, value: Any) -> bool:
    """Check that the stop condition ``name`` produced one boolean and return it."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.size == 1:
        return bool(value.reshape(()))
    kind = f"array of dtype {value.dtype} and shape {value.shape}" if isinstance(value, np.ndarray) else type(value)
    raise StopConditionError(f"stop condition {name!r} must be a bool or a one-element bool array, got {kind}")


def stop_condition_values(outputs: list[Any]) -> dict[str, bool]:
    """The checked value of each stop condition output, by its name (``name#i`` for a repeated name)."""
    values: dict[str, bool] = {}
    for i, output in enumerate(outputs):
        key = output.names[0] if output.names[0] not in values else f"{output.names[0]}#{i}"
        values[key] = stop_value(output.names[0], output.fetch())
    return values


def check_can_stop(job: Any, max_epochs: int | None) -> str | None:
    """Refuse a job that could never stop; a warning when some of its stop conditions never change.

    Raises
    ------
    JobDefinitionError
        ``job`` has no stop condition and ``max_epochs`` is ``None``.
    """
    if not job.stop_conditions and max_epochs is None:
        raise JobDefinitionError(
            f"job {job.name!r} has no stop condition and no max_epochs: it would never stop; "
            "add job.add_stop_condition(...), dj.epoch_limiter(job, n) or JobRunner(..., max_epochs=n)"
        )
    if fixed := job._fixed_stop_conditions():
        return (
            f"stop conditions {fixed} of job {job.name!r} are outputs of tasks outside the epoch group: each "
            "keeps the value captured when its task ran and never changes between epochs; make it an epoch-group "
            "task's output (job.add_stop_condition('<blob>') reads a blob after every epoch)"
        )
    return None


def check_placement(session: Session, job: Job) -> None:
    """Before anything of ``job`` runs: every node any of its groups uses (init, epoch, download,
    exit) has exactly one suitable worker in ``session``, waiting up to ``daskjobs.preflight-timeout``
    for workers still joining. A :class:`~daskjobs.LocalSession` runs every node itself.

    Raises
    ------
    NodePlacementError
        Naming the job, the nodes without a worker and the workers there are; nothing ran.
    """
    nodes, timeout = job.nodes(), config_timeout("preflight-timeout")
    try:
        session.wait_for_nodes(nodes, timeout=timeout, resources=job.node_resources())
    except NodePlacementError as exc:
        raise NodePlacementError(
            f"job {job.name!r} cannot start, nothing ran: {exc}\nWorkers still starting (a batch queue, an adaptive "
            f"cluster)? Wait longer for them: the Dask config value daskjobs.preflight-timeout ({timeout:g} s; e.g. "
            "DASK_DASKJOBS__PREFLIGHT_TIMEOUT=10m in the environment), or session.wait_for_nodes(job.nodes(), "
            "timeout=...) before train().",
            exc.nodes,
        ) from None
