"""One epoch of a run and its checkpoint: the epoch's group run with the save hooks its commit
pipeline planned, the stop values and metrics, and the save (init's run saves epoch 0 the same way)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._execution.plan import GroupRun, GroupRunFailed
from .._model.metrics import means
from ..checkpoint._managers.manager import overrides
from ..checkpoint._managers.saving import SaveMode, SavePlan
from ._checks import stop_condition_values
from ._history import EpochRecord

if TYPE_CHECKING:
    from .._model.group import TaskGroup
    from .._model.job import Job
    from ..checkpoint import MultiNodeCheckpointManager
    from ..checkpoint._managers.pipeline import CommitPipeline
    from ..session import Session
    from ._hooks import RunnerHooks


def run_epoch(
    session: Session,
    job: Job,
    pipeline: CommitPipeline | None,
    hooks: RunnerHooks,
    epoch: int,
    failures: int,
    *,
    last: bool,
) -> tuple[EpochRecord, bool]:
    """Run ``epoch`` of ``job`` and save it through ``pipeline`` (``None``: no checkpoints): inside the
    epoch's graph when possible, else as a group of its own; ``last``: the run should end with it.
    Returns its history record and whether its bytes come later (with an asynchronous save's commit)."""
    started = time.perf_counter()
    plan = None
    if pipeline is not None:
        used = job.epoch_group.used_nodes()
        plan = pipeline.plan(epoch, used, background=session.background_flushes, last=last, session=session)
    hook_errors: list[Exception] = []

    def meanwhile() -> None:  # must not raise: a hook's error is raised once the run ended
        if pipeline is not None:
            pipeline.meanwhile()
        try:
            hooks.epoch_running(epoch)
        except Exception as exc:
            hook_errors.append(exc)

    run = run_saving(session, job, pipeline, plan, job.epoch_group, epoch=epoch, attempt=failures, meanwhile=meanwhile)
    elapsed = time.perf_counter() - started
    try:
        if hook_errors:
            raise hook_errors[0]
        values, metrics = stop_condition_values(job.stop_conditions), means(run.metrics)
    except Exception:
        if pipeline is not None and plan is not None:
            pipeline.drop(session, plan, run.finished)
        raise
    if pipeline is None or plan is None:
        return EpochRecord(epoch, elapsed, 0.0, 0, 0, values, metrics, failures), False
    saved = pipeline.accept(session, plan, run.finished, values, metrics)
    written, reused = saved.bytes or (0, 0)
    tier0 = None if saved.tier is None else dict(saved.tier0_bytes or {})
    record = EpochRecord(
        epoch, elapsed, saved.seconds, written, reused, values, metrics, failures, tier=saved.tier, tier0_bytes=tier0
    )
    return record, saved.bytes is None


def run_init(
    session: Session,
    job: Job,
    manager: MultiNodeCheckpointManager,
    pipeline: CommitPipeline,
    hooks: RunnerHooks,
    failures: int,
) -> None:
    """Run ``job``'s init group and save epoch 0 through ``pipeline`` (inside its graph when possible)."""
    nodes = job.nodes_to_checkpoint()
    plan = pipeline.plan(0, job.init_group.used_nodes(), background=session.background_flushes, session=session)
    if plan.mode is SaveMode.IN_GRAPH:
        # The driver checked the prefix before anything ran (prepare_manager); on the nodes, the
        # save's write is the check, so the group manager.init returns is not run (it registers
        # the nodes) unless a subclass of the manager overrides init().
        check = manager.init(nodes)
        if overrides(manager, "init"):
            session.run_group(check, job=job.name, attempt=failures)
    run = run_saving(session, job, pipeline, plan, job.init_group, attempt=failures)
    if plan.mode is not SaveMode.IN_GRAPH:
        session.run_group(manager.init(nodes), job=job.name, attempt=failures)
    pipeline.accept(session, plan, run.finished, {}, means(run.metrics))  # what init logged: epoch 0's metrics
    hooks.epoch_saved(0)


def run_saving(
    session: Session,
    job: Job,
    pipeline: CommitPipeline | None,
    plan: SavePlan | None,
    group: TaskGroup,
    **options: Any,
) -> GroupRun:
    """Run ``group`` of ``job``, saving ``plan``'s epoch in its graph; when the run fails, what its save
    hooks reported of earlier saves is kept (``CommitPipeline.salvage``) and its own error raised."""
    finish = None if plan is None else plan.hooks or None
    try:
        return session.run_group(group, job=job.name, finish=finish, **options)
    except GroupRunFailed as failed:  # only a run with save hooks: they may have reported earlier saves
        error, finished = failed.error, failed.finished
    if pipeline is not None and plan is not None:
        pipeline.salvage(plan, finished)
    raise error
