"""Chunk layout, chunk hashes and array metadata of the raw (uncompressed) format (pure: no I/O).

Every blob is a Zarr v3 array split along axis 0 into chunks of about :data:`CHUNK_BYTES`
(``"default"`` chunk keys with ``"."`` separators: ``c.0.0``, ``c.1.0`` …). A raw chunk file
holds its rows' bytes, the last one zero-padded to the full chunk size as Zarr expects. Each
chunk file's bytes have an XXH3-128 digest, recorded in the commit record: it verifies every
read and decides delta reuse.

The ``zarr.json`` of a raw array is a pure function of ``(dtype, shape, chunks, kind,
dimension names)``: :func:`raw_metadata` builds the exact bytes, so a reader compares what it finds
byte for byte and refuses anything else. Every array names its dimensions ``<blob>/dim_<i>``
(:func:`dimension_names`), unique to its blob, so that xarray opens a node's group as a Dataset of
every blob; groups written before that name none, and are read as they are.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

CHUNK_BYTES = 64 << 20
"""Target chunk size: chunks split arrays along axis 0 into pieces of at most about this size."""
JSON_ATTRIBUTES = {"daskjobs": {"encoding": "json"}}
"""Attributes of the ``uint8`` array that holds a JSON blob's UTF-8 text."""

_PAGE = 4096
_ALIGN_FROM = 1 << 20
_HUGE_PAGE = 2 << 20
_HUGE_FROM = 8 << 20
_OWN_BUFFER_FROM = 64 << 10
"""Arrays a read allocates of at least this many bytes get a buffer of their own (:func:`empty_arrays`)."""
_ARENA_BYTES = 16 << 20
"""The most bytes of smaller arrays one shared buffer of a read holds."""
_ARENA_ALIGN = 64
"""Where each array in a shared buffer starts: a multiple of this (a cache line, and any dtype's alignment)."""
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
_FILL = {"b": False, "i": 0, "u": 0, "f": 0.0, "c": [0.0, 0.0], "U": "", "S": ""}


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Chunk shape splitting ``shape`` along axis 0 into about-equal chunks of about :data:`CHUNK_BYTES`.

    Where it costs little, chunks hold whole pages, so every chunk lands page-aligned in the
    page-aligned arrays :func:`empty_aligned` allocates for reading.
    """
    return list(_chunk_rows(shape, itemsize, CHUNK_BYTES))


@functools.lru_cache(maxsize=4096)
def _chunk_rows(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """:func:`chunk_rows` for chunks of about ``chunk_bytes``, remembered (a workspace's blobs keep
    their shapes from epoch to epoch)."""
    if not shape:
        return ()
    row = itemsize * math.prod(shape[1:])
    if shape[0] == 0 or row == 0:
        return (1, *(max(1, d) for d in shape[1:]))
    count = -(-shape[0] * row // chunk_bytes)
    rows = -(-shape[0] // count)
    step = _PAGE // math.gcd(row, _PAGE)
    if count > 1 and step * row * 64 <= chunk_bytes:
        rows = min(shape[0], -(-rows // step) * step)
    return (rows, *shape[1:])


def chunk_count(shape: list[int] | tuple[int, ...], chunks: list[int] | tuple[int, ...]) -> int:
    """How many chunk files an array of ``shape`` split into ``chunks`` has (1 for 0-d, 0 if empty)."""
    return math.prod(-(-s // c) for s, c in zip(shape, chunks, strict=True))


@functools.lru_cache(maxsize=4096)
def chunk_key(index: int, ndim: int) -> str:
    """The key of chunk ``index`` along axis 0: ``"c"`` for 0-d arrays, else ``"c.<index>.0…"``."""
    return ".".join(["c", str(index), *("0" * (ndim - 1))]) if ndim else "c"


def chunk_spans(nbytes: int, shape: list[int] | tuple[int, ...], chunks: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, padding)`` byte ranges of each chunk's rows in the flat array."""
    if nbytes == 0:
        return
    if not shape:
        yield 0, nbytes, 0
        return
    size = nbytes // shape[0] * chunks[0]
    for start in range(0, nbytes, size):
        stop = min(start + size, nbytes)
        yield start, stop, size - (stop - start)


