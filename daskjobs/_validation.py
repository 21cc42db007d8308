"""Name and dtype rules shared by the model, the workspaces and the checkpoint reader (pure)."""

from __future__ import annotations

import re

import numpy as np

from .errors import BlobTypeError, JobDefinitionError

_NAME_RE = re.compile(r"[A-Za-z0-9_\-.:]{1,128}")
ALLOWED_DTYPE_KINDS = frozenset("biufc")


def validate_name(name: object, what: str) -> str:
    """Return ``name`` if it is a valid node, blob or job name, else raise.

    Valid names have 1-128 characters from ``A-Z a-z 0-9 _ - . :``, do not start with ``__``,
    are not ``.`` or ``..`` and contain no ``..``. Such names are safe as file and object-store
    path segments and as Dask resource names.

    Raises
    ------
    JobDefinitionError
        A ``ValueError`` naming the bad name and the rule it breaks.
    """
    if not isinstance(name, str):
        raise JobDefinitionError(f"{what} name must be a str, got {type(name).__name__}: {name!r}")
    if not _NAME_RE.fullmatch(name):
        raise JobDefinitionError(f"invalid {what} name {name!r}: use 1-128 characters from A-Z a-z 0-9 _ - . :")
    if name.startswith("__"):
        raise JobDefinitionError(f"invalid {what} name {name!r}: names starting with '__' are reserved")
    if ".." in name or name == ".":
        raise JobDefinitionError(f"invalid {what} name {name!r}: '.', '..' and names containing '..' are not allowed")
    return name


def check_dtype(dtype: np.dtype, blob: str) -> None:
    """Raise :class:`BlobTypeError` unless ``dtype`` is a fixed-size bool or numeric dtype Zarr v3 stores."""
    if dtype.kind not in ALLOWED_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise BlobTypeError(
            f"blob {blob!r} has dtype {dtype} ({dtype.kind!r}); workspaces hold only bool, integer, "
            "unsigned, float and complex arrays"
        )
    if dtype.itemsize > (16 if dtype.kind == "c" else 8):
        raise BlobTypeError(f"blob {blob!r} has dtype {dtype}, which Zarr v3 cannot store; use float64 or complex128")


def as_blob(value: object, blob: str) -> np.ndarray:
    """Convert ``value`` to an array a workspace may hold (a scalar becomes a 0-d array)."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    check_dtype(array.dtype, blob)
    return array
