"""A node group's metadata read back and held against its commit record, before any chunk is read.

The group's ``zarr.json`` holds the node's entry (:func:`read_group_entry`); once the group is
committed it is the node's manifest, trusted only when its size and digest match the commit record
(:func:`read_manifest`), and a group a reader opens must still hold the committed save
(:func:`check_stored_group`). Each array's ``zarr.json`` must be exactly the bytes the entry implies
(:func:`~.zarr_groups.expected_metadata`, checked by :func:`check_array_metadata`). What differs is
said: metadata naming what daskjobs does not read raises :class:`CheckpointFormatError`, anything
else that disagrees with the commit record :class:`CheckpointCorruptError`, naming epoch, node and
blob.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, InvalidStateError
from .._format.entries import MAX_JSON_BYTES, loads, validate_node_entry
from .._format.manifests import ENTRY_KEY, check_manifest, reference
from .._format.records import MANIFEST_KEY
from .base import UnsafeFileError
from .zarr_groups import COMPRESSIONS, Location, expected_metadata

if TYPE_CHECKING:
    from .._format.documents import BlobMeta, EntryReport, EntrySummary, NodeEntry

_KNOWN_TYPES = frozenset(
    [
        *("bool", "int8", "uint8", "int16", "int32", "int64", "uint16", "uint32", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128", "fixed_length_utf32", "null_terminated_bytes"),
    ]
)
_KNOWN_CODECS = frozenset(["bytes", "crc32c", "transpose", "sharding_indexed", *COMPRESSIONS])
"""The codecs of the Zarr v3 specification: an array's ``zarr.json`` naming one of them that its
commit record does not is corrupt (it disagrees with the record); any other codec is unknown."""
_META_LIMIT = 1 << 20


def blob_label(context: str, name: str) -> str:
    """How messages name blob ``name`` of the group ``context`` names (``"epoch 3, node 'ps'"``)."""
    return f"{context}, blob {name!r}"


def read_group_entry(where: Location, node: str, epoch: int, *, validate: bool = True) -> NodeEntry | None:
    """The entry stored in the group's attributes (naming its manifest, the group's ``zarr.json``,
    under ``"manifest"``), or ``None`` if there is no group.

    ``validate=False`` skips checking every blob of it (for a caller that only compares its
    ``save_id`` with a committed, validated entry: one check per read instead of two).
    """
    label = f"group metadata of node {node!r} at epoch {epoch} ({where.url}/zarr.json)"
    try:
        where.files.check_directory(where.path)
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        raise CheckpointFormatError(f"{label}: {exc}") from None
    (data,) = where.files.read_small([f"{where.path}/zarr.json"], MAX_JSON_BYTES)
    if isinstance(data, FileNotFoundError):
        return None
    if isinstance(data, UnsafeFileError):
        raise CheckpointFormatError(f"{label}: {data}")
    if isinstance(data, OSError):
        raise CheckpointError(f"cannot read the checkpoint of node {node!r} at epoch {epoch}: {data}")
    group = loads(data, label)  # damaged: CheckpointCorruptError
    if isinstance(group, dict) and group.get("zarr_format") not in (3, None):
        raise CheckpointFormatError(f"{label} is Zarr format {group.get('zarr_format')!r}, not 3; nothing was decoded")
    if not isinstance(group, dict) or group.get("zarr_format") != 3 or group.get("node_type") != "group":
        raise CheckpointCorruptError(f"{label} is not the Zarr v3 group daskjobs wrote; nothing was decoded")
    attributes = group.get("attributes")
    if not isinstance(attributes, dict) or not isinstance(attributes.get(ENTRY_KEY), dict):
        raise CheckpointCorruptError(f"{label} holds no daskjobs entry (a foreign group)")
    if attributes[ENTRY_KEY].get("state") == "writing":
        raise CheckpointCorruptError(f"{label}: the save {attributes[ENTRY_KEY].get('save_id')} never finished")
    entry = (
        cast("NodeEntry", dict(attributes[ENTRY_KEY]))  # unchecked: the caller compares it with a validated one
        if not validate
        else validate_node_entry(attributes[ENTRY_KEY], node, epoch, label)
    )
    entry[MANIFEST_KEY] = reference(data)
    return entry


def _manifest_bytes(where: Location, node: str, epoch: int, size: int) -> bytes:
    """At most ``size + 1`` bytes of the group's ``zarr.json`` (a committed group's manifest)."""
    label = f"epoch {epoch}, node {node!r}: the node's manifest {where.url}/zarr.json"
    try:
        where.files.check_directory(where.path)
        (data,) = where.files.read_small([f"{where.path}/zarr.json"], size)
    except FileNotFoundError:
        data = FileNotFoundError()
    except UnsafeFileError as exc:
        raise CheckpointFormatError(f"{label}: {exc}") from None
    if isinstance(data, FileNotFoundError):
        raise CheckpointCorruptError(f"{label} is missing, although the epoch is committed")
    if isinstance(data, UnsafeFileError):
        raise CheckpointFormatError(f"{label}: {data}")
    if isinstance(data, OSError):
        raise CheckpointError(f"{label} cannot be read: {data}")
    return data


def read_manifest(where: Location, node: str, epoch: int, summary: EntrySummary | EntryReport) -> NodeEntry:
    """The node's entry from its manifest, verified against ``summary`` (from the commit record).

    Raises
    ------
    CheckpointCorruptError
        The manifest is missing, truncated, longer, edited, or another node's or epoch's; the
        message names epoch, node and the file.
    CheckpointFormatError
        It is not a regular file (or its group not a real folder), or it names a dtype or codec
        daskjobs does not read.
    """
    ref = summary[MANIFEST_KEY]
    if not isinstance(ref, Mapping):
        raise InvalidStateError(
            f"epoch {epoch}, node {node!r}: the summary names no manifest (its group was described, not written "
            "yet); read it once its write finished"
        )
    data = _manifest_bytes(where, node, epoch, ref["size"])
    label = f"epoch {epoch}, node {node!r}: the node's manifest {where.url}/zarr.json"
    return check_manifest(data, summary, ref, node, epoch, label)


def check_stored_group(where: Location, node: str, epoch: int, entry: NodeEntry, context: str) -> None:
    """Check that the group at ``where`` holds the committed save of ``entry`` (validated): the same
    ``save_id`` and the same blobs, each with the same entry (kind, dtype, shape, chunks, codec,
    hashes), as the commit record. ``context`` names the group in messages.

    Raises
    ------
    CheckpointCorruptError
        The group is missing, holds another save, or its entry and the record's differ (a blob
        removed from or added to either, or edited); the message names epoch, node and blob.
    """
    ref = entry.get(MANIFEST_KEY)
    if isinstance(ref, Mapping):  # the manifest this entry was read from (or written as): the same bytes
        data = _manifest_bytes(where, node, epoch, ref["size"])
        if reference(data) != ref:
            raise CheckpointCorruptError(
                f"{context}: the node's manifest {where.url}/zarr.json no longer matches the commit "
                f"record{_other_save(data, entry['save_id'])}; nothing of it is used"
            )
        return
    stored = read_group_entry(where, node, epoch, validate=False)
    if stored is None:
        raise CheckpointCorruptError(f"{context}: the node's group {where.url} is missing")
    if stored.get("save_id") != entry["save_id"]:
        raise CheckpointCorruptError(
            f"{context}: {where.url} holds save {stored['save_id']}, not the committed "
            f"save {entry['save_id']} (overwritten after the commit?)"
        )
    stored_blobs = stored.get("blobs")
    if not isinstance(stored_blobs, dict):
        raise CheckpointCorruptError(f"{context}: {where.url}/zarr.json lists no blobs")
    blobs = entry["blobs"]
    for name in sorted(set(stored_blobs) | set(blobs)):
        if stored_blobs.get(name) != blobs.get(name):
            raise CheckpointCorruptError(f"{blob_label(context, name)}: {_entry_difference(stored_blobs, blobs, name)}")


def check_array_metadata(where: Location, blobs: Mapping[str, BlobMeta], names: list[str], context: str) -> None:
    """Check that the ``zarr.json`` of each array ``names`` of the group at ``where`` is exactly the
    bytes its entry in ``blobs`` implies; ``context`` names the group in messages.

    Raises
    ------
    CheckpointCorruptError
        An array or its ``zarr.json`` is missing, or the bytes differ from what the record implies.
    CheckpointFormatError
        An array is not a real folder, is a Zarr v2 array, or its metadata names what daskjobs
        does not read.
    """
    files = where.files
    expected = {name: expected_metadata(blobs[name]) for name in names}
    paths = [f"{where.path}/{name}/zarr.json" for name in names]
    try:
        for name in names:
            files.check_directory(f"{where.path}/{name}")
    except UnsafeFileError as exc:
        raise CheckpointFormatError(f"{blob_label(context, name)}: {exc}") from None
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{blob_label(context, name)}: the array {where.url}/{name} is missing") from None
    limit = max((len(e) for e in expected.values()), default=0)
    for name, path, data in zip(names, paths, files.read_small(paths, limit), strict=True):
        if isinstance(data, bytes) and data == expected[name]:
            continue
        label = blob_label(context, name)
        if isinstance(data, FileNotFoundError):
            (v2,) = files.read_small([f"{where.path}/{name}/.zarray"], 0)
            if not isinstance(v2, OSError):
                raise CheckpointFormatError(
                    f"{label}: a Zarr v2 array; daskjobs reads only Zarr v3, nothing was decoded"
                )
            raise CheckpointCorruptError(f"{label}: array metadata {path} is missing")
        if isinstance(data, UnsafeFileError):
            raise CheckpointFormatError(f"{label}: {data}")
        if isinstance(data, OSError):
            raise CheckpointError(f"{label}: cannot read {path}: {data}")
        if len(data) > len(expected[name]):
            (data,) = files.read_small([path], _META_LIMIT)
        _explain_metadata(label, data, expected[name])


def _other_save(document: bytes, committed: str) -> str:
    """`` (it holds save X, not the committed save Y: …)`` when ``document`` is a group of another save."""
    try:
        found = loads(document, "group metadata")["attributes"][ENTRY_KEY]["save_id"]
    except (CheckpointCorruptError, KeyError, TypeError):
        return ""
    if found == committed:
        return " (edited or damaged)"
    return f" (it holds save {found}, not the committed save {committed}: overwritten after the commit?)"


def _entry_difference(stored: Mapping[str, Any], committed: Mapping[str, Any], name: str) -> str:
    """How blob ``name`` differs between the group's own entry (``stored``) and the commit record's."""
    if name not in committed:
        return "the node's group holds this blob but the commit record does not list it (the record was edited?)"
    if name not in stored:
        return "the commit record lists this blob but the node's group does not hold it"
    mine, theirs = stored[name], committed[name]
    if not isinstance(mine, dict):
        return f"the node's group describes it as {type(mine).__name__}, not as the commit record does"
    fields = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return f"{', '.join(fields)} in the node's group differ from the commit record"


def _explain_metadata(label: str, data: bytes | OSError, expected: bytes) -> None:
    """Raise the error saying how stored ``zarr.json`` bytes differ from the ``expected`` ones.

    Metadata naming what daskjobs does not read (another Zarr version, unknown data types or
    codecs, extensions that must be understood, storage transformers) is a
    :class:`CheckpointFormatError`; anything else that disagrees with the commit record (damaged
    bytes too) is a :class:`CheckpointCorruptError`.
    """
    if isinstance(data, OSError):
        raise CheckpointCorruptError(f"{label}: zarr.json cannot be read: {data}")
    if len(data) > _META_LIMIT:
        raise CheckpointCorruptError(f"{label}: zarr.json is larger than {_META_LIMIT} bytes; nothing was decoded")
    meta = loads(data, f"{label}: zarr.json")
    want = json.loads(expected)
    if isinstance(meta, dict) and meta.get("zarr_format") not in (3, None):
        raise CheckpointFormatError(
            f"{label}: zarr.json is Zarr format {meta.get('zarr_format')!r}; daskjobs reads only 3, nothing was decoded"
        )
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise CheckpointCorruptError(f"{label}: zarr.json is not the Zarr v3 array daskjobs wrote; nothing was decoded")
    data_type = meta.get("data_type")
    type_name = data_type.get("name") if isinstance(data_type, dict) else data_type
    codecs = meta.get("codecs")
    codecs = codecs if isinstance(codecs, list) else [codecs]
    names = [c.get("name") if isinstance(c, dict) else c for c in codecs]
    strange = [c for c in codecs if not isinstance(c, dict) or not isinstance(c.get("configuration", {}), dict)]
    if type_name not in _KNOWN_TYPES or any(n not in _KNOWN_CODECS for n in names) or strange:
        raise CheckpointFormatError(
            f"{label}: zarr.json has data type {type_name!r} and codecs {names}; daskjobs reads only "
            f"{sorted(_KNOWN_TYPES)} with Zarr v3 codecs ({sorted(_KNOWN_CODECS)}); nothing was decoded"
        )
    extensions = sorted(
        k for k, v in meta.items() if k not in want and isinstance(v, dict) and v.get("must_understand")
    )
    if extensions:
        raise CheckpointFormatError(
            f"{label}: zarr.json has extensions {extensions} that must be understood; daskjobs knows none, "
            "nothing was decoded"
        )
    if meta.get("storage_transformers"):
        raise CheckpointFormatError(
            f"{label}: zarr.json has storage transformers {meta['storage_transformers']}; daskjobs reads none, "
            "nothing was decoded"
        )
    fields = sorted(k for k in set(meta) | set(want) if meta.get(k) != want.get(k))
    details = ", ".join(f"{k} is {meta.get(k)!r} instead of {want.get(k)!r}" for k in fields)
    raise CheckpointCorruptError(
        f"{label}: zarr.json differs from the commit record ({details or 'formatting'}); nothing was decoded"
    )
