"""Checkpoint steps that run on a node's worker: save (now or in the background), wait, load, check."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._validation import copy_value
from ..errors import CheckpointError

if TYPE_CHECKING:
    from .._workspace import Workspace
    from ._store import CheckpointStore

ENTRY_BLOB = "daskjobs.checkpoint_entry"
"""Output blob through which a node's save task returns its (small, JSON) checkpoint entry."""
SAVER = "daskjobs.background_save"
BUFFERS = "daskjobs.snapshot_buffers"


def entry_array(entry: dict[str, Any]) -> np.ndarray:
    """A node's checkpoint entry as a uint8 blob, the form in which save tasks return it."""
    return np.frombuffer(json.dumps(entry).encode(), dtype=np.uint8).copy()


def snapshot(blobs: dict[str, Any], buffers: dict[str, Any]) -> dict[str, Any]:
    """Copy ``blobs``, reusing same-shaped arrays of the previous snapshot (warm memory copies ~10x faster).

    JSON values are deep-copied with :func:`~daskjobs._validation.copy_value`.
    """
    copies = {}
    for name, value in blobs.items():
        buffer = buffers.get(name)
        if not isinstance(value, np.ndarray):
            buffer = copy_value(value, name)
        elif isinstance(buffer, np.ndarray) and buffer.shape == value.shape and buffer.dtype == value.dtype:
            np.copyto(buffer, value)
        else:
            buffer = np.array(value, copy=True, order="C")
        copies[name] = buffer
    return copies


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


@dataclass(frozen=True)
class AsyncSaveStep:
    """Snapshots the node's GLOBAL workspace and starts writing it in the background."""

    store: CheckpointStore
    node: str
    epoch: int
    save_id: str
    previous: dict[str, Any] | None = None

    def __call__(self, ws: Workspace) -> None:
        state = ws._state
        running = state.services.get(SAVER)
        if running is not None and not running.done():
            raise CheckpointError(
                f"node {self.node!r} still writes epoch {running.epoch}; wait for it before saving epoch {self.epoch}"
            )
        with state.lock:
            copies = snapshot(state.scope.blobs, state.services.get(BUFFERS, {}))
        state.services[BUFFERS] = copies
        state.services[SAVER] = BackgroundSave(self.store, self.node, self.epoch, self.save_id, copies, self.previous)


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
        ws[ENTRY_BLOB] = entry_array(entry)


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
        entry = self.store.write_node(self.node, self.epoch, blobs, save_id=self.save_id, previous=self.previous)
        ws[ENTRY_BLOB] = entry_array(entry)


@dataclass(frozen=True)
class LoadStep:
    """Reads a node's verified blobs; a full load replaces the workspace, a partial one adds."""

    store: CheckpointStore
    node: str
    epoch: int
    entry: dict[str, Any]
    names: tuple[str, ...] | None = None

    def __call__(self, ws: Workspace) -> None:
        blobs = self.store.read_node(self.node, self.epoch, self.entry, self.names)
        state = ws._state
        if self.names is None:
            state.replace_blobs(blobs)
        else:
            with state.lock:
                state.scope.blobs.update(blobs)


@dataclass(frozen=True)
class CheckStep:
    """Pre-flight on the node: the prefix is writable, or the epoch to resume from is readable."""

    store: CheckpointStore
    node: str
    epoch: int | None

    def __call__(self, ws: Workspace) -> None:
        if self.epoch is None:
            self.store.check_writable()
        else:
            self.store.read_node_entry(self.node, self.epoch)
