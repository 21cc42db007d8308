"""Node entries: the JSON that says what one node's checkpoint holds (pure: no I/O).

A node's save writes its *entry* into its Zarr group's attributes (the node's *manifest*, see
:mod:`.manifests`); the epoch's commit record (:mod:`.records`) names every node's manifest::

    {"node": "ps", "epoch": 3, "save_id": "…", "bytes": 16, "bytes_written": 16, "bytes_reused": 0,
     "seconds": 0.01, "blobs": {"w": {"kind": "array", "dtype": "<f4", "shape": [2, 2], "nbytes": 16,
                                      "chunks": [2, 2], "codec": null, "hashes": ["<32 hex digits>"]}}}

``hashes`` holds the XXH3-128 digest of every stored chunk file, chunks in C order; it serves
verification on every read path and delta reuse. ``dimension_names`` (``["w/dim_0", "w/dim_1"]``,
see :func:`~.chunks.dimension_names`) says the array's ``zarr.json`` names its dimensions; entries
written before daskjobs named them lack it, and their ``zarr.json`` names none. A ``"json"`` blob is
a 1-d ``uint8`` array of UTF-8 JSON text. ``codec`` names the compressor (``None``: raw bytes); compressed chunks also
record their file sizes in ``sizes``.

Everything read back is validated here before any path is built or byte is decoded: names
with :func:`~daskjobs._model.values.validate_name`, dtypes against :data:`ALLOWED_DTYPES`,
shapes and sizes against the limits below.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..._model.values import check_dtype, validate_name
from ...errors import BlobTypeError, CheckpointCorruptError, CheckpointFormatError, JobDefinitionError
from .chunks import dimension_names

if TYPE_CHECKING:
    from .documents import NodeEntry

ALLOWED_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16"]
)
"""Stored numeric dtypes (numpy ``dtype.str``): bool, integers, floats and complex, always little-endian.
Fixed-width strings are stored too: ``<U<n>`` (UTF-32, little-endian) and ``|S<n>``, see :func:`allowed_dtype`."""

MAX_STRING_CHARS = 1 << 20
"""Longest fixed-width string item (characters or bytes)."""
KINDS = ("array", "json")
CODECS = (None, "zstd", "blosc", "gzip")

RESERVED_BLOB_NAMES = frozenset(["zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"])
"""Blob names that would collide with Zarr metadata keys inside a node's group."""

MAX_JSON_BYTES = 64 << 20
"""Largest commit record or group metadata document read (bigger is refused unread)."""
MAX_NODES = 4096
MAX_BLOBS = 100_000
MAX_NDIM = 32
MAX_BLOB_BYTES = 1 << 40
MAX_CHUNKS = 1 << 20
"""Most chunk files one blob may have."""
MAX_EPOCH = 10**12 - 1
"""Commit records are named with 12 zero-padded digits."""
SAVE_ID_RE = re.compile(r"[A-Za-z0-9_\-]{1,128}")
"""A save id: what a node entry's ``save_id`` must match."""

HASH_RE = re.compile(r"[0-9a-f]{32}")
_STRING_RE = re.compile(r"(<U|\|S)([1-9][0-9]{0,6})")
_ENTRY_KEYS = ("node", "epoch", "save_id", "blobs", "bytes", "bytes_written", "bytes_reused", "seconds")
_BLOB_KEYS = ("kind", "dtype", "shape", "nbytes", "chunks", "codec", "hashes")


def check_epoch(epoch: Any) -> int:
    """``epoch`` as an int from 0 to :data:`MAX_EPOCH` (numpy integers accepted).

    Raises
    ------
    JobDefinitionError
        Not an int (``bool`` included), or out of range.
    """
    try:
        value = operator.index(epoch)
    except TypeError:
        raise JobDefinitionError(f"epoch must be an int, got {type(epoch).__name__}: {epoch!r}") from None
    if isinstance(epoch, bool) or not 0 <= value <= MAX_EPOCH:
        raise JobDefinitionError(f"epoch must be an int from 0 to {MAX_EPOCH}, got {epoch!r}")
    return value


def allowed_dtype(dtype: str) -> bool:
    """Whether ``dtype`` (a numpy ``dtype.str``) is one daskjobs stores and reads."""
    if dtype in ALLOWED_DTYPES:
        return True
    match = _STRING_RE.fullmatch(dtype)
    return match is not None and int(match.group(2)) <= MAX_STRING_CHARS


