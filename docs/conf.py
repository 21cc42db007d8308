"""Sphinx configuration of the daskjobs documentation.

Build it with ``pip install -e ".[docs]"`` and ``sphinx-build -W -b html docs docs/_build/html``.
The build needs no network: no intersphinx, no remote images or scripts. Diagrams are drawn
with matplotlib at build time by ``_ext/diagrams.py``. How code examples are run by the tests:
see ``docs/README.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # document this checkout, not another installed copy

import daskjobs  # noqa: E402

project = "daskjobs"
author = "the daskjobs developers"
copyright = "the daskjobs developers"
release = daskjobs.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "sphinxarg.ext",
    "sphinx_copybutton",
    "diagrams",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
smartquotes = False  # "--checkpoint" stays two hyphens, "..." three dots (command lines are copied)
exclude_patterns = ["_build", "README.md", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# -- MyST -------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc, autosummary, numpydoc -------------------------------------------------------------
autosummary_generate = False  # tables only: the entries themselves are written out in reference/api.md
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
numpydoc_attributes_as_param_list = False

# Without intersphinx (the build is offline), names of other libraries cannot be linked; every
# reference into daskjobs itself must resolve (``-n``).
nitpick_ignore_regex = [
    (r"py:.*", r"(numpy|np|distributed|dask|zarr|fsspec|pandas|matplotlib|asyncio|concurrent|typing)(\..*)?"),
    (r"py:.*", r"collections\.abc\..*|os\..*|pathlib\..*|argparse\..*|logging\..*|types\..*"),
]

# -- HTML -------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"daskjobs {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_sidebars = {"**": ["sidebar-nav-bs"]}
html_show_sourcelink = False
html_copy_source = False
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True


def _public_names() -> dict[type, str]:
    """Public classes by object: a class defined in a private module is shown by its public name."""
    import daskjobs.checkpoint

    names = {}
    for module in (daskjobs.checkpoint, daskjobs):  # the top-level name wins
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type):
                names[value] = f"{module.__name__}.{name}"
    return names


def _public_bases(app, name, obj, options, bases):
    """Show a class's public bases: a private base (``_NodesError``, a mixin of a private module)
    is replaced by its own bases; ``object``, ``abc.ABC`` and ``enum`` classes are left out."""
    public = _public_names()
    shown, pending = [], list(bases)
    while pending:
        base = pending.pop(0)
        if base is object or base.__module__ in ("abc", "enum", "typing"):
            continue
        if base in public:
            label = f":py:class:`~{public[base]}`"
        elif base.__module__ == "builtins" or not any(
            part.startswith("_") for part in [*base.__module__.split("."), base.__name__]
        ):
            label = base
        else:
            pending[:0] = list(base.__bases__)
            continue
        if label not in shown:
            shown.append(label)
    bases[:] = shown


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
