"""Keeping the source file of steps that travel to workers, so their tracebacks show the user's code.

A step defined where a worker cannot import it (a notebook cell, a script's ``__main__``, a test
function) is pickled by value, with the functions of its own module that it calls. cloudpickle
3.1.3 and newer name the file of such code ``"<dynamic-code>"``; a traceback raised on the worker
then shows neither the file nor the line that raised. A plan records where those functions come
from when it is pickled (:func:`source_files`) and gives it back to the unpickled functions
(:func:`restore_source_files`): on a worker that sees the same files (a local cluster, a shared
disk, a notebook's cell files), the traceback shows the raising line as it would in-process.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

DYNAMIC_CODE = "<dynamic-code>"
"""The file name cloudpickle gives to code it pickled by value."""

_MOST_FUNCTIONS = 256
"""At most this many functions are followed from a plan's steps (a bound on the work per pickle)."""

SourceFiles = dict[tuple[str, str, int], str]
"""``(module, qualified name, first line): file`` of the functions a plan's steps reach."""


def _function(step: Callable[..., Any]) -> types.FunctionType | None:
    """The Python function that runs when ``step`` is called, if there is one."""
    target: Any = step
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)  # a bound method
    return target if inspect.isfunction(target) else None


def _names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` and the code nested in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _reachable(steps: Iterable[Callable[..., Any]]) -> Iterator[types.FunctionType]:
    """The steps' functions and the functions of the same module they call through globals or closures."""
    todo = [f for f in map(_function, steps) if f is not None]
    seen: set[int] = set()
    while todo and len(seen) < _MOST_FUNCTIONS:
        function = todo.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        yield function
        referred = [function.__globals__.get(name) for name in _names(function.__code__)]
        referred += [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
        todo += [f for f in referred if inspect.isfunction(f) and f.__module__ == function.__module__]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _key(function: types.FunctionType) -> tuple[str, str, int]:
    return function.__module__, function.__qualname__, function.__code__.co_firstlineno


def source_files(steps: Iterable[Callable[..., Any]]) -> SourceFiles:
    """Where the functions the steps reach come from (see :data:`SourceFiles`)."""
    return {_key(f): f.__code__.co_filename for f in _reachable(steps) if f.__code__.co_filename != DYNAMIC_CODE}


def restore_source_files(steps: Iterable[Callable[..., Any]], files: SourceFiles) -> None:
    """Give the functions unpickled with :data:`DYNAMIC_CODE` as their file (nested functions and
    lambdas too) the file recorded in ``files``; functions that kept their file are left alone."""
    if not files:
        return
    for function in _reachable(steps):
        file = files.get(_key(function))
        if file and function.__code__.co_filename == DYNAMIC_CODE:
            function.__code__ = _renamed(function.__code__, file)


def _renamed(code: types.CodeType, file: str) -> types.CodeType:
    consts = tuple(_renamed(c, file) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=file, co_consts=consts)
