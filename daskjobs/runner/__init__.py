"""The runner: :class:`JobRunner` loops a job's epochs on a session, checkpointing every epoch.

What it owns: the epoch loop (:mod:`._runner`), how a run starts, afresh or resumed
(:mod:`._start`), one epoch and its save (:mod:`._epochs`), its hooks (:mod:`._hooks`), the policy
for failed saves and the checkpoint calls a job makes itself (:mod:`._saving`; saving and committing
epochs, and the writer lock, are the checkpoint manager's commit pipeline), recovery from lost nodes
(:mod:`._recovery`), graceful stop on signals (:mod:`._interrupt`), checks of a run's inputs
(:mod:`._checks`), the epoch history (:mod:`._history`) and its display (:mod:`._progress`,
:mod:`._notebook`), and loading a job from a ``TARGET`` string (:mod:`._targets`).

It may import everything below it: the model, the execution layer, sessions, checkpoints and
readers. Only :mod:`daskjobs.testing` and the command line import it.
"""

from ._history import EpochRecord
from ._hooks import RunnerHooks
from ._runner import JobRunner

__all__ = ["EpochRecord", "JobRunner", "RunnerHooks"]
