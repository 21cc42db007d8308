"""Names and values: what a node or blob may be called, and what a workspace can hold (pure).

Every name (node, blob, metric, task) and every value a step assigns is checked here once, so that
what a step reads back is exactly what a restore from a checkpoint gives it.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeAlias

import numpy as np

from ..errors import BlobTypeError, DefinitionTypeError, JobDefinitionError

_NAME_RE = re.compile(r"[A-Za-z0-9_\-.:]{1,128}")


ALLOWED_DTYPE_KINDS = frozenset("biufcUS")
"""numpy dtype kinds a blob array may have: bool, integers, floats, complex, fixed-width strings."""


MAX_NDIM = 32
"""Most dimensions a blob array may have (Zarr v3 and the checkpoint reader refuse more)."""


MAX_STRING_CHARS = 1 << 20
"""Longest item of a fixed-width string array (characters for ``U``, bytes for ``S``)."""


MAX_JSON_DEPTH = 100
"""Deepest nesting of lists and dicts in a JSON value."""


MAX_JSON_INT_DIGITS = 10_000
"""Most decimal digits of an ``int`` kept as a JSON value. Converting an int to decimal text and back
takes time quadratic in its digits (Python refuses more than 4300 by default); at this bound one int
costs milliseconds, and a stored value cannot make reading a checkpoint take much longer."""


_INT_BOUND = 10**MAX_JSON_INT_DIGITS


_INT64 = np.iinfo(np.int64)


RESERVED_BLOB_NAMES = frozenset(["zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"])
"""Blob names that would collide with Zarr metadata keys inside a node's checkpoint group."""


JSON: TypeAlias = bool | int | float | str | list[Any] | dict[str, Any] | None
"""A normalised JSON value: lists and ``str``-keyed dicts of ``None``, bool, int, finite float, str."""


Value: TypeAlias = np.ndarray | JSON
"""What a workspace holds under a blob name."""

BlobValue: TypeAlias = Any
"""What reading a blob gives a step or a driver: a :data:`Value` at run time, ``Any`` for a type
checker. Which of them depends on the blob, and code uses it as what it knows it is
(``ws["w"] -= lr * grad``, ``float(output.fetch())``) without a cast."""


def validate_name(name: object, what: str) -> str:
    """Return ``name`` if it is a valid node, blob or job name, else raise.

    Valid names have 1-128 characters from ``A-Z a-z 0-9 _ - . :``, do not start with ``__``,
    are not ``.`` or ``..`` and contain no ``..``. Such names are safe as file and object-store
    path segments and as Dask resource names. Blob names must also not be Zarr metadata keys
    (:data:`RESERVED_BLOB_NAMES`).

    Raises
    ------
    DefinitionTypeError
        ``name`` is not a ``str`` (a ``JobDefinitionError`` and a ``TypeError``).
    JobDefinitionError
        A ``ValueError`` naming the bad name and the rule it breaks.

    Examples
    --------
    >>> validate_name("trainer_0", "node")
    'trainer_0'
    >>> validate_name("../x", "blob")
    Traceback (most recent call last):
    ...
    daskjobs.errors.JobDefinitionError: invalid blob name '../x': use 1-128 characters from A-Z a-z 0-9 _ - . :
    """
    if not isinstance(name, str):
        raise DefinitionTypeError(f"{what} name must be a str, got {type(name).__name__}: {name!r}")
    if not _NAME_RE.fullmatch(name):
        raise JobDefinitionError(f"invalid {what} name {name!r}: use 1-128 characters from A-Z a-z 0-9 _ - . :")
    if name.startswith("__"):
        raise JobDefinitionError(f"invalid {what} name {name!r}: names starting with '__' are reserved")
    if ".." in name or name == ".":
        raise JobDefinitionError(f"invalid {what} name {name!r}: '.', '..' and names containing '..' are not allowed")
    if what == "blob" and name in RESERVED_BLOB_NAMES:
        raise JobDefinitionError(f"invalid blob name {name!r}: reserved for Zarr metadata in checkpoints")
    return str(name)