def storage_dtype(dtype: np.dtype, blob: str) -> np.dtype:
    """The little-endian dtype a blob of ``dtype`` is stored as.

    Raises
    ------
    BlobTypeError
        The dtype is not bool or numeric, or has no Zarr v3 data type (e.g. ``float128``).
    """
    stored = _STORED.get(dtype)
    if stored is not None:  # a dtype seen before (every epoch saves the same ones)
        return stored
    if dtype.kind not in "US":
        check_dtype(dtype, blob)
    stored = dtype.newbyteorder("<") if dtype.kind != "S" else dtype
    if not allowed_dtype(stored.str):
        raise BlobTypeError(
            f"blob {blob!r} has dtype {dtype}, which Zarr v3 cannot store; use one of {sorted(ALLOWED_DTYPES)} "
            f"or a fixed-width string dtype of 1 to {MAX_STRING_CHARS} characters"
        )
    if len(_STORED) < 1024:
        _STORED[dtype] = stored
    return stored


_STORED: dict[np.dtype, np.dtype] = {}
"""Dtypes :func:`storage_dtype` accepted, with what they are stored as."""


def check_blob_name(name: object) -> str:
    """Validate a blob name for writing: :func:`validate_name` plus the Zarr-reserved names."""
    if not isinstance(name, str):
        validate_name(name, "blob")  # raises
    return _checked_blob_name(str(name))


@functools.lru_cache(maxsize=4096)
def _checked_blob_name(name: str) -> str:
    """:func:`check_blob_name` of a ``str``, remembered (a workspace saves the same names every epoch)."""
    validate_name(name, "blob")
    if name in RESERVED_BLOB_NAMES:
        raise JobDefinitionError(f"invalid blob name {name!r}: reserved for Zarr metadata")
    return name


def dumps(obj: Any) -> bytes:
    """Compact, strict JSON (no NaN or infinity) as UTF-8 bytes."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes, what: str, error: type[Exception] = CheckpointCorruptError) -> Any:
    """Parse JSON bytes read from storage; anything else raises ``error`` naming ``what``.

    Only :mod:`json` is used: nothing read from a checkpoint is ever unpickled.
    """
    if len(data) > MAX_JSON_BYTES:
        raise error(f"{what} is larger than {MAX_JSON_BYTES} bytes; refusing to parse it")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON (truncated, corrupt or foreign): {exc}") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def fail(where: str, problem: str) -> CheckpointCorruptError:
    """The error for a field of a document read back (at ``where``) that is wrong."""
    return CheckpointCorruptError(f"{where}: {problem}")


def check_int(value: Any, where: str, field: str, low: int = 0, high: int | None = None) -> int:
    """``value`` if it is an int from ``low`` to ``high``, else :func:`fail`."""
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f" <= {high}" if high is not None else ""
        raise fail(where, f"{field} must be an int >= {low}{bound}, got {value!r}")
    return value


def check_number(value: Any, where: str, field: str) -> float:
    """``value`` as a float if it is a finite number >= 0, else :func:`fail`."""
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise fail(where, f"{field} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_mapping(value: Any, where: str, field: str, keys: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """``value`` if it is a JSON object holding ``keys``, else :func:`fail`."""
    if not isinstance(value, dict):
        raise fail(where, f"{field} must be a JSON object, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise fail(where, f"{field} lacks {missing}")
    return value


def check_name(value: Any, where: str, what: str) -> str:
    """``value`` if it is a valid ``what`` name (``"node"``, ``"blob"``, ``"job"``), else :func:`fail`."""
    try:
        name = validate_name(value, what)
    except JobDefinitionError as exc:
        raise fail(where, str(exc)) from None
    if what == "blob" and name in RESERVED_BLOB_NAMES:
        raise fail(where, f"blob name {name!r} is reserved for Zarr metadata")
    return name


def _validate_blob(name: str, meta: Any, where: str) -> None:
    meta = check_mapping(meta, where, "blob entry", _BLOB_KEYS)
    layout = _layout_key(name, meta)
    try:
        count = _check_layout(name, meta, where) if layout is None else _checked_layout(*layout)
    except (CheckpointCorruptError, CheckpointFormatError):
        count = _check_layout(name, meta, where)  # raises again, naming ``where``
    codec, chunks, dtype = meta["codec"], meta["chunks"], meta["dtype"]
    hashes = meta["hashes"]
    if not isinstance(hashes, list) or len(hashes) != count:
        raise fail(where, f"hashes must list one digest per chunk ({count}), got {type(hashes).__name__}")
    for digest in hashes:
        if not isinstance(digest, str) or not HASH_RE.fullmatch(digest):
            raise fail(where, f"hashes must be 32 lowercase hex digits, got {digest!r}")
    if codec is not None:
        sizes = meta.get("sizes")
        if not isinstance(sizes, list) or len(sizes) != count:
            raise fail(where, f"a {codec} blob must list one stored size per chunk ({count})")
        raw = math.prod(chunks) * np.dtype(dtype).itemsize
        bound = max_stored_size(codec, raw)
        for size in sizes:
            if type(size) is not int or not 0 <= size <= bound:
                raise fail(
                    where,
                    f"sizes holds {size!r}; a {codec} chunk of {raw} bytes (chunks {chunks} of {dtype}) is stored "
                    f"in at most {bound} bytes",
                )


def _layout_key(name: str, meta: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The fields :func:`_check_layout` checks, as a key to remember a good layout by; ``None`` when a
    field is not of the plain type a good entry has (an ``int`` that is a ``bool`` would share its key)."""
    shape, chunks, nbytes, dims = meta["shape"], meta["chunks"], meta["nbytes"], meta.get("dimension_names")
    plain = (
        type(meta["dtype"]) is str
        and type(meta["kind"]) is str
        and (meta["codec"] is None or type(meta["codec"]) is str)
        and type(nbytes) is int
        and type(shape) is list
        and type(chunks) is list
        and all(type(d) is int for d in (*shape, *chunks))
        and ("dimension_names" not in meta or (type(dims) is list and all(type(d) is str for d in dims)))
    )
    if not plain:
        return None
    named = None if dims is None else tuple(dims)
    return name, meta["dtype"], meta["kind"], meta["codec"], tuple(shape), tuple(chunks), nbytes, named


