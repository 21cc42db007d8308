"""One node's checkpoint as a Zarr v3 group; the only module of daskjobs that imports ``zarr``.

Layout of ``<prefix>/<node>.<epoch>/``::

    zarr.json            group metadata; attributes["daskjobs"] holds the node's entry (written last):
                         the node's manifest, named by the commit record (see ``manifests``)
    <blob>/zarr.json     array metadata: shape, data type, chunk grid, codecs, dimension names
                         (``<blob>/dim_<i>``: xarray opens the group as a Dataset of every blob)
    <blob>/c.<i>.0.0     chunk i along axis 0 ("default" chunk keys with "." separators)

The group's ``zarr.json`` is its manifest: the node's entry, written last. On a local disk the
group is written in a staging folder ``<node>.<epoch>.tmp-<16 hex><16 hex>`` whose name proves
it daskjobs' own (see :mod:`.cleanup`), and renamed to ``<node>.<epoch>`` once all of it is
durable (the flush): a group appears under its name only complete and durable, a staging folder
is debris until then. A save may write over a retired group of the same node instead, renamed
to its staging folder (``over``, see :func:`~.cleanup.take_over_group`): its files are written in
place, new ones created, stale ones removed, and the manifest written last over the retired
group's ``zarr.json``, in place — once the folder's staging name is durable, so that whatever a
power loss tears in it, the folder's name proves it daskjobs' own. On object
stores, where nothing is renamed, ``zarr.json`` is written first with ``{"node", "epoch",
"save_id", "state": "writing"}`` (the marker that says daskjobs owns the group) and replaced last
by the manifest.

Uncompressed arrays (the default) are written by this module itself: metadata bytes from
:mod:`.._format.chunks` and chunk files straight from the array's buffer. Compressed arrays are encoded
by zarr in memory and written the same way. Numeric arrays, fixed-width ``U``/``S`` strings and
JSON values (a ``uint8`` array of UTF-8 text) all become ordinary Zarr v3 arrays that
``zarr.open_group`` reads. Each chunk file's XXH3-128 goes into the entry; with a ``previous``
entry, a chunk whose digest is unchanged is hard-linked (server-side copied on object stores)
from the previous epoch instead of written again.

Reading (:mod:`.reader`) trusts only the entry from the commit record and decodes compressed
chunks through :func:`decode` here. Nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BlobTypeError, CheckpointError, CheckpointWriteError
from .._format import json_values as _json
from .._format.chunks import (
    chunk_count,
    chunk_key,
    chunk_rows,
    chunk_spans,
    digest,
    dimension_names,
    flat_bytes,
    raw_metadata,
)
from .._format.entries import check_blob_name, storage_dtype
from .._format.manifests import group_document, reference
from .._format.records import MANIFEST_KEY
from .base import Files, LocalTree, Staged, local_tree, queued
from .cleanup import remove_staging, staging_name
from .deadline import DaemonPool

if TYPE_CHECKING:
    from zarr.core.buffer import Buffer

    from ..._model.values import Value
    from .._format.documents import BlobLayout, BlobMeta, EntryRef, NodeEntry

COMPRESSIONS = ("zstd", "blosc", "gzip")

_THREADS = 4
"""Threads writing blobs at once on local disks, for groups of at least :data:`_THREADS_FROM` bytes."""
_THREADS_FROM = 32 << 20
"""Below this, one thread writes faster: starting threads and handing work over costs more than
the overlap of hashing and copying gains (measured: 2 blobs of 4 KiB, 100 blobs of 4 KiB)."""
_ZARR_LOCK = threading.Lock()


def _reset_lock_after_fork() -> None:
    """A forked snapshot writer gets a fresh lock: a thread of the parent may have held it at the fork."""
    global _ZARR_LOCK
    _ZARR_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


@dataclass(frozen=True)
class Location:
    """Where one node group lives: its path on ``files``, its URL, and the prefix folder that
    must exist for it to be written (never created again once it vanished)."""

    files: Files
    path: str
    url: str
    anchor: str | None = None

    def sibling(self, name: str) -> str:
        """The path of another group under the same prefix."""
        return f"{self.path.rsplit('/', 1)[0]}/{name}"


# -- values -------------------------------------------------------------------------------------
def open_array(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A Zarr array opened read-only at a path or fsspec URL (for readers of user data, not checkpoints)."""
    import zarr

    return zarr.open_array(store=url, mode="r", storage_options=dict(storage_options) if storage_options else None)


