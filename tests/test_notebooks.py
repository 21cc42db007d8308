"""Every notebook in notebooks/ runs top to bottom without an error, an ERROR log line or a warning in
any output."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

WIDGET = "application/vnd.jupyter.widget-view+json"


def outputs(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]


LOGGED_ERROR = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
"""An ERROR or CRITICAL log line in any format ("distributed.worker - ERROR -", "ERROR:tornado...",
"[E ...]" aside), or a traceback printed by a logger."""


def text_of(output: nbformat.NotebookNode) -> str:
    """The text an output shows: a stream, or the text forms of displayed data."""
    if output.output_type == "stream":
        return output.text
    if output.output_type in ("display_data", "execute_result"):
        return "\n".join(str(v) for k, v in output.get("data", {}).items() if k.startswith("text/"))
    return ""


def warnings_in(output: nbformat.NotebookNode) -> list[str]:
    """Lines of an output that are or contain a warning (stderr stream, or displayed warning text)."""
    lines = text_of(output).splitlines()
    return [line for line in lines if "warning" in line.lower() or "IProgress not found" in line]


def logged_errors_in(output: nbformat.NotebookNode) -> list[str]:
    """Lines of an output that are an ERROR (or CRITICAL) log line or a logged traceback."""
    return [line for line in text_of(output).splitlines() if LOGGED_ERROR.search(line)]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("2026-01-01 10:00:00,000 - distributed.worker - ERROR - Worker stream died during communication", True),
        ("2026-01-01 10:00:00,000 - distributed.scheduler - ERROR - Task x marked as failed", True),
        ("ERROR:tornado.application:Exception in callback", True),
        ("distributed.nanny - CRITICAL - worker gone", True),
        ("Traceback (most recent call last):", True),
        ("node lost; restoring all nodes from epoch 4 (recovery 1 of 3)", False),
        ("error bars are drawn in grey", False),
        ("TaskFailedError: step failed", False),
    ],
)
def test_logged_errors_are_recognised(line, error):
    """The ERROR check catches log lines of every usual format, and nothing else."""
    output = nbformat.v4.new_output("stream", name="stderr", text=line + "\n")
    assert logged_errors_in(output) == ([line] if error else [])


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory):
    """Runs a notebook once per test module (in a fresh kernel, this checkout importable and its
    scripts, such as ``daskjobs``, on PATH) and returns the executed notebook."""
    done: dict[Path, nbformat.NotebookNode] = {}
    root = str(Path(__file__).parent.parent)

    def execute(path: Path) -> nbformat.NotebookNode:
        if path not in done:
            notebook = nbformat.read(path, as_version=4)
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
                patch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
                where = tmp_path_factory.mktemp(path.stem)
                NotebookClient(
                    notebook, timeout=150, kernel_name="python3", resources={"metadata": {"path": str(where)}}
                ).execute()
            done[path] = notebook
        return done[path]

    return execute


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors_or_warnings(path: Path, executed):
    """The notebook executes; no cell shows an error, an ERROR log line, a traceback or a warning."""
    notebook = executed(path)
    shown = outputs(notebook)
    assert not [o for o in shown if o.output_type == "error"]
    assert not [line for o in shown for line in logged_errors_in(o)]
    assert not [line for o in shown for line in warnings_in(o)]
    sources = "".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert "progress=False" not in sources


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quickstart_shows_widget_progress_table_plot_and_dashboard(executed):
    """The progress bar is a real widget; the runner repr, history table, plot and dashboard link show."""
    notebook = executed(NOTEBOOKS[0])
    shown = outputs(notebook)
    assert any(WIDGET in o.get("data", {}) for o in shown)
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in shown)
    assert "<b>JobRunner</b>" in html
    assert "<th>loss</th>" in html
    assert "Dask dashboard</a>" in html
    assert "<b>Job</b>" in html
    assert "<b>TaskGroup</b>" in html
    assert any("image/png" in o.get("data", {}) for o in shown)
    text = "\n".join(o.get("text", "") for o in shown if o.output_type == "stream")
    assert "Dask dashboard: http://127.0.0.1:" in text
    # A viewer without widgets (GitHub, nbviewer, a terminal) shows the bar's text form: its final state.
    bars = [
        o["data"]["text/plain"] for o in shown if WIDGET in o.get("data", {}) and "epoch" in o["data"]["text/plain"]
    ]
    assert bars
    assert all(re.match(r"job \S+: 100%\|#+\| (\d+)/\1 \[", bar) for bar in bars), bars
