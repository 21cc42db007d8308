"""Loading the job a ``TARGET`` string names (``package.module:name`` or ``path/to/file.py:name``),
as ``daskjobs run``, ``daskjobs check`` and :func:`daskjobs.testing.check_resume` take it.

A job file's module and the helper modules it imports from its own folder travel to the workers
with the steps, by value (see :mod:`daskjobs._execution.shipping`): workers that never saw these
files run the steps all the same.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from .._model.job import Job
from ..errors import TargetError, TargetLoadError


def load_job(target: str) -> Job:
    """The :class:`~daskjobs.Job` that ``TARGET`` names (calling it if it is a callable).

    A file's module, and the helper modules it imports from its folder, travel to the workers
    with the steps, by value (:func:`ship_by_value`).

    Raises
    ------
    TargetError
        TARGET is malformed, names a file or attribute that does not exist, or something that is
        neither a Job nor a callable without arguments returning one; or its module does not import
        (a ``SyntaxError`` or an ``ImportError``: the message names the file, and the line).
    TargetLoadError
        Importing TARGET's module raised another error, or calling its callable raised (``__cause__``).
    """
    source, sep, name = target.rpartition(":")
    if not sep or not source or not name or (len(source) == 1 and source.isalpha()):
        raise TargetError(f"TARGET must be package.module:name or path/to/file.py:name, got {target!r}")
    try:
        module = _import_file(source) if source.endswith(".py") or os.sep in source else _import_module(source)
    except (TargetError, KeyboardInterrupt):
        raise
    except (SyntaxError, ImportError) as exc:
        raise TargetError(_not_importable(source, exc)) from exc
    except Exception as exc:
        raise TargetLoadError(f"importing {source} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            found = sorted(n for n, v in vars(module).items() if isinstance(v, Job) or callable(v))[:10]
            raise TargetError(f"{source} has no attribute {name!r}; it has e.g. {', '.join(found) or 'nothing usable'}")
        obj = getattr(obj, part)
    if isinstance(obj, Job):
        return obj
    if not callable(obj):
        raise TargetError(f"{target} is not a Job or a callable returning one: it is {type(obj).__name__} {obj!r:.80}")
    if isinstance(obj, type) and not issubclass(obj, Job):  # never instantiated: it cannot make a Job
        raise TargetError(f"{target} is not a Job or a callable returning one: it is the class {obj.__qualname__}")
    needed = _required_parameters(obj)
    if needed:
        raise TargetError(
            f"{target} is not a Job or a callable returning one without arguments: "
            f"{getattr(obj, '__qualname__', name)} needs {', '.join(needed)}"
        )
    try:
        job = obj()
    except Exception as exc:
        raise TargetLoadError(f"building the job with {target}() failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(job, Job):
        raise TargetError(f"{target}() returned {type(job).__name__} {job!r:.80}, not a Job")
    return job


def _not_importable(source: str, error: SyntaxError | ImportError) -> str:
    """What a ``SyntaxError`` or ``ImportError`` raised while importing ``source`` says: the file
    and line where it happened, then the error. For an ``ImportError`` that is the innermost line of
    the job's own folder (the job file, or a helper module beside it), else the innermost line of
    any file that is not daskjobs' or Python's import machinery.

    Examples
    --------
    >>> error = SyntaxError("'(' was never closed", ("/jobs/train.py", 3, 9, "x = (\\n"))
    >>> _not_importable("train.py", error)
    "train.py does not import: /jobs/train.py, line 3: SyntaxError: '(' was never closed"
    """
    if isinstance(error, SyntaxError):
        where, line, message = error.filename, error.lineno, error.msg
    else:
        folder = Path(source).expanduser().resolve().parent if source.endswith(".py") else Path.cwd()
        daskjobs_folder = Path(__file__).resolve().parents[1]
        frames = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if not frame.filename.startswith("<") and not Path(frame.filename).is_relative_to(daskjobs_folder)
        ]
        own = [frame for frame in frames if Path(frame.filename).resolve().is_relative_to(folder)]
        last = (own or frames)[-1] if own or frames else None
        where, line, message = (last.filename, last.lineno, str(error)) if last else (source, None, str(error))
    at = f"{where}, line {line}" if line else str(where)
    return f"{source} does not import: {at}: {type(error).__name__}: {message}"


def _required_parameters(function: Any) -> list[str]:
    """The parameters ``function`` cannot be called without (none when its signature is unknown)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in kinds]


def _import_file(path: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise TargetError(f"TARGET file {path} does not exist")
    name = f"daskjobs_target_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent))
    before = set(sys.modules)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    ship_by_value(module, _modules_under(file.parent, set(sys.modules) - before))
    return module


def _import_module(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    before = set(sys.modules)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise TargetError(f"cannot import {name!r}: no module named {exc.name!r} (run from its folder?)") from None
        raise
    here = Path.cwd()
    file = getattr(module, "__file__", None)
    if not _is_daskjobs(name) and file and Path(file).resolve().is_relative_to(here):
        ship_by_value(module, _modules_under(here, set(sys.modules) - before))
    return module


def _is_daskjobs(name: str) -> bool:
    """Whether module ``name`` is part of daskjobs, which every worker imports (also when the
    target is a module of a daskjobs checkout, such as ``daskjobs.demo``, run from that checkout)."""
    return name.partition(".")[0] == __name__.partition(".")[0]


def _modules_under(folder: Path, names: set[str]) -> list[ModuleType]:
    """The modules named in ``names`` whose files lie under ``folder`` but not in an installed
    package (a virtual environment inside the project folder stays by reference) nor in daskjobs."""
    found = []
    for name in sorted(names):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if module is None or not file:
            continue
        path = Path(file).resolve()
        if _is_daskjobs(name) or {"site-packages", "dist-packages"} & set(path.parts):
            continue
        if path.is_relative_to(folder):
            found.append(module)
    return found


def ship_by_value(target: ModuleType, helpers: list[ModuleType]) -> None:
    """Send the code of the job's module and of its helper modules (those it imported from its own
    folder) with the steps, by value: workers that never saw these files still run the steps (see
    :mod:`daskjobs._execution.shipping`). A package is shipped whole."""
    import cloudpickle

    tops = {target.__name__: target}
    for module in helpers:
        top = module.__name__.partition(".")[0]
        tops.setdefault(top, sys.modules.get(top, module))
    for module in tops.values():
        cloudpickle.register_pickle_by_value(module)