def check_count(value: object, what: str, minimum: int = 1) -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``, else raise.

    Raises
    ------
    DefinitionTypeError
        ``value`` is not an integer (``bool`` and floats included).
    JobDefinitionError
        ``value`` is smaller than ``minimum``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise DefinitionTypeError(f"{what} must be an int >= {minimum}, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise JobDefinitionError(f"{what} must be >= {minimum}, got {value!r}")
    return int(value)


def check_positive(value: object, what: str, minimum: float = 0.0) -> float:
    """Return ``value`` as a ``float`` if it is a finite real number ``> minimum``, else raise.

    Raises
    ------
    DefinitionTypeError
        ``value`` is not a real number (``bool`` included).
    JobDefinitionError
        ``value`` is not finite or not greater than ``minimum``.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise DefinitionTypeError(f"{what} must be a number, got {type(value).__name__}: {value!r}")
    if not math.isfinite(value) or value <= minimum:
        raise JobDefinitionError(f"{what} must be a finite number > {minimum:g}, got {value!r}")
    return float(value)


_DTYPE_HINTS = {
    "O": "an object array; store a numeric array (np.asarray(value, dtype=float)), a fixed-width string "
    "array (value.astype(str)) or a JSON value (value.tolist())",
    "V": "a structured or void array; store each field as its own blob (value['field'])",
    "M": "a datetime array; store value.astype('int64') (unit in the blob name) or value.astype(str)",
    "m": "a timedelta array; store value.astype('int64') (unit in the blob name)",
    "T": "a variable-width string array; store value.astype(str) (fixed-width) or value.tolist()",
}


def check_dtype(dtype: np.dtype, blob: str) -> None:
    """Raise :class:`BlobTypeError` unless a blob array may have ``dtype``.

    Allowed: bool, integers, floats up to 64 bits, complex up to 128 bits, and fixed-width
    unicode (``U``) or bytes (``S``) strings; never structured or sub-array dtypes.
    """
    if dtype.kind not in ALLOWED_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        hint = _DTYPE_HINTS.get("V" if dtype.fields is not None else dtype.kind, "store a numeric array instead")
        raise BlobTypeError(
            f"blob {blob!r} would hold an array of dtype {dtype}, which a checkpoint cannot store: {hint}"
        )
    if dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        wanted = "float64" if dtype.kind == "f" else "complex128"
        raise BlobTypeError(
            f"blob {blob!r} would hold an array of dtype {dtype}, which Zarr v3 cannot store; "
            f"store value.astype(np.{wanted}) if its precision is enough"
        )


def check_array(array: np.ndarray, blob: str) -> np.ndarray:
    """Return a base-class ``array`` as a blob array (native byte order), or raise :class:`BlobTypeError`."""
    check_dtype(array.dtype, blob)
    if array.ndim > MAX_NDIM:
        raise BlobTypeError(
            f"blob {blob!r} would hold an array with {array.ndim} dimensions; at most {MAX_NDIM} are stored: reshape it"
        )
    if array.dtype.kind in "US" and array.dtype.itemsize > MAX_STRING_CHARS * (4 if array.dtype.kind == "U" else 1):
        raise BlobTypeError(
            f"blob {blob!r} would hold strings of dtype {array.dtype}; items of at most {MAX_STRING_CHARS} "
            "characters are stored: store long text as a str (a JSON value) or as bytes in a uint8 array"
        )
    if not array.dtype.isnative:
        # Lossless: the values stay, only the byte order changes, as a restore would give it.
        array = array.astype(array.dtype.newbyteorder("="))
    return array


def as_value(value: Any, blob: str) -> Value:
    """Normalise what a step assigns to ``blob`` into a value that survives a checkpoint.

    * numbers (Python or numpy scalars, ``bool`` included) become 0-d arrays; a Python ``int``
      outside the int64 range stays an exact JSON ``int``;
    * base-class ``numpy.ndarray`` of kind ``b i u f c U S`` is kept as is (non-native byte
      order is converted to native); a ``numpy.memmap`` becomes a plain ndarray view;
    * ``str``, ``None``, ``list``, ``tuple`` and ``dict`` with ``str`` keys become a new
      normalised JSON value: tuples become lists, numpy scalars inside become Python numbers;
    * anything else raises :class:`BlobTypeError`.

    Raises
    ------
    BlobTypeError
        A ``TypeError`` naming ``blob`` (and where inside a JSON value) and what to store instead.

    Examples
    --------
    >>> as_value(3, "x")
    array(3)
    >>> as_value({"seed": (1, 2**70), "lr": np.float32(0.5)}, "cfg")
    {'seed': [1, 1180591620717411303424], 'lr': 0.5}
    >>> as_value({1, 2}, "s")
    Traceback (most recent call last):
    ...
    daskjobs.errors.BlobTypeError: blob 's': cannot store a set; store sorted(value) (a list)
    """
    kind = type(value)  # exact types, one lookup (``value`` is ``Any``: no checker follows ``kind is ...``)
    if kind is np.ndarray:
        return check_array(value, blob)
    if kind is str:
        return _text(value, blob, "")
    if value is None:
        return value
    if kind is bool or kind is float or kind is complex:
        return np.asarray(value)
    if kind is int:
        return np.asarray(value, dtype=np.int64) if _INT64.min <= value <= _INT64.max else _int(value, blob, "")
    if kind is list or kind is tuple or kind is dict:
        return _json(value, blob, "", 0, set())
    if isinstance(value, np.generic):
        return check_array(np.asarray(value), blob)
    if isinstance(value, np.memmap):
        return check_array(np.asarray(value), blob)
    raise _refused(value, blob, "")


def copy_value(value: Value, blob: str = "value") -> Value:
    """An independent copy of a stored value: an array copy, or a new normalised JSON value.

    JSON values are checked again while copying, so a stored list or dict that a step changed
    in place into something unstorable raises :class:`BlobTypeError` naming ``blob``.

    Examples
    --------
    >>> state = {"pos": [1, 2]}
    >>> copied = copy_value(state)
    >>> copied == state, copied["pos"] is state["pos"]
    (True, False)
    """
    if isinstance(value, np.ndarray):
        return value.copy(order="K")
    return as_value(value, blob)


def _json(value: Any, blob: str, path: str, depth: int, active: set[int]) -> JSON:
    """Normalise one element of a JSON value found at ``path`` inside ``blob``."""
    kind = type(value)
    if kind is bool or value is None:
        return value
    if kind is int:
        return _int(value, blob, path)
    if kind is str:
        return _text(value, blob, path)
    if kind is float:
        if not math.isfinite(value):
            raise BlobTypeError(
                f"blob {blob!r}{_where(path)}: holds the float {value}, which JSON cannot store; "
                "store the data as a numpy array (arrays keep NaN and infinity) or use None"
            )
        return value
    if kind is list or kind is tuple or kind is dict:
        if depth >= MAX_JSON_DEPTH:
            raise BlobTypeError(
                f"blob {blob!r}{_where(path)}: nested deeper than {MAX_JSON_DEPTH} lists or dicts; flatten it"
            )
        if id(value) in active:
            raise BlobTypeError(f"blob {blob!r}{_where(path)}: the value contains itself; JSON values cannot be cyclic")
        active.add(id(value))
        try:
            if kind is dict:
                return {
                    _key(key, blob, path): _json(item, blob, f"{path}[{key!r}]", depth + 1, active)
                    for key, item in value.items()
                }
            return [_json(item, blob, f"{path}[{i}]", depth + 1, active) for i, item in enumerate(value)]
        finally:
            active.discard(id(value))
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating) and value.dtype.itemsize <= 8:
        return _json(float(value), blob, path, depth, active)
    if isinstance(value, np.str_):
        return _text(str(value), blob, path)
    raise _refused(value, blob, path)


def _int(value: int, blob: str, path: str) -> int:
    """``value`` if it has at most :data:`MAX_JSON_INT_DIGITS` decimal digits, else raise :class:`BlobTypeError`."""
    if -_INT_BOUND < value < _INT_BOUND:
        return value
    raise BlobTypeError(
        f"blob {blob!r}{_where(path)}: holds an int of more than {MAX_JSON_INT_DIGITS} decimal digits "
        f"({value.bit_length()} bits), more than a JSON value keeps; store its bytes as a uint8 array: "
        "np.frombuffer(value.to_bytes((value.bit_length() + 8) // 8, 'little', signed=True), np.uint8)"
    )


def _text(value: str, blob: str, path: str, what: str = "a str") -> str:
    """``value`` if UTF-8 can encode it (no lone surrogates), else raise :class:`BlobTypeError`."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BlobTypeError(
            f"blob {blob!r}{_where(path)}: holds {what} with the lone surrogate {value[exc.start]!r} at index "
            f"{exc.start}, which UTF-8 (and so a checkpoint) cannot store; store valid text, e.g. "
            "value.encode('utf-8', 'replace').decode(), or its bytes as a uint8 array: "
            "np.frombuffer(value.encode('utf-8', 'surrogatepass'), np.uint8)"
        ) from None
    return value


