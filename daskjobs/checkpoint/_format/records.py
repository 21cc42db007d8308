"""Commit records: the JSON file whose existence makes an epoch committed (pure: no I/O).

The client gathers every node's *summary* of its save into the epoch's commit record::

    {"sealed": "<32 hex digits>", "format": "daskjobs-checkpoint", "format_version": 5,
     "daskjobs_version": "0.1.0",
     "created": "2026-01-01T00:00:00+00:00", "job": "train", "epoch": 3,
     "nodes": ["ps", "trainer"],
     "manifests": {"ps": {"save_id": "…", "bytes": 16, "bytes_written": 16, "bytes_reused": 0,
                          "seconds": 0.01, "manifest": {"size": 412, "xxh3": "<32 hex digits>"}}, …},
     "stop_values": {"done": false}, "timings": {"save_seconds": 0.02}, "metrics": {"loss": 0.5}}

The record names each node's *manifest* (the group's ``zarr.json`` holding the node's whole entry,
see :mod:`.entries` and :mod:`.manifests`) by its size and XXH3-128 digest: it grows with the number
of nodes, not with nodes x blobs x chunks, and a manifest that does not match it is corrupt. It keeps
what listing, ``show``, best-k and history need without reading any manifest: totals, timings,
stop values and metrics.

Records of format versions 2 and 3 held every node's whole entry under ``"node_entries"``
instead; they are still read (:func:`record_summaries` gives the totals of any version,
:func:`committed_entry` what a read of a node's group starts from).

The record file is *sealed*: it starts with ``{"sealed":"<XXH3-128 of every byte after this
field>",`` (:func:`seal`), so that a record edited or damaged after it was written — a node
removed together with its name, a manifest's digest, a metric or stop value changed, a digit
flipped — is refused (:func:`unseal`, after the record validated: an unknown dtype stays a format
error) instead of read as the truth. Records of format version 2 (written before seals existed)
are read without that check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final, cast

import numpy as np
import xxhash

from ..._version import __version__
from ...errors import CheckpointCorruptError, CheckpointFormatError, InvalidStateError
from .documents import CommitRecord, CommittedEntry, EntryRef, EntryReport, EntrySummary, NodeEntry, Totals
from .entries import (
    HASH_RE,
    MAX_EPOCH,
    MAX_JSON_BYTES,
    MAX_NODES,
    SAVE_ID_RE,
    check_int,
    check_mapping,
    check_name,
    check_number,
    dumps,
    fail,
    validate_node_entry,
)

FORMAT_NAME = "daskjobs-checkpoint"
RECORD_FORMAT_VERSION = 5
"""Version of the checkpoint format written now: a sealed record (see :func:`seal`) naming every
node's manifest, whose arrays name their dimensions (``dimension_names``, so that xarray reads a
node's group).

Version 4 (the same, arrays without dimension names), version 3 (sealed, every node's whole entry in
the record) and version 2 (the same, unsealed) are still read; a record of version 3 or newer without
its seal is corrupt. Version 1 (daskjobs before per-chunk hashes) kept one CRC-32C per blob, which
cannot verify a lazily read chunk on its own; its records are refused, naming the version, rather
than read with weaker checks. Newer versions are refused with :class:`CheckpointFormatError`."""
_OLDEST_READ_VERSION = 2
MANIFESTS_FROM = 4
"""The first record version that names manifests instead of holding the node entries."""
MANIFEST_KEY: Final = "manifest"
"""Key of a manifest's reference (``{"size", "xxh3"}``) in a summary and in an entry a write returned."""
SUMMARY_KEYS = ("save_id", "bytes", "bytes_written", "bytes_reused", "seconds", MANIFEST_KEY)
_RECORD_KEYS = ("format", "format_version", "daskjobs_version", "created", "job", "epoch", "nodes")
_VALUE_KEYS = ("stop_values", "timings", "metrics")


