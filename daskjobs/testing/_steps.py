"""Which step's output first diverged: the epoch of reference A where a run first differs, run once
more in this process from A's epoch before it, recording which task assigns each blob.

Workspaces record the task that last assigned each blob (``ws[name] = value``; see
:attr:`~daskjobs._model.workspace.Scope.writers`). Of the blobs that differ first, the one whose
assigning task comes first in its group (the order the job defines its tasks in, which every
dataflow edge follows) names the step. A blob changed in place (``ws["w"][:] = ...``), or assigned
in an earlier epoch, names none: then the step is not known.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from .._model.job import Job
from ..checkpoint import CheckpointStore, MultiNodeCheckpointManager
from ..session import LocalSession
from ._report import FirstStep

logger = logging.getLogger("daskjobs")


def first_step(
    make_job: Callable[[], Job], reference: CheckpointStore, epoch: int, blobs: Iterable[tuple[str, str]]
) -> FirstStep | None:
    """The step that first assigned one of ``blobs`` (``(node, blob)`` pairs that differ in
    ``epoch``) when reference A ran that epoch; ``None`` when no such assignment is seen, or the
    epoch cannot be run again in this process (the reason is logged at debug level)."""
    wanted = set(blobs)
    if not wanted:
        return None
    try:
        writers = _writers(make_job(), reference, epoch)
    except Exception as exc:
        logger.debug("check: could not run epoch %d again to find its first diverging step: %s", epoch, exc)
        return None
    found = []
    for node, blob in wanted:
        writer = writers.get(node, {}).get(blob)
        if writer is not None and writer[0] == (None if epoch == 0 else epoch):
            found.append((writer[1], node, blob, writer[2]))
    if not found:
        return None
    _, node, blob, task = min(found)
    return FirstStep(task, node, blob, epoch)


def _writers(job: Job, reference: CheckpointStore, epoch: int) -> dict[str, dict[str, tuple[int | None, int, str]]]:
    """Per node, who assigned each blob when ``job`` ran ``epoch`` (0: its init group) from reference A's
    commit of the epoch before, on a :class:`~daskjobs.LocalSession` of this process."""
    with LocalSession() as session:
        session.start_job_run(job.name)
        if epoch == 0:
            session.run_group(job.init_group, job=job.name)
        else:
            manager = MultiNodeCheckpointManager(reference.url, storage_options=reference.storage_options)
            manager.set_params(job.nodes_to_checkpoint(), job_name=job.name)
            session.run_group(manager.load(epoch - 1), job=job.name)
            session.run_group(job.epoch_group, job=job.name, epoch=epoch)
        return {node: session._call_on_node(node, lambda state: dict(state.scope.writers)) for node in job.nodes()}
