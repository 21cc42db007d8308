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
from ...errors import CheckpointError, CheckpointWriteError
from .._storage.deadline import Deadline
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


def still_writing(saver: Saver) -> CheckpointWriteError:
    """The error of a node's asynchronous save ``saver``, still running when a wait for it ran out."""
    what = f"the asynchronous save of node {saver.node!r} at epoch {saver.epoch} to {saver.path}"
    return CheckpointWriteError((saver.overdue or Deadline()).message(what))


def not_started(node: str, epoch: int, running: Saver) -> CheckpointWriteError:
    """Why ``node``'s save of ``epoch`` does not start: its save ``running`` still writes."""
    return CheckpointWriteError(
        f"node {node!r} does not start its save of epoch {epoch} (never two saves of a node in flight): "
        f"{still_writing(running)}"
    )


class BackgroundSave:
    """One node's checkpoint write running in a daemon thread; at most one per node.

    A thread stuck in the OS cannot be stopped: waiting for it (:meth:`join`, :meth:`result`) ends at
    ``daskjobs.storage-timeout`` and leaves it running, still the node's save in flight (:attr:`overdue`).
    """

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
        self.path = store.db_name(node, epoch)
        self.overdue: Deadline | None = None
        """The first wait for the write that ran out, if one did: later waits only look (see :meth:`join`)."""
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

    def join(self, deadline: Deadline) -> bool:
        """Wait for the write to end, successfully or not, until ``deadline``; whether it did. Once a
        wait ran out, only look: a write stuck in the storage holds up no later save for as long again."""
        if self.overdue is None and not deadline.joined(self._thread):
            self.overdue = deadline
        return self.done()

    def result(self) -> NodeEntry:
        """Wait for the write (at most ``daskjobs.storage-timeout``: then a
        :class:`CheckpointWriteError` naming node, epoch and path); after a failure, try once more
        synchronously, then raise."""
        if not self.join(Deadline()):
            raise still_writing(self)
        if self._error is not None:
            self._error = None
            self._write()
        if self._error is not None:
            raise self._error
        assert self._entry is not None
        return self._entry


Saver = BackgroundSave | ForkedSave
"""A node's asynchronous save in flight, in a thread or a forked child."""


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
    waited for first: never two in flight, never two writers of one group. One still running after
    ``daskjobs.storage-timeout`` fails this save with :class:`CheckpointWriteError`.
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
        if running is not None and not running.join(Deadline()):
            raise not_started(self.node, self.epoch, running)
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
    both (see :class:`~.outcomes.AsyncSaveOutcome`). A save still running after
    ``daskjobs.storage-timeout`` failed, and stays the node's save in flight: ``epoch``'s save does
    not start (never two in flight), nor do the next ones while it runs.
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
                running.join(Deadline())
            if not running.done():  # stuck in the storage: still the node's save in flight
                slots.saver = running
                return AsyncSaveOutcome(previous, not_started(self.node, self.epoch, running))
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
    stays uncommitted debris, which nothing writes to any more. Each wait ends at
    ``daskjobs.storage-timeout``: a writing thread still running then stays the node's save in
    flight (no save of the node starts while it runs)."""

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
        if not saver.join(Deadline()):
            slots.saver = saver


for _step in (AsyncSaveStep, WaitSaveStep):
    setattr(_step, INTERNAL, True)
