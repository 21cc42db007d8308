"""What the checkpoint keeps on a node between group runs: its save in flight, its snapshot buffers,
its background flush, its last entry, and the blobs a load read (one :class:`CheckpointSlots` per
node, in its ``NodeState``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from ..._model.values import Value
    from .._format.documents import NodeEntry
    from .async_saves import BackgroundSave
    from .fork import ForkedSave
    from .save_steps import PendingFlush, Unflushed


@dataclass(slots=True)
class CheckpointSlots:
    """A node's checkpoint state between group runs (see :func:`checkpoint_slots`)."""

    saver: BackgroundSave | ForkedSave | None = None
    """The node's asynchronous save in flight: at most one (see :mod:`.async_saves`)."""
    buffers: dict[str, Value] = field(default_factory=dict)
    """The copies of the last asynchronous save's snapshot, whose arrays the next one copies into."""
    flush: PendingFlush | None = None
    """The synchronous save whose fsync (or whole write) runs in the background."""
    unflushed: Unflushed | None = None
    """A save whose background flush failed, until the driver has it written again."""
    manifest: NodeEntry | None = None
    """The last entry the node wrote or loaded whole and verified: what its next save reuses chunks
    from without reading that manifest again (see ``reuse_base``)."""
    staged: tuple[str, dict[str, Value]] | None = None
    """``(load_id, blobs)`` a load read and verified, until it assigns them."""
    discarded: str | None = None
    """The ``load_id`` of the last load that failed: a read of it ending late keeps nothing."""


def checkpoint_slots(state: NodeState) -> CheckpointSlots:
    """The checkpoint's state on the node of ``state``."""
    return state.slot(CheckpointSlots)
