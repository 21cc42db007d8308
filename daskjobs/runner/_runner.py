"""JobRunner: runs a Job's groups on a session, checkpointing every epoch."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from .._config import check_config
from .._model.job import Job
from .._model.metrics import means
from .._model.values import check_count
from ..data import epochs_until_finished
from ..errors import JobDefinitionError, JobInterruptedError, NodeLostError, SessionLostError
from ..session import Session, as_session
from ._checks import check_can_stop, check_placement, resume_epoch, stop_condition_values
from ._history import EpochRecord, history_frame, history_html, plot_history, settle_bytes
from ._interrupt import AbandonedRun, GracefulStop, interruption, signal_of
from ._progress import EpochProgress, known_total
from ._recovery import (
    Departures,
    Recovery,
    check_recoverable,
    load_epoch,
    placement_of,
    rebalance,
    restore,
    with_last_commit,
)
from ._saving import EpochSaver, load_now, overrides, save_now
from ._writer import end_saves, holding_lock, prepare_manager

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._model.group import TaskGroup
    from ..checkpoint import MultiNodeCheckpointManager, UploadTaskGroupBuilder

logger = logging.getLogger("daskjobs")


class JobRunner:
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

    Notes
    -----
    Graceful stop: while :meth:`train` runs on the main thread, the first SIGINT (Ctrl-C, a
    notebook's "interrupt kernel") or SIGTERM lets the running epoch finish, commits it, waits
    for an asynchronous save, releases the checkpoint lock and raises ``KeyboardInterrupt``
    (SIGINT) or :class:`~daskjobs.errors.JobInterruptedError` (SIGTERM). A second signal
    abandons the running epoch at once; nothing of it is committed.

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
    ) -> None:
        if not isinstance(job, Job):
            raise JobDefinitionError(f"JobRunner needs a Job, got {job!r}")
        if max_epochs is not None:
            max_epochs = check_count(max_epochs, "max_epochs (or None)")
        if on_save_error not in ("raise", "warn"):
            raise JobDefinitionError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
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
        self.history: list[EpochRecord] = []
        self._bytes_pending: list[int] = []
        self.dashboard_link: str | None = None
        """The Dask dashboard of the last session trained on, when it has one."""
        self._placement: Callable[[], dict[str, str]] = dict
        """The current placement (node -> worker) of the last session trained on, for the repr."""
        self._signals = GracefulStop()
        self._saver: EpochSaver | None = None
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
        self._signals.requested = None
        self._saver = None
        try:
            check_placement(session, self.job)
            with self._signals:
                if manager is None:
                    return self._train(session, None)
                with holding_lock(manager, self.job.name, break_lock=self.break_lock):
                    try:
                        for leftover in manager.store.cleanup_uncommitted(manager.nodes()):
                            logger.info("removed uncommitted checkpoint leftover %s", leftover)
                        return self._train(session, manager)
                    except SessionLostError as exc:
                        self._settle()
                        raise with_last_commit(exc, manager) from exc
                    except BaseException as exc:
                        interrupted = isinstance(exc, (KeyboardInterrupt, JobInterruptedError))
                        committed = self._settle(None if interrupted else session)
                        end_saves(manager, session)
                        if committed and interrupted:
                            # abandoned by a second signal: the error names the epoch just committed
                            error = self._interruption(signal_of(exc), abandoned=True)
                            raise error.with_traceback(exc.__traceback__) from None
                        raise
        except AbandonedRun as exc:  # a second signal, wherever it struck: the public error of its signal
            raise self._interruption(exc.signum, abandoned=True).with_traceback(exc.__traceback__) from None
        finally:
            if own:
                session.close()

    __call__ = train

    def save_checkpoints(self, epoch: int, session: Session, stop_values: dict[str, bool] | None = None) -> None:
        """Save every checkpointed node's workspace as ``epoch`` and commit it.

        With an asynchronous manager the previous epoch's background save is committed first
        and this one is committed later. Failures are retried ``save_retries`` times; then
        ``on_save_error`` decides. Works before :meth:`train` too: the manager is first set up
        for the job's checkpointed nodes and name, and the prefix's writer lock is held for the
        save (and the commit of an asynchronous save, waited for), as :meth:`train` holds it.

        Raises
        ------
        CheckpointLockedError
            Another writer (a running :meth:`train`) holds the prefix; nothing was written.
        CheckpointStorageError
            A node's worker does not see the prefix as this process does (see
            :meth:`~daskjobs.MultiNodeCheckpointManager.check_shared`); nothing was written.
        """
        save_now(
            self._set_up_manager(),
            self.job.name,
            epoch,
            session,
            stop_values or {},
            save_retries=self.save_retries,
            on_save_error=self.on_save_error,
            break_lock=self.break_lock,
        )

    def load_blobs_from_checkpoints(self, blob_names: list[str], epoch: int, session: Session) -> bool:
        """Load ``blob_names`` of ``epoch`` into every checkpointed node; ``False`` (nothing loaded)
        if any node has no committed checkpoint of that epoch (works before :meth:`train` too)."""
        return load_now(self._set_up_manager(), self.job.nodes_to_checkpoint(), blob_names, epoch, session)

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
        if manager is not None:
            self._saver = EpochSaver(
                manager,
                job.name,
                save_retries=self.save_retries,
                on_save_error=self.on_save_error,
                last_committed=resume,
            )
        failures = departures = 0
        lost: list[str] = []
        departed: str | None = None
        phase, epoch, stop = "start", 0, False
        dashboard = self.dashboard_link = getattr(getattr(session, "client", None), "dashboard_link", None)
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
                        restored = restore(session, manager, self.job, latest, recovery, self.max_epochs)
                        phase, resume = ("loop", resume) if restored is not None else ("start", None)
                        epoch, stop = restored or (0, False)
                        # One history record per epoch: those of the epochs run again go.
                        rerun = 1 if restored is None else epoch + 1 if stop else epoch
                        self.history = [r for r in self.history if r.epoch < rerun]
                        self._bytes_pending = [e for e in self._bytes_pending if e < rerun]
                    if phase == "start":
                        epoch, stop = self._start(session, manager, resume, failures + departures)
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
                    self._settle()
                    lost, departed = exc.nodes, self._departures.planned(exc, manager, self._last_committed())
                    if departed is not None:
                        departures += 1
                    else:
                        check_recoverable(manager, exc, failures, self.max_failures, self._last_committed())
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
            record = self._run_epoch(session, epoch, failures)
            self.history.append(record)
            self._settle_bytes()
            bar.update(record)
            if self.on_epoch is not None and self._saver is not None:
                self._saver.when_committed(partial(self._committed, len(self.history) - 1))
            elif self.on_epoch is not None:
                self.on_epoch(record)
            self._stop_if_interrupted(manager, session)
            stop = any(record.stop_values.values()) or self._reached_max(epoch)
            if not stop:
                rebalance(session, self._saver)
                epoch += 1
        bar.complete()
        if self._saver is not None:
            self._saver.flush(session)
            self._settle_bytes()
        return epoch

    def _committed(self, index: int) -> None:
        """``on_epoch`` for the epoch of history record ``index``, now committed (with its bytes)."""
        self._settle_bytes()
        if self.on_epoch is not None:
            self.on_epoch(self.history[index])

    def _reached_max(self, epoch: int) -> bool:
        return self.max_epochs is not None and epoch >= self.max_epochs

    def _run_epoch(self, session: Session, epoch: int, failures: int) -> EpochRecord:
        """Run one epoch and save it: inside the epoch's graph when possible, else as its own group."""
        job = self.job
        started = time.perf_counter()
        saver = self._saver
        last = self._reached_max(epoch) or epoch == job.epoch_limit
        hooks = None if saver is None else saver.hooks(epoch, job.epoch_group.used_nodes(), session, last=last)
        finished: dict[str, Any] = {}
        try:
            sums = session.run_group(
                job.epoch_group,
                job=job.name,
                epoch=epoch,
                attempt=failures,
                finish=hooks or None,
                finished=finished,
                meanwhile=None if saver is None else saver.meanwhile,
            )
        except Exception:
            if saver is not None and hooks and finished:
                saver.salvage(epoch, finished)
            raise
        finally:
            if saver is not None:
                saver.check_meanwhile(epoch)
        elapsed = time.perf_counter() - started
        try:
            values, metrics = stop_condition_values(self.job.stop_conditions), means(sums)
        except Exception:
            if saver is not None and hooks:
                saver.drop(epoch, finished)
            raise
        if saver is None:
            saved, (written, reused) = 0.0, (0, 0)
        else:
            if hooks is None:
                saved = saver.save(epoch, session, values, metrics)
            elif not hooks:
                saved = 0.0
            else:
                saved = saver.accept(epoch, session, finished, values, metrics)
            known = saver.bytes(epoch)
            if known is None:  # an asynchronous save: its figures come with its commit (see _settle_bytes)
                self._bytes_pending.append(epoch)
            written, reused = known or (0, 0)
        return EpochRecord(epoch, elapsed, saved, written, reused, values, metrics, failures)

    def _settle_bytes(self) -> None:
        """Give the history records of asynchronously saved epochs the bytes their commits report."""
        if self._bytes_pending and self._saver is not None:
            settle_bytes(self.history, self._bytes_pending, self._saver.manager.committed_bytes)

    def _start(
        self, session: Session, manager: MultiNodeCheckpointManager | None, resume: int | None, failures: int
    ) -> tuple[int, bool]:
        """Init from scratch (saving epoch 0) or restore ``resume``; return the first epoch and
        whether the job had already stopped."""
        job = self.job
        nodes = job.nodes_to_checkpoint()
        if manager is not None:  # before anything is written or loaded: the nodes see the driver's prefix
            manager.check_shared(session)
        if resume is None:
            if self._saver is None:
                session.run_group(job.init_group, job=job.name, attempt=failures)
            else:
                self._saver.run_init(session, job.init_group, nodes, attempt=failures)
            return 1, False
        if manager is None:
            logger.info("resuming at epoch %d without a checkpoint manager: init group skipped, nothing loaded", resume)
            return (resume, True) if self._reached_max(resume) else (resume + 1, False)
        newer = manager.resume_older(resume)
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
        return load_epoch(session, manager, job.name, resume, failures, self.max_epochs)

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
        if self._saver is not None:
            self._saver.flush(session)
        error = self._interruption(self._signals.requested, abandoned=False)
        logger.warning("%s", error)
        raise error

    def _interruption(self, signum: int, *, abandoned: bool) -> BaseException:
        """The error an interrupted run raises; an abandoned run's is logged here (a graceful stop
        logs its own in :meth:`_stop_if_interrupted`)."""
        store = None if self.checkpoint_manager is None else self.checkpoint_manager.store
        url, listing = (None, None) if store is None else (store.url, store.committed_epochs)
        error = interruption(
            signum, self.job.name, self._last_committed(), url, abandoned=abandoned, list_committed=listing
        )
        if abandoned:
            logger.warning("%s", error)
        return error

    # -- helpers --------------------------------------------------------------------------
    def _last_committed(self) -> int | None:
        """The newest epoch this run committed or resumed from (``None``: none)."""
        return None if self._saver is None else self._saver.last_committed

    def _settle(self, session: Session | None = None) -> bool:
        """A failed run first commits the epochs still waiting for their commit (they finished),
        asking the nodes through ``session`` for the flushes not yet reported; ``True`` if it did.
        The history records of the epochs it committed get their bytes."""
        committed = self._saver is not None and self._saver.settle(session)
        self._settle_bytes()
        return committed

    def _set_up_manager(self) -> MultiNodeCheckpointManager:
        """The checkpoint manager, told the job's checkpointed nodes and name (as :meth:`train` does)."""
        manager = self.checkpoint_manager
        if manager is None:
            raise JobDefinitionError("this JobRunner has no checkpoint manager")
        manager.set_params(nodes=self.job.nodes_to_checkpoint(), job_name=self.job.name)
        return manager

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
        return f"JobRunner(job={self.job.name!r}, checkpoints={self.checkpoint_manager!r}, last_epoch={last}{where})"

    def _repr_html_(self) -> str:
        where = self.checkpoint_manager.store.url if self.checkpoint_manager is not None else "no checkpoints"
        return history_html(self.history, self.job.name, where, self.dashboard_link)