def _stored(name: str, value: Any) -> tuple[str, np.ndarray]:
    """``(kind, array)`` of a blob value: an array in its storage dtype, or a JSON value as UTF-8 bytes."""
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        return "array", array.astype(storage_dtype(array.dtype, name), order="C", copy=False)
    try:
        data = _json.encode(value)
    except (TypeError, ValueError) as exc:
        raise BlobTypeError(
            f"blob {name!r} holds a {type(value).__name__} that is neither a numpy array nor a JSON value "
            f"({exc}); store an array, or str/None/bool/int/finite float/list/dict with str keys"
        ) from None
    return "json", np.frombuffer(data, dtype=np.uint8)


# -- metadata ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_zarr() -> Iterator[None]:
    """Silence zarr's warning that the U and S data types are "unstable" (we pin what it writes).

    ``warnings.catch_warnings`` swaps process-wide state, so the writer threads take turns.
    """
    import zarr.errors

    with _ZARR_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=zarr.errors.UnstableSpecificationWarning)
        yield


def _compressor(name: str) -> Any:
    import zarr.codecs

    return {"zstd": zarr.codecs.ZstdCodec, "blosc": zarr.codecs.BloscCodec, "gzip": zarr.codecs.GzipCodec}[name]()


def _zarr_array(
    store: Any,
    dtype: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    kind: str,
    codec: str,
    dims: tuple[str, ...] | None = None,
) -> Any:
    import zarr

    from .._format.chunks import JSON_ATTRIBUTES

    with _quiet_zarr():
        return zarr.create_array(
            store,
            name="a",
            shape=shape,
            dtype=np.dtype(dtype),
            chunks=chunks,
            compressors=[_compressor(codec)],
            chunk_key_encoding={"name": "default", "separator": "."},
            attributes=dict(JSON_ATTRIBUTES) if kind == "json" else None,
            dimension_names=dims,
            config={"write_empty_chunks": True},
        )


@functools.lru_cache(maxsize=1024)
def _compressed_metadata(
    dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], kind: str, codec: str, dims: tuple[str, ...] | None
) -> bytes:
    import zarr.storage

    documents: dict[str, Buffer] = {}
    _zarr_array(zarr.storage.MemoryStore(documents), dtype, shape, chunks, kind, codec, dims)
    return documents["a/zarr.json"].to_bytes()


def expected_metadata(meta: BlobLayout) -> bytes:
    """The exact ``zarr.json`` bytes of a blob as its (validated) entry describes it: with the
    dimension names it lists, or none (a group written before daskjobs named them)."""
    dims = tuple(meta["dimension_names"]) if "dimension_names" in meta else None
    key = (meta["dtype"], tuple(meta["shape"]), tuple(meta["chunks"]), meta["kind"])
    if meta["codec"] is None:
        return raw_metadata(*key, dims)
    return _compressed_metadata(*key, meta["codec"], dims)


def _encode(array: np.ndarray, chunks: list[int], kind: str, codec: str) -> list[bytes]:
    """Chunk files of ``array`` compressed with ``codec`` (encoded by zarr, in memory)."""
    import zarr.storage

    documents: dict[str, Buffer] = {}
    target = _zarr_array(zarr.storage.MemoryStore(documents), array.dtype.str, array.shape, tuple(chunks), kind, codec)
    with _quiet_zarr():
        target[...] = array
    return [documents[f"a/{chunk_key(i, array.ndim)}"].to_bytes() for i in range(chunk_count(array.shape, chunks))]


