"""Every notebook in notebooks/ runs top to bottom."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    """The notebook executes without an error."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [
        o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
