"""Tier 0 on a node's worker: the epoch's ``finish`` hook that keeps the node's snapshot in memory
and, on a durable epoch, writes the same snapshot to the prefix (SPEC §3).

:class:`KeepFinish` copies the node's GLOBAL workspace exactly as a save would write it (arrays,
JSON values, reader positions) and hands the copy to the node's
:class:`~daskjobs._execution.memory.SnapshotKeeper` (its worker's memory, with replicas sent to
peers in the background). On a durable epoch the copy is also written under the prefix: in the
process's background write thread while the next epochs run (its entry and flush reported by a
later hook, as a synchronous save's background flush is), or at once where the run cannot defer
commits. Like every ``*Finish`` hook it returns its outcome (:class:`KeepOutcome`) instead of raising.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._execution.memory import KeepOrder, snapshot_bytes
from ...errors import CheckpointWriteError
from .._format.records import MANIFEST_KEY
from .._protocol.commits import RetiredEpoch
from .._storage.durable import deleting_in_background
from .outcomes import KeepOutcome, SaveOutcome
from .save_steps import (
    delete_groups,
    outcome,
    poll_flush,
    remember,
    reported,
    reuse_from,
    settle_flush,
    snapshot,
    write_in_background,
)
from .slots import checkpoint_slots

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..._execution.node_run import NodeState
    from ..._model.values import Value
    from .._format.documents import CommittedEntry, EntryReport, PreviousEntry
    from .._protocol.store import CheckpointStore


@dataclass(frozen=True)
class DurableWrite:
    """How a node writes a durable epoch's snapshot under the prefix: the save ``save_id``, the entry
    it reuses chunks from (``previous``, delta), in the background or at once, and the node's groups
    of epochs retention un-committed (``doomed``, see ``SaveFinish``)."""

    store: CheckpointStore
    save_id: str
    previous: PreviousEntry | None = None
    background: bool = False
    doomed: tuple[tuple[int, CommittedEntry | None], ...] = ()


def provisional_entry(node: str, epoch: int, save_id: str, blobs: Mapping[str, Value]) -> EntryReport:
    """What a node reports of a group its background thread is still writing: the save it belongs
    to and its size; its manifest (and the bytes written and reused) come with the flush's report,
    which replaces it before the epoch can be committed."""
    return {
        "node": node,
        "epoch": epoch,
        "save_id": save_id,
        "bytes": snapshot_bytes(blobs),
        "bytes_written": 0,
        "bytes_reused": 0,
        "seconds": 0.0,
        MANIFEST_KEY: None,
    }


@dataclass(frozen=True)
class KeepFinish:
    """An epoch's ``finish`` hook with tier 0: the node's snapshot kept in memory as ``order`` says,
    and written under the prefix when ``durable`` is given. Returns a :class:`KeepOutcome`."""

    order: KeepOrder
    durable: DurableWrite | None = None

    def __call__(self, state: NodeState) -> KeepOutcome:
        with state.lock:
            blobs = dict(state.scope.blobs)
        keeper = state.memory
        if keeper is None:
            error = CheckpointWriteError(
                f"node {self.order.node!r}: its session keeps no tier-0 snapshots (in_memory=True needs a "
                "LocalSession or a DaskSession)"
            )
            kept = self._durably(state, blobs, None)
            return dataclasses.replace(kept, error=error)
        try:
            nbytes = snapshot_bytes(blobs)
            keeper.check_fits(self.order, nbytes)
            copies = snapshot(blobs, {})
            memory = keeper.keep(self.order, copies, nbytes)
        except Exception as exc:
            kept = self._durably(state, blobs, None)
            return dataclasses.replace(kept, error=exc, pushes=tuple(keeper.failures(self.order.node)))
        kept = self._durably(state, blobs, copies)
        return dataclasses.replace(kept, kept=memory, pushes=tuple(keeper.failures(self.order.node)))

    def _durably(self, state: NodeState, blobs: dict[str, Value], copies: dict[str, Value] | None) -> KeepOutcome:
        """The epoch's durable part: its write under the prefix on a durable epoch, else a look at the
        node's earlier background write."""
        if self.durable is None:
            return KeepOutcome(flush=poll_flush(state))
        return KeepOutcome(save=self._write(state, blobs, copies))

    def _write(self, state: NodeState, blobs: dict[str, Value], copies: dict[str, Value] | None) -> SaveOutcome:
        """Write the epoch under the prefix: from the snapshot in the background, else (no snapshot, or
        no deferred commits) at once from the workspace."""
        durable, node, epoch = self.durable, self.order.node, self.order.epoch
        assert durable is not None
        store, save_id = durable.store, durable.save_id
        flushed = settle_flush(state)  # one write under the prefix in flight per node
        previous = reuse_from(state, store, node, durable.previous, flushed)
        background = durable.background and copies is not None
        retired = RetiredEpoch(durable.doomed[0][0], {node: durable.doomed[0][1]}) if durable.doomed else None
        if durable.doomed[1:]:
            deleting_in_background(functools.partial(delete_groups, store, node, durable.doomed[1:]))

        def write() -> EntryReport:
            if background and copies is not None:
                write_in_background(
                    state, store, node, epoch, copies, save_id=save_id, previous=previous, retired=retired
                )
                return provisional_entry(node, epoch, save_id, copies)
            entry = store.write_node(node, epoch, blobs, save_id=save_id, previous=previous)
            remember(state, entry)
            return reported(entry)

        written = outcome(write)
        return dataclasses.replace(written, later=checkpoint_slots(state).flush is not None, flushed=flushed)
