"""Reading one node's Zarr group back, verified against its committed entry.

The entry is the only thing trusted: the node's manifest (its group's ``zarr.json``) once its size
and digest matched the commit record (:func:`read_manifest`), or the entry a record of an earlier
format version held itself. Before anything is decoded, each
array's ``zarr.json`` must be exactly the bytes the entry implies (:func:`~.zarr_groups.expected_metadata`)
and every chunk file must be a regular file (see :mod:`.files`) of the recorded size whose
XXH3-128 digest matches. A mismatch raises :class:`CheckpointCorruptError` naming epoch, node, blob
and chunk; anything daskjobs does not understand raises :class:`CheckpointFormatError`.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, InvalidStateError
from .._format import json_values as _json
from .._format.chunks import chunk_count, chunk_key, chunk_spans, empty_aligned, flat_bytes
from .._format.entries import MAX_JSON_BYTES, loads, validate_node_entry
from .._format.manifests import ENTRY_KEY, check_manifest, reference
from .._format.records import MANIFEST_KEY
from .base import ChunkRead, ChunkResult, SizeProblem, UnsafeFileError
from .zarr_groups import COMPRESSIONS, Location, decode, expected_metadata

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import BlobMeta, EntryRef, EntryReport, EntrySummary, NodeEntry

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
_TRUSTED_BYTES = 64 << 20
"""Memory one read allocates on the commit record's word alone. Beyond it, the chunk files of the
largest blobs are checked first (one ``lstat`` each; one listing per blob on object stores): a
record claiming more bytes than the files hold is refused before anything is allocated."""


def _value(kind: str, array: np.ndarray, label: str) -> Value:
    if kind == "array":
        return array
    try:
        return _json.decode(array.tobytes())
    except ValueError as exc:
        raise CheckpointCorruptError(f"{label}: the stored JSON value does not parse: {exc}") from None


# -- reading -----------------------------------------------------------------------------------
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


class GroupReader:
    """Reads and verifies blobs of one node's group against its committed entry.

    The entry is validated once, here; the group's own metadata is checked once, on the first
    read. Every read then checks each array's ``zarr.json`` and every chunk's size and digest.
    """

    def __init__(self, where: Location, node: str, epoch: int, entry: EntryRef, *, validated: bool = False):
        self.where, self.node, self.epoch = where, node, epoch
        self.context = f"epoch {epoch}, node {node!r}"
        self._group_checked = False
        if "blobs" not in entry:  # a commit record's summary: the manifest read and verified here is the group's
            entry, validated = read_manifest(where, node, epoch, entry), True
            self._group_checked = True
        self.entry: NodeEntry = (
            entry.copy() if validated else validate_node_entry(entry, node, epoch, f"entry of {self.context}")
        )
        self.blobs: dict[str, BlobMeta] = self.entry["blobs"]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_group_checked": False}

    def check_group(self) -> None:
        """Check once that the group holds the committed save: the same ``save_id`` and the same blobs,
        each with the same entry (kind, dtype, shape, chunks, codec, hashes), as the commit record.

        Raises
        ------
        CheckpointCorruptError
            The group is missing, holds another save, or its entry and the record's differ (a blob
            removed from or added to either, or edited); the message names epoch, node and blob.
        """
        if self._group_checked:
            return
        ref = self.entry.get(MANIFEST_KEY)
        if isinstance(ref, Mapping):  # the manifest this entry was read from (or written as): the same bytes
            data = _manifest_bytes(self.where, self.node, self.epoch, ref["size"])
            if reference(data) != ref:
                raise CheckpointCorruptError(
                    f"{self.context}: the node's manifest {self.where.url}/zarr.json no longer matches the commit "
                    f"record{_other_save(data, self.entry['save_id'])}; nothing of it is used"
                )
            self._group_checked = True
            return
        stored = read_group_entry(self.where, self.node, self.epoch, validate=False)
        if stored is None:
            raise CheckpointCorruptError(f"{self.context}: the node's group {self.where.url} is missing")
        if stored.get("save_id") != self.entry["save_id"]:
            raise CheckpointCorruptError(
                f"{self.context}: {self.where.url} holds save {stored['save_id']}, not the committed "
                f"save {self.entry['save_id']} (overwritten after the commit?)"
            )
        stored_blobs = stored.get("blobs")
        if not isinstance(stored_blobs, dict):
            raise CheckpointCorruptError(f"{self.context}: {self.where.url}/zarr.json lists no blobs")
        for name in sorted(set(stored_blobs) | set(self.blobs)):
            if stored_blobs.get(name) != self.blobs.get(name):
                raise CheckpointCorruptError(
                    f"{self._label(name)}: {_entry_difference(stored_blobs, self.blobs, name)}"
                )
        self._group_checked = True

    def _label(self, name: str) -> str:
        return f"{self.context}, blob {name!r}"

    def _check_metadata(self, names: list[str]) -> None:
        files = self.where.files
        expected = {name: expected_metadata(self.blobs[name]) for name in names}
        paths = [f"{self.where.path}/{name}/zarr.json" for name in names]
        try:
            for name in names:
                files.check_directory(f"{self.where.path}/{name}")
        except UnsafeFileError as exc:
            raise CheckpointFormatError(f"{self._label(name)}: {exc}") from None
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{self._label(name)}: the array {self.where.url}/{name} is missing") from None
        limit = max((len(e) for e in expected.values()), default=0)
        for name, path, data in zip(names, paths, files.read_small(paths, limit), strict=True):
            if isinstance(data, bytes) and data == expected[name]:
                continue
            label = self._label(name)
            if isinstance(data, FileNotFoundError):
                (v2,) = files.read_small([f"{self.where.path}/{name}/.zarray"], 0)
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

    def chunk_plan(self, name: str, out: np.ndarray) -> list[tuple[ChunkRead, int]]:
        """``((path, view, size), index)`` of every chunk of ``name``, views into ``out`` (raw) or scratch buffers."""
        meta = self.blobs[name]
        spans = list(chunk_spans(out.nbytes, out.shape, meta["chunks"]))
        data = flat_bytes(out) if out.size else memoryview(b"")
        plan = []
        for index, (start, stop, _pad) in enumerate(spans):
            path, size = self._chunk_file(name, index)
            if meta["codec"] is None:
                plan.append(((path, data[start:stop], size), index))
            else:
                with self._allocating(name, size):
                    plan.append(((path, memoryview(bytearray(size)), size), index))
        return plan

    def _chunk_file(self, name: str, index: int) -> tuple[str, int]:
        """The path of chunk ``index`` of ``name`` and the size the entry says its file has."""
        meta = self.blobs[name]
        shape = meta["shape"]
        path = f"{self.where.path}/{name}/{chunk_key(index, len(shape))}"
        if meta["codec"] is not None:
            return path, meta["sizes"][index]
        return path, np.dtype(meta["dtype"]).itemsize * math.prod(meta["chunks"])

    def _count(self, name: str) -> int:
        return chunk_count(self.blobs[name]["shape"], self.blobs[name]["chunks"])

    def _claimed(self, name: str) -> int:
        """The bytes reading ``name`` allocates: the array, and the compressed chunks if any."""
        meta = self.blobs[name]
        return meta["nbytes"] + (sum(meta["sizes"]) if meta["codec"] is not None else 0)

    def _check_sizes(self, claims: list[tuple[str, list[int], int]]) -> None:
        """Check the chunk files of the largest ``(blob, chunk indices, bytes claimed)`` before allocating, so
        that at most :data:`_TRUSTED_BYTES` are allocated on the commit record's word alone."""
        trusted, checked = 0, []
        for name, indices, claimed in sorted(claims, key=lambda claim: claim[2]):
            trusted += claimed
            if trusted > _TRUSTED_BYTES:
                checked += [(name, index) for index in indices]
        if not checked:
            return
        try:
            problems = self.where.files.check_sizes([self._chunk_file(name, index) for name, index in checked])
        except OSError as exc:
            raise CheckpointError(f"{self.context}: reading {self.where.url} failed: {exc}") from exc
        for (name, index), problem in zip(checked, problems, strict=True):
            if problem is not None:
                self._verify(name, index, problem)

    @contextlib.contextmanager
    def _allocating(self, name: str, nbytes: int) -> Iterator[None]:
        """Add a note naming the blob to a :class:`MemoryError` (its chunk files do hold that much)."""
        try:
            yield
        except MemoryError as exc:
            exc.add_note(f"{self._label(name)}: reading it needs {nbytes} bytes, as the commit record says")
            raise

    def _allocate(self, name: str) -> np.ndarray:
        meta = self.blobs[name]
        with self._allocating(name, meta["nbytes"]):
            return empty_aligned(meta["shape"], np.dtype(meta["dtype"]))

    def read(self, names: Iterable[str] | None = None) -> dict[str, Value]:
        """Read, verify and decode blobs (default: all); names the entry lacks are skipped."""
        wanted = list(self.blobs) if names is None else [n for n in dict.fromkeys(names) if n in self.blobs]
        self.check_group()
        self._check_metadata(wanted)
        self._check_sizes([(name, list(range(self._count(name))), self._claimed(name)) for name in wanted])
        outs = {name: self._allocate(name) for name in wanted}
        plans = [(name, read, index) for name in wanted for read, index in self.chunk_plan(name, outs[name])]
        results = self._read_chunks([read for _, read, _ in plans])
        parts: dict[str, list[bytes]] = {}
        for (name, read, index), result in zip(plans, results, strict=True):
            self._verify(name, index, result)
            if self.blobs[name]["codec"] is not None:
                parts.setdefault(name, []).append(read[1].tobytes())
        values = {}
        for name, out in outs.items():
            if name in parts:
                self._decode(name, parts[name], out)
            values[name] = _value(self.blobs[name]["kind"], out, self._label(name))
        return values

    def read_blob(self, name: str) -> Value:
        """Blob ``name``, read and verified like :meth:`read` (for lazy views of arrays without chunks)."""
        return self.read([name])[name]

    def read_chunk(self, name: str, index: int) -> np.ndarray:
        """Chunk ``index`` (along axis 0) of array blob ``name``, verified; for lazy views."""
        self.check_group()
        self._check_metadata([name])
        meta = self.blobs[name]
        shape, chunks, dtype = meta["shape"], meta["chunks"], np.dtype(meta["dtype"])
        path, size = self._chunk_file(name, index)
        claimed = dtype.itemsize * math.prod(chunks) + (size if meta["codec"] is not None else 0)
        self._check_sizes([(name, [index], claimed)])
        rows = chunks[0] if shape else 1
        out_shape = [min(rows, shape[0] - index * rows), *shape[1:]] if shape else []
        with self._allocating(name, claimed):
            out = empty_aligned(out_shape, dtype)
            buffer = flat_bytes(out) if meta["codec"] is None else memoryview(bytearray(size))
        read: ChunkRead = (path, buffer, size)
        (result,) = self._read_chunks([read])
        self._verify(name, index, result)
        if meta["codec"] is not None:
            scratch = np.empty(chunks, dtype)
            self._decode_chunk(name, read[1].tobytes(), scratch)
            out[...] = scratch[: out.shape[0]] if shape else scratch
        return out

    def stored_chunks(self, name: str) -> Iterator[tuple[str, memoryview]]:
        """The chunk files of array blob ``name`` as stored: ``(chunk key, bytes)``, one chunk in
        memory at a time, each verified against its digest before it is yielded (for a copy).

        Raises
        ------
        CheckpointCorruptError, CheckpointFormatError
            As :meth:`read`, for the first chunk or metadata found damaged.
        """
        self.check_group()
        self._check_metadata([name])
        for index in range(self._count(name)):
            path, size = self._chunk_file(name, index)
            self._check_sizes([(name, [index], size)])
            with self._allocating(name, size):
                buffer = memoryview(bytearray(size))
            (result,) = self._read_chunks([(path, buffer, size)])
            self._verify(name, index, result)
            yield chunk_key(index, len(self.blobs[name]["shape"])), buffer

    def damaged_files(self) -> list[tuple[str | None, str, CheckpointError]]:
        """Every file of the group that does not verify, as ``(blob, path relative to the group,
        error)`` (blob ``None``: the node's manifest), reading one chunk at a time; ``[]`` when
        the whole group verifies. Unlike :meth:`read`, it goes on after the first problem.
        """
        try:
            self.check_group()
        except CheckpointError as exc:
            return [(None, "zarr.json", exc)]
        found: list[tuple[str | None, str, CheckpointError]] = []
        for name in self.blobs:
            try:
                self._check_metadata([name])
            except CheckpointError as exc:
                found.append((name, f"{name}/zarr.json", exc))
                continue
            for index in range(self._count(name)):
                path, size = self._chunk_file(name, index)
                try:
                    self._check_sizes([(name, [index], size)])
                    with self._allocating(name, size):
                        buffer = memoryview(bytearray(size))
                    (result,) = self._read_chunks([(path, buffer, size)])
                    self._verify(name, index, result)
                except CheckpointError as exc:
                    found.append((name, path[len(self.where.path) + 1 :], exc))
        return found

    def _read_chunks(self, reads: list[ChunkRead]) -> list[ChunkResult | UnsafeFileError]:
        try:
            return self.where.files.read_chunks(reads)
        except OSError as exc:
            raise CheckpointError(f"{self.context}: reading {self.where.url} failed: {exc}") from exc

    def _verify(self, name: str, index: int, result: ChunkResult | SizeProblem) -> None:
        """Raise the error for a chunk whose read (or size check) found ``result``; ``None`` is fine."""
        key = chunk_key(index, len(self.blobs[name]["shape"]))
        if isinstance(result, UnsafeFileError):
            raise CheckpointFormatError(f"{self._label(name)}, chunk {key}: {result}")
        if result is None:
            return
        found, problem = (None, result) if isinstance(result, str) else result
        if problem is not None:
            raise CheckpointCorruptError(f"{self._label(name)}, chunk {key}: the chunk file {problem}")
        if found != self.blobs[name]["hashes"][index]:
            raise CheckpointCorruptError(
                f"{self._label(name)}: checksum mismatch in chunk {key} (its bytes differ from what was committed)"
            )

    def _decode(self, name: str, parts: list[bytes], out: np.ndarray) -> None:
        try:
            decode(self.blobs[name], parts, out)
        except Exception as exc:  # verified bytes that do not decode: a codec mismatch, so refuse them
            raise CheckpointCorruptError(f"{self._label(name)}: cannot decode the stored chunks: {exc}") from exc

    def _decode_chunk(self, name: str, part: bytes, out: np.ndarray) -> None:
        meta = self.blobs[name]
        one: BlobMeta = {**meta, "shape": list(out.shape), "hashes": [""], "sizes": [len(part)]}
        try:
            decode(one, [part], out)
        except Exception as exc:  # as in _decode
            raise CheckpointCorruptError(f"{self._label(name)}: cannot decode the stored chunk: {exc}") from exc


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


def read_group(
    where: Location, node: str, epoch: int, entry: EntryRef, names: Iterable[str] | None = None
) -> dict[str, Value]:
    """Read and verify blobs of the group at ``where`` against ``entry`` (see the store's ``read_node``)."""
    return GroupReader(where, node, epoch, entry).read(names)