SEAL_KEY = "sealed"
_SEAL_HEAD = b'{"' + SEAL_KEY.encode() + b'":"'
_SEAL_END = len(_SEAL_HEAD) + 32 + 2  # the head, 32 hex digits, then '",'


def seal(record: CommitRecord) -> bytes:
    """The bytes of a commit record file: :func:`dumps` of ``record`` (a non-empty mapping; any old
    seal dropped), with the XXH3-128 digest of all bytes after it as its first field."""
    rest = dumps({k: v for k, v in record.items() if k != SEAL_KEY})[1:]  # after the opening brace
    return _SEAL_HEAD + xxhash.xxh3_128(rest).hexdigest().encode() + b'",' + rest


def unseal(data: bytes, record: CommitRecord, what: str) -> CommitRecord:
    """``record`` (parsed from ``data``) without its seal, after checking the seal matches ``data``.

    Raises
    ------
    CheckpointCorruptError
        ``record`` is sealed but ``data`` differs from what was sealed: edited, re-formatted or
        damaged after it was written.
    """
    if not isinstance(record, dict):
        return record
    if SEAL_KEY not in record:
        if record.get("format_version") == _OLDEST_READ_VERSION:  # written before seals existed
            return record
        raise CheckpointCorruptError(f"{what} lacks its seal: it was edited or damaged after it was written")
    sealed = data[len(_SEAL_HEAD) : _SEAL_END - 2]
    if (
        not data.startswith(_SEAL_HEAD)
        or data[_SEAL_END - 2 : _SEAL_END] != b'",'
        or xxhash.xxh3_128(data[_SEAL_END:]).hexdigest().encode() != sealed
    ):
        raise CheckpointCorruptError(
            f"{what} does not match its seal: it was edited, re-formatted or damaged after it was written; "
            "nothing of it is used"
        )
    return cast(CommitRecord, {k: v for k, v in record.items() if k != SEAL_KEY})


def make_commit_record(
    job: str,
    epoch: int,
    node_entries: Mapping[str, NodeEntry | EntryReport],
    stop_values: Mapping[str, Any],
    timings: Mapping[str, float],
    *,
    metrics: Mapping[str, float] | None = None,
) -> CommitRecord:
    """Build the commit record of ``epoch`` from every node's entry (or its summary).

    Parameters
    ----------
    job
        The job's name.
    epoch
        The epoch being committed.
    node_entries
        What each node's save returned, by node name: the entry a write returned (naming its
        manifest) or its summary (see :func:`summarise`).
    stop_values
        The stop-condition values of the epoch (``bool`` or ``numpy.bool_``), by name.
    timings
        Durations in seconds, by name (e.g. ``{"save_seconds": 1.2}``).
    metrics
        The epoch's metric means, by name (finite floats).

    Returns
    -------
    dict
        The record; :meth:`CheckpointStore.commit` validates it (:func:`validate_commit_record`)
        before writing it.

    Raises
    ------
    InvalidStateError
        An entry names no manifest (its group was described, not written yet).
    """
    for name, value in stop_values.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"stop value {name!r} must be a bool, got {type(value).__name__}")
    return {
        "format": FORMAT_NAME,
        "format_version": RECORD_FORMAT_VERSION,
        "daskjobs_version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "job": job,
        "epoch": epoch,
        "nodes": sorted(node_entries),
        "manifests": {node: summarise(node, entry) for node, entry in node_entries.items()},
        "stop_values": {str(name): bool(value) for name, value in stop_values.items()},
        "timings": {str(name): float(value) for name, value in timings.items()},
        "metrics": {str(name): float(value) for name, value in (metrics or {}).items()},
    }


