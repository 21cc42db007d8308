"""Thread-local context stacks behind ``with Node(...)``, ``with TaskGroup()`` and friends (pure)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Literal, Self, overload

from ..errors import DefinitionTypeError, InvalidStateError

_local = threading.local()


def _stack(cls: type) -> list[Any]:
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = {}
    return stacks.setdefault(cls, [])


class Managed:
    """A class whose instances can be entered as the thread's current one.

    Entering pushes the instance on the stack of every managed class in its hierarchy, so a
    subclass instance is also current for its base classes. ``_default_factory`` classes build a
    default instance on demand that stays as the thread's default.
    """

    _managed_default: ClassVar[bool] = False

    def __enter__(self) -> Self:
        for cls in self._managed_classes():
            _stack(cls).append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for cls in self._managed_classes():
            popped = _stack(cls).pop()
            if popped is not self:
                raise InvalidStateError(
                    f"context stack of {cls.__name__} corrupted: exited {self!r}, top was {popped!r}"
                )

    @classmethod
    def _managed_classes(cls) -> list[type]:
        return [c for c in cls.__mro__ if isinstance(c, type) and issubclass(c, Managed) and c is not Managed]

    @overload
    @classmethod
    def current(cls, value: Self | None = None, required: Literal[True] = True) -> Self: ...

    @overload
    @classmethod
    def current(cls, value: Self | None = None, required: bool = True) -> Self | None: ...

    @classmethod
    def current(cls, value: Self | None = None, required: bool = True) -> Self | None:
        """The innermost active instance (or ``value`` when given).

        With no active instance, default-managed classes create and keep a default one;
        others return ``None`` when ``required`` is false and raise otherwise.

        Raises
        ------
        InvalidStateError
            No instance is active, none is made by default and ``required`` is true.
        DefinitionTypeError
            ``value`` is not an instance of this class.
        """
        if value is not None:
            if not isinstance(value, cls):
                raise DefinitionTypeError(f"expected a {cls.__name__}, got {type(value).__name__}")
            return value
        stack = _stack(cls)
        if stack:
            return stack[-1]
        if cls._managed_default:
            default = cls()
            stack.append(default)
            return default
        if required:
            raise InvalidStateError(f"no active {cls.__name__}: use it inside 'with {cls.__name__}(...):'")
        return None
