"""The README: its example runs as shown and prints what it says, its two set-up commands are the
ones CI runs, it stays short, and the example is the one the documentation shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def example(text: str, heading: str = "## A job in 20 lines") -> str:
    return re.search(re.escape(heading) + r"\n\n(?:.*?\n\n)??```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_runs_and_resumes(tmp_path):
    """The 20-line example trains to epoch 4 with total 10, and a re-run resumes without an epoch."""
    code = example(README)
    assert len(code.splitlines()) <= 20
    code = code.replace('"/tmp/counter-ckpt"', repr(str(tmp_path / "counter-ckpt")))
    for _ in range(2):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), {})
        assert printed.getvalue().split() == ["4", "10"]


def test_readme_names_the_two_setup_commands():
    """The README gives the demo command and the test command that .ci/run runs."""
    assert "pip install -e . && daskjobs demo" in README
    assert 'pip install -e ".[test]" && python -m pytest' in README
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_short_and_names_the_command_that_builds_the_docs():
    """At most 200 lines; the one documented command builds the site (tests/test_docs.py builds it
    the same way, with -n and --keep-going on top)."""
    assert len(README.splitlines()) <= 200
    assert 'pip install -e ".[docs]" && sphinx-build -W -b html docs docs/_build/html' in README


def test_the_docs_show_the_readme_example_unchanged():
    """The front page and Getting started show the README's 20-line example, character for character."""
    for page, heading in (("index.md", "## A job in 20 lines"), ("getting-started.md", "## Your first job")):
        assert example((ROOT / "docs" / page).read_text(), heading) == example(README), page
