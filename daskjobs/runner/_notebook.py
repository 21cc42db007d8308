"""Jupyter integration: detecting a running kernel, and showing figures that no pyplot state created."""

from __future__ import annotations

import io
import sys
from typing import Any


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None


def in_jupyter() -> bool:
    """Whether this process is a running Jupyter kernel (not merely one that imported IPython)."""
    return getattr(_shell(), "kernel", None) is not None


def show_figures_inline(figure_type: type) -> None:
    """In a Jupyter kernel, display ``figure_type`` objects (matplotlib Figures) as PNG cell results.

    Jupyter renders a Figure returned by a cell only once pyplot's inline backend registered a
    formatter for it; a Figure built without pyplot (as :meth:`~daskjobs.JobRunner.plot` builds
    it) would show as ``<Figure size ...>``. This registers the same kind of formatter, once, and
    does nothing outside a kernel or when a formatter already exists.
    """
    shell = _shell()
    if getattr(shell, "kernel", None) is None:
        return
    formatter = shell.display_formatter.formatters["image/png"]
    if not _has_type(formatter, figure_type):
        formatter.for_type(figure_type, _png)


def _has_type(formatter: Any, figure_type: type) -> bool:
    try:
        formatter.lookup_by_type(figure_type)
    except KeyError:
        return False
    return True


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()
