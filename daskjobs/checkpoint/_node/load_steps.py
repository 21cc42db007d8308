"""Checkpoint steps that run on a node's worker for a load (read, then assign or discard) and the
pre-flight check of a run.

Each step class is marked :data:`~daskjobs._execution.node_run.INTERNAL`: the daskjobs errors it raises (a
corrupt checkpoint) surface as themselves, not as a user's task failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._execution.node_run import INTERNAL
from ..._model.workspace import node_state
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .save_steps import remember
from .sharing import unseen_commit
from .slots import checkpoint_slots

if TYPE_CHECKING:
    from ..._model.workspace import Workspace
    from .._format.documents import CommittedEntry
    from .._protocol.store import CheckpointStore

READ_BLOB = "daskjobs.blobs_read"
"""Output blob through which a partial load's read task tells every node's assignment it succeeded."""


@dataclass(frozen=True)
class ReadStep:
    """The first half of a load: reads and verifies the node's blobs (``names``, skipping those the
    entry lacks; ``None``: all) and keeps them on the node, outside its workspace, for :class:`AssignStep`.

    ``entry`` is what the commit record holds of the node: from format version 4 on, the summary
    naming its manifest, which the node reads and verifies itself (the driver never reads it). The
    verified entry is kept for the node's next save (delta reuse without reading it again).

    The task's output (``READ_BLOB``) is what every node's :class:`AssignStep` waits for: no
    workspace changes before every node read its blobs.
    """

    store: CheckpointStore
    node: str
    epoch: int
    entry: CommittedEntry
    names: tuple[str, ...] | None
    load_id: str

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        slots = checkpoint_slots(state)
        slots.staged = None  # what a failed earlier load left
        try:
            entry = self.store.resolve_entry(self.node, self.epoch, self.entry)
            blobs = self.store.read_node(self.node, self.epoch, entry, self.names, entry_validated=True)
        except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
            if self.store.has_group(self.node, self.epoch):
                raise
            raise unseen_commit(self.store, self.node, self.epoch, state.where) or exc from None
        with state.lock:  # the load may have failed on another node, and been discarded, meanwhile
            if slots.discarded != self.load_id:
                slots.staged = (self.load_id, blobs)
                remember(state, entry)
        ws[READ_BLOB] = True


@dataclass(frozen=True)
class AssignStep:
    """The second half of a load: puts the blobs :class:`ReadStep` kept into the node's GLOBAL
    workspace (run once every node's read succeeded): added to it, or with ``replace`` in place of
    everything it held (a whole load)."""

    node: str
    epoch: int
    load_id: str
    replace: bool = False

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        slots = checkpoint_slots(state)
        staged, slots.staged = slots.staged, None
        if staged is None or staged[0] != self.load_id:
            raise CheckpointError(
                f"node {self.node!r} holds no blobs read for this load of epoch {self.epoch} "
                "(its worker restarted?); load again"
            )
        if self.replace:
            state.replace_blobs(staged[1])
            return
        with state.lock:
            state.scope.blobs.update(staged[1])


@dataclass(frozen=True)
class DiscardStep:
    """After a failed partial load: drop the blobs the node read for it, and keep a read of that
    load still running on the node from keeping them."""

    load_id: str

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        slots = checkpoint_slots(state)
        with state.lock:
            slots.discarded = self.load_id
            if slots.staged is not None and slots.staged[0] == self.load_id:
                slots.staged = None


@dataclass(frozen=True)
class CheckStep:
    """Pre-flight on the node: the prefix is writable, or the epoch to resume from is readable.

    A committed epoch without the node's group is corrupt (:class:`CheckpointCorruptError`); an
    epoch that is not committed is not found (:class:`CheckpointNotFoundError`).
    """

    store: CheckpointStore
    node: str
    epoch: int | None
    committed: bool = False
    """Whether the driver saw ``epoch`` committed: a node that does not then sees another directory."""

    def __call__(self, ws: Workspace) -> None:
        if self.epoch is None:
            self.store.check_writable()
            return
        try:
            self.store.read_node_entry(self.node, self.epoch)
        except CheckpointNotFoundError:
            unseen = unseen_commit(self.store, self.node, self.epoch, node_state(ws).where) if self.committed else None
            if unseen is not None:
                raise unseen from None
            if self.epoch not in self.store.committed_epochs():
                raise
            group = self.store.db_name(self.node, self.epoch)
            raise CheckpointCorruptError(
                f"epoch {self.epoch}, node {self.node!r}: the node's group {group} (or its zarr.json) is missing, "
                f"although epoch {self.epoch} is committed; resume from another committed epoch"
            ) from None


for _step in (ReadStep, AssignStep, DiscardStep, CheckStep):
    setattr(_step, INTERNAL, True)
