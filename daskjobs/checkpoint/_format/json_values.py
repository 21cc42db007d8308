"""JSON blob values as stored in a checkpoint: compact UTF-8 JSON text, ints of any size included.

:func:`json.dumps` and :func:`json.loads` refuse ints of more than ``sys.get_int_max_str_digits()``
decimal digits (4300 by default): Python's conversion between ``int`` and decimal text takes time
quadratic in the digits. Raising that limit is process-wide, so this module leaves it alone and
converts such ints itself, through :class:`decimal.Decimal`, only when the fast path fails.
Reading refuses ints of more than :data:`~daskjobs._model.values.MAX_JSON_INT_DIGITS` digits, the
most an assignment accepts, which bounds the time one stored int can cost.
"""

from __future__ import annotations

import decimal
import json
from typing import Any

from ..._model.values import MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS


def encode(value: Any) -> bytes:
    """The UTF-8 JSON text of a normalised JSON value (no NaN or infinity, ``str`` keys).

    Raises
    ------
    TypeError
        Something in ``value`` is not a JSON value.
    ValueError
        A non-finite float, nesting deeper than :data:`~daskjobs._model.values.MAX_JSON_DEPTH` (or a
        cycle), or a ``str`` that UTF-8 cannot encode (a lone surrogate).
    """
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # an int beyond the process's digit limit (or what the slow path refuses too)
        parts: list[str] = []
        _encode(value, parts, 0)
        text = "".join(parts)
    return text.encode()


def _encode(value: Any, parts: list[str], depth: int) -> None:
    """Append the JSON text of ``value`` to ``parts``, writing long ints through :class:`decimal.Decimal`."""
    if type(value) is int:
        parts.append(_int_text(value))
    elif isinstance(value, list | tuple | dict) and depth >= MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} lists or dicts")
    elif isinstance(value, list | tuple):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _encode(item, parts, depth + 1)
        parts.append("]")
    elif isinstance(value, dict):
        parts.append("{")
        for index, (key, item) in enumerate(value.items()):
            if type(key) is not str:
                raise TypeError(f"keys must be str, not {type(key).__name__}")
            parts.append(f"{',' if index else ''}{_scalar(key)}:")
            _encode(item, parts, depth + 1)
        parts.append("}")
    else:
        parts.append(_scalar(value))


def _scalar(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _int_text(value: int) -> str:
    try:
        return repr(value)
    except ValueError:  # more digits than int <-> str converts in this process
        return str(decimal.Decimal(value))


def decode(data: bytes) -> Any:
    """The JSON value of stored UTF-8 text; ints of up to :data:`MAX_JSON_INT_DIGITS` digits.

    Raises
    ------
    ValueError
        Not JSON, a non-finite number, an int with more digits, or nesting too deep to parse
        (``UnicodeDecodeError`` for text that is not UTF-8, also a ``ValueError``).
    """
    text = data.decode("utf-8")
    try:
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError:  # maybe an int beyond the process's digit limit: parse again, converting ints here
            return json.loads(text, parse_constant=_no_constant, parse_int=_parse_int)
    except RecursionError:
        raise ValueError("lists or objects nested too deeply to parse") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _parse_int(digits: str) -> int:
    try:
        return int(digits)
    except ValueError:
        pass
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise ValueError(
            f"an int of {len(digits.lstrip('-'))} digits, more than the {MAX_JSON_INT_DIGITS} a checkpoint stores"
        )
    return int(decimal.Decimal(digits))
