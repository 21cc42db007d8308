"""JobRunner: runs a Job's groups on a session, checkpointing every epoch."""

from __future__ import annotations

import bisect
import logging
import signal
from dataclasses import replace
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from .._config import check_config
from .._model.job import Job
from .._model.values import check_count
from ..data import epochs_until_finished
from ..errors import JobDefinitionError, JobInterruptedError, NodeLostError, SessionLostError
from ..session import Session, as_session
from ._checks import check_can_stop, check_placement, resume_epoch
from ._epochs import run_epoch
from ._history import EpochRecord, history_frame, history_html, plot_history
from ._hooks import RunnerHooks
from ._interrupt import AbandonedRun, GracefulStop, interruption, signal_of
from ._progress import EpochProgress, known_total
from ._recovery import (
    Departures,
    Recovery,
    check_recoverable,
    placement_of,
    rebalance,
    restore,
    with_last_commit,
)
from ._saving import ManualCheckpoints, prepare_manager
from ._start import start_run

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._model.group import TaskGroup
    from ..checkpoint import MultiNodeCheckpointManager, UploadTaskGroupBuilder
    from ..checkpoint._managers.pipeline import CommitPipeline

logger = logging.getLogger("daskjobs")


class JobRunner(ManualCheckpoints):
    """Runs a :class:`~daskjobs.Job`: init, epochs until a stop condition is true, download, exit.

    Parameters
    ----------
    job
        The job to run.
    checkpoint_manager
        Saves every epoch (epoch 0 right after init) and resumes from the latest committed one.
    resume_from_epoch
        Resume from this committed epoch instead of the latest. The epochs after it are deleted
        when the first new epoch commits (not before: a run that fails first leaves them).
    upload_task_group_builder
        Its ``build(last_epoch, manager)`` group runs once after the loop.
    max_epochs
        Stop after this absolute epoch number even if no stop condition is true.
    max_failures
        How many node losses to recover from (waiting up to ``daskjobs.recovery-timeout``,
        60 s by default, for every node to have a worker again, then restoring all nodes from the last epoch this run
        committed, or running init again if none) before giving up with
        :class:`~daskjobs.errors.NodeLostError`. Losses in every phase count: init, saves,
        loads, epochs, the restore itself, and the download and exit groups.
    on_save_error
        ``"raise"`` (default): stop with :class:`~daskjobs.errors.CheckpointWriteError` after
        ``save_retries`` retries, the last committed checkpoint intact. ``"warn"``: log and go on.
    progress
        Show a progress bar over epochs: ``None`` shows one on a terminal or in a notebook.
    on_epoch
        Called with each :class:`EpochRecord` once its epoch is committed (with a checkpoint manager,
        usually while a later epoch runs: its commit is written then; on a ``DaskSession`` two
        epochs later, after the nodes' background flush).
    save_retries
        How often a failed save is retried before ``on_save_error`` decides.
    break_lock
        Take over the checkpoint prefix even if another runner's lock is on it. Without it, a
        lock is broken only when its holder is a process of this host that no longer exists.
    hooks
        A :class:`RunnerHooks` told of every epoch as it runs, is saved and is committed.

    Notes
    -----
    Graceful stop: while :meth:`train` runs on the main thread, the first SIGINT (Ctrl-C, a
    notebook's "interrupt kernel") or SIGTERM lets the running epoch finish, commits it, waits
    for an asynchronous save, releases the checkpoint lock and raises ``KeyboardInterrupt``
    (SIGINT) or :class:`~daskjobs.errors.JobInterruptedError` (SIGTERM). A second signal
    abandons the running epoch at once; nothing of it is committed. :meth:`request_stop` asks
    for the same from code (a hook, another thread).

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         _ = dj.Task(lambda ws: ws.__setitem__("n", 0))
    ...     _ = dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    >>> runner = dj.JobRunner(job, max_epochs=4, progress=False)
    >>> runner.train(None), [r.epoch for r in runner.history]
    (4, [1, 2, 3, 4])
    """

    def __init__(
        self,
        job: Job,
        checkpoint_manager: MultiNodeCheckpointManager | None = None,
        resume_from_epoch: int | None = None,
        upload_task_group_builder: UploadTaskGroupBuilder | None = None,
        *,
        max_epochs: int | None = None,
        max_failures: int = 3,
        on_save_error: Literal["raise", "warn"] = "raise",
        save_retries: int = 2,
        progress: bool | None = None,
        on_epoch: Callable[[EpochRecord], None] | None = None,
        break_lock: bool = False,
        hooks: RunnerHooks | None = None,
    ) -> None:
        if not isinstance(job, Job):
            raise JobDefinitionError(f"JobRunner needs a Job, got {job!r}")
        if max_epochs is not None:
            max_epochs = check_count(max_epochs, "max_epochs (or None)")
        if on_save_error not in ("raise", "warn"):
            raise JobDefinitionError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        if hooks is not None and not isinstance(hooks, RunnerHooks):
            raise JobDefinitionError(f"hooks must be a dj.RunnerHooks (a subclass of it), got {hooks!r}")
        max_failures = check_count(max_failures, "max_failures", 0)
        self.job = job
        self.checkpoint_manager = checkpoint_manager
        self.resume_from_epoch = resume_epoch(resume_from_epoch)
        self.upload_task_group_builder = upload_task_group_builder
        self.max_epochs = max_epochs
        self.max_failures = max_failures
        self.on_save_error = on_save_error
        self.save_retries = save_retries
        self.progress = progress
        self.on_epoch = on_epoch
        self.break_lock = break_lock
        self.hooks = hooks or RunnerHooks()
        self.history: list[EpochRecord] = []
        self._bytes_pending: list[int] = []
        self.dashboard_link: str | None = None
        """The Dask dashboard of the last session trained on, when it has one."""
        self._placement: Callable[[], dict[str, str]] = dict
        """The current placement (node -> worker) of the last session trained on, for the repr."""
        self._signals = GracefulStop()
        self._pipeline: CommitPipeline | None = None
        self._session: Session | None = None
        self._resume: int | None = None
        """The metadata handler's answer to ``resume_from_epoch`` (asked once per run, before it starts)."""
        self._departures = Departures()

    # -- public ---------------------------------------------------------------------------
    def train(self, session: Session | Any = None) -> int:
        """Run the job and return the number of the last epoch run.

        ``session`` may be a :class:`~daskjobs.Session`, a ``distributed.Client`` or ``None``
        (a :class:`~daskjobs.LocalSession` created and closed here). With a checkpoint manager,
        before anything is written or loaded, every checkpointed node's worker must see the prefix
        as this process does (:meth:`~daskjobs.MultiNodeCheckpointManager.check_shared`), else
        :class:`~daskjobs.errors.CheckpointStorageError` names the nodes. A ``daskjobs.*`` setting
        of the Dask config that its key cannot take raises :class:`~daskjobs.errors.ConfigError`
        before anything runs.
        """
        check_config()
        if warning := check_can_stop(self.job, self.max_epochs):
            logger.warning("%s", warning)
        manager = self.checkpoint_manager
        if manager is not None:
            manager, self._resume = prepare_manager(
                manager, self.job, self.resume_from_epoch, warn_unwritable=self.on_save_error == "warn"
            )
        own, session = not isinstance(session, Session), as_session(session)
        self._placement = placement_of(session)
        session.start_job_run(self.job.name)
        self.history = []
        self._bytes_pending = []
        self._session = session
        try:
            check_placement(session, self.job)
            self._signals.on_request = session.stop_requested
            with self._signals:
                if manager is None:
                    try:
                        return self._train(session, None)
                    except SessionLostError as exc:
                        raise self._scheduler_lost(exc, None) from exc
                with manager.writing(
                    self.job.name,
                    break_lock=self.break_lock,
                    policy=self._policy(manager),
                    on_commit=self._committed,
                    on_memory_commit=self._in_memory,
                ) as pipeline:
                    self._pipeline = pipeline
                    pipeline.remove_debris()  # what runs before this one left uncommitted
                    try:
                        return self._train(session, manager)
                    except SessionLostError as exc:
                        pipeline.settle()
                        raise self._scheduler_lost(exc, manager) from exc
                    except BaseException as exc:
                        interrupted = isinstance(exc, (KeyboardInterrupt, JobInterruptedError))
                        committed = pipeline.settle(None if interrupted else session)
                        pipeline.end_writes(session, lost=exc.nodes if isinstance(exc, NodeLostError) else ())
                        if committed and interrupted:
                            # abandoned by a second signal: the error names the epoch just committed
                            error = self._interruption(signal_of(exc), abandoned=True)
                            raise error.with_traceback(exc.__traceback__) from None
                        raise
        except AbandonedRun as exc:  # a second signal, wherever it struck: the public error of its signal
            raise self._interruption(exc.signum, abandoned=True).with_traceback(exc.__traceback__) from None
        finally:
            self._pipeline = self._session = None
            session.stop_requested(False)
            if own:
                session.close()

    __call__ = train

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask the running :meth:`train` to stop as the signal ``signum`` (``SIGTERM`` or ``SIGINT``) asks:
        the running epoch finishes and is committed, then ``train`` raises what that signal makes it
        raise (see the Notes). A second request abandons the running epoch at once, as a second signal
        does, where ``train`` handles signals (on the main thread). Safe from any thread, a hook
        included; before ``train`` starts, or after it ended, it does nothing.

        Examples
        --------
        >>> import threading
        >>> timer = threading.Timer(3600, runner.request_stop)  # doctest: +SKIP
        """
        self._signals.request(signum)

    # -- the algorithm --------------------------------------------------------------------
    def _train(self, session: Session, manager: MultiNodeCheckpointManager | None) -> int:
        """Start (or resume), loop, finish; a lost node sends the run back to the last commit."""
        job = self.job
        if manager is None:
            resume = self.resume_from_epoch
        elif self.resume_from_epoch is not None:
            resume = self._resume  # the handler answered before the run started
        else:
            resume = manager.get_resume_from_epoch_id()
        if self._pipeline is not None:
            self._pipeline.last_committed = resume
        failures = departures = 0
        lost: list[str] = []
        departed: str | None = None
        phase, epoch, stop = "start", 0, False
        dashboard = self.dashboard_link = session.dashboard_link
        if dashboard:
            logger.info("job %s: Dask dashboard at %s", job.name, dashboard)
        bar: EpochProgress | None = None
        try:
            while True:
                try:
                    if phase == "restore":
                        assert manager is not None
                        latest = self._last_committed()
                        recovery = Recovery(failures, departures, self.max_failures, lost, departed)
                        assert self._pipeline is not None
                        restored = restore(
                            session, manager, self._pipeline, self.job, latest, recovery, self.max_epochs
                        )
                        phase, resume = ("loop", resume) if restored is not None else ("start", None)
                        epoch, stop = restored or (0, False)
                        # One history record per epoch: those of the epochs run again go.
                        rerun = 1 if restored is None else epoch + 1 if stop else epoch
                        self.history = [r for r in self.history if r.epoch < rerun]
                        self._bytes_pending = [e for e in self._bytes_pending if e < rerun]
                    if phase == "start":
                        epoch, stop = start_run(
                            session,
                            job,
                            manager,
                            self._pipeline,
                            self.hooks,
                            resume,
                            failures + departures,
                            self.max_epochs,
                        )
                        self._stop_if_interrupted(manager, session)
                        phase = "loop"
                    if bar is None:
                        finite_data = (epochs_until_finished(c) for c in job.stop_conditions)
                        total = known_total(self.max_epochs, job.epoch_limit, *finite_data)
                        bar = EpochProgress(self.progress, job.name, start=epoch, total=total, dashboard=dashboard)
                    if phase == "loop":
                        epoch = self._loop(session, manager, epoch, stop, failures + departures, bar)
                        phase = "finish"
                    self._finish(session, epoch)
                    self._stop_if_interrupted(manager, session)
                    return epoch
                except NodeLostError as exc:
                    logger.debug("%s", exc)  # what was lost and how it was noticed; the recovery logs one line
                    self._settle()
                    if self._signals.requested is not None:  # a stop was asked for: nothing is run again
                        logger.info("%s", exc)
                        raise self._interruption(self._signals.requested, abandoned=True) from None
                    newest = self._newest_commit()
                    lost, departed = exc.nodes, self._departures.planned(exc, manager, newest)
                    if departed is not None:
                        departures += 1
                    else:
                        check_recoverable(manager, exc, failures, self.max_failures, newest)
                        failures += 1
                    phase = "restore"
        finally:
            if bar is not None:
                bar.close()

    def _loop(
        self,
        session: Session,
        manager: MultiNodeCheckpointManager | None,
        epoch: int,
        stop: bool,
        failures: int,
        bar: EpochProgress,
    ) -> int:
        """Run epochs from ``epoch`` until a stop condition or ``max_epochs``; return the last one."""
        while not stop:
            self.hooks.before_epoch(epoch)
            last = self._reached_max(epoch) or epoch == self.job.epoch_limit
            record, pending = run_epoch(session, self.job, self._pipeline, self.hooks, epoch, failures, last=last)
            if pending:  # an asynchronous save: its bytes come with its commit (see _committed)
                self._bytes_pending.append(epoch)
            self.history.append(record)
            bar.update(record)
            self.hooks.epoch_saved(epoch)
            if self.on_epoch is not None and self._pipeline is not None:
                self._pipeline.when_committed(partial(self._settled, len(self.history) - 1), epoch)
            elif self.on_epoch is not None:
                self.on_epoch(record)
            self._stop_if_interrupted(manager, session)
            stop = any(record.stop_values.values()) or self._reached_max(epoch)
            if not stop:
                rebalance(session, self._pipeline)
                epoch += 1
        bar.complete()
        if self._pipeline is not None:
            self._pipeline.finish(session)
        return epoch

    def _settled(self, index: int) -> None:
        """``on_epoch`` for the epoch of history record ``index``, now committed (with its bytes)."""
        if self.on_epoch is not None:
            self.on_epoch(self.history[index])

    def _committed(self, epoch: int, bytes_written: int, bytes_reused: int) -> None:
        """The commit pipeline committed ``epoch`` under the prefix: its history record is durable, a
        record whose bytes came later (a save written in the background) gets them, and the hooks
        are told."""
        index = self._record_of(epoch)
        if index is not None:
            record = self.history[index]
            changes: dict[str, Any] = {"tier": "durable"}
            if epoch in self._bytes_pending or record.tier0_bytes is not None:
                changes.update(bytes_written=bytes_written, bytes_reused=bytes_reused)
            self.history[index] = replace(record, **changes)
        if epoch in self._bytes_pending:
            self._bytes_pending.remove(epoch)
        self.hooks.epoch_committed(epoch)

    def _in_memory(self, epoch: int, tier0_bytes: dict[str, int]) -> None:
        """The commit pipeline committed ``epoch`` in cluster memory (tier 0): its history record gets
        the bytes each worker holds."""
        index = self._record_of(epoch)
        if index is not None:
            self.history[index] = replace(self.history[index], tier0_bytes=dict(tier0_bytes))

    def _record_of(self, epoch: int) -> int | None:
        """The index of ``epoch``'s history record (``None``: it has none)."""
        index = bisect.bisect_left(self.history, epoch, key=attrgetter("epoch"))  # records run in epoch order
        return index if index < len(self.history) and self.history[index].epoch == epoch else None

    def _reached_max(self, epoch: int) -> bool:
        return self.max_epochs is not None and epoch >= self.max_epochs

    def _finish(self, session: Session, epoch: int) -> None:
        job = self.job
        if self.upload_task_group_builder is not None:
            group: TaskGroup = self.upload_task_group_builder.build(epoch, self.checkpoint_manager)
            session.run_group(group, job=job.name)
        session.run_group(job.download_group, job=job.name)
        session.run_group(job.exit_group, job=job.name)

    # -- graceful stop --------------------------------------------------------------------
    def _stop_if_interrupted(self, manager: MultiNodeCheckpointManager | None, session: Session) -> None:
        """After a committed epoch: if a stop was asked for, flush, log one line and raise."""
        if self._signals.requested is None:
            return
        if self._pipeline is not None:
            self._pipeline.finish(session)
        error = self._interruption(self._signals.requested, abandoned=False)
        logger.warning("%s", error)
        raise error

    def _scheduler_lost(self, exc: SessionLostError, manager: MultiNodeCheckpointManager | None) -> BaseException:
        """What losing the scheduler raises: the error told with what survives it; while a stop asked
        for runs, the stop's own error, the running epoch abandoned (a signal to the whole batch job
        stops the scheduler too)."""
        if self._signals.requested is not None:
            logger.info("%s", exc)
            return self._interruption(self._signals.requested, abandoned=True)
        return with_last_commit(exc, manager)

    def _interruption(self, signum: int, *, abandoned: bool) -> BaseException:
        """The error an interrupted run raises; an abandoned run's is logged here (a graceful stop
        logs its own in :meth:`_stop_if_interrupted`)."""
        manager = self.checkpoint_manager
        store = None if manager is None or not manager.durable else manager.store
        url, listing = (None, None) if store is None else (store.url, store.committed_epochs)
        error = interruption(
            signum, self.job.name, self._last_committed(), url, abandoned=abandoned, list_committed=listing
        )
        if abandoned:
            logger.warning("%s", error)
        return error

    # -- helpers --------------------------------------------------------------------------
    def _last_committed(self) -> int | None:
        """The newest epoch this run committed under the prefix or resumed from (``None``: none)."""
        return None if self._pipeline is None else self._pipeline.last_committed

    def _newest_commit(self) -> int | None:
        """The newest epoch this run committed, under the prefix or (tier 0) in cluster memory."""
        return None if self._pipeline is None else self._pipeline.newest_commit

    def _settle(self) -> None:
        """A run that lost a node first commits the epochs still waiting for their commit (they
        finished); the flushes no node reported are made from here."""
        if self._pipeline is not None:
            self._pipeline.settle()

    def history_frame(self) -> Any:
        """``history`` as a pandas DataFrame, one row per epoch.

        Columns: ``epoch``, ``seconds``, ``checkpoint_seconds``, ``bytes_written``, ``bytes_reused``,
        ``recoveries``, then ``stop:<name>`` per stop condition and one column per logged metric.
        Needs pandas (``pip install "daskjobs[notebook]"``).
        """
        return history_frame(self.history)

    def plot(self) -> Any:
        """A matplotlib Figure of every metric and of epoch and checkpoint seconds over the epochs.

        Needs matplotlib (``pip install "daskjobs[notebook]"``); no pyplot state is touched.
        """
        return plot_history(self.history, title=f"job {self.job.name}")

    def __repr__(self) -> str:
        last = self.history[-1].epoch if self.history else None
        placement = self._placement()
        where = f", placement={placement}" if placement else ""
        tier0 = next((r for r in reversed(self.history) if r.tier0_bytes is not None), None)
        memory = f", tier={tier0.tier!r}, tier0_bytes={tier0.tier0_bytes}" if tier0 is not None else ""
        return (
            f"JobRunner(job={self.job.name!r}, checkpoints={self.checkpoint_manager!r}, last_epoch={last}"
            f"{memory}{where})"
        )

    def _repr_html_(self) -> str:
        where = self.checkpoint_manager.store.url if self.checkpoint_manager is not None else "no checkpoints"
        return history_html(self.history, self.job.name, where, self.dashboard_link)
