"""Asynchronous saves on a node's worker: the workspace is snapshot at the epoch boundary and written
in the background while the next epoch runs (by a thread, or a forked child: :mod:`.fork`), one
save in flight per node; and ending a node's background writes when a run fails.

:class:`AsyncSaveStep` and :class:`WaitSaveStep` are marked
:data:`~daskjobs._execution.node_run.INTERNAL`: the daskjobs errors they raise surface as themselves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..._execution.node_run import INTERNAL
from ..._model.values import copy_value
from ..._model.workspace import node_state
from ...errors import CheckpointError
from .fork import ForkedSave, forks
from .outcomes import AsyncSaveOutcome, SaveOutcome
from .save_steps import (
    ENTRY_BLOB,
    entry_array,
    remember,
    reported,
    reuse_base,
    settle_flush,
    snapshot,
)
from .slots import checkpoint_slots

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from ..._model.values import Value
    from ..._model.workspace import Workspace
    from .._format.documents import NodeEntry, PreviousEntry
    from .._protocol.store import CheckpointStore


class BackgroundSave:
    """One node's checkpoint write running in a thread; at most one per node."""

    def __init__(
        self,
        store: CheckpointStore,
        node: str,
        epoch: int,
        save_id: str,
        blobs: dict[str, Value],
        previous: NodeEntry | None = None,
    ) -> None:
        self.store, self.node, self.epoch, self.save_id, self.blobs = store, node, epoch, save_id, blobs
        self.previous = previous
        self._entry: NodeEntry | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name=f"daskjobs-save-{node}-{epoch}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            self._entry = self.store.write_node(
                self.node, self.epoch, self.blobs, save_id=self.save_id, previous=self.previous
            )
        except BaseException as exc:
            self._error = exc

    def done(self) -> bool:
        """Whether the write has finished (successfully or not)."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the write to end, successfully or not."""
        self._thread.join()

    def result(self) -> NodeEntry:
        """Wait for the write; after a failure, try once more synchronously, then raise."""
        self._thread.join()
        if self._error is not None:
            self._error = None
            self._write()
        if self._error is not None:
            raise self._error
        assert self._entry is not None
        return self._entry


def start_background(
    state: NodeState,
    store: CheckpointStore,
    node: str,
    epoch: int,
    save_id: str,
    previous: NodeEntry | None,
    snapshot_mode: str,
) -> None:
    """Snapshot the node's GLOBAL workspace now and start writing it in the background.

    ``snapshot_mode="fork"``: a forked child writes its copy-on-write image of the arrays
    (:mod:`.fork`); ``"copy"``: the arrays are copied and a thread writes the copies;
    ``"auto"``: fork for a big workspace (:func:`~.fork.forks`). JSON values are copied (and
    checked) in both.
    """
    slots = checkpoint_slots(state)
    with state.lock:
        if forks(snapshot_mode, state.scope.blobs):
            blobs = {
                name: value if isinstance(value, np.ndarray) else copy_value(value, name)
                for name, value in state.scope.blobs.items()
            }
            slots.buffers = {}
            slots.saver = ForkedSave(store, node, epoch, save_id, blobs, previous)
            return
        copies = snapshot(state.scope.blobs, slots.buffers)
    slots.buffers = copies
    slots.saver = BackgroundSave(store, node, epoch, save_id, copies, previous)


@dataclass(frozen=True)
class AsyncSaveStep:
    """Snapshots the node's GLOBAL workspace and starts writing it in the background.

    A save still running on the node (one the driver gave up on, e.g. after a node loss) is
    waited for first: never two in flight, never two writers of one group.
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous: PreviousEntry | None = None
    snapshot_mode: str = "copy"
    """``"fork"``, ``"copy"`` or ``"auto"`` (see :func:`start_background`)."""

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        running = checkpoint_slots(state).saver
        if running is not None:
            running.join()
        base = reuse_base(state, self.store, self.node, self.previous)
        start_background(state, self.store, self.node, self.epoch, self.save_id, base, self.snapshot_mode)


@dataclass(frozen=True)
class WaitSaveStep:
    """Waits for the node's background save of ``epoch`` and returns its entry as the task output."""

    node: str
    epoch: int
    save_id: str

    def __call__(self, ws: Workspace) -> None:
        state = node_state(ws)
        slots = checkpoint_slots(state)
        saver = slots.saver
        if saver is None or saver.save_id != self.save_id:
            raise CheckpointError(
                f"node {self.node!r} has no save of epoch {self.epoch} in flight (its worker restarted?); "
                "save the epoch again"
            )
        entry = saver.result()
        slots.saver = None
        remember(state, entry)
        ws[ENTRY_BLOB] = entry_array(entry)


@dataclass(frozen=True)
class AsyncSaveFinish:
    """An epoch's ``finish`` hook with asynchronous saves.

    On the node: waits for the save in flight (``previous_id``, the epoch before) and reports its
    outcome, then snapshots the workspace and starts writing ``epoch`` in the background; returns
    both (see :class:`~.outcomes.AsyncSaveOutcome`).
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous_id: str | None
    previous: PreviousEntry | None = None
    """The summary of the newest committed epoch's node entry, for delta reuse. The entry of the save
    in flight, when it succeeded on this node, is newer: chunks are then reused from that epoch instead."""
    snapshot_mode: str = "copy"
    """``"fork"``, ``"copy"`` or ``"auto"`` (see :func:`start_background`)."""
    delta: bool = True
    """Whether chunks may be reused at all (the manager's ``delta``)."""

    def __call__(self, state: NodeState) -> AsyncSaveOutcome:
        slots = checkpoint_slots(state)
        running, slots.saver = slots.saver, None
        previous: SaveOutcome | None = None
        written: NodeEntry | None = None
        if running is not None:
            if running.save_id == self.previous_id:
                try:
                    written = running.result()
                except Exception as exc:
                    previous = SaveOutcome(error=exc)
                else:
                    previous = SaveOutcome(entry=reported(written))
                remember(state, written)
            else:  # a save the driver gave up on: let it end, never two in flight
                running.join()
        if self.previous_id is not None and previous is None:
            previous = SaveOutcome(
                error=CheckpointError(
                    f"node {self.node!r} has no save in flight for the epoch before {self.epoch} "
                    "(its worker restarted?); save that epoch again"
                )
            )

        committed = -1 if self.previous is None else self.previous["epoch"]
        if self.delta and written is not None and written["epoch"] > committed:
            base: NodeEntry | None = written  # a failed link to it (its epoch given up) writes the bytes
        else:
            base = reuse_base(state, self.store, self.node, self.previous)
        try:
            start_background(state, self.store, self.node, self.epoch, self.save_id, base, self.snapshot_mode)
        except Exception as exc:
            return AsyncSaveOutcome(previous, exc)
        return AsyncSaveOutcome(previous)


@dataclass(frozen=True)
class EndWrites:
    """A ``finish`` hook ending the node's background writes without using them: a forked writer of
    an asynchronous save is killed, a writing thread is waited for, and so is a synchronous save's
    background flush (its outcome, and a save whose flush failed, are dropped). What they wrote
    stays uncommitted debris, which nothing writes to any more."""

    def __call__(self, state: NodeState) -> None:
        settle_flush(state)
        slots = checkpoint_slots(state)
        saver, slots.unflushed, slots.saver = slots.saver, None, None
        if saver is None:
            return
        pid = getattr(saver, "pid", None)
        if pid is not None and not saver.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        saver.join()


for _step in (AsyncSaveStep, WaitSaveStep):
    setattr(_step, INTERNAL, True)
