"""One node's checkpoint as a Zarr v3 group; the only module of daskjobs that imports ``zarr``.

Layout of ``<prefix>/<node>.<epoch>/``::

    zarr.json            group metadata; attributes["daskjobs"] holds the node's entry (written last)
    <blob>/zarr.json     array metadata: shape, data type, chunk grid, codecs
    <blob>/c.<i>.0.0     chunk i along axis 0 ("default" chunk keys with "." separators)

Uncompressed arrays (the default) take a fast path: this module writes the metadata JSON
itself and the chunks as plain files straight from the array's buffer, computing CRC-32C on
the way, and reads them back with ``readinto`` into a preallocated array. The result is an
ordinary Zarr v3 group that ``zarr.open_group`` reads. Compressed arrays go through zarr.

Reading trusts only the entry from the commit record: each array's ``zarr.json`` must be Zarr
v3 with an allowlisted data type and codecs *before* anything is decoded, must match the
entry, every chunk must be present, and the checksum must match. Nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointWriteError
from ._files import Checksums, ChunkRead, LocalFiles, RemoteFiles
from ._format import MAX_JSON_BYTES, check_blob_name, dumps, format_checksum, loads, storage_dtype, validate_node_entry

CHUNK_BYTES = 64 << 20
"""Target chunk size: chunks split arrays along axis 0 into pieces of at most about this size."""
COMPRESSIONS = ("zstd", "blosc", "gzip")
ENTRY_KEY = "daskjobs"
"""Key of the node entry in the group's attributes."""

_ZARR_TYPES = {
    "|b1": "bool",
    "|i1": "int8",
    "|u1": "uint8",
    "<i2": "int16",
    "<i4": "int32",
    "<i8": "int64",
    "<u2": "uint16",
    "<u4": "uint32",
    "<u8": "uint64",
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "<c8": "complex64",
    "<c16": "complex128",
}
_NUMPY_TYPES = {zarr_name: dtype for dtype, zarr_name in _ZARR_TYPES.items()}
_FILL = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": [0.0, 0.0]}
_CODECS = frozenset(["bytes", *COMPRESSIONS, "crc32c"])
_ARRAY_KEYS = frozenset(
    [
        "zarr_format",
        "node_type",
        "shape",
        "data_type",
        "chunk_grid",
        "chunk_key_encoding",
        "fill_value",
        "codecs",
        "attributes",
        "storage_transformers",
        "dimension_names",
    ]
)
_META_LIMIT = 1 << 20
_PAGE = 4096
_ALIGN_FROM = 1 << 20
_BACKGROUND_FROM = 32 << 20
_WRITERS = 4


