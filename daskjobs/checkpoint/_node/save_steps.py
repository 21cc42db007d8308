"""Checkpoint steps that run on a node's worker: save (now or in the background) and wait for it.

Each step class is marked :data:`~daskjobs._execution.node_run.INTERNAL`: the daskjobs errors it raises
(a failed write) surface as themselves, not as a user's task failure.
The ``*Finish`` classes are the same saves as hooks run at the end of an epoch's own Dask task
(:meth:`~daskjobs.Session.run_group` ``finish=``); they return their outcome instead of raising.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._execution.node_run import INTERNAL
from ..._model.values import copy_value
from ...errors import CheckpointError, CheckpointLockedError
from .._protocol.commits import RetiredEpoch
from .._storage.durable import deleting_in_background
from .delta import entry_array, remember, reported, reuse_base, snapshot
from .flushes import FLUSH, UNFLUSHED, flush_later, outcome, reuse_from, settle_flush, small, write_later
from .fork import ForkedSave, forks

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from ..._model.workspace import Workspace
    from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")

ENTRY_BLOB = "daskjobs.checkpoint_entry"
"""Output blob through which a node's save task returns the (small, JSON) summary of its entry."""
SAVER = "daskjobs.background_save"
BUFFERS = "daskjobs.snapshot_buffers"


class BackgroundSave:
    """One node's checkpoint write running in a thread; at most one per node."""

    def __init__(
        self,
        store: CheckpointStore,
        node: str,
        epoch: int,
        save_id: str,
        blobs: dict[str, np.ndarray],
        previous: dict[str, Any] | None = None,
    ) -> None:
        self.store, self.node, self.epoch, self.save_id, self.blobs = store, node, epoch, save_id, blobs
        self.previous = previous
        self._entry: dict[str, Any] | None = None
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

    def result(self) -> dict[str, Any]:
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
    previous: dict[str, Any] | None,
    snapshot_mode: str,
) -> None:
    """Snapshot the node's GLOBAL workspace now and start writing it in the background.

    ``snapshot_mode="fork"``: a forked child writes its copy-on-write image of the arrays
    (:mod:`.fork`); ``"copy"``: the arrays are copied and a thread writes the copies;
    ``"auto"``: fork for a big workspace (:func:`~.fork.forks`). JSON values are copied (and
    checked) in both.
    """
    with state.lock:
        if forks(snapshot_mode, state.scope.blobs):
            blobs = {
                name: value if isinstance(value, np.ndarray) else copy_value(value, name)
                for name, value in state.scope.blobs.items()
            }
            state.services.pop(BUFFERS, None)
            state.services[SAVER] = ForkedSave(store, node, epoch, save_id, blobs, previous)
            return
        copies = snapshot(state.scope.blobs, state.services.get(BUFFERS, {}))
    state.services[BUFFERS] = copies
    state.services[SAVER] = BackgroundSave(store, node, epoch, save_id, copies, previous)


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
    previous: dict[str, Any] | None = None
    snapshot_mode: str = "copy"
    """``"fork"``, ``"copy"`` or ``"auto"`` (see :func:`start_background`)."""

    def __call__(self, ws: Workspace) -> None:
        state = ws._state
        running = state.services.get(SAVER)
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
        state = ws._state
        saver = state.services.get(SAVER)
        if saver is None or saver.save_id != self.save_id:
            raise CheckpointError(
                f"node {self.node!r} has no save of epoch {self.epoch} in flight (its worker restarted?); "
                "save the epoch again"
            )
        entry = saver.result()
        state.services.pop(SAVER, None)
        remember(state, entry)
        ws[ENTRY_BLOB] = entry_array(entry)


@dataclass(frozen=True)
class EndWrites:
    """A ``finish`` hook ending the node's background writes without using them: a forked writer of
    an asynchronous save is killed, a writing thread is waited for, and so is a synchronous save's
    background flush (its outcome, and a save whose flush failed, are dropped). What they wrote
    stays uncommitted debris, which nothing writes to any more."""

    def __call__(self, state: NodeState) -> None:
        settle_flush(state)
        state.services.pop(UNFLUSHED, None)
        saver = state.services.pop(SAVER, None)
        if saver is None:
            return
        pid = getattr(saver, "pid", None)
        if pid is not None and not saver.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        saver.join()


