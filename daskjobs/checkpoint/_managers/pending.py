"""The saves a checkpoint manager started but has not committed: ids, entries, the one in flight."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from ..._model.task import Task
from ...errors import CheckpointError, CheckpointWriteError, InvalidStateError
from .._format.records import committed_entry
from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")

Pending = tuple[int, dict[str, bool], dict[str, float], dict[str, float]]
"""A save awaiting its commit: ``(epoch, stop_values, timings, metrics)``."""


def write_error(epoch: int, failed: dict[str, Any]) -> CheckpointWriteError:
    """One error for the nodes whose save of ``epoch`` failed (``{node: error or reason}``), caused by the first."""
    detail = "; ".join(f"node {n!r}: {e}" for n, e in sorted(failed.items()))
    error = CheckpointWriteError(f"saving epoch {epoch} failed on {len(failed)} node(s): {detail}")
    first = next(iter(failed.values()))
    error.__cause__ = first if isinstance(first, BaseException) else None
    return error


def previous_entries(
    store: CheckpointStore, epoch: int, committed: list[int], last_record: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
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
    return {node: {**committed_entry(record, node), "node": node, "epoch": older[-1]} for node in record["nodes"]}


class Saves:
    """Per epoch: the save id the nodes' entries must carry, and the entries (or the tasks returning them).

    With ``async_save``, :attr:`pending` is the one save written in the background that is
    committed once it finished.
    """

    def __init__(self) -> None:
        self.ids: dict[int, str] = {}
        self.tasks: dict[int, list[Task]] = {}
        self.entries: dict[int, dict[str, dict[str, Any]]] = {}
        self.pending: Pending | None = None
        self.sources: dict[int, int] = {}
        """Per save not yet committed, the earlier epoch it reuses chunks from (delta): kept by retention."""
        self.unflushed: dict[int, set[str]] = {}
        """Per written epoch, the nodes whose background flush of it has not been reported yet."""

    def start(self, epoch: int, source: int | None = None) -> str:
        """A new save id for ``epoch``, reusing chunks of the earlier epoch ``source`` (delta);
        entries of an earlier save of it are forgotten."""
        self.ids[epoch] = uuid.uuid4().hex
        self.entries.pop(epoch, None)
        self.sources.pop(epoch, None)
        self.unflushed.pop(epoch, None)
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
        self.ids.pop(epoch, None)
        self.entries.pop(epoch, None)
        self.tasks.pop(epoch, None)
        self.sources.pop(epoch, None)
        self.unflushed.pop(epoch, None)

    def flushed(self, epoch: int) -> bool:
        """Whether every node reported ``epoch``'s group durable (or wrote it durable at once)."""
        return epoch in self.entries and not self.unflushed.get(epoch)

    def note_flushes(self, results: dict[str, Any], failed: dict[int, CheckpointWriteError]) -> None:
        """Take the flush outcomes nodes reported (``results[node]["flushed"]``), with the entry a
        background write returned; an epoch whose flush failed, or whose flush a node no longer
        has, fails (in ``failed``) and is forgotten."""
        epochs = {save_id: epoch for epoch, save_id in self.ids.items()}
        bad: dict[int, dict[str, Any]] = {}
        for node, result in results.items():
            if not isinstance(result, dict) or "flushed" not in result:
                continue
            outcome = result["flushed"] or {}
            reported = epochs.get(outcome.get("save_id"))
            for epoch, nodes in self.unflushed.items():
                if node not in nodes:
                    continue
                if epoch != reported:
                    bad.setdefault(epoch, {})[node] = "its background flush is gone (the worker restarted?)"
                elif outcome.get("error") is not None:
                    bad.setdefault(epoch, {})[node] = outcome["error"]
                else:
                    nodes.discard(node)
                    if isinstance(outcome.get("entry"), dict) and epoch in self.entries:
                        self.entries[epoch][node] = outcome["entry"]  # the write's own (a hard link may have failed)
        for epoch, errors in bad.items():
            self.forget(epoch)
            failed[epoch] = write_error(epoch, errors)

    def newest_written(self, before: int) -> int | None:
        """The newest epoch before ``before`` whose save all nodes finished and that awaits its commit."""
        return max((e for e in self.entries if e < before), default=None)

    def pending_epoch(self) -> int | None:
        """The epoch whose asynchronous save is written but not yet committed."""
        return None if self.pending is None else self.pending[0]

    def take_pending(self) -> Pending | None:
        """The asynchronous save awaiting its commit, no longer pending."""
        pending, self.pending = self.pending, None
        return pending

    def discard_pending(self) -> None:
        """Forget the asynchronous save in flight, if any."""
        if self.pending is not None:
            self.forget(self.pending[0])
            self.pending = None

    def take(self, epoch: int, outcomes: dict[str, Any], failed: dict[int, CheckpointWriteError]) -> bool:
        """Keep the entries the nodes returned for ``epoch``; a node without one fails the epoch (in ``failed``)."""
        bad = {n: (o or {}).get("error", "no result") for n, o in outcomes.items() if "entry" not in (o or {})}
        if bad:
            self.forget(epoch)
            failed[epoch] = write_error(epoch, bad)
            return False
        self.entries[epoch] = {n: o["entry"] for n, o in outcomes.items()}
        later = {n for n, o in outcomes.items() if o.get("later")}
        if later:
            self.unflushed[epoch] = later
        return True

    def accept(
        self,
        epoch: int,
        results: dict[str, Any],
        nodes: list[str],
        async_save: bool,
        commit: Callable[[int, dict[str, bool], dict[str, float], dict[str, float]], None],
    ) -> dict[int, CheckpointWriteError]:
        """Take the finish hooks' ``results`` for ``epoch``, committing the save in flight; return failed saves."""
        failed: dict[int, CheckpointWriteError] = {}
        self.note_flushes(results, failed)
        missing = sorted(set(nodes) - set(results))
        if missing:
            self.forget(epoch)
            failed[epoch] = CheckpointWriteError(f"epoch {epoch}: no save result from nodes {missing}")
        elif not async_save:
            self.take(epoch, dict(results), failed)
            return failed
        pending = self.take_pending()
        if pending is not None:
            outcomes = {n: (r or {}).get("previous") for n, r in results.items()}
            if self.take(pending[0], outcomes, failed):
                try:
                    commit(*pending)
                except CheckpointWriteError as exc:
                    self.forget(pending[0])
                    failed[pending[0]] = exc
        starts = {n: r["error"] for n, r in results.items() if r and r.get("error") is not None}
        if starts and epoch not in failed:
            self.forget(epoch)
            failed[epoch] = write_error(epoch, starts)
        return failed

    def finished(self, epoch: int) -> dict[str, dict[str, Any]]:
        """The nodes' entries of ``epoch``'s save, to commit (kept until :meth:`forget`, so a failed
        commit can be tried again); refuses entries of another save.

        Raises
        ------
        RuntimeError
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
            entries = {task.node: json.loads(task.outputs()[0].fetch().tobytes()) for task in tasks}
            self.entries[epoch] = entries
        save_id = self.ids[epoch]
        stale = [n for n, e in entries.items() if e.get("save_id") != save_id]
        if stale:
            self.forget(epoch)
            raise CheckpointError(
                f"epoch {epoch}: nodes {stale} returned entries of another save; not committing; save the epoch again"
            )
        return entries