@functools.lru_cache(maxsize=4096)
def _checked_layout(
    name: str,
    dtype: str,
    kind: str,
    codec: str | None,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    nbytes: int,
    dims: tuple[str, ...] | None,
) -> int:
    """:func:`_check_layout` of a layout given by :func:`_layout_key`, remembered when it is good
    (a node's blobs keep their layouts from epoch to epoch)."""
    meta: dict[str, Any] = {"dtype": dtype, "kind": kind, "codec": codec, "shape": list(shape)}
    meta.update({"chunks": list(chunks), "nbytes": nbytes})
    if dims is not None:
        meta["dimension_names"] = list(dims)
    return _check_layout(name, meta, "")


def _check_layout(name: str, meta: Mapping[str, Any], where: str) -> int:
    """Check a blob entry's data type, kind, codec, shape, chunks, size and dimension names; return its
    number of chunks."""
    dtype, kind, codec = meta["dtype"], meta["kind"], meta["codec"]
    if not isinstance(dtype, str) or not allowed_dtype(dtype):
        raise CheckpointFormatError(
            f"{where}: dtype {dtype!r} is not one daskjobs reads {sorted(ALLOWED_DTYPES)} (or <U<n>, |S<n>); "
            "nothing was decoded"
        )
    if kind not in KINDS or (kind == "json" and dtype != "|u1"):
        raise CheckpointFormatError(f"{where}: blob kind {kind!r} of {dtype} is not one of {KINDS}; nothing decoded")
    if codec not in CODECS:
        raise CheckpointFormatError(f"{where}: codec {codec!r} is not one of {CODECS}; nothing was decoded")
    shape, chunks = meta["shape"], meta["chunks"]
    for field, dims, low in (("shape", shape, 0), ("chunks", chunks, 1)):
        if not isinstance(dims, list) or len(dims) > MAX_NDIM:
            raise fail(where, f"{field} must be a list of at most {MAX_NDIM} ints, got {dims!r}")
        for dim in dims:
            check_int(dim, where, field, low, MAX_BLOB_BYTES)
    if len(chunks) != len(shape) or (kind == "json" and len(shape) != 1):
        raise fail(where, f"chunks {chunks} do not match shape {shape}")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > MAX_BLOB_BYTES:
        raise fail(where, f"shape {shape} of {dtype} is {nbytes} bytes, more than the limit {MAX_BLOB_BYTES}")
    if check_int(meta["nbytes"], where, "nbytes") != nbytes:
        raise fail(where, f"nbytes {meta['nbytes']} does not match shape {shape} and dtype {dtype}")
    if any(c > max(1, s) for s, c in zip(shape, chunks, strict=True)):
        raise fail(where, f"chunks {chunks} are larger than shape {shape}; daskjobs never writes such chunks")
    if math.prod(shape) and chunks[1:] != shape[1:]:
        raise CheckpointFormatError(
            f"{where}: chunks {chunks} split axes other than the first of shape {shape}; daskjobs did not write "
            "this, nothing was decoded"
        )
    count = math.prod(-(-s // c) for s, c in zip(shape, chunks, strict=True))
    if count > MAX_CHUNKS:
        raise fail(where, f"chunks {chunks} split shape {shape} into more than {MAX_CHUNKS} chunks")
    if "dimension_names" in meta and meta["dimension_names"] != dimension_names(name, len(shape)):
        raise fail(
            where,
            f"dimension_names {meta['dimension_names']!r} are not {dimension_names(name, len(shape))}, the names "
            "daskjobs gives the dimensions of this blob",
        )
    return count


def max_stored_size(codec: str, raw: int) -> int:
    """The most bytes a chunk of ``raw`` bytes can take once compressed with ``codec`` (its worst case:
    incompressible data), so that a commit record claiming more is refused before anything is allocated.

    zstd: ``ZSTD_compressBound`` plus room for the frame header and checksum; gzip: zlib's
    ``deflateBound`` for any settings plus the gzip header and trailer; blosc: the most it adds
    (16 bytes in c-blosc 1, 32 in c-blosc 2).
    """
    if codec == "zstd":
        return raw + (raw >> 8) + (((128 << 10) - raw) >> 11 if raw < 128 << 10 else 0) + 32
    if codec == "gzip":
        return raw + ((raw + 7) >> 3) + ((raw + 63) >> 6) + 5 + 18
    return raw + 32


def validate_node_entry(obj: Any, node: str, epoch: int, where: str | None = None) -> NodeEntry:
    """Check one node's entry (types, names, dtypes, sizes) and that it is ``node``'s at ``epoch``.

    Raises
    ------
    CheckpointCorruptError
        A field is missing, mistyped, inconsistent or out of limits, or a name is invalid.
    CheckpointFormatError
        A blob has a dtype daskjobs does not read.
    """
    where = where or f"checkpoint entry of node {node!r} at epoch {epoch}"
    entry = check_mapping(obj, where, "entry", _ENTRY_KEYS)
    if entry["node"] != node or entry["epoch"] != epoch or type(entry["epoch"]) is not int:
        raise fail(where, f"entry is for node {entry['node']!r} at epoch {entry['epoch']!r}")
    if not isinstance(entry["save_id"], str) or not SAVE_ID_RE.fullmatch(entry["save_id"]):
        raise fail(where, f"save_id must be 1-128 characters from A-Z a-z 0-9 _ -, got {entry['save_id']!r}")
    blobs = check_mapping(entry["blobs"], where, "blobs")
    if len(blobs) > MAX_BLOBS:
        raise fail(where, f"{len(blobs)} blobs, more than the limit {MAX_BLOBS}")
    for name, meta in blobs.items():
        _validate_blob(name, meta, f"{where}, blob {check_name(name, where, 'blob')!r}")
    total = sum(meta["nbytes"] for meta in blobs.values())
    if check_int(entry["bytes"], where, "bytes") != total:
        raise fail(where, f"bytes {entry['bytes']} is not the sum of the blobs' nbytes {total}")
    written, reused = (
        check_int(entry["bytes_written"], where, "bytes_written"),
        check_int(entry["bytes_reused"], where, "bytes_reused"),
    )
    if written + reused != total:
        raise fail(where, f"bytes_written + bytes_reused is not the sum of the blobs' nbytes {total}")
    check_number(entry["seconds"], where, "seconds")
    return cast("NodeEntry", dict(entry))
