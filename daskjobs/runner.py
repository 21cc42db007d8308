"""JobRunner: runs a Job's groups on a session, checkpointing every epoch."""

from __future__ import annotations

import html
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._model.job import Job
from ._progress import EpochProgress, known_total
from .checkpoint._lock import local_holder
from .errors import (
    CheckpointLockedError,
    CheckpointWriteError,
    JobDefinitionError,
    NodeLostError,
    StopConditionError,
)
from .history import EpochRecord, history_frame, history_rows, means, plot_history
from .session import LocalSession, Session

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._model.group import TaskGroup
    from ._model.task import TaskOutput
    from .checkpoint import MultiNodeCheckpointManager, UploadTaskGroupBuilder

logger = logging.getLogger("daskjobs")


def _resolve_session(session: Session | Any) -> tuple[bool, Session]:
    """The session to use and whether this runner created it (and so closes it)."""
    if isinstance(session, Session):
        return False, session
    if session is None:
        return True, LocalSession()
    from .session import as_session

    return True, as_session(session)


def stop_value(output: TaskOutput, value: Any) -> bool:
    """Check that a stop condition produced one boolean and return it."""
    name = output.names[0]
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.size == 1:
        return bool(value.reshape(()))
    kind = f"array of dtype {value.dtype} and shape {value.shape}" if isinstance(value, np.ndarray) else type(value)
    raise StopConditionError(f"stop condition {name!r} must be a bool or a one-element bool array, got {kind}")