def summarise(node: str, entry: EntryRef) -> EntrySummary:
    """The summary a commit record keeps of ``node``'s entry (a whole entry a write returned, or a
    summary already): totals, seconds and the reference of its manifest.

    Raises
    ------
    InvalidStateError
        The entry names no manifest: its group was described but not written yet.
    """
    ref = entry.get(MANIFEST_KEY)
    if not isinstance(ref, Mapping):
        raise InvalidStateError(
            f"node {node!r}'s checkpoint entry of epoch {entry.get('epoch')} names no manifest: its group is not "
            "written yet (wait for its background write before the commit)"
        )
    return {
        "save_id": entry["save_id"],
        "bytes": entry["bytes"],
        "bytes_written": entry["bytes_written"],
        "bytes_reused": entry["bytes_reused"],
        "seconds": round(float(entry["seconds"]), 6),
        MANIFEST_KEY: {"size": ref["size"], "xxh3": ref["xxh3"]},
    }


def record_summaries(record: CommitRecord) -> dict[str, Totals]:
    """Every node's totals of a validated record of any version: ``bytes``, ``bytes_written``,
    ``bytes_reused``, ``seconds``, ``save_id`` (and the manifest's reference from version 4 on)."""
    if record["format_version"] >= MANIFESTS_FROM:
        return {node: record["manifests"][node].copy() for node in record["nodes"]}
    return {node: _totals(record["node_entries"][node]) for node in record["nodes"]}


def _totals(entry: Totals) -> Totals:
    return {
        "save_id": entry["save_id"],
        "bytes": entry["bytes"],
        "bytes_written": entry["bytes_written"],
        "bytes_reused": entry["bytes_reused"],
        "seconds": entry["seconds"],
    }


def record_bytes(record: CommitRecord) -> tuple[int, int, int]:
    """Bytes saved, written and reused of a validated record of any version, over all nodes."""
    summaries = record_summaries(record).values()
    return (
        sum(s["bytes"] for s in summaries),
        sum(s["bytes_written"] for s in summaries),
        sum(s["bytes_reused"] for s in summaries),
    )


def committed_entry(record: CommitRecord, node: str) -> CommittedEntry:
    """What a read of ``node``'s group starts from: its whole entry (records before version 4) or
    its summary naming the manifest (see the store's ``resolve_entry``)."""
    if record["format_version"] >= MANIFESTS_FROM:
        return record["manifests"][node].copy()
    return record["node_entries"][node].copy()


def validate_commit_record(obj: Any, epoch: int) -> CommitRecord:
    """Check a commit record read back (or about to be written) for ``epoch``.

    Raises
    ------
    CheckpointFormatError
        Not a daskjobs record, a newer ``format_version``, or an unsupported dtype.
    CheckpointCorruptError
        A field is missing, mistyped, inconsistent or out of limits, a name is invalid, or the
        record is of another epoch.
    """
    where = f"commit record of epoch {epoch}"
    if isinstance(obj, dict) and obj.get("format") != FORMAT_NAME and "format" in obj:
        raise CheckpointFormatError(f"{where}: format {obj['format']!r} is not {FORMAT_NAME!r}")
    version = obj.get("format_version") if isinstance(obj, dict) else None
    if type(version) is int and version > RECORD_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: checkpoint format version {version} is newer than supported version "
            f"{RECORD_FORMAT_VERSION}; upgrade daskjobs to read it"
        )
    if type(version) is int and 1 <= version < _OLDEST_READ_VERSION:
        raise CheckpointFormatError(
            f"{where}: checkpoint format version {version} (one CRC-32C per blob, written by an older daskjobs) "
            f"is no longer read; this daskjobs reads versions {_OLDEST_READ_VERSION}-{RECORD_FORMAT_VERSION} "
            "(a hash per chunk): restore "
            "it with the daskjobs that wrote it, or start the job afresh under another prefix"
        )
    field = "manifests" if type(version) is int and version >= MANIFESTS_FROM else "node_entries"
    record = check_mapping(obj, where, "record", (*_RECORD_KEYS, field, *_VALUE_KEYS))
    check_int(record["format_version"], where, "format_version", low=1)
    if check_int(record["epoch"], where, "epoch", high=MAX_EPOCH) != epoch:
        raise fail(where, f"record says epoch {record['epoch']}")
    for key in ("daskjobs_version", "created"):
        if not isinstance(record[key], str) or len(record[key]) > 64:
            raise fail(where, f"{key} must be a short string, got {record[key]!r}")
    check_name(record["job"], where, "job")
    nodes, entries = record["nodes"], check_mapping(record[field], where, field)
    if (
        not isinstance(nodes, list)
        or len(nodes) > MAX_NODES
        or not all(isinstance(n, str) for n in nodes)
        or nodes != sorted(set(nodes))
        or set(nodes) != set(entries)
    ):
        raise fail(where, f"nodes must be the sorted names of {field}, got {nodes!r}")
    for node in nodes:
        check_name(node, where, "node")
        if field == "manifests":
            if not _plain_summary(entries[node]):  # the usual case checked at once; else say what is wrong
                validate_summary(entries[node], f"{where}, node {node!r}")
        else:
            validate_node_entry(entries[node], node, epoch, f"{where}, node {node!r}")
    for key, value_ok in zip(_VALUE_KEYS, (lambda v: type(v) is bool, _finite, _finite), strict=True):
        values = check_mapping(record[key], where, key)
        bad = {k: v for k, v in values.items() if len(k) > 256 or not value_ok(v)}
        if bad or len(values) > 1024:
            raise fail(where, f"{key} must map at most 1024 short names to values of the right type; bad: {bad}")
    return cast(CommitRecord, dict(record))