def decode(meta: BlobLayout, parts: list[bytes], out: np.ndarray) -> None:
    import zarr
    import zarr.storage
    from zarr.core.buffer import cpu

    documents: dict[str, Buffer] = {"a/zarr.json": cpu.Buffer.from_bytes(expected_metadata(meta))}
    documents.update({f"a/{chunk_key(i, out.ndim)}": cpu.Buffer.from_bytes(p) for i, p in enumerate(parts)})
    with _quiet_zarr():
        out[...] = zarr.open_array(zarr.storage.MemoryStore(documents, read_only=True), path="a", mode="r")[...]


# -- writing -----------------------------------------------------------------------------------
def write_group(
    where: Location,
    node: str,
    epoch: int,
    blobs: Mapping[str, Value],
    *,
    save_id: str,
    compression: str | None,
    previous: EntryRef | None = None,
    sync: bool = True,
    over: tuple[str, Mapping[str, BlobMeta]] | None = None,
) -> NodeEntry:
    """Write ``blobs`` as the Zarr v3 group at ``where`` and return the node's entry (see the store),
    naming the manifest written (the group's ``zarr.json``) under ``"manifest"``.

    ``sync=False`` leaves the fsync of a local group to the caller (``where.files.flush()``).
    ``over``: ``(staging folder, its blobs)``: a retired group on a local disk renamed there to be
    written over (see the module), and what it holds (name → blob entry).
    """
    started = time.perf_counter()
    stored = {check_blob_name(name): _stored(name, value) for name, value in blobs.items()}
    files = where.files
    reuse_from, reused_epoch = _reusable(previous, node, epoch)
    old = where.sibling(f"{node}.{reused_epoch}") if reuse_from else ""
    sealed = files.sealed_at(old) if reuse_from else None
    copied: dict[str, int] = {}
    """Reused chunk files (a queued copy on object stores) → the bytes counted as reused."""

    def write(item: tuple[str, tuple[str, np.ndarray]]) -> tuple[str, BlobMeta, int, int]:
        name, (kind, array) = item
        before = (reuse_from.get(name), f"{old}/{name}", sealed)
        there = over is not None and name in over[1]
        return name, *_write_blob(files, f"{path}/{name}", name, kind, array, compression, before, copied, there)

    if over is not None:
        path = over[0]
    elif local_tree(files):  # in a staging folder, put in place once durable (see the module)
        path = staging_name(where.path)
    else:
        path = where.path
    try:
        if over is None:
            files.mkdir(path, parents=True, within=where.anchor)
        if not local_tree(files):  # the marker first, alone: what follows is recognisably ours
            marker = {"node": node, "epoch": epoch, "save_id": save_id, "state": "writing"}
            files.put_atomic(f"{path}/zarr.json", group_document(marker))
            if queued(files):
                files.settle()
        total = sum(array.nbytes for _, array in stored.values())
        if not files.queues_writes and len(stored) > 1 and total >= _THREADS_FROM:
            with DaemonPool(min(_THREADS, len(stored)), "daskjobs-write") as pool:
                results = pool.map(write, list(stored.items()), lambda item: f"the write of {path}/{item[0]}")
        else:
            results = list(map(write, stored.items()))
        # queued writes: the copies and chunks, before the entry counts them (a failed copy is written)
        rewritten = sum(copied.get(target, 0) for target in files.settle()) if queued(files) else 0
        entry: NodeEntry = {
            "node": node,
            "epoch": epoch,
            "save_id": save_id,
            "blobs": {name: meta for name, meta, _, _ in results},
            "bytes": total,
            "bytes_written": sum(w for _, _, w, _ in results) + rewritten,
            "bytes_reused": sum(r for _, _, _, r in results) - rewritten,
            "seconds": time.perf_counter() - started,
        }
        manifest = group_document(entry)
        if local_tree(files):
            if over is None:
                files.put(f"{path}/zarr.json", manifest)
            else:  # over the retired marker only once the folder's staging name is durable
                _drop_stale(files, path, over[1], entry["blobs"])
                files.await_renames()
                files.overwrite(f"{path}/zarr.json", manifest)
            files.publish_when_durable(Staged(path, where.path))
        else:
            files.put_atomic(f"{path}/zarr.json", manifest)
        entry[MANIFEST_KEY] = reference(manifest)
        if sync or not files.defers_flush:
            files.flush()
    except CheckpointError:
        raise
    except OSError as exc:
        # this attempt's staging folder (a full disk wants its space back); not after a wait for
        # storage ran out (see .deadline): deleting there would hang as well, the next cleanup does it
        if path != where.path and not isinstance(exc, TimeoutError):
            remove_staging(path)
        raise CheckpointWriteError(
            f"could not write the checkpoint of node {node!r} at epoch {epoch} to {where.url}: {exc}"
        ) from exc
    return entry


