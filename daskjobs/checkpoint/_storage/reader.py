"""Reading one node's Zarr group back, verified against its committed entry.

The entry is the only thing trusted: the node's manifest (its group's ``zarr.json``) once its size
and digest matched the commit record, or the entry a record of an earlier format version held
itself. Before anything is decoded, the group's and each array's metadata must agree with the
entry (:mod:`.group_metadata`) and every chunk file must be a regular file (see :mod:`.files`) of
the recorded size whose XXH3-128 digest matches. A mismatch raises :class:`CheckpointCorruptError`
naming epoch, node, blob and chunk; anything daskjobs does not understand raises
:class:`CheckpointFormatError`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError
from .._format import json_values as _json
from .._format.chunks import chunk_count, chunk_key, chunk_spans, empty_aligned, empty_arrays, flat_bytes
from .._format.entries import validate_node_entry
from .base import ChunkRead, ChunkResult, SizeProblem, UnsafeFileError
from .group_metadata import blob_label, check_array_metadata, check_stored_group, read_manifest
from .zarr_groups import Location, decode

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import BlobMeta, EntryRef, NodeEntry

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
        """Check once that the group holds the committed save (see :func:`~.group_metadata.check_stored_group`).

        Raises
        ------
        CheckpointCorruptError
            The group is missing, holds another save, or its entry and the record's differ; the
            message names epoch, node and blob.
        """
        if not self._group_checked:
            check_stored_group(self.where, self.node, self.epoch, self.entry, self.context)
            self._group_checked = True

    def _label(self, name: str) -> str:
        return blob_label(self.context, name)

    def _check_metadata(self, names: list[str]) -> None:
        check_array_metadata(self.where, self.blobs, names, self.context)

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

    def _allocate(self, names: list[str]) -> dict[str, np.ndarray]:
        """An uninitialised array for each blob of ``names`` (the small ones share buffers, see
        :func:`~.._format.chunks.empty_arrays`)."""
        layouts = [(self.blobs[name]["shape"], np.dtype(self.blobs[name]["dtype"])) for name in names]
        try:
            return dict(zip(names, empty_arrays(layouts), strict=True))
        except MemoryError as exc:
            claimed = sum(self.blobs[name]["nbytes"] for name in names)
            exc.add_note(
                f"{self.context}: reading {len(names)} blob(s) needs {claimed} bytes, as the commit record says"
            )
            raise

    def read(self, names: Iterable[str] | None = None) -> dict[str, Value]:
        """Read, verify and decode blobs (default: all); names the entry lacks are skipped."""
        wanted = list(self.blobs) if names is None else [n for n in dict.fromkeys(names) if n in self.blobs]
        self.check_group()
        self._check_metadata(wanted)
        self._check_sizes([(name, list(range(self._count(name))), self._claimed(name)) for name in wanted])
        outs = self._allocate(wanted)
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


def read_group(
    where: Location, node: str, epoch: int, entry: EntryRef, names: Iterable[str] | None = None
) -> dict[str, Value]:
    """Read and verify blobs of the group at ``where`` against ``entry`` (see the store's ``read_node``)."""
    return GroupReader(where, node, epoch, entry).read(names)
