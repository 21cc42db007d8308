"""The documentation site: it builds without a warning, its examples run, its reference is complete.

* The build: ``sphinx-build -W --keep-going -n -b html docs <tmp>`` (warnings and broken
  cross-references fail it), once per test session.
* The examples: every ```` ```python ```` block of a page runs, in page order, in one fresh
  interpreter per page (a fresh namespace, ``__name__ == "__main__"``, the current directory a
  temporary one, ``/tmp/`` in paths replaced by it). A ```` ```text ```` block right after a
  Python block is what that block prints. A block that must not run (it needs a cluster address,
  S3 credentials, a batch system, or names defined elsewhere) is written as a
  ```` ```{code-block} python ```` directive instead: it renders the same and is skipped.
* The docstring examples of every object the API reference documents run and print what they show.
* The reference: every public name (``daskjobs.__all__``, ``daskjobs.errors.__all__``) and every
  ``daskjobs`` sub-command and option appears in the built HTML.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import daskjobs as dj
import daskjobs.errors
from daskjobs.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and p.name != "README.md")
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def blocks(page: Path) -> list[tuple[str, str, int, str | None]]:
    """``(info, code, line, expected output)`` of the page's top-level fenced blocks, in order; the
    expected output is the ```` ```text ```` block that directly follows a block, if any."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        body = textwrap.dedent(match["body"])
        found.append((match["info"].strip(), body, text.count("\n", 0, match.start()) + 1, match.end()))
    result = []
    for i, (info, body, line, end) in enumerate(found):
        expected = None
        if i + 1 < len(found) and found[i + 1][0] == "text":
            following = found[i + 1]
            between = text[end : text.index("```text", end)]
            if not between.strip():
                expected = following[1]
        result.append((info, body, line, expected))
    return result


def python_blocks(page: Path) -> list[tuple[str, int, str | None]]:
    return [(code, line, expected) for info, code, line, expected in blocks(page) if info == "python"]


EXAMPLE_PAGES = [p for p in PAGES if python_blocks(p)]

RUNNER = r"""
import contextlib, io, json, sys, traceback
if __name__ == "__main__":
    blocks, tmp = json.load(sys.stdin)
    namespace = {"__name__": "__main__"}
    for code, where, expected in blocks:
        code = code.replace("/tmp/", tmp + "/")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, where, "exec"), namespace)
        except BaseException:
            print(f"FAILED {where}\n{traceback.format_exc()}\n{printed.getvalue()}", file=sys.stderr)
            sys.exit(1)
        got = printed.getvalue().replace(tmp + "/", "/tmp/")
        if expected is not None and got.rstrip().splitlines() != expected.rstrip().splitlines():
            print(f"OUTPUT {where}\n--- expected\n{expected}--- printed\n{got}", file=sys.stderr)
            sys.exit(1)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=[str(p.relative_to(DOCS)) for p in EXAMPLE_PAGES])
def test_python_examples_run_and_print_what_the_page_says(page, tmp_path):
    """Every ```python block of the page runs, in order, in one fresh interpreter; a ```text block
    right after one is exactly what it prints."""
    import json

    script = tmp_path / "run_examples.py"
    script.write_text(RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    payload = [(code, f"{page.relative_to(ROOT)}:{line}", expected) for code, line, expected in python_blocks(page)]
    result = subprocess.run(
        [sys.executable, str(script)],
        input=json.dumps([payload, str(work)]),
        cwd=work,
        env=env(),
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert result.returncode == 0, result.stderr


def documented_objects() -> dict[str, object]:
    """The objects the API reference documents, by their documented name."""
    from daskjobs import checkpoint

    objects = {f"daskjobs.{n}": getattr(dj, n) for n in dj.__all__ if n not in ("__version__", "errors", "testing")}
    objects.update({f"daskjobs.errors.{n}": getattr(daskjobs.errors, n) for n in daskjobs.errors.__all__})
    testing = {n: getattr(dj.testing, n) for n in dj.testing.__all__}
    objects.update({f"daskjobs.testing.{n}": v for n, v in testing.items() if hasattr(v, "__module__")})
    for name in ("CheckpointInfo", "CheckpointView", "NodeCheckpoint", "MetadataHandler", "CommitRecordHandler"):
        objects[f"daskjobs.checkpoint.{name}"] = getattr(checkpoint, name)
    return objects


def private_bases(obj: object) -> list[type]:
    """The bases of class ``obj`` defined in daskjobs' private modules (mixins such as the manager's
    ``Loads``): the reference shows their methods as the class's own (``:inherited-members:``)."""
    bases = getattr(obj, "__mro__", ())[1:]
    return [
        base
        for base in bases
        if base.__module__.startswith("daskjobs.")
        and any(part.startswith("_") for part in [*base.__module__.split("."), base.__name__])
    ]


