"""What a node keeps of the checkpoints it wrote or loaded, and what it tells the driver of them:
the summary of an entry (never its blobs), the last entry for the next save's delta, and the
snapshot a background write takes of a workspace."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._model.values import copy_value
from ...errors import CheckpointError
from .._format.manifests import is_summary
from .._format.records import MANIFEST_KEY

if TYPE_CHECKING:
    from ..._execution.node_run import NodeState
    from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")

MANIFEST = "daskjobs.last_manifest"
"""Node service holding the last entry the node wrote or loaded whole and verified: what its next
save reuses chunks from without reading that manifest again (see :func:`reuse_base`)."""
_REPORTED = ("node", "epoch", "save_id", "bytes", "bytes_written", "bytes_reused", "seconds")


def reported(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What a node tells the driver of an entry it wrote: its totals and the reference of its manifest
    (``None`` for an entry described before its group was written), never its blobs: the driver's
    work and messages stay the same size whatever a node holds."""
    ref = entry.get(MANIFEST_KEY)
    return {**{key: entry[key] for key in _REPORTED}, MANIFEST_KEY: dict(ref) if isinstance(ref, Mapping) else None}


def entry_array(entry: dict[str, Any]) -> np.ndarray:
    """What a node tells the driver of its entry (:func:`reported`) as a uint8 blob, the form in which
    save tasks return it."""
    return np.frombuffer(json.dumps(reported(entry)).encode(), dtype=np.uint8).copy()


def remember(state: NodeState, entry: Mapping[str, Any] | None) -> None:
    """Keep ``entry`` (written by this node, or loaded whole and verified) for the next save's delta."""
    if entry is not None and isinstance(entry.get(MANIFEST_KEY), Mapping):
        state.services[MANIFEST] = dict(entry)


def reuse_base(
    state: NodeState, store: CheckpointStore, node: str, previous: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The whole entry a save reuses chunks from, given what the driver named (``previous``: the
    summary of the newest earlier save, or a whole entry of a record before format version 4).

    The node's own last entry (:func:`remember`) when it is that save (same epoch, save id and
    manifest); else that manifest, read and verified against the summary. A manifest that is
    missing or does not match is never reused from: the save writes every chunk (a warning names
    the :class:`~daskjobs.errors.CheckpointCorruptError`).
    """
    if previous is None or not is_summary(previous):
        return None if previous is None else dict(previous)
    ref = previous.get(MANIFEST_KEY)
    mine = state.services.get(MANIFEST)
    if (
        isinstance(mine, dict)
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


def snapshot(blobs: dict[str, Any], buffers: dict[str, Any]) -> dict[str, Any]:
    """Copy ``blobs``, reusing same-shaped arrays of the previous snapshot (warm memory copies ~10x faster).

    Arrays are copied; JSON values (anything else) are copied with :func:`copy_value`.
    """
    copies = {}
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
