"""Sources of an ArrayReader: numpy arrays (kept as blobs on the node) and Zarr arrays (read on the node)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from ..errors import JobDefinitionError

ARRAY_KINDS = frozenset("biufcUS")


def is_zarr_array(value: object) -> TypeGuard[Any]:
    """Whether ``value`` is a ``zarr.Array`` (checked without importing zarr)."""
    return type(value).__module__.split(".")[0] == "zarr" and hasattr(value, "shape") and hasattr(value, "dtype")


@dataclass(frozen=True)
class ZarrSource:
    """A Zarr array read slice by slice on the node: a ``zarr.Array``, or a URL/path opened there."""

    target: Any
    """The ``zarr.Array`` itself, or its URL or absolute path."""
    storage_options: Mapping[str, Any] | None = None

    def describe(self) -> str:
        """How error messages name this source."""
        return repr(self.target) if isinstance(self.target, str) else f"zarr.Array {self.target.shape}"

    def open(self, reader: str, node: str) -> Any:
        """The array, opened on this node; errors name ``reader`` and the URL."""
        if not isinstance(self.target, str):
            return self.target
        from ..checkpoint._storage.zarr_groups import open_array

        options = dict(self.storage_options or {}) if "://" in self.target else None
        try:
            array = open_array(self.target, options)
        except FileNotFoundError as exc:
            raise JobDefinitionError(
                f"reader {reader!r}: no Zarr array at {self.target!r} on node {node!r} ({exc}); "
                "give a path or URL that the node's worker can read"
            ) from exc
        except Exception as exc:
            kind = "a Zarr group, not an array" if "group" in str(exc) else f"unreadable: {type(exc).__name__}: {exc}"
            raise JobDefinitionError(
                f"reader {reader!r}: the Zarr source {self.target!r} on node {node!r} is {kind}; give the URL or "
                "path of one Zarr array"
            ) from exc
        check_array_meta(array.shape, np.dtype(array.dtype), reader, self.describe())
        return array


def check_array_meta(shape: tuple[int, ...], dtype: np.dtype, reader: str, source: str) -> None:
    """Refuse sources that have no records or whose dtype a workspace cannot hold."""
    if len(shape) < 1:
        raise JobDefinitionError(f"reader {reader!r}: source {source} is 0-d; records are rows: it needs a first axis")
    if dtype.kind not in ARRAY_KINDS or dtype.fields is not None:
        raise JobDefinitionError(
            f"reader {reader!r}: source {source} has dtype {dtype}; use bool, numeric or fixed-width string arrays"
        )


def as_source(value: object, reader: str, index: int, storage_options: Mapping[str, Any] | None) -> Any:
    """Normalise one ``ArrayReader`` source: a numpy array, or a :class:`ZarrSource`."""
    label = f"{index} ({type(value).__name__})"
    if is_zarr_array(value):
        check_array_meta(tuple(value.shape), np.dtype(value.dtype), reader, label)
        return ZarrSource(value)
    if isinstance(value, str | os.PathLike):
        target = os.fspath(value)
        if isinstance(target, bytes) or not target:
            raise JobDefinitionError(f"reader {reader!r}: source {label} must be a non-empty Zarr URL or path")
        if "://" not in target:
            target = os.path.abspath(target)
        return ZarrSource(target, storage_options)
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        raise JobDefinitionError(
            f"reader {reader!r}: source {label} is an ndarray subclass; pass np.asarray(...) of it (a plain array)"
        )
    if not isinstance(value, np.ndarray | list | tuple):
        raise JobDefinitionError(
            f"reader {reader!r}: source {label} is not a numpy array, a zarr.Array or a Zarr URL/path"
        )
    array = np.asarray(value)
    check_array_meta(array.shape, array.dtype, reader, label)
    return array
