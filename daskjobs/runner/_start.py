"""How a run starts: from scratch (the init group, saving epoch 0 through the commit pipeline), or
from a committed epoch it resumes (every checkpointed node loaded from it; the newer commits stay
until the run's first commit), and without checkpoints at the epoch after the one it is told."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..checkpoint._managers.manager import overrides
from ._epochs import run_init
from ._recovery import load_epoch

if TYPE_CHECKING:
    from .._model.job import Job
    from ..checkpoint import MultiNodeCheckpointManager
    from ..checkpoint._managers.pipeline import CommitPipeline
    from ..session import Session
    from ._hooks import RunnerHooks

logger = logging.getLogger("daskjobs")


def start_run(
    session: Session,
    job: Job,
    manager: MultiNodeCheckpointManager | None,
    pipeline: CommitPipeline | None,
    hooks: RunnerHooks,
    resume: int | None,
    failures: int,
    max_epochs: int | None,
) -> tuple[int, bool]:
    """Init ``job`` from scratch (saving epoch 0 through ``pipeline``) or restore ``resume``; return the
    first epoch to run and whether the job had already stopped (``max_epochs`` reached, or a stop
    condition true when ``resume`` was committed)."""
    nodes = job.nodes_to_checkpoint()
    if manager is not None:  # before anything is written or loaded: the nodes see the driver's prefix
        manager.check_shared(session)
    if resume is None:
        if manager is None or pipeline is None:
            session.run_group(job.init_group, job=job.name, attempt=failures)
        else:
            run_init(session, job, manager, pipeline, hooks, failures)
        return 1, False
    if manager is None:
        logger.info("resuming at epoch %d without a checkpoint manager: init group skipped, nothing loaded", resume)
        return (resume, True) if max_epochs is not None and resume >= max_epochs else (resume + 1, False)
    assert pipeline is not None
    newer = pipeline.resume_older(resume)
    if newer:
        logger.info(
            "resuming from epoch %d: the newer commits %s stay until epoch %d is committed",
            resume,
            newer,
            resume + 1,
        )
    # The load checks on each node what the group manager.init returns would check (the
    # node's group of the epoch is there and readable): that group is not run, unless a
    # subclass of the manager overrides init().
    check = manager.init(nodes, retrieve_from_epoch=resume)
    if overrides(manager, "init"):
        session.run_group(check, job=job.name, attempt=failures)
    return load_epoch(session, manager, job.name, resume, failures, max_epochs)
