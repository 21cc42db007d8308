"""Tier 0 on a node's worker: the epoch's ``finish`` hook that keeps the node's snapshot in memory
and, on a durable epoch, writes the same snapshot to the prefix (SPEC §3).

:class:`KeepFinish` copies the node's GLOBAL workspace exactly as a save would write it (arrays,
JSON values, reader positions) and hands the copy to the node's
:class:`~daskjobs._execution.memory.SnapshotKeeper` (its worker's memory, with replicas sent to
peers in the background). On a durable epoch the copy is also written under the prefix: in the
process's background write thread while the next epochs run (its entry and flush reported by a
later hook, as a synchronous save's background flush is), or at once where the run cannot defer
commits. Like every ``*Finish`` hook it returns its outcome instead of raising.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._execution.memory import KeepOrder, snapshot_bytes
from ...errors import CheckpointWriteError
from .._format.records import MANIFEST_KEY
from .._protocol.commits import RetiredEpoch
from .._storage.durable import deleting_in_background
from .save_steps import (
    FLUSH,
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

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..._execution.node_run import NodeState
    from .._protocol.store import CheckpointStore


@dataclass(frozen=True)
class DurableWrite:
    """How a node writes a durable epoch's snapshot under the prefix: the save ``save_id``, the entry
    it reuses chunks from (``previous``, delta), in the background or at once, and the node's groups
    of epochs retention un-committed (``doomed``, see ``SaveFinish``)."""

    store: CheckpointStore
    save_id: str
    previous: dict[str, Any] | None = None
    background: bool = False
    doomed: tuple[tuple[int, Mapping[str, Any] | None], ...] = ()


def provisional_entry(node: str, epoch: int, save_id: str, blobs: Mapping[str, Any]) -> dict[str, Any]:
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
    and written under the prefix when ``durable`` is given.

    Returns ``{"memory": {"bytes", "holder"}}`` (or ``{"memory_error": exception}``: the snapshot
    does not fit), ``{"pushes": [...]}`` (replicas of earlier epochs that could not be sent), the
    outcome of the node's earlier background write (``"flushed"``, only once it ended: a hook of a
    memory-only epoch never waits for it), and on a durable epoch ``{"entry"}`` or ``{"error"}``
    with ``"later"`` as ``SaveFinish`` returns them.
    """

    order: KeepOrder
    durable: DurableWrite | None = None

    def __call__(self, state: NodeState) -> dict[str, Any]:
        with state.lock:
            blobs = dict(state.scope.blobs)
        result: dict[str, Any] = {}
        copies = None
        keeper = state.memory
        if keeper is None:
            result["memory_error"] = CheckpointWriteError(
                f"node {self.order.node!r}: its session keeps no tier-0 snapshots (in_memory=True needs a "
                "LocalSession or a DaskSession)"
            )
        else:
            try:
                keeper.check_fits(self.order, snapshot_bytes(blobs))
                copies = snapshot(blobs, {})
                result["memory"] = keeper.keep(self.order, copies)
            except Exception as exc:
                result["memory_error"] = exc
            result["pushes"] = keeper.failures(self.order.node)
        if self.durable is None:
            return {**result, **poll_flush(state)}
        return {**result, **self._write(state, blobs, copies)}

    def _write(self, state: NodeState, blobs: dict[str, Any], copies: dict[str, Any] | None) -> dict[str, Any]:
        """Write the epoch under the prefix (see the class docstring): from the snapshot in the
        background, else (no snapshot, or no deferred commits) at once from the workspace."""
        durable, node, epoch = self.durable, self.order.node, self.order.epoch
        assert durable is not None
        store, save_id = durable.store, durable.save_id
        flushed = settle_flush(state)  # one write under the prefix in flight per node
        previous = reuse_from(state, store, node, durable.previous, flushed)
        background = durable.background and copies is not None
        retired = RetiredEpoch(durable.doomed[0][0], {node: durable.doomed[0][1]}) if durable.doomed else None
        if durable.doomed[1:]:
            deleting_in_background(functools.partial(delete_groups, store, node, durable.doomed[1:]))

        def write() -> dict[str, Any]:
            if background and copies is not None:
                write_in_background(
                    state, store, node, epoch, copies, save_id=save_id, previous=previous, retired=retired
                )
                return provisional_entry(node, epoch, save_id, copies)
            entry = store.write_node(node, epoch, blobs, save_id=save_id, previous=previous)
            remember(state, entry)
            return reported(entry)

        return {**outcome(write), "later": FLUSH in state.services, "flushed": flushed}