@dataclass(frozen=True)
class Location:
    """Where one node group lives: its path on ``files`` and, for zarr's own stores, its URL."""

    files: LocalFiles | RemoteFiles
    path: str
    url: str
    storage_options: Mapping[str, Any]

    def zarr_store(self, read_only: bool) -> Any:
        """A zarr store rooted at the group (for the compressed path)."""
        import zarr.storage

        if isinstance(self.files, LocalFiles):
            return zarr.storage.LocalStore(self.path, read_only=read_only)
        return zarr.storage.FsspecStore.from_url(
            self.url, storage_options=dict(self.storage_options), read_only=read_only
        )


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Chunk shape splitting ``shape`` along axis 0 into about-equal chunks of about :data:`CHUNK_BYTES`.

    Where it costs little, chunks hold whole pages, so every chunk lands page-aligned in the
    page-aligned arrays :func:`empty_aligned` allocates for reading.
    """
    if not shape:
        return []
    row = itemsize * math.prod(shape[1:])
    if shape[0] == 0 or row == 0:
        return [1, *(max(1, d) for d in shape[1:])]
    count = -(-shape[0] * row // CHUNK_BYTES)
    rows = -(-shape[0] // count)
    step = _PAGE // math.gcd(row, _PAGE)
    if count > 1 and step * row * 64 <= CHUNK_BYTES:
        rows = min(shape[0], -(-rows // step) * step)
    return [rows, *shape[1:]]


def empty_aligned(shape: list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array; large ones start on a page boundary.

    Linux copies file pages into a buffer at numpy's usual address of large arrays (16 bytes
    past a page boundary) about 3x slower than into a page-aligned one.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dtype)
    buffer = np.empty(nbytes + _PAGE, np.uint8)
    start = -buffer.ctypes.data % _PAGE
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def _chunk_key(index: tuple[int, ...], encoding: tuple[str, str]) -> str:
    name, separator = encoding
    if name == "v2":
        return separator.join(map(str, index)) or "0"
    return separator.join(["c", *map(str, index)])


def array_metadata(dtype: np.dtype, shape: tuple[int, ...], chunks: list[int]) -> dict[str, Any]:
    """The Zarr v3 ``zarr.json`` of an uncompressed little-endian array."""
    codec: dict[str, Any] = {"name": "bytes"}
    if dtype.itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": _ZARR_TYPES[dtype.str],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": _FILL[dtype.kind],
        "codecs": [codec],
        "attributes": {},
        "storage_transformers": [],
    }


@functools.lru_cache(maxsize=4096)
def _array_metadata_bytes(dtype: np.dtype, shape: tuple[int, ...], chunks: tuple[int, ...]) -> bytes:
    # The same arrays are saved every epoch: encode their zarr.json once.
    return dumps(array_metadata(dtype, shape, list(chunks)))


def _flat(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def _codec(name: str) -> Any:
    import zarr.codecs

    return {"zstd": zarr.codecs.ZstdCodec, "blosc": zarr.codecs.BloscCodec, "gzip": zarr.codecs.GzipCodec}[name]()


def write_group(
    where: Location, node: str, epoch: int, blobs: Mapping[str, Any], *, save_id: str, compression: str | None
) -> dict[str, Any]:
    """Write ``blobs`` as the Zarr v3 group at ``where`` and return the node's entry (see the store)."""
    started = time.perf_counter()
    arrays = {}
    for name, value in blobs.items():
        array = np.asarray(value)
        arrays[check_blob_name(name)] = array.astype(storage_dtype(array.dtype, name), order="C", copy=False)
    files, metas = where.files, {}
    try:
        files.clear(where.path)
        files.mkdir(where.path, parents=True)
        if compression is None:
            metas = _write_all_raw(files, where.path, arrays)
        else:
            for name, array in arrays.items():
                chunks = chunk_rows(array.shape, array.itemsize)
                _write_with_zarr(where, name, array, chunks, compression)
                metas[name] = _blob_meta(array, chunks, crc32c.crc32c(_flat(array)))
            files.track_tree(where.path)
        entry = {
            "node": node,
            "epoch": epoch,
            "save_id": save_id,
            "blobs": metas,
            "bytes": sum(a.nbytes for a in arrays.values()),
            "seconds": time.perf_counter() - started,
        }
        files.put(
            f"{where.path}/zarr.json", dumps({"zarr_format": 3, "node_type": "group", "attributes": {ENTRY_KEY: entry}})
        )
        files.flush()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointWriteError(
            f"could not write the checkpoint of node {node!r} at epoch {epoch} to {where.url}: {exc}"
        ) from exc
    return entry


def _blob_meta(array: np.ndarray, chunks: list[int], checksum: int) -> dict[str, Any]:
    return {
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "checksum": format_checksum(checksum),
        "nbytes": array.nbytes,
        "chunks": chunks,
    }