def _plain_summary(summary: Any) -> bool:
    """Whether ``summary`` passes :func:`validate_summary` (one expression: a record holds thousands)."""
    if type(summary) is not dict or len(summary) != len(SUMMARY_KEYS):
        return False
    try:
        total, written, reused = summary["bytes"], summary["bytes_written"], summary["bytes_reused"]
        seconds, ref, save_id = summary["seconds"], summary[MANIFEST_KEY], summary["save_id"]
        return (
            type(total) is int
            and type(written) is int
            and type(reused) is int
            and written >= 0
            and reused >= 0
            and written + reused == total
            and type(seconds) in (int, float)
            and 0 <= seconds < math.inf
            and type(ref) is dict
            and len(ref) == 2
            and type(ref["size"]) is int
            and 0 < ref["size"] <= MAX_JSON_BYTES
            and type(ref["xxh3"]) is str
            and HASH_RE.fullmatch(ref["xxh3"]) is not None
            and type(save_id) is str
            and SAVE_ID_RE.fullmatch(save_id) is not None
        )
    except KeyError:
        return False


def validate_summary(obj: Any, where: str) -> EntrySummary:
    """Check one node's summary in a commit record (types, limits, totals).

    Raises
    ------
    CheckpointCorruptError
        A field is missing, mistyped or inconsistent.
    """
    summary = check_mapping(obj, where, "manifest summary", SUMMARY_KEYS)
    if not isinstance(summary["save_id"], str) or not SAVE_ID_RE.fullmatch(summary["save_id"]):
        raise fail(where, f"save_id must be 1-128 characters from A-Z a-z 0-9 _ -, got {summary['save_id']!r}")
    total = check_int(summary["bytes"], where, "bytes")
    if (
        check_int(summary["bytes_written"], where, "bytes_written")
        + check_int(summary["bytes_reused"], where, "bytes_reused")
        != total
    ):
        raise fail(where, f"bytes_written + bytes_reused is not bytes ({total})")
    check_number(summary["seconds"], where, "seconds")
    ref = summary[MANIFEST_KEY]
    if (
        not isinstance(ref, dict)
        or set(ref) != {"size", "xxh3"}
        or type(ref["size"]) is not int
        or not 0 < ref["size"] <= MAX_JSON_BYTES
        or not isinstance(ref["xxh3"], str)
        or not HASH_RE.fullmatch(ref["xxh3"])
    ):
        raise fail(where, f"manifest must be {{'size': 1 to {MAX_JSON_BYTES}, 'xxh3': 32 hex digits}}, got {ref!r}")
    return cast(EntrySummary, summary)


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