def _reusable(previous: EntryRef | None, node: str, epoch: int) -> tuple[dict[str, BlobMeta], int]:
    """The blobs of ``previous`` (the node's entry of an earlier committed epoch) whose chunks may be
    reused, and that epoch (``({}, -1)``: none)."""
    if not previous or "blobs" not in previous:
        return {}, -1
    old = previous.get("epoch")
    if previous.get("node") != node or type(old) is not int or not 0 <= old < epoch:
        return {}, -1
    blobs = previous.get("blobs")
    return (dict(blobs), old) if isinstance(blobs, dict) else ({}, -1)


def _layout(name: str, kind: str, array: np.ndarray, codec: str | None) -> tuple[BlobLayout, list[Any], list[Any]]:
    """Blob ``name``'s entry without digests, its chunk spans and each chunk's stored parts."""
    shape, nbytes = array.shape, array.nbytes
    chunks = chunk_rows(shape, array.itemsize)
    meta: BlobLayout = {
        "kind": kind,
        "dtype": array.dtype.str,
        "shape": list(shape),
        "nbytes": nbytes,
        "chunks": chunks,
        "codec": codec,
        "dimension_names": dimension_names(name, array.ndim),
    }
    if codec is not None:
        spans = list(chunk_spans(nbytes, shape, chunks))
        return meta, spans, [(part, b"") for part in _encode(array, chunks, kind, codec)]
    if nbytes and (not shape or chunks[0] == shape[0]):  # one chunk holding the whole array (small blobs)
        return meta, [(0, nbytes, 0)], [(flat_bytes(array),)]
    data = flat_bytes(array) if array.size else memoryview(b"")
    spans = list(chunk_spans(nbytes, shape, chunks))
    return meta, spans, [(data[start:stop], bytes(pad)) if pad else (data[start:stop],) for start, stop, pad in spans]


_NOT_LAYOUT = ("nbytes", "dimension_names")
"""Blob entry fields that do not change its chunk files (dimension names are in its ``zarr.json`` only)."""


def _same_layout(before: BlobMeta | None, meta: BlobLayout, chunk_count: int) -> bool:
    """Whether ``before`` (the previous epoch's blob entry) has this layout: its chunk files may be
    reused (its ``zarr.json`` too when the dimension names are the same as well)."""
    return (
        isinstance(before, dict)
        and all(before.get(k) == v for k, v in meta.items() if k not in _NOT_LAYOUT)
        and isinstance(before.get("hashes"), list)
        and len(before["hashes"]) == chunk_count
    )


def _finish_meta(meta: BlobLayout, hashes: list[str], codec: str | None, stored: list[Any]) -> BlobMeta:
    finished: BlobMeta = {**meta, "hashes": hashes}
    if codec is not None:
        finished["sizes"] = [len(p) for p, _ in stored]
    return finished