def _write_all_raw(files: LocalFiles | RemoteFiles, path: str, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Write uncompressed arrays; on local disks several at once (creating files is costly there)."""

    def write(item: tuple[str, np.ndarray]) -> tuple[str, dict[str, Any]]:
        name, array = item
        chunks = chunk_rows(array.shape, array.itemsize)
        return name, _blob_meta(array, chunks, _write_raw(files, f"{path}/{name}", array, chunks))

    if isinstance(files, LocalFiles) and len(arrays) > 1:
        with ThreadPoolExecutor(min(_WRITERS, len(arrays)), thread_name_prefix="daskjobs-write") as pool:
            return dict(pool.map(write, arrays.items()))
    return dict(map(write, arrays.items()))


def _write_raw(files: LocalFiles | RemoteFiles, path: str, array: np.ndarray, chunks: list[int]) -> int:
    """Write an array's metadata and chunk files (the last one zero-padded); return the CRC-32C of what was written."""
    files.mkdir(path)
    files.put(f"{path}/zarr.json", _array_metadata_bytes(array.dtype, array.shape, tuple(chunks)))
    if array.size == 0:
        return 0
    data, checksum = _flat(array), 0
    size = chunks[0] * array.itemsize * math.prod(array.shape[1:]) if array.ndim else array.itemsize
    tail = (0,) * (array.ndim - 1)
    for index, start in enumerate(range(0, len(data), size)):
        part = data[start : start + size]
        checksum = crc32c.crc32c(part, checksum)
        files.put(f"{path}/{_chunk_key((index, *tail)[: array.ndim], ('default', '.'))}", part, bytes(size - len(part)))
    return checksum


def _write_with_zarr(where: Location, name: str, array: np.ndarray, chunks: list[int], compression: str) -> None:
    import zarr

    target = zarr.create_array(
        where.zarr_store(read_only=False),
        name=name,
        shape=array.shape,
        dtype=array.dtype,
        chunks=tuple(chunks),
        compressors=[_codec(compression)],
        fill_value=0,
        chunk_key_encoding={"name": "default", "separator": "."},
        config={"write_empty_chunks": True},
        overwrite=True,
    )
    target[...] = array


def read_group_entry(where: Location, node: str, epoch: int) -> dict[str, Any] | None:
    """The entry stored in the group's attributes (validated), or ``None`` if there is no group."""
    (data,) = where.files.read_small([f"{where.path}/zarr.json"], MAX_JSON_BYTES)
    if isinstance(data, FileNotFoundError):
        return None
    if isinstance(data, OSError):
        raise CheckpointError(f"cannot read the checkpoint of node {node!r} at epoch {epoch}: {data}")
    label = f"group metadata of node {node!r} at epoch {epoch} ({where.url}/zarr.json)"
    group = loads(data, label, CheckpointFormatError)
    if not isinstance(group, dict) or group.get("zarr_format") != 3 or group.get("node_type") != "group":
        raise CheckpointFormatError(f"{label} is not a Zarr v3 group; nothing was decoded")
    attributes = group.get("attributes")
    if not isinstance(attributes, dict) or ENTRY_KEY not in attributes:
        raise CheckpointCorruptError(f"{label} holds no daskjobs entry (an unfinished or foreign save)")
    return validate_node_entry(attributes[ENTRY_KEY], node, epoch, label)


@dataclass
class _Plan:
    """One blob to read: its verified layout and where its bytes go."""

    name: str
    out: np.ndarray
    chunks: list[int]
    key_encoding: tuple[str, str]
    raw: bool
    checksum: str


def read_group(
    where: Location, node: str, epoch: int, entry: Mapping[str, Any], names: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Read and verify blobs of the group at ``where`` against ``entry`` (see the store's ``read_node``)."""
    context = f"epoch {epoch}, node {node!r}"
    entry = validate_node_entry(entry, node, epoch, f"entry of {context}")
    wanted = list(entry["blobs"]) if names is None else [n for n in dict.fromkeys(names) if n in entry["blobs"]]
    stored = read_group_entry(where, node, epoch)
    if stored is None:
        raise CheckpointCorruptError(f"{context}: the node's group {where.url} is missing")
    if stored["save_id"] != entry["save_id"]:
        raise CheckpointCorruptError(
            f"{context}: {where.url} holds save {stored['save_id']}, not the committed "
            f"save {entry['save_id']} (overwritten after the commit?)"
        )
    documents = where.files.read_small([f"{where.path}/{n}/zarr.json" for n in wanted], _META_LIMIT)
    plans = [
        _plan(where, f"{context}, blob {name!r}", name, entry["blobs"][name], data)
        for name, data in zip(wanted, documents, strict=True)
    ]
    try:
        checksums = _read_raw(where, context, [p for p in plans if p.raw and p.out.size])
        for plan in plans:
            if not plan.raw and plan.out.size:
                _read_with_zarr(where, f"{context}, blob {plan.name!r}", plan)
                checksums[plan.name] = crc32c.crc32c(_flat(plan.out))
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{context}: reading {where.url} failed: {exc}") from exc
    for plan in plans:
        if format_checksum(checksums.get(plan.name, 0)) != plan.checksum:
            raise CheckpointCorruptError(
                f"{context}, blob {plan.name!r}: checksum mismatch (the data differs from what was committed)"
            )
    return {plan.name: plan.out for plan in plans}


def _config(item: dict[str, Any], label: str) -> dict[str, Any]:
    config = item.get("configuration", {})
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{label}: configuration {config!r} is not an object; nothing was decoded")
    return config


def _plan(where: Location, label: str, name: str, expected: Mapping[str, Any], data: bytes | OSError) -> _Plan:
    path = f"{where.path}/{name}"
    if isinstance(data, FileNotFoundError):
        if where.files.exists(f"{path}/.zarray"):
            raise CheckpointFormatError(f"{label}: a Zarr v2 array; daskjobs reads only Zarr v3, nothing was decoded")
        raise CheckpointCorruptError(f"{label}: array metadata {path}/zarr.json is missing")
    if isinstance(data, OSError):
        raise CheckpointError(f"{label}: cannot read {path}/zarr.json: {data}")
    if len(data) > _META_LIMIT:
        raise CheckpointFormatError(f"{label}: {path}/zarr.json is larger than {_META_LIMIT} bytes")
    meta = _check_metadata(loads(data, f"{label}: zarr.json", CheckpointFormatError), label)
    dtype = np.dtype(_NUMPY_TYPES[meta["data_type"]])
    shape, chunks = meta["shape"], _config(meta["chunk_grid"], label).get("chunk_shape")
    for field, value in {"dtype": dtype.str, "shape": shape, "chunks": chunks}.items():
        if value != expected[field]:
            raise CheckpointCorruptError(
                f"{label}: {field} is {value} in zarr.json but {expected[field]} in the commit record"
            )
    kind = meta["chunk_key_encoding"]["name"]
    separator = _config(meta["chunk_key_encoding"], label).get("separator", "." if kind == "v2" else "/")
    if separator not in (".", "/"):
        raise CheckpointFormatError(f"{label}: chunk key separator {separator!r}; nothing was decoded")
    endian = _config(meta["codecs"][0], label).get("endian", "little")
    raw = len(meta["codecs"]) == 1 and endian == "little" and chunks[1:] == shape[1:]
    return _Plan(name, empty_aligned(shape, dtype), chunks, (kind, separator), raw, expected["checksum"])


def _check_metadata(meta: Any, label: str) -> dict[str, Any]:
    """Refuse anything but a Zarr v3 array of an allowlisted data type and codecs (nothing decoded yet)."""

    def refuse(problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{label}: {problem}; daskjobs reads only numeric Zarr v3 arrays with codecs "
            f"{sorted(_CODECS)}, nothing was decoded"
        )

    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        raise refuse("not a Zarr v3 array")
    unknown = [
        k
        for k, v in meta.items()
        if k not in _ARRAY_KEYS and not (isinstance(v, dict) and v.get("must_understand") is False)
    ]
    if unknown or meta.get("storage_transformers"):
        raise refuse(f"unsupported extensions {unknown or meta['storage_transformers']}")
    if not isinstance(meta.get("data_type"), str) or meta["data_type"] not in _NUMPY_TYPES:
        raise refuse(f"data type {meta.get('data_type')!r}")
    grid, encoding, codecs = meta.get("chunk_grid"), meta.get("chunk_key_encoding"), meta.get("codecs")
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        raise refuse(f"chunk grid {grid!r}")
    if not isinstance(encoding, dict) or encoding.get("name") not in ("default", "v2"):
        raise refuse(f"chunk key encoding {encoding!r}")
    if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
        raise refuse(f"codecs {codecs!r}")
    names = [c.get("name") for c in codecs]
    if names[0] != "bytes" or any(n not in _CODECS or n == "bytes" for n in names[1:]):
        raise refuse(f"codecs {names}")
    return meta


def _read_raw(where: Location, context: str, plans: list[_Plan]) -> dict[str, int]:
    """Read uncompressed chunk files straight into the output arrays; return each blob's CRC-32C.

    Raises :class:`CheckpointCorruptError` naming the chunk if one is missing, has the wrong size
    or non-zero padding.
    """
    reads: list[ChunkRead] = []
    owners: list[str] = []
    for plan in plans:
        data = _flat(plan.out)
        size = plan.chunks[0] * plan.out.itemsize * math.prod(plan.out.shape[1:]) if plan.out.ndim else len(data)
        tail = (0,) * (plan.out.ndim - 1)
        for index, start in enumerate(range(0, len(data), size)):
            key = _chunk_key((index, *tail)[: plan.out.ndim], plan.key_encoding)
            reads.append((f"{where.path}/{plan.name}/{key}", data[start : start + size], size))
            owners.append(plan.name)
    checksums = Checksums(background=sum(len(view) for _, view, _ in reads) >= _BACKGROUND_FROM)
    try:
        for index, block, problem in where.files.read_chunks(reads):
            if problem is not None:
                raise CheckpointCorruptError(
                    f"{context}, blob {owners[index]!r}, chunk "
                    f"{reads[index][0].rsplit('/', 1)[1]}: the chunk file {problem}"
                )
            if block is not None:
                checksums.add(owners[index], block)
    finally:
        values = checksums.close()
    return values


def _read_with_zarr(where: Location, label: str, plan: _Plan) -> None:
    """Read a compressed (or otherwise encoded) array through zarr after checking every chunk exists."""
    import zarr

    counts = [-(-s // c) for s, c in zip(plan.out.shape, plan.chunks, strict=True)]
    present = where.files.list_tree(f"{where.path}/{plan.name}")
    for index in np.ndindex(*counts):
        key = _chunk_key(tuple(int(i) for i in index), plan.key_encoding)
        if key not in present:
            raise CheckpointCorruptError(f"{label}, chunk {key}: the chunk file is missing")
    try:
        plan.out[...] = zarr.open_array(where.zarr_store(read_only=True), path=plan.name, mode="r", zarr_format=3)[...]
    except Exception as exc:  # the chunks exist, so a failure to decode them means they are damaged
        raise CheckpointCorruptError(f"{label}: cannot decode the stored chunks: {exc}") from exc