def digest(*parts: Any) -> str:
    """XXH3-128 of the concatenated buffers, as 32 lowercase hex digits."""
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def empty_aligned(shape: list[int] | tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array; large ones start on a page boundary, very large ones on a huge page's.

    Linux copies file pages into a buffer at numpy's usual address of large arrays (16 bytes
    past a page boundary) about 3x slower than into a page-aligned one. Numpy asks for
    transparent huge pages for large arrays, and only whole 2 MiB pages of the buffer get
    them: aligned to one, reading 1 GiB into fresh memory takes 512 page faults, not 262144.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dtype)
    align = _HUGE_PAGE if nbytes >= _HUGE_FROM else _PAGE
    buffer = np.empty(nbytes + align, np.uint8)
    start = -buffer.ctypes.data % align
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def empty_arrays(layouts: list[tuple[list[int], np.dtype]]) -> list[np.ndarray]:
    """Uninitialised arrays of the given ``(shape, dtype)`` for one read: each large one from
    :func:`empty_aligned`; the small ones (under :data:`_OWN_BUFFER_FROM` bytes, and too small for
    :func:`empty_aligned` to align) packed into shared buffers of up to :data:`_ARENA_BYTES`, each
    at an offset aligned to :data:`_ARENA_ALIGN`.

    One allocation per small array scales badly: the C allocator gives the memory of a freed read's
    thousands of arrays back to the system and takes it again for the next, about 2 µs per array
    at 1000 blobs of 4 KiB against 0.2 µs at 100. The price of packing: an array still in use keeps
    its whole buffer (at most :data:`_ARENA_BYTES`) alive.

    Examples
    --------
    >>> a, b = empty_arrays([([3], np.dtype("<f8")), ([2, 2], np.dtype("<i4"))])
    >>> a.shape, b.shape, a.base is b.base, b.ctypes.data % 64
    ((3,), (2, 2), True, 0)
    """
    arrays: dict[int, np.ndarray] = {}
    small: list[tuple[int, int]] = []  # (index, bytes) of the arrays packed into shared buffers
    for index, (shape, dtype) in enumerate(layouts):
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes >= min(_OWN_BUFFER_FROM, _ALIGN_FROM) or not nbytes:
            arrays[index] = empty_aligned(shape, dtype)
        else:
            small.append((index, nbytes))
    while small:
        taken, size = 0, 0
        while taken < len(small) and (not taken or size + _padded(small[taken][1]) <= _ARENA_BYTES):
            size += _padded(small[taken][1])
            taken += 1
        arena = np.empty(size + _ARENA_ALIGN, np.uint8)
        offset = -arena.ctypes.data % _ARENA_ALIGN
        for index, nbytes in small[:taken]:
            shape, dtype = layouts[index]
            arrays[index] = arena[offset : offset + nbytes].view(dtype).reshape(shape)
            offset += _padded(nbytes)
        del small[:taken]
    return [arrays[index] for index in range(len(layouts))]


def _padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`_ARENA_ALIGN`."""
    return -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN


def flat_bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a flat ``uint8`` memoryview (writable if the array is).

    Examples
    --------
    >>> bytes(flat_bytes(np.arange(2, dtype="<u2"))), bytes(flat_bytes(np.zeros((0, 3))))
    (b'\\x00\\x00\\x01\\x00', b'')
    """
    if array.size and array.flags.c_contiguous:
        try:  # the buffer protocol's view: a few times cheaper than numpy's reshape and view
            return array.data.cast("B")
        except (TypeError, ValueError):  # a dtype without a buffer format
            pass
    return array.reshape(-1).view(np.uint8).data


def zarr_data_type(dtype: np.dtype) -> Any:
    """The Zarr v3 ``data_type`` of a stored dtype (as zarr-python 3.1 writes it)."""
    if dtype.kind == "U":
        return {"name": "fixed_length_utf32", "configuration": {"length_bytes": dtype.itemsize}}
    if dtype.kind == "S":
        return {"name": "null_terminated_bytes", "configuration": {"length_bytes": dtype.itemsize}}
    return _ZARR_TYPES[dtype.str]


def bytes_codec(dtype: np.dtype) -> dict[str, Any]:
    """The ``bytes`` codec of a stored dtype: little-endian where byte order matters."""
    if dtype.kind == "U" or (dtype.kind != "S" and dtype.itemsize > 1):
        return {"name": "bytes", "configuration": {"endian": "little"}}
    return {"name": "bytes"}


def dimension_names(blob: str, ndim: int) -> list[str]:
    """The Zarr v3 ``dimension_names`` of blob ``blob``'s array: ``<blob>/dim_<i>``. A blob name never
    holds ``/``, so no two blobs share a dimension (xarray would join dimensions of one name, and
    refuse them when their sizes differ) and no dimension is named like a blob.

    Examples
    --------
    >>> dimension_names("w", 2), dimension_names("step", 0)
    (['w/dim_0', 'w/dim_1'], [])
    """
    return list(_dimension_names(blob, ndim))


@functools.lru_cache(maxsize=4096)
def _dimension_names(blob: str, ndim: int) -> tuple[str, ...]:
    """:func:`dimension_names`, remembered (a workspace names the same blobs every epoch)."""
    return tuple(f"{blob}/dim_{axis}" for axis in range(ndim))


def array_metadata(
    dtype: np.dtype, shape: list[int], chunks: list[int], kind: str, dims: list[str] | None = None
) -> dict[str, Any]:
    """The Zarr v3 ``zarr.json`` (as a dict) of an uncompressed little-endian array, naming its
    dimensions ``dims`` (``None``: none, as groups written before daskjobs named them)."""
    named = {} if dims is None else {"dimension_names": list(dims)}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": zarr_data_type(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": _FILL[dtype.kind],
        "codecs": [bytes_codec(dtype)],
        "attributes": JSON_ATTRIBUTES if kind == "json" else {},
        **named,
        "storage_transformers": [],
    }


@functools.lru_cache(maxsize=8192)
def raw_metadata(
    dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], kind: str, dims: tuple[str, ...] | None = None
) -> bytes:
    """The exact ``zarr.json`` bytes of an uncompressed array (cached: the same arrays recur every epoch)."""
    meta = array_metadata(np.dtype(dtype), list(shape), list(chunks), kind, None if dims is None else list(dims))
    return json.dumps(meta, separators=(",", ":")).encode()
