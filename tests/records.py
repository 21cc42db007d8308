"""Commit records of every format version, for tests.

* :func:`as_version` rewrites a committed epoch's record as an older daskjobs wrote it: format 3
  (sealed, every node's whole entry inside the record) or 2 (the same, unsealed). The node groups
  are the same in every version: their ``zarr.json`` always held the node's entry.
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
from daskjobs.checkpoint._format.records import MANIFEST_KEY, seal

VERSIONS = (2, 3, 4)
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
    """Rewrite the record of committed ``epoch`` (format 4) as format ``version`` would have held it."""
    if version == 4:
        return
    record = raw_record(store, epoch)
    entries = store.node_entries(epoch)
    legacy = {key: value for key, value in record.items() if key != "manifests"}
    legacy["format_version"] = version
    legacy["node_entries"] = {
        node: {key: value for key, value in entry.items() if key != MANIFEST_KEY} for node, entry in entries.items()
    }
    write_record(store, epoch, legacy)


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
