"""A node's synchronous saves made durable in the background while the next epoch runs.

A save hook that leaves the fsync (or, for a small workspace, the whole write) to the process's
background thread keeps a :class:`PendingFlush`; the node's next hook (or :class:`FlushFinish`)
waits for it and reports the outcome. A flush that failed leaves an :class:`Unflushed` save behind,
which :class:`ResaveFinish` writes again, durably, when the driver retries that epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._storage.durable import in_background
from .delta import MANIFEST, remember, reported, reuse_base, snapshot

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from .._protocol.commits import RetiredEpoch
    from .._protocol.store import CheckpointStore, GroupFlush

FLUSH = "daskjobs.pending_flush"
UNFLUSHED = "daskjobs.unflushed_save"
WRITE_LATER_UP_TO = 1 << 20
"""A synchronous save of a node whose arrays hold at most this many bytes copies them and leaves
the whole write to the background thread, not only the fsync (see ``SaveFinish``)."""


def outcome(write: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``{"entry": ...}`` of a successful write, ``{"error": exception}`` of a failed one."""
    try:
        return {"entry": write()}
    except Exception as exc:
        return {"error": exc}


@dataclass(frozen=True)
class PendingFlush:
    """A node's synchronous save of ``epoch`` whose fsync (or whole write) runs in the background;
    ``done`` gives the group's entry when the background thread wrote it, else ``None``. ``copies``:
    the snapshot a background write writes, kept to write it again should that fail."""

    save_id: str
    epoch: int
    done: Future[dict[str, Any] | None]
    copies: dict[str, Any] | None = None


@dataclass(frozen=True)
class Unflushed:
    """A save whose background flush failed, kept until the driver has it written again (see
    :class:`ResaveFinish`): the snapshot it was written from, or ``None`` (it was written from the
    workspace, which has moved on since: its group is read back)."""

    save_id: str
    epoch: int
    copies: dict[str, Any] | None


def settle_flush(state: NodeState) -> dict[str, Any] | None:
    """Wait for the node's background flush, if any: ``{"save_id", "error": None | exception,
    "entry": what the background write returned (:func:`reported`), or None}``. The written entry
    is remembered for the next save's delta; after a failed flush nothing is, and the save is kept
    as :class:`Unflushed`."""
    pending = state.services.pop(FLUSH, None)
    if not isinstance(pending, PendingFlush):
        return None
    try:
        entry = pending.done.result()
    except Exception as exc:
        state.services.pop(MANIFEST, None)  # never link chunks of a group whose flush failed
        state.services[UNFLUSHED] = Unflushed(pending.save_id, pending.epoch, pending.copies)
        return {"save_id": pending.save_id, "error": exc, "entry": None}
    remember(state, entry)
    return {"save_id": pending.save_id, "error": None, "entry": None if entry is None else reported(entry)}


def reuse_from(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    previous: Mapping[str, Any] | None,
    flushed: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The entry a node's next save reuses chunks from, after :func:`settle_flush` reported
    ``flushed``: none after a failed flush, else :func:`reuse_base` of ``previous``."""
    if flushed is not None and flushed["error"] is not None:
        return None
    return reuse_base(state, store, node, previous)


def small(blobs: dict[str, Any]) -> bool:
    """Whether a workspace is written whole by the background thread (see :data:`WRITE_LATER_UP_TO`)."""
    return sum(v.nbytes for v in blobs.values() if isinstance(v, np.ndarray)) <= WRITE_LATER_UP_TO


def write_later(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    epoch: int,
    blobs: dict[str, Any],
    *,
    save_id: str,
    previous: Mapping[str, Any] | None,
    retired: RetiredEpoch | None,
) -> dict[str, Any]:
    """Copy a small workspace and hand its whole write, and the flush, to the background thread;
    return the entry the write will return, computed here (see ``CheckpointStore.describe_node``)."""
    copies = snapshot(blobs, {})
    entry = store.describe_node(node, epoch, copies, save_id=save_id, previous=previous)
    done: Future[dict[str, Any] | None] = Future()
    unsynced = functools.partial(
        store.write_node_unsynced, node, epoch, copies, save_id=save_id, previous=previous, retired=retired
    )
    in_background(functools.partial(_write_there, unsynced, done))
    state.services[FLUSH] = PendingFlush(save_id, epoch, done, copies)
    return entry


def flush_later(state: NodeState, save_id: str, epoch: int, flush: GroupFlush) -> None:
    """Hand the fsync of a group written here to the process's next batch of syncs."""
    state.services[FLUSH] = PendingFlush(save_id, epoch, flush.soon())


def _write_there(
    unsynced: Callable[[], tuple[dict[str, Any], GroupFlush | None]], done: Future[dict[str, Any] | None]
) -> None:
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
    """A ``finish`` hook that waits for the node's background flush: ``{"flushed": outcome or None}``."""

    def __call__(self, state: NodeState) -> dict[str, Any]:
        return {"flushed": settle_flush(state)}


@dataclass(frozen=True)
class ResaveFinish:
    """A ``finish`` hook writing again, durably, the node's save ``save_id`` of ``epoch`` whose
    background flush failed: from the snapshot the background write kept, else from its group read
    back and verified against ``entry`` (what the node reported of it; see
    ``CheckpointStore.read_unflushed``). Returns ``{"entry"}`` (the rewritten group's, same save id)
    or ``{"error"}``.

    Nothing links chunks of the group written again: the node's next save already wrote whole (a
    node never links chunks of a group whose flush failed).
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    entry: Mapping[str, Any]

    def __call__(self, state: NodeState) -> dict[str, Any]:
        kept = state.services.get(UNFLUSHED)
        mine = isinstance(kept, Unflushed) and kept.save_id == self.save_id
        copies = kept.copies if isinstance(kept, Unflushed) and mine else None

        def write() -> dict[str, Any]:
            blobs = copies if copies is not None else self.store.read_unflushed(self.node, self.epoch, self.entry)
            return reported(self.store.write_node(self.node, self.epoch, blobs, save_id=self.save_id))

        written = outcome(write)
        if mine and "entry" in written:
            state.services.pop(UNFLUSHED, None)
        return written