class JobRunner:
    """Runs a :class:`~daskjobs.Job`: init, epochs until a stop condition is true, download, exit.

    Parameters
    ----------
    job
        The job to run.
    checkpoint_manager
        Saves every epoch (epoch 0 right after init) and resumes from the latest committed one.
    resume_from_epoch
        Resume from this committed epoch instead of the latest.
    upload_task_group_builder
        Its ``build(last_epoch, manager)`` group runs once after the loop.
    max_epochs
        Stop after this absolute epoch number even if no stop condition is true.
    max_failures
        How many node losses to recover from (restoring all nodes from the latest committed
        epoch) before giving up with :class:`~daskjobs.errors.NodeLostError`.
    on_save_error
        ``"raise"`` (default): stop with :class:`~daskjobs.errors.CheckpointWriteError` after
        ``save_retries`` retries, the last committed checkpoint intact. ``"warn"``: log and go on.
    progress
        Show a progress bar over epochs: ``None`` shows one on a terminal or in a notebook.
    on_epoch
        Called with each :class:`EpochRecord` once its epoch is checkpointed.
    break_lock
        Take over the checkpoint prefix even if another runner's lock is on it. Without it, a
        lock is broken only when its holder is a process of this host that no longer exists.

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
        if max_epochs is not None and (
            isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 1
        ):
            raise JobDefinitionError(f"max_epochs must be a positive int or None, got {max_epochs!r}")
        if on_save_error not in ("raise", "warn"):
            raise JobDefinitionError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        if not isinstance(max_failures, int) or max_failures < 0:
            raise JobDefinitionError(f"max_failures must be an int >= 0, got {max_failures!r}")
        self.job = job
        self.checkpoint_manager = checkpoint_manager
        self.resume_from_epoch = resume_from_epoch
        self.upload_task_group_builder = upload_task_group_builder
        self.max_epochs = max_epochs
        self.max_failures = max_failures
        self.on_save_error = on_save_error
        self.save_retries = save_retries
        self.progress = progress
        self.on_epoch = on_epoch
        self.break_lock = break_lock
        self.history: list[EpochRecord] = []
        self.dashboard_link: str | None = None
        """The Dask dashboard of the last session trained on, when it has one."""

    # -- public ---------------------------------------------------------------------------
    def train(self, session: Session | Any = None) -> int:
        """Run the job and return the number of the last epoch run.

        ``session`` may be a :class:`~daskjobs.Session`, a ``distributed.Client`` or ``None``
        (a :class:`~daskjobs.LocalSession` created and closed here).
        """
        if not self.job.stop_conditions and self.max_epochs is None:
            raise JobDefinitionError(
                f"job {self.job.name!r} has no stop condition and no max_epochs: it would never stop; "
                "add job.add_stop_condition(...), dj.epoch_limiter(job, n) or JobRunner(..., max_epochs=n)"
            )
        own, session = _resolve_session(session)
        manager = self.checkpoint_manager
        self.history = []
        try:
            if manager is not None:
                manager.set_params(nodes=self.job.nodes_to_checkpoint(), job_name=self.job.name)
                manager.store.check_writable()
                self._acquire_lock(manager)
            try:
                if manager is not None:
                    for leftover in manager.store.cleanup_uncommitted(manager.nodes()):
                        logger.info("removed uncommitted checkpoint leftover %s", leftover)
                return self._train(session)
            finally:
                if manager is not None:
                    self._release_lock(manager)
        finally:
            if own:
                session.close()

    __call__ = train

    def save_checkpoints(self, epoch: int, session: Session, stop_values: dict[str, bool] | None = None) -> None:
        """Save every checkpointed node's workspace as ``epoch`` and commit it.

        With an asynchronous manager the previous epoch's background save is committed first
        and this one is committed later. Failures are retried ``save_retries`` times; then
        ``on_save_error`` decides.
        """
        self._save(epoch, session, stop_values or {})

    def _save(
        self, epoch: int, session: Session, stop_values: dict[str, bool], metrics: dict[str, float] | None = None
    ) -> tuple[float, int]:
        """:meth:`save_checkpoints`; returns the seconds it took and the bytes it committed."""
        manager = self._require_manager()
        if not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d not saved", epoch)
            return 0.0, 0
        started = time.perf_counter()
        manager.last_commit_bytes = 0
        self._flush(session)

        def save() -> None:
            session.run_group(manager.save(epoch), job=self.job.name, epoch=epoch)
            manager.write_checkpoint_metadata(
                epoch,
                stop_values=stop_values,
                timings={"save_seconds": time.perf_counter() - started},
                metrics=metrics,
            )
            if manager.pending_epoch() is None:
                manager.report_checkpoint_stats("checkpoint_save")

        self._with_retries(epoch, save)
        return time.perf_counter() - started, manager.last_commit_bytes

    def _flush(self, session: Session) -> None:
        """Commit the manager's asynchronous save in flight, if any."""
        manager = self.checkpoint_manager
        pending = None if manager is None else manager.pending_epoch()
        if pending is not None:
            self._with_retries(pending, lambda: manager.flush(session), give_up=manager.discard_pending)

    def _with_retries(
        self, epoch: int, attempt: Callable[[], object], give_up: Callable[[], None] | None = None
    ) -> None:
        manager = self._require_manager()
        error: BaseException | None = None
        for number in range(self.save_retries + 1):
            try:
                attempt()
                return
            except (NodeLostError, CheckpointLockedError):
                raise
            except Exception as exc:
                error = exc
                logger.warning(
                    "saving epoch %d failed (attempt %d of %d): %s", epoch, number + 1, self.save_retries + 1, exc
                )
                time.sleep(min(0.05 * 2**number, 1.0))
        if give_up is not None:
            give_up()
        message = f"could not write the checkpoint of epoch {epoch} under {manager.store.url}: {error}"
        if self.on_save_error == "raise":
            raise CheckpointWriteError(f"{message}; the last committed checkpoint is intact") from error
        logger.warning("%s; continuing (on_save_error='warn')", message)

    def load_blobs_from_checkpoints(self, blob_names: list[str], epoch: int, session: Session) -> bool:
        """Load ``blob_names`` of ``epoch`` into every checkpointed node; ``False`` (nothing loaded)
        if any node has no committed checkpoint of that epoch."""
        manager = self._require_manager()
        own, session = _resolve_session(session)
        try:
            loaded = manager.load_blobs_locally(self.job.nodes_to_checkpoint(), blob_names, epoch, session)
        finally:
            if own:
                session.close()
        manager.report_checkpoint_stats("checkpoint_partial_load")
        return loaded

    # -- the algorithm --------------------------------------------------------------------
    def _train(self, session: Session) -> int:
        manager = self.checkpoint_manager
        job = self.job
        resume = manager.get_resume_from_epoch_id(self.resume_from_epoch) if manager else self.resume_from_epoch
        recoveries = 0
        epoch, stop = self._start(session, resume)
        dashboard = self.dashboard_link = getattr(getattr(session, "client", None), "dashboard_link", None)
        if dashboard:
            logger.info("job %s: Dask dashboard at %s", job.name, dashboard)
        total = known_total(self.max_epochs, job.epoch_limit)
        bar = EpochProgress(self.progress, job.name, start=epoch, total=total, dashboard=dashboard)
        try:
            while not stop:
                started = time.perf_counter()
                try:
                    sums = session.run_group(job.epoch_group, job=job.name, epoch=epoch, attempt=recoveries)
                    values = self._stop_values()
                    elapsed = time.perf_counter() - started
                    metrics = means(sums)
                    saved = self._save(epoch, session, values, metrics) if manager is not None else (0.0, 0)
                except NodeLostError as exc:
                    epoch = self._recover(session, exc, recoveries)
                    recoveries += 1
                    continue
                record = EpochRecord(epoch, elapsed, saved[0], saved[1], 0, values, metrics, recoveries)
                self.history.append(record)
                bar.update(record)
                if self.on_epoch is not None:
                    self.on_epoch(record)
                stop = any(values.values()) or (self.max_epochs is not None and epoch >= self.max_epochs)
                if not stop:
                    epoch += 1
            bar.complete()
            self._flush(session)
        finally:
            bar.close()
        self._finish(session, epoch)
        return epoch

    def _start(self, session: Session, resume: int | None) -> tuple[int, bool]:
        """Init from scratch (saving epoch 0) or restore ``resume``; return the first epoch and
        whether the job had already stopped."""
        manager, job = self.checkpoint_manager, self.job
        nodes = job.nodes_to_checkpoint()
        if resume is None:
            session.run_group(job.init_group, job=job.name)
            if manager is not None:
                session.run_group(manager.init(nodes), job=job.name)
                self._save(0, session, {})
            return 1, False
        if manager is None:
            logger.info("resuming at epoch %d without a checkpoint manager: init group skipped, nothing loaded", resume)
            return resume + 1, False
        manager.discard_after(resume)
        session.run_group(manager.init(nodes, retrieve_from_epoch=resume), job=job.name)
        session.run_group(manager.load(resume), job=job.name)
        manager.report_checkpoint_stats("checkpoint_load")
        stopped = [name for name, value in manager.stop_values(resume).items() if value]
        if stopped:
            logger.info("epoch %d was committed with stop conditions %s true: no further epoch runs", resume, stopped)
            return resume, True
        return resume + 1, False

    def _stop_values(self) -> dict[str, bool]:
        values: dict[str, bool] = {}
        for i, output in enumerate(self.job.stop_conditions):
            key = output.names[0] if output.names[0] not in values else f"{output.names[0]}#{i}"
            values[key] = stop_value(output, output.fetch())
        return values

    def _recover(self, session: Session, exc: NodeLostError, recoveries: int) -> int:
        """Wait for every node, restore all of them from the latest commit; return the epoch to run.

        ``recoveries`` counts the earlier recoveries of this run; the restore runs as attempt
        ``recoveries + 1``.
        """
        manager = self.checkpoint_manager
        latest = manager.store.committed_epochs()[-1:] if manager is not None else []
        if manager is None or recoveries >= self.max_failures or not latest:
            where = f"last committed epoch {latest[0]}" if latest else "no committed epoch"
            raise NodeLostError(f"{exc} — giving up after {recoveries} recoveries ({where})", exc.nodes) from exc
        manager.discard_pending()
        logger.warning(
            "node lost (%s); restoring all nodes from epoch %d (recovery %d of %d)",
            exc,
            latest[0],
            recoveries + 1,
            self.max_failures,
        )
        wait = getattr(session, "wait_for_nodes", None)
        if wait is not None:
            wait(self.job.nodes())
        session.forget_tokens()
        session.run_group(manager.load(latest[0]), job=self.job.name, attempt=recoveries + 1)
        return latest[0] + 1

    def _finish(self, session: Session, epoch: int) -> None:
        job = self.job
        if self.upload_task_group_builder is not None:
            group: TaskGroup = self.upload_task_group_builder.build(epoch, self.checkpoint_manager)
            session.run_group(group, job=job.name)
        session.run_group(job.download_group, job=job.name)
        session.run_group(job.exit_group, job=job.name)

    # -- helpers --------------------------------------------------------------------------
    def _require_manager(self) -> MultiNodeCheckpointManager:
        if self.checkpoint_manager is None:
            raise JobDefinitionError("this JobRunner has no checkpoint manager")
        return self.checkpoint_manager

    def _acquire_lock(self, manager: MultiNodeCheckpointManager) -> None:
        manager.store.acquire_lock(self._lock_holder(), break_lock=self.break_lock)

    @staticmethod
    def _release_lock(manager: MultiNodeCheckpointManager) -> None:
        try:
            manager.store.release_lock()
        except Exception as exc:
            logger.warning(
                "could not release the writer lock of %s: %s; run 'daskjobs checkpoints unlock %s'",
                manager.store.url,
                exc,
                manager.store.url,
            )

    def _lock_holder(self) -> dict[str, Any]:
        return local_holder(self.job.name)

    def history_frame(self) -> Any:
        """:attr:`history` as a pandas DataFrame, one row per epoch.

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
        return f"JobRunner(job={self.job.name!r}, checkpoints={self.checkpoint_manager!r}, last_epoch={last})"

    def _repr_html_(self) -> str:
        rows = history_rows(self.history[-20:])
        columns = list(dict.fromkeys(key for row in rows for key in row))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{_cell(row.get(c, ''))}</td>" for c in columns) + "</tr>" for row in rows
        )
        where = self.checkpoint_manager.store.url if self.checkpoint_manager is not None else "no checkpoints"
        dashboard = self.dashboard_link
        link = f' &mdash; <a href="{html.escape(dashboard)}" target="_blank">Dask dashboard</a>' if dashboard else ""
        shown = f", last {len(rows)} shown" if len(self.history) > len(rows) else ""
        return (
            f"<b>JobRunner</b> for job {html.escape(self.job.name)} &mdash; {len(self.history)} epochs run{shown}, "
            f"checkpoints: <code>{html.escape(where)}</code>{link}"
            f"<table><tr>{head}</tr>{body}</table>"
        )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))
