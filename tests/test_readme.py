"""The README's example runs as shown and prints what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_example_runs_and_resumes(tmp_path):
    """The 20-line example trains to epoch 4 with total 10, and a re-run resumes without an epoch."""
    code = re.search(r"## A job in 20 lines\n\n```python\n(.*?)```", README, re.S).group(1)
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
    assert "python -m pytest" in (Path(__file__).parent.parent / ".ci" / "run").read_text()
