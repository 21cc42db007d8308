"""Keeping the source file of steps that travel to workers, so their tracebacks show the user's code.

A step defined where a worker cannot import it (a notebook cell, a script's ``__main__``, a test
function) is pickled by value. cloudpickle 3.1.3 and newer name the file of such code
``"<dynamic-code>"``; a traceback raised on the worker then shows neither the file nor the line
that raised. A plan records each step's file when it is pickled (:func:`source_files`) and gives
it back to the unpickled steps (:func:`restore_source_files`): on a worker that sees the same
file (a local cluster, a shared disk), the traceback shows the raising line as it would in-process.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

DYNAMIC_CODE = "<dynamic-code>"
"""The file name cloudpickle gives to code it pickled by value."""


def _function(step: Callable[..., Any]) -> types.FunctionType | None:
    """The Python function that runs when ``step`` is called, if there is one."""
    target: Any = step
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)  # a bound method
    return target if inspect.isfunction(target) else None


def source_files(steps: Iterable[Callable[..., Any]]) -> tuple[str, ...]:
    """The file each step's code comes from (``""`` for steps that are not Python functions)."""
    files = []
    for step in steps:
        function = _function(step)
        files.append("" if function is None else function.__code__.co_filename)
    return tuple(files)


def restore_source_files(steps: Iterable[Callable[..., Any]], files: Iterable[str]) -> None:
    """Give steps unpickled with :data:`DYNAMIC_CODE` as their file the file they came from (nested
    functions and lambdas too); steps that kept their file are left alone."""
    for step, file in zip(steps, files, strict=False):
        function = _function(step)
        if function is not None and file and function.__code__.co_filename == DYNAMIC_CODE:
            function.__code__ = _renamed(function.__code__, file)


def _renamed(code: types.CodeType, file: str) -> types.CodeType:
    consts = tuple(_renamed(c, file) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=file, co_consts=consts)