def describe_group(
    node: str,
    epoch: int,
    blobs: Mapping[str, Value],
    *,
    save_id: str,
    compression: str | None,
    previous: EntryRef | None = None,
) -> NodeEntry:
    """The entry :func:`write_group` would return for ``blobs``, computed without writing anything.

    Digests and layout are exact; ``bytes_written``/``bytes_reused`` assume every chunk whose
    digest equals the previous epoch's is reused (a failed hard link writes it instead). It names
    no manifest (none is written): the write's own entry does.
    """
    started = time.perf_counter()
    stored = {check_blob_name(name): _stored(name, value) for name, value in blobs.items()}
    reuse_from, _ = _reusable(previous, node, epoch)
    described: dict[str, BlobMeta] = {}
    written, reused = 0, 0
    for name, (kind, array) in stored.items():
        meta, spans, parts = _layout(name, kind, array, compression)
        before = reuse_from.get(name)
        same = _same_layout(before, meta, len(spans))
        hashes = [digest(*chunk) for chunk in parts]
        for index, (start, stop, _pad) in enumerate(spans):
            if same and before is not None and before["hashes"][index] == hashes[index]:
                reused += stop - start
            else:
                written += stop - start
        described[name] = _finish_meta(meta, hashes, compression, parts)
    return {
        "node": node,
        "epoch": epoch,
        "save_id": save_id,
        "blobs": described,
        "bytes": sum(array.nbytes for _, array in stored.values()),
        "bytes_written": written,
        "bytes_reused": reused,
        "seconds": time.perf_counter() - started,
    }


def _drop_stale(files: LocalTree, path: str, over: Mapping[str, BlobMeta], blobs: Mapping[str, BlobMeta]) -> None:
    """Remove what the retired group written over held and the new one does not: blobs it no longer
    has (their metadata, chunks and folder) and chunks past a blob's new chunk grid."""
    for name, meta in over.items():
        folder, ndim, kept = f"{path}/{name}", len(meta["shape"]), blobs.get(name)
        keys = [chunk_key(i, ndim) for i in range(chunk_count(tuple(meta["shape"]), meta["chunks"]))]
        if kept is None:
            for key in [*keys, "zarr.json"]:
                files.remove(f"{folder}/{key}", sync_folder=False)
            files.remove_folder(folder)
            continue
        if len(kept["shape"]) == ndim:  # the same chunk names: those past the new grid are stale
            keys = keys[chunk_count(tuple(kept["shape"]), kept["chunks"]) :]
        for key in keys:
            files.remove(f"{folder}/{key}", sync_folder=False)
        files.changed(folder)


def _write_blob(
    files: Files,
    path: str,
    name: str,
    kind: str,
    array: np.ndarray,
    codec: str | None,
    reusable: tuple[BlobMeta | None, str, int | None],
    copied: dict[str, int],
    there: bool = False,
) -> tuple[BlobMeta, int, int]:
    """Write blob ``name``'s array metadata and chunk files; return its blob entry, bytes written and bytes reused.

    ``reusable``: the previous epoch's blob entry (``None``: nothing to reuse), the array's path
    there, and when that group got its entry (see :meth:`~.base.Files.reuse`); ``copied`` gets
    each reused chunk file and the bytes it counts. ``there``: the blob's folder is already there,
    in a retired group written over (a :class:`~.base.LocalTree` only): its files are written over
    (see :meth:`~.base.LocalTree.overwrite`).
    """
    before, old_path, sealed = reusable
    meta, spans, stored = _layout(name, kind, array, codec)
    if not _same_layout(before, meta, len(spans)):
        before = None  # no chunk file of it is reused
    put, reuse = files.put, files.reuse
    if there and local_tree(files):
        put, reuse = files.overwrite, files.reuse_over
    else:
        files.mkdir(path)
    metadata = expected_metadata(meta)  # the same bytes as the previous epoch's when ``named`` too
    # the dimension names too: a group of format 4 names none
    named = before is not None and before.get("dimension_names") == meta["dimension_names"]
    if not (named and reuse(f"{old_path}/zarr.json", f"{path}/zarr.json", (metadata,), sealed)):
        put(f"{path}/zarr.json", metadata)
    hashes, written, reused, ndim = [], 0, 0, array.ndim
    for index, (start, stop, _pad) in enumerate(spans):
        parts = stored[index]
        key = chunk_key(index, ndim)
        hashes.append(digest(*parts))
        target = f"{path}/{key}"
        if (
            before is not None
            and before["hashes"][index] == hashes[-1]
            and reuse(f"{old_path}/{key}", target, parts, sealed)
        ):
            copied[target] = stop - start
            reused += stop - start
            continue
        put(target, *parts)
        written += stop - start
    return _finish_meta(meta, hashes, codec, stored), written, reused
