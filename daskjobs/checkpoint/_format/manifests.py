"""Node manifests and their summaries in commit records (pure: no I/O).

A node's *manifest* is its group's ``zarr.json``: the Zarr v3 group metadata whose
``attributes["daskjobs"]`` holds the node's whole entry (every blob's dtype, shape, chunks and
the XXH3-128 digest of every chunk file; see :mod:`.entries`). The node writes it last, as part of
its save, and it is made durable with the group.

A commit record of format version 4 does not repeat the entries: it holds one *summary* per node
(under ``"manifests"``) naming the node's manifest by its size and the XXH3-128 of its bytes,
inside the record's seal, plus what listing, ``show``, best-k and history need without reading
any manifest::

    "manifests": {"ps": {"save_id": "…", "bytes": 16, "bytes_written": 16, "bytes_reused": 0,
                         "seconds": 0.01, "manifest": {"size": 412, "xxh3": "<32 hex digits>"}}}

So a record grows with the number of nodes, not with nodes x blobs x chunks. A manifest is read
back only after its size and digest matched the record (:func:`check_manifest`): what it says is
as trustworthy as the record itself, and verification stays as strong as when the record held it.
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

from ...errors import CheckpointCorruptError
from .documents import ManifestRef, NodeEntry, Totals
from .entries import dumps, loads, validate_node_entry
from .records import MANIFEST_KEY, SUMMARY_KEYS

ENTRY_KEY = "daskjobs"
"""Key of the node entry in the group's attributes."""


def group_document(entry: Mapping[str, object]) -> bytes:
    """The bytes of a group's ``zarr.json`` holding ``entry`` (its reference, if any, left out)."""
    inner = {k: v for k, v in entry.items() if k != MANIFEST_KEY}
    return dumps({"zarr_format": 3, "node_type": "group", "attributes": {ENTRY_KEY: inner}})


def reference(document: bytes) -> ManifestRef:
    """The reference a commit record keeps of a manifest: its size and XXH3-128 digest."""
    return {"size": len(document), "xxh3": xxhash.xxh3_128(document).hexdigest()}


def check_manifest(document: bytes, summary: Totals, ref: ManifestRef, node: str, epoch: int, label: str) -> NodeEntry:
    """The entry in manifest ``document`` (the group's ``zarr.json`` as read, at most one byte more
    than the record says), after its size and digest matched ``ref`` (``summary``'s manifest) and it
    validated.

    The returned entry carries the manifest's reference under :data:`MANIFEST_KEY`.

    Raises
    ------
    CheckpointCorruptError
        The manifest is truncated, longer, edited, or another node's or epoch's (its size or digest
        differs from the commit record's), or what it holds disagrees with the record's summary.
    CheckpointFormatError
        It names a dtype or codec daskjobs does not read (only after it matched the record).
    """
    if len(document) != ref["size"]:
        found = f"{len(document)}" if len(document) <= ref["size"] else f"more than {ref['size']}"
        raise CheckpointCorruptError(
            f"{label} has {found} bytes, the commit record says {ref['size']} (truncated, replaced or another "
            "node's or epoch's); nothing of it is used"
        )
    if xxhash.xxh3_128(document).hexdigest() != ref["xxh3"]:
        raise CheckpointCorruptError(
            f"{label} does not match the digest in the commit record (edited, damaged, or another node's or "
            "epoch's manifest); nothing of it is used"
        )
    group = loads(document, label)
    attributes = group.get("attributes") if isinstance(group, dict) else None
    inner = attributes.get(ENTRY_KEY) if isinstance(attributes, dict) else None
    if not isinstance(group, dict) or group.get("zarr_format") != 3 or not isinstance(inner, dict):
        raise CheckpointCorruptError(f"{label} is not the Zarr v3 group metadata daskjobs wrote")
    entry = validate_node_entry(inner, node, epoch, label)
    stored: Mapping[str, object] = entry
    told: Mapping[str, object] = summary
    differs = [key for key in SUMMARY_KEYS[:-1] if key != "seconds" and stored[key] != told[key]]
    if differs:
        raise CheckpointCorruptError(f"{label}: {', '.join(differs)} differ from the commit record's summary")
    entry[MANIFEST_KEY] = ref.copy()
    return entry
