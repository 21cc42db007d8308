"""Checkpoint steps that save a node's workspace now, on its worker, and what the node keeps between
saves: its last entry (what the next save reuses chunks from), the background flush of its last
save, and a save whose flush failed until the driver has it written again. Asynchronous saves
(snapshot now, write in the background) are :mod:`.async_saves`.

:class:`SaveStep` is marked :data:`~daskjobs._execution.node_run.INTERNAL`: the daskjobs errors it
raises (a failed write) surface as themselves, not as a user's task failure. The ``*Finish``
classes run as hooks at the end of an epoch's own Dask task (:meth:`~daskjobs.Session.run_group`
``finish=``); they return their outcome (:mod:`.outcomes`) instead of raising.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..._execution.node_run import INTERNAL
from ..._model.values import copy_value
from ..._model.workspace import node_state
from ...errors import CheckpointError, CheckpointLockedError, CheckpointWriteError
from .._format.records import MANIFEST_KEY
from .._protocol.commits import RetiredEpoch
from .._storage.deadline import Deadline
from .._storage.durable import deleting_in_background, in_background
from .outcomes import FlushOutcome, FlushReport, SaveOutcome
from .slots import checkpoint_slots

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from ..._model.values import Value
    from ..._model.workspace import Workspace
    from .._format.documents import CommittedEntry, EntryReport, NodeEntry, PreviousEntry
    from .._protocol.store import CheckpointStore, GroupFlush

logger = logging.getLogger("daskjobs")

ENTRY_BLOB = "daskjobs.checkpoint_entry"
"""Output blob through which a node's save task returns the (small, JSON) summary of its entry."""
WRITE_LATER_UP_TO = 1 << 20
"""A synchronous save of a node whose arrays hold at most this many bytes copies them and leaves
the whole write to the background thread, not only the fsync (see :class:`SaveFinish`)."""


def reported(entry: NodeEntry) -> EntryReport:
    """What a node tells the driver of an entry it wrote: its totals and the reference of its manifest
    (``None`` for an entry described before its group was written), never its blobs: the driver's
    work and messages stay the same size whatever a node holds."""
    ref = entry.get(MANIFEST_KEY)
    return {
        "node": entry["node"],
        "epoch": entry["epoch"],
        "save_id": entry["save_id"],
        "bytes": entry["bytes"],
        "bytes_written": entry["bytes_written"],
        "bytes_reused": entry["bytes_reused"],
        "seconds": entry["seconds"],
        MANIFEST_KEY: ref.copy() if isinstance(ref, Mapping) else None,
    }


def entry_array(entry: NodeEntry) -> np.ndarray:
    """What a node tells the driver of its entry (:func:`reported`) as a uint8 blob, the form in which
    save tasks return it."""
    return np.frombuffer(json.dumps(reported(entry)).encode(), dtype=np.uint8).copy()


def remember(state: NodeState, entry: NodeEntry | None) -> None:
    """Keep ``entry`` (written by this node, or loaded whole and verified) for the next save's delta."""
    if entry is not None and isinstance(entry.get(MANIFEST_KEY), Mapping):
        checkpoint_slots(state).manifest = entry.copy()


def reuse_base(state: NodeState, store: CheckpointStore, node: str, previous: PreviousEntry | None) -> NodeEntry | None:
    """The whole entry a save reuses chunks from, given what the driver named (``previous``: the
    summary of the newest earlier save, or a whole entry of a record before format version 4).

    The node's own last entry (:func:`remember`) when it is that save (same epoch, save id and
    manifest); else that manifest, read and verified against the summary. A manifest that is
    missing or does not match is never reused from: the save writes every chunk (a warning names
    the :class:`~daskjobs.errors.CheckpointCorruptError`).
    """
    if previous is None or "blobs" in previous:
        return None if previous is None else previous.copy()
    ref = previous.get(MANIFEST_KEY)
    mine = checkpoint_slots(state).manifest
    if (
        mine is not None
        and mine.get("epoch") == previous.get("epoch")
        and mine.get("save_id") == previous.get("save_id")
        and (ref is None or mine.get(MANIFEST_KEY) == ref)
    ):
        return mine
    if not isinstance(ref, Mapping):  # described but never reported written: nothing to verify it against
        return None
    try:
        return store.resolve_entry(node, previous["epoch"], previous)
    except CheckpointError as exc:
        logger.warning(
            "node %r does not reuse chunks of epoch %s (delta): %s: %s; every chunk is written",
            node,
            previous.get("epoch"),
            type(exc).__name__,
            exc,
        )
        return None


