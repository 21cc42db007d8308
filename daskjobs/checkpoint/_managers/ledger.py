"""The saves a checkpoint manager started but has not committed: per epoch its save id, the nodes'
entries (or the tasks returning them), what it reuses chunks from, the nodes whose background flush
is still to be reported, and the asynchronous save in flight.

The commit pipeline asks the ledger one thing per phase of an epoch, and gets one typed answer:
:meth:`SaveLedger.begin` before the epoch runs (:class:`StartedSave`), :meth:`SaveLedger.receive`
once its save hooks returned (:class:`Received`, with the epochs now durable handed out for their
commit)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from ..._model.task import Task
from ...errors import CheckpointError, CheckpointWriteError, InvalidStateError
from .._format.records import committed_entry
from .._node.outcomes import AsyncSaveOutcome, FlushOutcome, SaveOutcome
from .._protocol.store import CheckpointStore

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import CommitRecord, CommittedEntry, EntryReport, PreviousEntry

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class PendingCommit:
    """An epoch saved and awaiting its commit, with what its commit record holds besides the nodes'
    entries: the stop values, the metric means and the timings."""

    epoch: int
    stop_values: Mapping[str, bool] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    entries: Mapping[str, EntryReport] | None = None
    """The nodes' entries to commit, once the ledger handed them out (``None``: the commit asks it)."""


@dataclass(frozen=True)
class StartedSave:
    """A save :meth:`SaveLedger.begin` started: its id, the node entries it reuses chunks from (delta)
    and the id of the asynchronous save in flight, which its hooks wait for (``None``: none)."""

    save_id: str
    previous: dict[str, PreviousEntry]
    in_flight_id: str | None = None