@dataclass(frozen=True)
class SaveStep:
    """Writes the node's whole GLOBAL workspace; returns the entry as the task output."""

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous: dict[str, Any] | None = None

    def __call__(self, ws: Workspace) -> None:
        state = ws._state
        with state.lock:
            blobs = dict(state.scope.blobs)
        previous = reuse_from(state, self.store, self.node, self.previous, settle_flush(state))
        entry = self.store.write_node(self.node, self.epoch, blobs, save_id=self.save_id, previous=previous)
        remember(state, entry)
        ws[ENTRY_BLOB] = entry_array(entry)


@dataclass(frozen=True)
class SaveFinish:
    """:class:`SaveStep` as an epoch's ``finish`` hook: returns ``{"entry"}`` or ``{"error"}``, and
    under ``"flushed"`` the outcome of the node's previous background flush (see :func:`settle_flush`).

    ``flush_later``: the group's fsync runs in the background while the next epoch runs; the
    entry then says ``"later": True`` and the next hook (or :class:`FlushFinish`) reports the
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
    previous: dict[str, Any] | None = None
    flush_later: bool = False
    doomed: tuple[tuple[int, Mapping[str, Any] | None], ...] = ()

    def __call__(self, state: NodeState) -> dict[str, Any]:
        with state.lock:
            blobs = dict(state.scope.blobs)
        flushed = settle_flush(state)
        previous = reuse_from(state, self.store, self.node, self.previous, flushed)
        retired = RetiredEpoch(self.doomed[0][0], {self.node: self.doomed[0][1]}) if self.doomed else None
        if self.doomed[1:]:
            deleting_in_background(functools.partial(delete_groups, self.store, self.node, self.doomed[1:]))
        store, node, epoch, save_id = self.store, self.node, self.epoch, self.save_id

        def write() -> dict[str, Any]:
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

        return {**outcome(write), "later": FLUSH in state.services, "flushed": flushed}


def delete_groups(store: CheckpointStore, node: str, doomed: tuple[tuple[int, Mapping[str, Any] | None], ...]) -> None:
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


@dataclass(frozen=True)
class AsyncSaveFinish:
    """An epoch's ``finish`` hook with asynchronous saves.

    On the node: waits for the save in flight (``previous_id``, the epoch before) and reports its
    outcome, then snapshots the workspace and starts writing ``epoch`` in the background.
    Returns ``{"previous": {"entry"} | {"error"} | None, "error": None | exception}``, the
    latter for a failure to start this epoch's save.
    """

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous_id: str | None
    previous: dict[str, Any] | None = None
    """The summary of the newest committed epoch's node entry, for delta reuse. The entry of the save
    in flight, when it succeeded on this node, is newer: chunks are then reused from that epoch instead."""
    snapshot_mode: str = "copy"
    """``"fork"``, ``"copy"`` or ``"auto"`` (see :func:`start_background`)."""
    delta: bool = True
    """Whether chunks may be reused at all (the manager's ``delta``)."""

    def __call__(self, state: NodeState) -> dict[str, Any]:
        running = state.services.pop(SAVER, None)
        previous = None
        if running is not None:
            if running.save_id == self.previous_id:
                previous = outcome(running.result)
                remember(state, previous.get("entry"))
            else:  # a save the driver gave up on: let it end, never two in flight
                running.join()
        if self.previous_id is not None and previous is None:
            previous = {
                "error": CheckpointError(
                    f"node {self.node!r} has no save in flight for the epoch before {self.epoch} "
                    "(its worker restarted?); save that epoch again"
                )
            }

        written = (previous or {}).get("entry") if self.delta else None
        if written is not None and written.get("epoch", -1) > (self.previous or {}).get("epoch", -1):
            base: dict[str, Any] | None = written  # a failed link to it (its epoch given up) writes the bytes
        else:
            base = reuse_base(state, self.store, self.node, self.previous)

        def start() -> dict[str, Any]:
            start_background(state, self.store, self.node, self.epoch, self.save_id, base, self.snapshot_mode)
            return {}

        if previous is not None and previous.get("entry") is not None:
            previous = {"entry": reported(previous["entry"])}
        return {"previous": previous, "error": outcome(start).get("error")}


for _step in (AsyncSaveStep, WaitSaveStep, SaveStep):
    setattr(_step, INTERNAL, True)
