"""Commit records of every format version, for tests.

* :func:`as_version` rewrites a committed epoch as an older daskjobs wrote it: format 4 (arrays
  without ``dimension_names``, the manifests without them), 3 (the same, sealed, every node's whole
  entry inside the record) or 2 (the same, unsealed). The groups' ``zarr.json`` always held the
  node's entry.
* :func:`edit_entry` changes a node's entry as a writer would have written it, consistently: in a
  record of format 4 the node's manifest (the group's ``zarr.json``) is rewritten and the record
  names the new manifest (size and digest, sealed again); in older records the entry inside the
  record. It reaches the defences behind the seal and the manifest digest (a writer's bug, or a
  hostile writer), not those against an editor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.manifests import reference
from daskjobs.checkpoint._format.records import MANIFEST_KEY, RECORD_FORMAT_VERSION, seal
from daskjobs.checkpoint._storage.zarr_groups import expected_metadata

VERSIONS = (2, 3, 4, 5)
"""The commit-record versions this daskjobs reads."""


def fs_path(store: CheckpointStore, *parts: str) -> str:
    """The filesystem path of ``parts`` under the store's prefix."""
    return store.fs._strip_protocol("/".join([store.url, *parts]))


def record_path(store: CheckpointStore, epoch: int) -> str:
    return fs_path(store, "__daskjobs__", "commits", f"epoch-{epoch:012d}.json")


def manifest_path(store: CheckpointStore, node: str, epoch: int) -> str:
    return fs_path(store, f"{node}.{epoch}", "zarr.json")


def raw_record(store: CheckpointStore, epoch: int) -> dict[str, Any]:
    """The record file of ``epoch`` as JSON (its seal dropped), not validated."""
    record = json.loads(store.fs.cat_file(record_path(store, epoch)))
    record.pop("sealed", None)
    return record


def write_record(store: CheckpointStore, epoch: int, record: dict[str, Any]) -> None:
    """Write ``record`` as the record file of ``epoch``: sealed from format version 3 on."""
    data = seal(record) if record["format_version"] >= 3 else json.dumps(record).encode()
    store.fs.pipe_file(record_path(store, epoch), data)


def as_version(store: CheckpointStore, epoch: int, version: int) -> None:
    """Rewrite committed ``epoch`` (format 5) as format ``version`` would have held it."""
    if version == RECORD_FORMAT_VERSION:
        return
    record = raw_record(store, epoch)
    for node in record["nodes"]:
        edit_entry(store, epoch, node, _without_dimension_names(store, node, epoch))
    record = raw_record(store, epoch)
    record["format_version"] = 4
    write_record(store, epoch, record)
    if version == 4:
        return
    entries = store.node_entries(epoch)
    legacy = {key: value for key, value in record.items() if key != "manifests"}
    legacy["format_version"] = version
    legacy["node_entries"] = {
        node: {key: value for key, value in entry.items() if key != MANIFEST_KEY} for node, entry in entries.items()
    }
    write_record(store, epoch, legacy)


def _without_dimension_names(store: CheckpointStore, node: str, epoch: int) -> Callable[[dict[str, Any]], None]:
    """An entry change dropping ``dimension_names`` from every blob, and from its array's ``zarr.json``."""

    def change(entry: dict[str, Any]) -> None:
        for name, meta in entry["blobs"].items():
            meta.pop("dimension_names", None)
            path = fs_path(store, f"{node}.{epoch}", name, "zarr.json")
            store.fs.rm_file(path)  # a new file: other epochs may hard-link the old one
            store.fs.pipe_file(path, expected_metadata(meta))

    return change


def edit_entry(store: CheckpointStore, epoch: int, node: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to ``node``'s entry of committed ``epoch`` where its record version keeps it,
    keeping the record consistent with it (see the module's docstring)."""
    record = raw_record(store, epoch)
    if record["format_version"] < 4:
        change(record["node_entries"][node])
    else:
        path = manifest_path(store, node, epoch)
        document = json.loads(store.fs.cat_file(path))
        entry = document["attributes"]["daskjobs"]
        change(entry)
        data = json.dumps(document, separators=(",", ":")).encode()
        store.fs.pipe_file(path, data)
        summary = record["manifests"][node]
        summary.update({key: entry[key] for key in ("bytes", "bytes_written", "bytes_reused") if key in entry})
        summary[MANIFEST_KEY] = reference(data)
    write_record(store, epoch, record)
