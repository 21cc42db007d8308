"""Hooks into a run: what a :class:`~daskjobs.JobRunner` tells an observer as its epochs go by."""

from __future__ import annotations


class RunnerHooks:
    """Called by a :class:`~daskjobs.JobRunner` (``hooks=``) as a run goes on; every hook does nothing
    here: subclass it and define the ones you need. This class serves mostly as documentation.

    The hooks are called in the thread that runs :meth:`~daskjobs.JobRunner.train`, between the
    runner's own steps: a hook that takes long holds the run up (``epoch_running`` holds up the
    driver, not the epoch's tasks). A hook may call :meth:`~daskjobs.JobRunner.request_stop` and
    :meth:`~daskjobs.JobRunner.commit_saved`; an exception it raises ends the run like a failing
    step's, nothing of the running epoch committed.

    Examples
    --------
    >>> import daskjobs as dj
    >>> class StopAfter(dj.RunnerHooks):
    ...     def __init__(self, last):
    ...         self.last, self.runner, self.seen = last, None, []
    ...     def epoch_saved(self, epoch):
    ...         self.seen.append(epoch)
    ...         if epoch == self.last:
    ...             self.runner.request_stop()  # the same graceful stop as a SIGTERM
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         _ = dj.Task(lambda ws: ws.__setitem__("n", 0))
    ...     _ = dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    >>> hooks = StopAfter(2)
    >>> runner = hooks.runner = dj.JobRunner(job, max_epochs=5, progress=False, hooks=hooks)
    >>> try:
    ...     runner.train(None)
    ... except dj.errors.JobInterruptedError:
    ...     print("stopped after epoch", runner.history[-1].epoch, "; saw", hooks.seen)
    stopped after epoch 2 ; saw [1, 2]
    """

    __slots__ = ()

    def before_epoch(self, epoch: int) -> None:
        """``epoch`` is about to run (the epochs before it ran, and were saved)."""

    def epoch_running(self, epoch: int) -> None:
        """``epoch``'s tasks were handed to the cluster and run now (in a :class:`~daskjobs.LocalSession`:
        they are about to run)."""

    def epoch_saved(self, epoch: int) -> None:
        """``epoch`` ran and its checkpoint is written (with a checkpoint manager), not necessarily
        committed yet: see :meth:`epoch_committed`. Epoch 0 is the checkpoint of the init group."""

    def epoch_committed(self, epoch: int) -> None:
        """``epoch``'s checkpoint is committed: a resume would start after it. On a
        :class:`~daskjobs.DaskSession` usually two epochs later (see ``on_epoch``)."""