def snapshot(blobs: Mapping[str, Value], buffers: Mapping[str, Value]) -> dict[str, Value]:
    """Copy ``blobs``, reusing same-shaped arrays of the previous snapshot (warm memory copies ~10x faster).

    Arrays are copied; JSON values (anything else) are copied with :func:`copy_value`.
    """
    copies: dict[str, Value] = {}
    for name, value in blobs.items():
        if not isinstance(value, np.ndarray):
            copies[name] = copy_value(value, name)
            continue
        buffer = buffers.get(name)
        if isinstance(buffer, np.ndarray) and buffer.shape == value.shape and buffer.dtype == value.dtype:
            np.copyto(buffer, value)
        else:
            buffer = np.array(value, copy=True, order="C")
        copies[name] = buffer
    return copies


def outcome(write: Callable[[], EntryReport]) -> SaveOutcome:
    """The entry of a successful write, the error of a failed one."""
    try:
        return SaveOutcome(entry=write())
    except Exception as exc:
        return SaveOutcome(error=exc)


@dataclass(frozen=True)
class PendingFlush:
    """A node's synchronous save of ``epoch`` whose fsync (or whole write) runs in the background;
    ``done`` gives the group's entry when the background thread wrote it, else ``None``. ``copies``:
    the snapshot a background write writes, kept to write it again should that fail. ``path``:
    where the group goes (for messages)."""

    save_id: str
    epoch: int
    done: Future[NodeEntry | None] | Future[None]
    path: str
    copies: dict[str, Value] | None = None


@dataclass(frozen=True)
class Unflushed:
    """A save whose background flush failed, kept until the driver has it written again (see
    :class:`ResaveFinish`): the snapshot it was written from, or ``None`` (it was written from the
    workspace, which has moved on since: its group is read back)."""

    save_id: str
    epoch: int
    copies: dict[str, Value] | None


def settle_flush(state: NodeState) -> FlushReport | None:
    """Wait for the node's background flush, if any, and report how it ended (with the entry the
    background write returned, :func:`reported`). The written entry is remembered for the next
    save's delta; after a failed flush nothing is, and the save is kept as :class:`Unflushed`.

    A flush still running after ``daskjobs.storage-timeout`` failed: a :class:`CheckpointWriteError`
    naming node, epoch and path (its thread, stuck in the OS, is left to itself)."""
    slots = checkpoint_slots(state)
    pending, slots.flush = slots.flush, None
    if pending is None:
        return None
    try:
        what = f"making the checkpoint of node {state.node!r} at epoch {pending.epoch} durable at {pending.path}"
        done = cast("Future[NodeEntry | None]", pending.done)  # a flush alone gives None
        entry = Deadline().result(done, what, CheckpointWriteError)
    except Exception as exc:
        slots.manifest = None  # never link chunks of a group whose flush failed
        slots.unflushed = Unflushed(pending.save_id, pending.epoch, pending.copies)
        return FlushReport(pending.save_id, exc)
    remember(state, entry)
    return FlushReport(pending.save_id, None, None if entry is None else reported(entry))


def reuse_from(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    previous: PreviousEntry | None,
    flushed: FlushReport | None,
) -> NodeEntry | None:
    """The entry a node's next save reuses chunks from, after :func:`settle_flush` reported
    ``flushed``: none after a failed flush, else :func:`reuse_base` of ``previous``."""
    if flushed is not None and flushed.error is not None:
        return None
    return reuse_base(state, store, node, previous)


def small(blobs: Mapping[str, Value]) -> bool:
    """Whether a workspace is written whole by the background thread (see :data:`WRITE_LATER_UP_TO`)."""
    return sum(v.nbytes for v in blobs.values() if isinstance(v, np.ndarray)) <= WRITE_LATER_UP_TO