@dataclass(frozen=True)
class Received:
    """What the save hooks of an epoch reported, as :meth:`SaveLedger.receive` took it.

    ``failure``: the epoch's own save failed (it is forgotten); ``flushes``: by earlier epoch, the
    nodes whose background flush failed or is gone (their error, or why); ``durable``: the epochs
    durable on every node, oldest first, with the entries to commit (see :meth:`SaveLedger.hand_out`).
    With ``async_save``: ``in_flight``, the save in flight the hooks waited for, its entries handed
    out (``None``: none, or its write failed: ``in_flight_failure``); ``not_started``: the nodes whose
    save of the epoch could not start (their error).
    """

    failure: CheckpointWriteError | None = None
    flushes: dict[int, dict[str, BaseException | str]] = field(default_factory=dict)
    durable: dict[int, dict[str, EntryReport]] = field(default_factory=dict)
    in_flight: PendingCommit | None = None
    in_flight_failure: dict[int, CheckpointWriteError] = field(default_factory=dict)
    not_started: dict[str, BaseException] = field(default_factory=dict)


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
        self.version = 0
        """Counts the changes that may make a waiting epoch durable (or no longer so): an epoch the
        last :meth:`hand_out` did not hand out is still not durable while this is unchanged."""

    def begin(
        self,
        epoch: int,
        store: CheckpointStore,
        committed: list[int] | None,
        last_record: CommitRecord | None,
        *,
        done: Collection[int] = (),
    ) -> StartedSave:
        """Start a save of ``epoch`` (:meth:`start`), reusing chunks (delta) of the newest earlier epoch
        written and awaiting its commit, else of the newest of ``committed`` before it (its record:
        ``last_record`` when that is it, else read from ``store``); ``committed=None``: reuse nothing.
        The saves of ``done`` (committed with the entries :meth:`hand_out` gave) are forgotten first."""
        for other in done:
            self.forget(other)
        in_flight = None if self.in_flight is None else self.ids.get(self.in_flight.epoch)
        previous = {} if committed is None else self._reusable(epoch, store, committed, last_record)
        source = next(iter(previous.values()))["epoch"] if previous else None
        return StartedSave(self.start(epoch, source), previous, in_flight)

    def _reusable(
        self, epoch: int, store: CheckpointStore, committed: list[int], last_record: CommitRecord | None
    ) -> dict[str, PreviousEntry]:
        """The node entries a save of ``epoch`` reuses chunks from: those of the newest earlier epoch,
        written and awaiting its commit or committed."""
        written = self.newest_written(epoch)
        if written is not None and written > max((e for e in committed if e < epoch), default=-1):
            return dict(self.entries[written])
        return previous_entries(store, epoch, committed, last_record)

    def receive(
        self,
        epoch: int,
        finished: Mapping[str, object],
        nodes: Sequence[str],
        *,
        async_save: bool,
        waiting: Sequence[int] = (),
    ) -> Received:
        """Take what the save hooks of ``epoch`` on ``nodes`` returned (``finished``): the flushes they
        report of earlier epochs, ``epoch``'s entries (with ``async_save``, those of the save in flight
        the hooks waited for, handed out for its commit); then hand out (:meth:`hand_out`) the
        durable epochs of ``waiting`` (oldest first, ``epoch`` last when it waits too)."""
        flushes = self.note_flushes(finished)
        failure = None
        missing = sorted(set(nodes) - set(finished))
        if missing:
            self.forget(epoch)
            failure = CheckpointWriteError(f"epoch {epoch}: no save result from nodes {missing}")
        elif not async_save:
            bad = self.take(epoch, finished)
            if bad:
                failure = write_error(epoch, bad)
        durable = self.hand_out([e for e in waiting if failure is None or e != epoch])[0] if waiting else {}
        if not async_save:
            return Received(failure, flushes, durable)
        in_flight, in_flight_failure = self._waited(finished)
        not_started = {
            n: r.error for n, r in finished.items() if isinstance(r, AsyncSaveOutcome) and r.error is not None
        }
        return Received(failure, flushes, durable, in_flight, in_flight_failure, not_started)

    def _waited(self, finished: Mapping[str, object]) -> tuple[PendingCommit | None, dict[int, CheckpointWriteError]]:
        """The asynchronous save in flight, no longer in flight, with the entries its nodes reported
        to the hooks that returned ``finished`` (handed out when they are whole), or its failure."""
        pending = self.take_in_flight()
        if pending is None:
            return None, {}
        bad = self.take(pending.epoch, in_flight_outcomes(finished))
        if bad:
            return None, {pending.epoch: write_error(pending.epoch, bad)}
        handed, _ = self.hand_out([pending.epoch])
        return replace(pending, entries=handed.get(pending.epoch)), {}

    def hand_out(self, epochs: Sequence[int]) -> tuple[dict[int, dict[str, EntryReport]], int | None]:
        """The entries to commit of the epochs of ``epochs`` (oldest first) durable on every node, up to
        the first that is not (kept here until :meth:`forget`, or the next :meth:`begin` once committed);
        and the first durable epoch whose entries are of another save, if any (not handed out: its commit
        refuses it, see :meth:`finished`)."""
        handed: dict[int, dict[str, EntryReport]] = {}
        for epoch in epochs:
            entries = self.entries.get(epoch)
            if entries is None or self.unflushed.get(epoch):
                return handed, None
            if any(e.get("save_id") != self.ids.get(epoch) for e in entries.values()):
                return handed, epoch
            handed[epoch] = dict(entries)
        return handed, None

    def start(self, epoch: int, source: int | None = None) -> str:
        """A new save id for ``epoch``, reusing chunks of the earlier epoch ``source`` (delta);
        entries of an earlier save of it are forgotten."""
        self.forget(epoch)
        self.ids[epoch] = uuid.uuid4().hex
        if source is not None:
            self.sources[epoch] = source
        return self.ids[epoch]

    def forget(self, epoch: int) -> None:
        """Forget the save of ``epoch`` (committed, or never to be: the caller no longer waits for it,
        so :attr:`version` stays)."""
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
        self.version += 1
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

    def rewritten(self, epoch: int, entries: Mapping[str, EntryReport]) -> None:
        """The nodes of ``entries`` wrote their groups of ``epoch`` again, durably: their new entries."""
        self.version += 1
        for node, entry in entries.items():
            self.entries[epoch][node] = entry
            self.unflushed.get(epoch, set()).discard(node)

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
        self.version += 1
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
            self.version += 1
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