def _key(key: object, blob: str, path: str) -> str:
    if type(key) is str or type(key) is np.str_:
        return _text(str(key), blob, path, "the dict key")
    raise BlobTypeError(
        f"blob {blob!r}{_where(path)}: has the dict key {key!r} ({type(key).__name__}); JSON keys are str: "
        "convert the keys, e.g. {str(k): v for k, v in value.items()}"
    )


def _where(path: str) -> str:
    return f" at value{path}" if path else ""


def _refused(value: object, blob: str, path: str) -> BlobTypeError:
    """The error for a value that is neither a blob array nor JSON, with what to store instead."""
    kind = type(value)
    name = kind.__name__
    module = getattr(kind, "__module__", "") or ""
    if isinstance(value, np.ndarray) and path:
        hint = "store the array as its own blob, or value.tolist() inside a JSON value"
    elif isinstance(value, np.ma.MaskedArray):
        hint = (
            "a masked array would lose its mask; store np.ma.getdata(value) and np.ma.getmaskarray(value) as two blobs"
        )
    elif isinstance(value, np.matrix):
        hint = "np.matrix would come back as a plain array; store np.asarray(value)"
    elif isinstance(value, np.ndarray):
        hint = f"a {name} (an ndarray subclass) would come back as a plain array; store np.asarray(value)"
    elif isinstance(value, np.complexfloating):
        hint = "JSON has no complex numbers; store [value.real, value.imag] or a complex array as its own blob"
    elif isinstance(value, np.floating):
        hint = "JSON floats have 64 bits; store float(value) if that precision is enough"
    elif isinstance(value, np.generic):
        hint = "store str(value) or a number inside a JSON value, or a numpy array as its own blob"
    elif module.split(".")[0] == "pandas":
        hint = "store its columns as arrays (value['col'].to_numpy()) or value.to_dict('list') as a JSON value"
    elif isinstance(value, set | frozenset):
        hint = "store sorted(value) (a list)"
    elif isinstance(value, bytes | bytearray | memoryview):
        hint = "store value.decode() (a str), np.frombuffer(value, np.uint8), or np.array(value) (fixed-width bytes)"
    elif isinstance(value, complex):
        hint = "JSON has no complex numbers; store [value.real, value.imag] or a complex array as its own blob"
    elif isinstance(value, bool | int | float | str | list | tuple | dict):
        base = next(b for b in (bool, int, float, str, list, tuple, dict) if isinstance(value, b)).__name__
        hint = f"a {name} (a subclass of {base}) would come back as a plain {base}; store {base}(value)"
    elif hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        hint = "store np.asarray(value)"
    else:
        hint = (
            "a workspace holds numpy arrays (numbers become 0-d arrays) and JSON values (None, str, bool, int, "
            "finite float, list, dict with str keys); convert it to one of those"
        )
    what = f"a {module}.{name}" if module not in ("builtins", "") and not module.startswith("numpy") else f"a {name}"
    return BlobTypeError(f"blob {blob!r}{_where(path)}: cannot store {what}; {hint}")


def check_label(name: object, what: str, *, forbidden: str = "") -> str:
    """``name`` if it can label a task or a metric: a ``str`` of 1-128 printable characters, none of
    ``forbidden`` (a label shows in messages, records and tables; it is never a path)."""
    if not isinstance(name, str):
        raise DefinitionTypeError(f"{what} name must be a str, got {type(name).__name__}: {name!r}")
    if not 1 <= len(name) <= 128 or not name.isprintable() or any(c in name for c in forbidden):
        other = f" other than {', '.join(map(repr, forbidden))}" if forbidden else ""
        raise JobDefinitionError(f"invalid {what} name {name!r}: use 1-128 printable characters{other}")
    return name
