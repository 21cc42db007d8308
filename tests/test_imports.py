"""Import hygiene: the pure core stays free of distributed and zarr, and the public namespace is tidy."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import daskjobs as dj

CORE = (
    "daskjobs._model.job",
    "daskjobs._model.group",
    "daskjobs._model.task",
    "daskjobs._model.node",
    "daskjobs._model.workspace",
    "daskjobs._execution.lowering",
    "daskjobs._execution.node_run",
    "daskjobs._execution.shipping",
    "daskjobs.data",
)


def imported_after(modules: tuple[str, ...], probe: str) -> bool:
    code = f"import sys\nimport {', '.join(modules)}\nprint({probe!r} in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip() == "True"


@pytest.mark.slow
def test_core_does_not_import_zarr():
    """Importing the job model, workspaces, executor and readers does not import zarr."""
    assert imported_after(CORE, "zarr") is False


@pytest.mark.slow
def test_core_does_not_import_distributed():
    """Importing the job model, workspaces, executor and readers does not import distributed."""
    assert imported_after(CORE, "distributed") is False


@pytest.mark.slow
def test_import_daskjobs_in_fresh_process():
    """import daskjobs works in a fresh interpreter and exposes its version."""
    code = "import daskjobs as dj; print(dj.__version__); print(dj.LocalSession.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == [dj.__version__, "LocalSession"]
    assert result.stderr == ""


def test_all_is_sorted_and_complete():
    """dj.__all__ is sorted, unique, and every name in it exists."""
    assert dj.__all__ == sorted(dj.__all__)
    assert len(set(dj.__all__)) == len(dj.__all__)
    missing = [name for name in dj.__all__ if not hasattr(dj, name)]
    assert missing == []


@pytest.mark.parametrize("first", ["", "dj.DaskSession; dj.open_checkpoint; dj.ArrayReader; dj.JobRunner"])
@pytest.mark.slow
def test_dir_shows_the_public_names_only(first):
    """dir(daskjobs) lists __all__ and dunders: no helper import (importlib), no private module, no
    subpackage loaded on first use; in a fresh interpreter, before and after the lazy names load."""
    code = f"import daskjobs as dj\n{first}\nprint(' '.join(n for n in dir(dj) if not n.startswith('__')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == sorted(set(dj.__all__) - {"__version__"})
    assert "__version__" in dir(dj)


def test_all_holds_the_core_api():
    """dj.__all__ holds the model, session and runner names of the spec."""
    core = {
        "Cluster",
        "Job",
        "JobRunner",
        "LocalSession",
        "Node",
        "Session",
        "SetupNets",
        "Task",
        "TaskGroup",
        "TaskOutput",
        "TaskOutputList",
        "Workspace",
        "WorkspaceType",
        "epoch_limiter",
        "errors",
        "final_output",
    }
    assert core <= set(dj.__all__)


@pytest.mark.parametrize("name", sorted(n for n in dj.__all__ if inspect.isclass(getattr(dj, n))))
def test_public_classes_have_docstrings(name):
    """Every public class has its own non-empty docstring."""
    doc = getattr(dj, name).__dict__.get("__doc__")
    assert doc
    assert doc.strip()


@pytest.mark.parametrize("name", sorted(n for n in dj.__all__ if inspect.isfunction(getattr(dj, n))))
def test_public_functions_have_docstrings(name):
    """Every public function has a non-empty docstring."""
    assert (getattr(dj, name).__doc__ or "").strip()


def test_only_the_zarr_module_imports_zarr():
    """``checkpoint/_storage/zarr_groups.py`` is the one module whose source imports zarr (also lazily)."""
    import re
    from pathlib import Path

    package = Path(dj.__file__).parent
    importing = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"^\s*(import zarr|from zarr)", path.read_text(), re.M)
    )
    assert importing == ["checkpoint/_storage/zarr_groups.py"]