def write_later(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    epoch: int,
    blobs: Mapping[str, Value],
    *,
    save_id: str,
    previous: NodeEntry | None,
    retired: RetiredEpoch | None,
) -> NodeEntry:
    """Copy a small workspace and hand its whole write, and the flush, to the background thread;
    return the entry the write will return, computed here (see ``CheckpointStore.describe_node``)."""
    copies = snapshot(blobs, {})
    entry = store.describe_node(node, epoch, copies, save_id=save_id, previous=previous)
    write_in_background(state, store, node, epoch, copies, save_id=save_id, previous=previous, retired=retired)
    return entry


def write_in_background(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    epoch: int,
    copies: dict[str, Value],
    *,
    save_id: str,
    previous: NodeEntry | None,
    retired: RetiredEpoch | None,
) -> None:
    """Hand the whole write of ``copies`` (a snapshot nothing changes any more) and its flush to the
    process's background write thread; the node's next hook (or ``FlushFinish``) reports it."""
    done: Future[NodeEntry | None] = Future()
    unsynced = functools.partial(
        store.write_node_unsynced, node, epoch, copies, save_id=save_id, previous=previous, retired=retired
    )
    in_background(functools.partial(_write_there, unsynced, done))
    checkpoint_slots(state).flush = PendingFlush(save_id, epoch, done, store.db_name(node, epoch), copies)


def poll_flush(state: NodeState) -> FlushOutcome | None:
    """The node's background flush as a hook reports it without waiting: how it ended (see
    :func:`settle_flush`; ``flushed`` is ``None`` when there was none), or ``None`` while it runs."""
    pending = checkpoint_slots(state).flush
    if pending is not None and not pending.done.done():
        return None
    return FlushOutcome(settle_flush(state))


def flush_later(state: NodeState, save_id: str, epoch: int, flush: GroupFlush) -> None:
    """Hand the fsync of a group written here to the process's next batch of syncs."""
    path = flush.store.db_name(flush.node, epoch)
    checkpoint_slots(state).flush = PendingFlush(save_id, epoch, flush.soon(), path)


def _write_there(unsynced: Callable[[], tuple[NodeEntry, GroupFlush | None]], done: Future[NodeEntry | None]) -> None:
    """Write a small workspace's copy in the background thread (``unsynced``: its
    ``write_node_unsynced``); ``done`` gets the written entry once the group is durable (in the next
    batch of syncs, with the groups of the other nodes this process serves), or the error."""
    try:
        entry, flush = unsynced()
    except BaseException as exc:
        done.set_exception(exc)
        return
    if flush is None:
        done.set_result(entry)
        return

    def report(synced: Future[None]) -> None:
        error = synced.exception()
        if error is None:
            done.set_result(entry)
        else:
            done.set_exception(error)

    flush.soon().add_done_callback(report)


@dataclass(frozen=True)
class FlushFinish:
    """A ``finish`` hook that waits for the node's background flush and reports it (see :func:`settle_flush`)."""

    def __call__(self, state: NodeState) -> FlushOutcome:
        return FlushOutcome(settle_flush(state))


@dataclass(frozen=True)
class ResaveFinish:
    """A ``finish`` hook writing again, durably, the node's save ``save_id`` of ``epoch`` whose
    background flush failed: from the snapshot the background write kept, else from its group read
    back and verified against ``entry`` (what the node reported of it; see
    ``CheckpointStore.read_unflushed``). Returns the rewritten group's entry (same save id) or the
    error.

    Nothing links chunks of the group written again: the node's next save already wrote whole (a
    node never links chunks of a group whose flush failed).
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    entry: EntryReport

    def __call__(self, state: NodeState) -> SaveOutcome:
        slots = checkpoint_slots(state)
        kept = slots.unflushed
        mine = kept is not None and kept.save_id == self.save_id
        copies = kept.copies if kept is not None and mine else None

        def write() -> EntryReport:
            blobs = copies if copies is not None else self.store.read_unflushed(self.node, self.epoch, self.entry)
            return reported(self.store.write_node(self.node, self.epoch, blobs, save_id=self.save_id))

        written = outcome(write)
        if mine and written.entry is not None:
            slots.unflushed = None
        return written


@dataclass(frozen=True)
class SaveStep:
    """Writes the node's whole GLOBAL workspace; returns the entry as the task output."""

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous: PreviousEntry | None = None

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        with state.lock:
            blobs = dict(state.scope.blobs)
        previous = reuse_from(state, self.store, self.node, self.previous, settle_flush(state))
        entry = self.store.write_node(self.node, self.epoch, blobs, save_id=self.save_id, previous=previous)
        remember(state, entry)
        ws[ENTRY_BLOB] = entry_array(entry)


