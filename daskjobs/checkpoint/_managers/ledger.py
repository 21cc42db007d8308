"""The saves a checkpoint manager started but has not committed: per epoch its save id, the nodes'
entries (or the tasks returning them), what it reuses chunks from, the nodes whose background flush
is still to be reported, and the asynchronous save in flight."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..._model.task import Task
from ...errors import CheckpointError, CheckpointWriteError, InvalidStateError
from .._format.naming import db_name
from .._format.records import committed_entry
from .._node.outcomes import AsyncSaveOutcome, FlushOutcome, SaveOutcome
from .._protocol.store import CheckpointStore

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import CommitRecord, CommittedEntry, EntryRef, EntryReport, PreviousEntry

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class PendingCommit:
    """An epoch saved and awaiting its commit, with what its commit record holds besides the nodes'
    entries: the stop values, the metric means and the timings."""

    epoch: int
    stop_values: Mapping[str, bool] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)


def write_error(epoch: int, failed: Mapping[str, BaseException | str]) -> CheckpointWriteError:
    """One error for the nodes whose save of ``epoch`` failed (``{node: error or reason}``), caused by the first."""
    detail = "; ".join(f"node {n!r}: {e}" for n, e in sorted(failed.items()))
    error = CheckpointWriteError(f"saving epoch {epoch} failed on {len(failed)} node(s): {detail}")
    first = next(iter(failed.values()))
    error.__cause__ = first if isinstance(first, BaseException) else None
    return error


def saved_entries(outcomes: Mapping[str, object]) -> tuple[dict[str, EntryReport], dict[str, BaseException | str]]:
    """The entries the nodes' save outcomes (``SaveOutcome``) hold, and the nodes without one, with
    its error (or why not)."""
    entries: dict[str, EntryReport] = {}
    failed: dict[str, BaseException | str] = {}
    for node, outcome in outcomes.items():
        if not isinstance(outcome, SaveOutcome):
            failed[node] = "no result"
        elif outcome.entry is None:
            failed[node] = "no result" if outcome.error is None else outcome.error
        else:
            entries[node] = outcome.entry
    return entries, failed


def in_flight_outcomes(finished: Mapping[str, object]) -> dict[str, SaveOutcome | None]:
    """How the asynchronous save in flight ended on each node, as the hooks that returned ``finished``
    (``AsyncSaveOutcome``) reported it."""
    return {n: r.previous if isinstance(r, AsyncSaveOutcome) else None for n, r in finished.items()}


def previous_entries(
    store: CheckpointStore, epoch: int, committed: list[int], last_record: CommitRecord | None
) -> dict[str, PreviousEntry]:
    """What the commit record of the newest of ``committed`` before ``epoch`` holds of each node (the
    summary naming its manifest, or a record's whole entry before format version 4), with the node
    and epoch: what each node's save reuses chunks from (delta); {} without.

    ``last_record`` is used when it is that epoch's commit record, else the record is read.
    """
    older = [e for e in committed if e < epoch]
    if not older:
        return {}
    record = last_record
    if record is None or record["epoch"] != older[-1]:
        try:
            record = store.read_commit(older[-1])
        except CheckpointError as exc:  # an unreadable commit is never reused from: write everything
            logger.warning("not reusing chunks of epoch %d: %s", older[-1], exc)
            return {}
    return {node: _named(committed_entry(record, node), node, older[-1]) for node in record["nodes"]}


def _named(entry: CommittedEntry, node: str, epoch: int) -> PreviousEntry:
    """``entry`` (what ``epoch``'s commit record holds of ``node``) naming its node and epoch."""
    if "blobs" in entry:  # a whole entry names them itself (validated)
        return entry
    return {**entry, "node": node, "epoch": epoch}


class SaveLedger:
    """Per epoch: the save id the nodes' entries must carry, and the entries (or the tasks returning them).

    With ``async_save``, :attr:`in_flight` is the one save written in the background that is
    committed once it finished.
    """

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}
        self.tasks: dict[int, list[Task]] = {}
        self.entries: dict[int, dict[str, EntryReport]] = {}
        self.in_flight: PendingCommit | None = None
        """The asynchronous save written in the background, once its commit was asked for."""
        self.salvaged: dict[str, SaveOutcome | None] = {}
        """Outcomes of the asynchronous save in flight that nodes reported before their epoch failed."""
        self.sources: dict[int, int] = {}
        """Per save not yet committed, the earlier epoch it reuses chunks from (delta): kept by retention."""
        self.unflushed: dict[int, set[str]] = {}
        """Per written epoch, the nodes whose background flush of it has not been reported yet."""

    def start(self, epoch: int, source: int | None = None) -> str:
        """A new save id for ``epoch``, reusing chunks of the earlier epoch ``source`` (delta);
        entries of an earlier save of it are forgotten."""
        self.forget(epoch)
        self.ids[epoch] = uuid.uuid4().hex
        if source is not None:
            self.sources[epoch] = source
        return self.ids[epoch]

    def keeping_sources(self, best: Callable[[list[int]], list[int]] | None) -> Callable[[list[int]], list[int]]:
        """Retention's ``best``, also keeping the epochs whose chunks saves not yet committed reuse."""
        sources = set(self.sources.values())

        def kept(epochs: list[int]) -> list[int]:
            return sorted({*(best(epochs) if best is not None else ()), *(e for e in epochs if e in sources)})

        return kept

    def forget(self, epoch: int) -> None:
        """Forget the save of ``epoch`` (committed, or never to be)."""
        for book in (self.ids, self.entries, self.tasks, self.sources, self.unflushed):
            book.pop(epoch, None)

    def flushed(self, epoch: int) -> bool:
        """Whether every node reported ``epoch``'s group durable (or wrote it durable at once)."""
        return epoch in self.entries and not self.unflushed.get(epoch)

    def writing_nodes(self) -> set[str]:
        """The nodes whose background flush of some epoch is still to be reported."""
        return set().union(*self.unflushed.values())

    def note_flushes(self, results: Mapping[str, object]) -> dict[int, dict[str, BaseException | str]]:
        """Take the flush reports nodes gave (the ``flushed`` of a ``SaveOutcome`` or ``FlushOutcome``),
        with the entry a background write returned; return, by epoch, the nodes whose flush failed or
        is gone (their error, or why), which stay unflushed."""
        epochs = {save_id: epoch for epoch, save_id in self.ids.items()}
        bad: dict[int, dict[str, BaseException | str]] = {}
        for node, result in results.items():
            if not isinstance(result, SaveOutcome | FlushOutcome):
                continue
            flushed = result.flushed
            reported = None if flushed is None else epochs.get(flushed.save_id)
            for epoch, nodes in self.unflushed.items():
                if node not in nodes:
                    continue
                if flushed is None or epoch != reported:
                    bad.setdefault(epoch, {})[node] = "its background flush is gone (the worker restarted?)"
                elif flushed.error is not None:
                    bad.setdefault(epoch, {})[node] = flushed.error
                else:
                    nodes.discard(node)
                    if flushed.entry is not None and epoch in self.entries:
                        self.entries[epoch][node] = flushed.entry  # the write's own (a hard link may have failed)
        return bad

    def newest_written(self, before: int) -> int | None:
        """The newest epoch before ``before`` whose save all nodes finished and that awaits its commit."""
        return max((e for e in self.entries if e < before), default=None)

    def in_flight_epoch(self) -> int | None:
        """The epoch whose asynchronous save is written but not yet committed."""
        return None if self.in_flight is None else self.in_flight.epoch

    def take_in_flight(self) -> PendingCommit | None:
        """The asynchronous save awaiting its commit, no longer in flight (its reports forgotten)."""
        pending, self.in_flight, self.salvaged = self.in_flight, None, {}
        return pending

    def discard_in_flight(self) -> None:
        """Forget the asynchronous save in flight, if any."""
        pending = self.take_in_flight()
        if pending is not None:
            self.forget(pending.epoch)

    def take(self, epoch: int, outcomes: Mapping[str, object]) -> dict[str, BaseException | str]:
        """Keep the entries the nodes' save outcomes (``SaveOutcome``) hold for ``epoch``; return the nodes
        without one (with their error, or why), which fail the epoch (it is forgotten then)."""
        entries, bad = saved_entries(outcomes)
        if bad:
            self.forget(epoch)
            return bad
        self.entries[epoch] = entries
        later = {n for n, o in outcomes.items() if isinstance(o, SaveOutcome) and o.later}
        if later:
            self.unflushed[epoch] = later
        return {}

    def finished(self, epoch: int) -> dict[str, EntryReport]:
        """The nodes' entries of ``epoch``'s save, to commit (kept until :meth:`forget`, so a failed
        commit can be tried again); refuses entries of another save.

        Raises
        ------
        InvalidStateError
            ``epoch`` was not saved.
        CheckpointError
            A node returned an entry of another save of ``epoch``.
        """
        entries = self.entries.get(epoch)
        if entries is None:
            tasks = self.tasks.get(epoch)
            if tasks is None:
                raise InvalidStateError(
                    f"no save of epoch {epoch} to commit: run manager.save({epoch}) in a session first"
                )
            entries = {task.node: _reported(task.outputs()[0].fetch()) for task in tasks}
            self.entries[epoch] = entries
        save_id = self.ids[epoch]
        stale = [n for n, e in entries.items() if e.get("save_id") != save_id]
        if stale:
            self.forget(epoch)
            raise CheckpointError(
                f"epoch {epoch}: nodes {stale} returned entries of another save; not committing; save the epoch again"
            )
        return entries


def _reported(output: Value) -> EntryReport:
    """What a save task returned of a node's entry (see ``entry_array``): JSON text as a uint8 array."""
    entry: EntryReport = json.loads(np.asarray(output).tobytes())
    return entry


class LastCheckpoint:
    """The last checkpoint a manager saved or loaded: where it is and its nodes' entries (or their
    summaries; blob names are read only when asked), the durations to report, and the commit record
    a save reuses chunks from (delta) without reading it again."""

    def __init__(self) -> None:
        self.found: tuple[CheckpointStore, int, dict[str, EntryRef]] | None = None
        self.stats: dict[str, int] = {}
        """Nanoseconds by checkpoint name (``<db_prefix>/<node>.<epoch>``), for the metadata handler."""
        self.record: CommitRecord | None = None
        """The commit record saved or loaded last through the manager's own store."""

    def remember(self, store: CheckpointStore, epoch: int, entries: Mapping[str, EntryRef], prefix: str) -> None:
        """Keep the durations of the node ``entries`` of ``epoch`` just saved or loaded from ``store``,
        and where their blob names are (``prefix``: the manager's ``db_prefix``)."""
        self.found = (store, epoch, dict(entries))
        folder = db_name(epoch, next(iter(entries), "n"), prefix).rsplit("/", 1)[0]  # the names were validated
        self.stats = {f"{folder}/{n}.{epoch}": int(e.get("seconds", 0) * 1e9) for n, e in entries.items()}

    def blob_list(self) -> dict[str, list[str]]:
        """Blob names per node of the last checkpoint (from its nodes' manifests)."""
        if self.found is None:
            raise InvalidStateError("no checkpoint saved or loaded yet by this manager")
        store, epoch, entries = self.found
        return {n: sorted(store.resolve_entry(n, epoch, e)["blobs"]) for n, e in entries.items()}