@pytest.mark.parametrize("name", sorted(documented_objects()))
def test_docstring_examples_of_the_api_reference_run(name, tmp_path, monkeypatch):
    """The ``Examples`` of every documented object (and its methods, those of its private mixins
    too) give the output they show, run with their module's names in scope, as ``python -m doctest``
    would."""
    import doctest

    monkeypatch.chdir(tmp_path)
    obj = documented_objects()[name]
    module = sys.modules[obj.__module__]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for owner in (obj, *private_bases(obj)):
        for test in doctest.DocTestFinder().find(owner, name, globs=dict(vars(module))):
            runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site built once: ``sphinx-build -W --keep-going -n -b html docs <tmp>``."""
    pytest.importorskip("sphinx", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(DOCS), str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert result.stderr == ""
    return out


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_site_builds_without_a_warning(site):
    """The build passed with warnings as errors; every page of the docs folder is in it."""
    built = {p.relative_to(site).with_suffix("") for p in site.rglob("*.html") if "_modules" not in p.parts}
    sources = {p.relative_to(DOCS).with_suffix("") for p in PAGES}
    assert sources <= built


def html_ids(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text()))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_api_reference_documents_every_public_name(site):
    """Every name of ``daskjobs.__all__``, ``daskjobs.errors.__all__`` and ``daskjobs.testing.__all__``
    has its entry in the API reference."""
    ids = html_ids(site / "reference" / "api.html")
    public = [n for n in dj.__all__ if n not in ("errors", "testing", "__version__")]
    missing = [n for n in public if f"daskjobs.{n}" not in ids]
    missing += [n for n in daskjobs.errors.__all__ if f"daskjobs.errors.{n}" not in ids]
    missing += [n for n in dj.testing.__all__ if f"daskjobs.testing.{n}" not in ids]
    assert missing == []
    assert "module-daskjobs.errors" in ids
    assert "dj.__version__" in (site / "reference" / "api.html").read_text()


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], list[str]]]:
    """``(command path, option strings)`` of every command of the parser, depth first."""
    found = [(path, [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")])]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, (*path, name))
    return found


def page_text(html_text: str) -> str:
    """The visible text of a built page's HTML, whitespace collapsed."""
    import html

    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html_text)))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_cli_reference_shows_every_command_and_option(site):
    """The CLI reference, generated from ``build_parser()``, has a section for every sub-command
    holding each of its options (and its usage line)."""
    source = (site / "reference" / "cli.html").read_text()
    found = commands(build_parser())
    starts = []
    for path, _ in found:
        anchor = f'id="{"-".join(("daskjobs", *path))}"'
        assert anchor in source, path
        starts.append(source.index(anchor))
    assert starts == sorted(starts)
    for (path, options), start, end in zip(found, starts, [*starts[1:], len(source)], strict=True):
        section = page_text(source[start:end])
        assert " ".join(("daskjobs", *path)) in section, path
        missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", section)]
        assert missing == [], path


def test_readme_links_only_to_pages_that_exist():
    """Links from the README into docs/ name existing pages."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_notebooks_give_the_install_command_of_the_docs():
    """The install hint is the same everywhere: the getting-started page, the README and each
    notebook's first cell say ``pip install -e ".[notebook]"``."""
    import json

    hint = 'pip install -e ".[notebook]"'
    assert hint in (DOCS / "getting-started.md").read_text()
    assert hint in (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = "".join(json.loads(path.read_text())["cells"][0]["source"])
        assert hint in first, path.name
        assert "daskjobs[notebook]" not in first.replace(hint, ""), path.name


def test_git_ignores_what_the_demo_and_the_docs_build_write():
    """``daskjobs demo``'s default checkpoint folder and the docs build are in .gitignore."""
    parser = build_parser()
    demo = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["demo"]
    default = next(a.default for a in demo._actions if "--checkpoint-dir" in a.option_strings)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert f"{default}/" in ignored
    assert "docs/_build/" in ignored


@pytest.mark.slow
def test_shadowing_clone_folder_is_explained_with_the_error_python_gives(tmp_path):
    """A folder named ``daskjobs`` in the current directory hides an editable install (setuptools'
    import hook comes after Python's path search, which takes the folder for a namespace package):
    Getting started warns about it, quoting the error that then appears."""
    (tmp_path / "daskjobs").mkdir()
    (tmp_path / "job.py").write_text("import daskjobs as dj\nprint(dj.__file__)\ndj.Job\n")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "job.py"], cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60
    )
    page = (DOCS / "getting-started.md").read_text()
    assert "A clone folder named `daskjobs` shadows the package" in page
    if result.returncode == 0:
        pytest.skip("daskjobs is installed so that a folder named daskjobs does not shadow it here")
    assert result.stdout.split() == ["None"]
    error = result.stderr.strip().splitlines()[-1]
    assert error == "AttributeError: module 'daskjobs' has no attribute 'Job'"
    assert f"`{error}`" in " ".join(page.split())