@dataclass(frozen=True)
class SaveFinish:
    """:class:`SaveStep` as an epoch's ``finish`` hook: returns the entry or the error, and the report
    of the node's previous background flush (see :func:`settle_flush`).

    ``flush_later``: the group's fsync runs in the background while the next epoch runs; the
    outcome then says ``later`` and the next hook (or :class:`FlushFinish`) reports the
    outcome. A small workspace (:data:`WRITE_LATER_UP_TO`) is copied and written there whole, by
    the process's one background write thread, one group after the other (the groups of every
    node it serves: side by side, their threads would pass the GIL to each other around every
    file operation): the hook returns its entry as :meth:`CheckpointStore.describe_node`
    computes it, and the report brings the entry the write returned. Whatever the mode, a node first waits for its
    previous flush, reuses chunks by that write's own entry, and never hard-links chunks of a
    group whose flush failed. ``doomed``: the node's groups of epochs retention un-committed: the
    oldest is written over by this save (see :meth:`CheckpointStore.write_node_unsynced`
    ``retired``), the others are deleted in the background, in a thread of their own (this save's
    write and flush never wait for it).
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous: PreviousEntry | None = None
    flush_later: bool = False
    doomed: tuple[tuple[int, CommittedEntry | None], ...] = ()

    def __call__(self, state: NodeState) -> SaveOutcome:
        with state.lock:
            blobs = dict(state.scope.blobs)
        flushed = settle_flush(state)
        previous = reuse_from(state, self.store, self.node, self.previous, flushed)
        retired = RetiredEpoch(self.doomed[0][0], {self.node: self.doomed[0][1]}) if self.doomed else None
        if self.doomed[1:]:
            deleting_in_background(functools.partial(delete_groups, self.store, self.node, self.doomed[1:]))
        store, node, epoch, save_id = self.store, self.node, self.epoch, self.save_id

        def write() -> EntryReport:
            if not self.flush_later:
                entry = store.write_node(node, epoch, blobs, save_id=save_id, previous=previous)
                remember(state, entry)
                return reported(entry)
            if store.defers_flush and small(blobs):
                described = write_later(
                    state, store, node, epoch, blobs, save_id=save_id, previous=previous, retired=retired
                )
                return reported(described)
            entry, flush = store.write_node_unsynced(
                node, epoch, blobs, save_id=save_id, previous=previous, retired=retired
            )
            if flush is not None:
                flush_later(state, save_id, epoch, flush)
            remember(state, entry)  # reused only once its flush is reported (settle_flush forgets it otherwise)
            return reported(entry)

        written = outcome(write)
        return dataclasses.replace(written, later=checkpoint_slots(state).flush is not None, flushed=flushed)


def delete_groups(store: CheckpointStore, node: str, doomed: tuple[tuple[int, CommittedEntry | None], ...]) -> None:
    """Delete ``node``'s groups of retired epochs (``(epoch, entry)``); failures are logged, and
    after a lost lock nothing more is deleted (the next run's cleanup removes what is left)."""
    for epoch, entry in doomed:
        try:
            store.remove_retired(RetiredEpoch(epoch, {node: entry}))
        except Exception as exc:
            logger.warning(
                "retention: could not delete node %r's group of epoch %d under %s: %s", node, epoch, store.url, exc
            )
            if isinstance(exc, CheckpointLockedError):
                return


def idle(ws: Workspace) -> None:
    """A step that does nothing: the task at whose end a node runs a ``finish`` hook alone."""


setattr(SaveStep, INTERNAL, True)
