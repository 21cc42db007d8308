"""Retention: which committed epochs a prefix keeps after a commit (newest, last k, every n, best k)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..._model.values import check_count
from ...errors import CheckpointLockedError, JobDefinitionError
from .._storage.deadline import Deadline
from .commits import RetiredEpoch
from .store import CheckpointStore

if TYPE_CHECKING:
    from .._format.documents import CommitRecord, CommittedEntry

logger = logging.getLogger("daskjobs")

DEFAULT_BEST_METRIC = "loss"
"""The metric best-k retention ranks by when ``keep_best`` is given without ``best_metric``."""


def check_retention(
    keep_last: int | None, keep_every: int | None, keep_best: int | None, best_metric: str | None, best_mode: str
) -> None:
    """Check a manager's retention options.

    Raises
    ------
    JobDefinitionError
        A count that is not a positive int or ``None``, a ``best_mode`` other than ``"min"`` or
        ``"max"``, or ``keep_best`` with a ``best_metric`` that is not a non-empty ``str``.
    """
    for label, value in (("keep_last", keep_last), ("keep_every", keep_every), ("keep_best", keep_best)):
        if value is not None:
            check_count(value, f"{label} (or None)")
    if best_mode not in ("min", "max"):
        raise JobDefinitionError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if keep_best is not None and not (isinstance(best_metric, str) and best_metric):
        raise JobDefinitionError(
            f"keep_best={keep_best} needs best_metric, the name of a metric logged with ws.log, got {best_metric!r}"
        )


DEFAULT_FULL_EVERY = 10
"""A delta manager writes every epoch divisible by this in full (see :func:`writes_in_full`)."""


def check_full_every(full_every: object) -> int:
    """``full_every`` checked: an int >= 0 (``0``: only epoch 0 and the epochs ``keep_every`` keeps).

    Raises
    ------
    DefinitionTypeError
        Not an int (``True`` and ``10.0`` included).
    JobDefinitionError
        Negative.
    """
    return check_count(full_every, "full_every", minimum=0)


def writes_in_full(epoch: int, full_every: int, keep_every: int | None) -> bool:
    """Whether a save of ``epoch`` is written in full: sharing no file with an earlier epoch, so
    that a damaged file spoils at most the epochs from the last full one to the next.

    Full: epoch 0, every epoch divisible by ``full_every`` (``0``: none of those), and every epoch
    ``keep_every`` keeps (an epoch kept for long is not one file away from loss).

    Examples
    --------
    >>> [e for e in range(25) if writes_in_full(e, 10, None)]
    [0, 10, 20]
    >>> [e for e in range(25) if writes_in_full(e, 0, 8)]
    [0, 8, 16, 24]
    """
    return (
        epoch == 0
        or (full_every > 0 and epoch % full_every == 0)
        or (keep_every is not None and epoch % keep_every == 0)
    )


def best_epochs(values: dict[int, float | None], mode: str) -> list[int]:
    """Epochs ordered best first by their metric value (``None``: no value, never best); ties: earlier first.

    Examples
    --------
    >>> best_epochs({1: 0.5, 2: 0.25, 3: None, 4: 0.25}, "min")
    [2, 4, 1]
    >>> best_epochs({1: 0.5, 2: 0.25}, "max")
    [1, 2]
    """
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * value, epoch) for epoch, value in values.items() if value is not None]
    return [epoch for _, epoch in sorted(scored)]


def best_of(
    store: CheckpointStore,
    epochs: list[int],
    known: dict[int, float | None],
    metric: str,
    mode: str,
    keep: int,
) -> list[int]:
    """The ``keep`` best of ``epochs`` by ``metric``; each commit record is read once per manager.

    ``known`` (epoch: metric value) is the cache: updated in place to hold exactly ``epochs``.
    """
    values = {e: known[e] if e in known else store.read_commit(e).get("metrics", {}).get(metric) for e in epochs}
    known.clear()
    known.update(values)
    return best_epochs(values, mode)[:keep]


def kept_epochs(epochs: list[int], keep_last: int | None, keep_every: int | None, best: Iterable[int] = ()) -> set[int]:
    """Which of the committed ``epochs`` (ascending) retention keeps: always the newest, the last
    ``keep_last``, every epoch divisible by ``keep_every`` and ``best``.

    Examples
    --------
    >>> sorted(kept_epochs([0, 1, 2, 3, 4, 5], keep_last=2, keep_every=2))
    [0, 2, 4, 5]
    """
    keep = set(epochs[-1:]) | set(best)
    if keep_last is not None:
        keep.update(epochs[-keep_last:])
    if keep_every is not None:
        keep.update(e for e in epochs if e % keep_every == 0)
    return keep


def apply_retention(
    store: CheckpointStore,
    newest: int,
    keep_last: int | None,
    keep_every: int | None,
    best: Callable[[list[int]], list[int]] | None,
    retired: RetiredGroups | None = None,
    written: Mapping[int, CommitRecord] | None = None,
    committed: list[int] | None = None,
) -> list[int]:
    """Delete committed epochs older than ``newest`` that retention does not keep; failures are logged warnings.

    Kept: ``newest``, the last ``keep_last``, every epoch divisible by ``keep_every`` and the
    epochs ``best`` returns for the committed ones. All ``None``: everything is kept.

    With ``retired``, the epochs are only un-committed (not yet durably: the caller syncs the
    commit folder) and added to it; their groups are deleted later (see :class:`RetiredGroups`).
    ``written``: commit records the caller wrote itself, by epoch (not read again). ``committed``:
    the committed epochs when the caller knows them (it holds the lock), else they are listed.
    Returns the committed epochs afterwards (ascending).
    """
    if keep_last is None and keep_every is None and best is None:
        return []
    try:
        epochs = sorted(committed) if committed is not None else store.committed_epochs()
        kept = best(epochs) if best is not None else []
    except OSError as exc:
        logger.warning("retention: could not list the epochs under %s: %s", store.url, exc)
        return []
    keep = kept_epochs(epochs, keep_last, keep_every, kept) | {newest}
    left = list(epochs)
    for epoch in epochs:
        if epoch < newest and epoch not in keep:
            try:
                record = (written or {}).get(epoch) or store.read_commit(epoch)
                if retired is not None:
                    retired.add(store.retire_epoch(epoch, record["nodes"], sync_folder=False, record=record))
                    left.remove(epoch)
                    continue
                store.remove_retired(store.retire_epoch(epoch, record["nodes"], record=record))
            except Exception as exc:  # the new epoch is committed: never fail the save for this
                logger.warning("retention: could not delete epoch %d under %s: %s", epoch, store.url, exc)
                if isinstance(exc, CheckpointLockedError):
                    return left
                continue
            left.remove(epoch)
            logger.info("retention: deleted epoch %d under %s", epoch, store.url)
    return left


class RetiredGroups:
    """Epochs retention un-committed whose node groups are still to be deleted.

    While a runner holds the lock, retention only un-commits (one fsync with the commit) and the
    groups are deleted later by :meth:`remove`: in a background thread while the next epoch runs,
    and finally before the runner releases the lock. Until then they are uncommitted debris,
    which the next run's cleanup also removes.
    """

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, CommittedEntry | None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._deleter: tuple[threading.Thread, _Stop] | None = None
        self._store: CheckpointStore | None = None
        self._deleting = False
        self._epoch: int | None = None
        """The epoch whose groups are being deleted, or were last (for messages)."""

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._pending) or self._deleting

    def add(self, retired: RetiredEpoch) -> None:
        """Remember ``retired`` (from :meth:`CheckpointStore.retire_epoch`) for deletion."""
        with self._lock:
            self._pending[retired.epoch] = dict(retired.entries)

    def hand_out(self, nodes: list[str]) -> dict[str, tuple[tuple[int, CommittedEntry | None], ...]]:
        """Per node of ``nodes``, its pending groups as ``(epoch, entry)``, for the node to delete
        itself (see :meth:`~daskjobs.MultiNodeCheckpointManager.finish_hooks`); those are no
        longer pending here (groups of other nodes stay)."""
        out: dict[str, list[tuple[int, CommittedEntry | None]]] = {node: [] for node in nodes}
        with self._lock:
            for epoch, entries in sorted(self._pending.items()):
                for node in [n for n in entries if n in out]:
                    out[node].append((epoch, entries.pop(node)))
            self._pending = {epoch: entries for epoch, entries in self._pending.items() if entries}
        return {node: tuple(groups) for node, groups in out.items()}

    def remove(self, store: CheckpointStore, *, wait: bool = True) -> None:
        """Delete the pending groups; ``wait=False``: in the background (the caller goes on; groups
        added while a deletion runs wait for it). ``wait=True`` first ends the background thread.
        Failures are logged warnings; after a lost lock nothing more is deleted.

        One thread serves all background deletions of a run: starting a thread per epoch costs
        as much CPU as deleting a small epoch's groups. ``wait=True`` waits for it at most
        ``daskjobs.storage-timeout``: a deletion still running then (its storage hangs) is left to
        finish the epoch it deletes and stop, a warning says so, and nothing more is deleted here
        (what is left is uncommitted: the next run's cleanup removes it).
        """
        if wait:
            if self._stop(store):
                self._remove(store)
            return
        with self._lock:
            if not self._pending:
                return
            self._store = store
            if self._deleter is None:
                stop = _Stop(threading.Event(), threading.Event())
                thread = threading.Thread(target=self._serve, args=(stop,), name="daskjobs-retention", daemon=True)
                self._deleter = (thread, stop)
                thread.start()
            self._wake.notify()

    def _serve(self, stop: _Stop) -> None:
        while True:
            with self._lock:
                while not self._pending and not stop.asked.is_set():
                    self._wake.wait()
                if stop.asked.is_set():
                    return
                store, self._deleting = self._store, True
            assert store is not None  # set before the thread started
            try:
                self._remove(store, stop.abandoned)
            finally:
                with self._lock:
                    self._deleting = False

    def _stop(self, store: CheckpointStore) -> bool:
        """End the background thread after the deletion it runs, if any, within
        ``daskjobs.storage-timeout``; ``False`` (a warning) if it still deletes then."""
        with self._lock:
            deleter, self._deleter = self._deleter, None
            if deleter is not None:
                deleter[1].asked.set()
            self._wake.notify()
        if deleter is None:
            return True
        thread, stop = deleter
        deadline = Deadline()
        if deadline.joined(thread):
            return True
        stop.abandoned.set()  # it stops after the epoch it deletes
        what = f"retention: deleting the groups of epoch {self._epoch} (un-committed) under {store.url}"
        logger.warning("%s; they are left to the next run's cleanup", deadline.message(what))
        return False

    def _remove(self, store: CheckpointStore, abandoned: threading.Event | None = None) -> None:
        with self._lock:
            doomed, self._pending = self._pending, {}
        for epoch, entries in sorted(doomed.items()):
            if abandoned is not None and abandoned.is_set():
                return
            self._epoch = epoch
            try:
                store.remove_retired(RetiredEpoch(epoch, entries))
            except Exception as exc:
                logger.warning("retention: could not delete epoch %d under %s: %s", epoch, store.url, exc)
                if isinstance(exc, CheckpointLockedError):
                    return
                continue
            logger.info("retention: deleted epoch %d under %s", epoch, store.url)


class _Stop(NamedTuple):
    """How the retention deleter is told to stop: ``asked`` once it has no deletion to do, ``abandoned``
    after the epoch it deletes (a wait for it ran out)."""

    asked: threading.Event
    abandoned: threading.Event


def retention_warning(apply: Callable[[int], None], newest: int, url: str) -> None:
    """Run ``apply(newest)``; a failure is a warning (``newest`` is committed already), retried next commit."""
    try:
        apply(newest)
    except Exception as exc:
        logger.warning(
            "epoch %d is committed, but retention under %s failed: %s; it is retried after the next commit",
            newest,
            url,
            exc,
        )


_WRITTEN_KEPT = 16
"""Commit records of the last epochs a runner committed, kept so retention reads no file for them."""


class Retention:
    """A manager's retention: the policy (``keep_last``, ``keep_every``, best-k), what it already
    knows of committed epochs, and the groups of un-committed epochs still to delete.

    Parameters are those of :class:`~daskjobs.MultiNodeCheckpointManager` (checked here).
    """

    def __init__(
        self,
        keep_last: int | None,
        keep_every: int | None,
        keep_best: int | None,
        best_metric: str | None,
        best_mode: str,
    ) -> None:
        if keep_best is not None and best_metric is None:
            best_metric = DEFAULT_BEST_METRIC
        check_retention(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.keep_best, self.best_metric, self.best_mode = keep_best, best_metric, best_mode
        self.retired = RetiredGroups()
        self._best_values: dict[int, float | None] = {}
        self._written: dict[int, CommitRecord] = {}
        self._committed: list[int] | None = None
        """The committed epochs while a runner holds the lock (no other writer): listed once, then
        kept up to date here, so a commit costs no listing of the commit records."""

    @property
    def deletes(self) -> bool:
        """Whether this policy ever deletes an epoch."""
        return self.keep_last is not None or self.keep_every is not None or self.keep_best is not None

    def describe(self) -> dict[str, object]:
        """The policy, for a manager's HTML view."""
        best = self.keep_best and f"{self.keep_best} by {self.best_mode} {self.best_metric}"
        return {"keep_last": self.keep_last, "keep_every": self.keep_every, "keep_best": best}

    def stamp(self, record: CommitRecord) -> None:
        """Name the best-k metric and mode in a commit record about to be written."""
        if self.best_metric is not None:
            record["best"] = {"metric": self.best_metric, "mode": self.best_mode}

    def committed(self, record: CommitRecord, *, mine: bool) -> None:
        """Remember what retention needs of a commit just written (``mine``: while holding the lock)."""
        epoch = record["epoch"]
        if mine:
            self._written = dict(list(self._written.items())[-_WRITTEN_KEPT:]) | {epoch: record}
            if self._committed is not None and epoch not in self._committed:
                self._committed.append(epoch)
        else:
            self._committed = None
        # best_of keeps it to the committed epochs; else it would only grow
        if self.keep_best is not None and self.best_metric is not None:
            self._best_values[epoch] = record["metrics"].get(self.best_metric)

    def apply(
        self,
        store: CheckpointStore,
        newest: int,
        *,
        deferred: bool,
        keeping: Collection[int] = (),
    ) -> None:
        """Delete (``deferred``: only un-commit, see :class:`RetiredGroups`) the committed epochs
        older than ``newest`` the policy drops, but those of ``keeping`` (saves in flight reuse them)."""
        if not self.deletes:
            return
        best: Callable[[list[int]], list[int]] | None = None
        if self.keep_best is not None and self.best_metric is not None:
            best = functools.partial(
                best_of,
                store,
                known=self._best_values,
                metric=self.best_metric,
                mode=self.best_mode,
                keep=self.keep_best,
            )
        # Deferred too, ``keeping`` holds back the epochs saves not yet committed link chunks of:
        # their groups are deleted by tidy() while the next epoch runs.
        retired, written = (self.retired, self._written) if deferred else (None, None)
        committed = self._committed if deferred else None
        left = apply_retention(
            store, newest, self.keep_last, self.keep_every, _also(best, keeping), retired, written, committed
        )
        self._committed = left if deferred and left else None

    def tidy(self, store: CheckpointStore, *, final: bool, by_nodes: bool = False) -> None:
        """Delete the retired groups in the background (``by_nodes``: leave them to the nodes'
        next hooks); ``final``: here and now, and forget the records written (the run ends)."""
        if by_nodes and not final:
            return
        self.retired.remove(store, wait=final)
        if final:
            self._written, self._committed = {}, None


def _also(best: Callable[[list[int]], list[int]] | None, keeping: Collection[int]) -> Callable[[list[int]], list[int]]:
    """Retention's ``best``, also keeping the epochs of ``keeping``."""
    kept = set(keeping)

    def also(epochs: list[int]) -> list[int]:
        return sorted({*(best(epochs) if best is not None else ()), *(e for e in epochs if e in kept)})

    return also
