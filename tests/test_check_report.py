"""What ``dj.testing`` says: how two blob values differ, the order of divergences, and the report's
text, HTML and JSON forms (pure: no runs, except the one-line ``assert_resumes_exactly`` checks)."""

from __future__ import annotations

import html
import json

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import ResumeDivergenceError
from daskjobs.testing import CheckedRun, Divergence, ResumeReport
from daskjobs.testing._compare import difference, ordering
from daskjobs.testing._report import LIKELY_CAUSES, epoch_span


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (np.arange(3.0), np.arange(3.0), None),
        ({"seen": [1, 2]}, {"seen": [1, 2]}, None),
        (np.array([0.0, np.nan]), np.array([0.0, np.nan]), None),
        (
            np.arange(4.0).reshape(2, 2),
            np.array([[0.0, 1.0], [2.5, 3.0]]),
            "float64 (2, 2): 1 of 4 elements differ; largest absolute difference 0.5 at [1, 0] (A 2.0, run 2.5)",
        ),
        (
            np.array([1, 5, 9], dtype=np.int64),
            np.array([1, -5, 10], dtype=np.int64),
            "int64 (3,): 2 of 3 elements differ; largest absolute difference 10 at [1] (A 5, run -5)",
        ),
        (
            np.array(1.5, dtype=np.float32),
            np.array(2.0, dtype=np.float32),
            "float32 (): 1 of 1 elements differ; largest absolute difference 0.5 (A 1.5, run 2.0)",
        ),
        (
            np.array([0.0, 1.0]),
            np.array([-0.0, 1.0]),
            "float64 (2,): 1 of 2 elements differ; largest absolute difference 0 at [0] (A 0.0, run -0.0)",
        ),
        (
            np.array([1.0, 2.0]),
            np.array([np.nan, 2.0]),
            "float64 (2,): 1 of 2 elements differ; largest absolute difference inf at [0] (A 1.0, run nan)",
        ),
        (
            np.array([1 + 1j]),
            np.array([1 + 2j]),
            "complex128 (1,): 1 of 1 elements differ; largest absolute difference 1 at [0] (A (1+1j), run (1+2j))",
        ),
        (np.array([True, False]), np.array([True, True]), "bool (2,): 1 of 2 elements differ"),
        (np.array(["ab", "cd"]), np.array(["ab", "ce"]), "<U2 (2,): 1 of 2 elements differ"),
        (
            np.zeros(3),
            np.zeros(3, dtype=np.float32),
            "A holds an array of float64 (3,), the run an array of float32 (3,)",
        ),
        (np.zeros(3), np.zeros(4), "A holds an array of float64 (3,), the run an array of float64 (4,)"),
        (np.zeros(2), [0.0, 0.0], "A holds an array of float64 (2,), the run the JSON value [0.0, 0.0]"),
        ({"n": 1}, {"n": 2}, "JSON values differ: A {'n': 1}, run {'n': 2}"),
        ("x" * 100, "y", f"JSON values differ: A '{'x' * 56}..., run 'y'"),
    ],
    ids=lambda v: None,
)
def test_difference_names_what_differs(a, b, expected):
    """Arrays are equal when dtype, shape and bytes are (NaN equals NaN, 0.0 is not -0.0); JSON values
    when they are equal; a numeric difference names its largest absolute value and where."""
    assert difference(a, b) == expected


def divergence(epoch, run="stop@1", kind="resume", node="a", blob="x"):
    return Divergence(epoch, node, blob, run, kind, "detail")


def test_divergences_are_ordered_earliest_first():
    """Earliest epoch first; within an epoch nondeterminism first, then the runs in their order, whole
    epochs before nodes' blobs, blobs before stop values and metrics."""
    found = [
        divergence(3, "kill@1"),
        divergence(2, "stop@1", "metric", None, "loss"),
        divergence(2, "kill@1", "resume", "b", "y"),
        divergence(2, "stop@1", "resume", None, "done"),
        divergence(2, "stop@1", "missing", None, None),
        divergence(2, "stop@1", "resume", "a", "x"),
        divergence(2, "B", "nondeterministic", "z", "w"),
    ]
    ordered = sorted(found, key=ordering(["A", "B", "stop@1", "kill@1"]))
    assert [(d.epoch, d.run, d.kind, d.node, d.blob) for d in ordered] == [
        (2, "B", "nondeterministic", "z", "w"),
        (2, "stop@1", "resume", "a", "x"),
        (2, "stop@1", "resume", None, "done"),
        (2, "kill@1", "resume", "b", "y"),
        (2, "stop@1", "missing", None, None),
        (2, "stop@1", "metric", None, "loss"),
        (3, "kill@1", "resume", "a", "x"),
    ]


RUNS = [
    CheckedRun("A", None, None, None, (0, 1, 2, 3), 1.25),
    CheckedRun("B", None, None, None, (0, 1, 2, 3), 1.0),
    CheckedRun("stop@1", "stop", 1, 1, (0, 1, 2, 3), 2.0, 2),
    CheckedRun("kill@2", "kill", 2, 2, (0, 1, 2, 3), 2.0),
    CheckedRun("lose-node@2", "lose-node", 2, 2, (0, 1, 2, 3), 3.0, 0, "ps"),
]
FOUND = [
    Divergence(2, "ps", "w", "stop@1", "resume", "float64 (4,): largest absolute difference 0.5 at [1]"),
    Divergence(3, None, "loss", "stop@1", "metric", "A 0.25, run 0.5 (absolute difference 0.25)"),
]


@pytest.mark.parametrize(("found", "ok"), [(FOUND, False), ([], True)])
def test_report_text(found, ok):
    """One line per run with what happened to it; the verdict; the first divergence with what differs
    and the likely causes of its kind, wrapped at 100 columns."""
    report = ResumeReport("train", "jobs.py:make", "LocalSession", RUNS, found)
    lines = str(report).splitlines()
    assert lines[0] == "daskjobs check of job 'train' (jobs.py:make) on LocalSession: 5 runs"
    assert lines[1].split() == ["A", "reference", "epochs", "0-3", "1.2", "s"]
    assert " ".join(lines[2].split()) == "B reference, run again epochs 0-3 1.0 s equal to A"
    assert " ".join(lines[4].split()) == "kill@2 driver killed in epoch 3, resumed from 2 epochs 0-3 2.0 s equal to A"
    assert " ".join(lines[5].split()).startswith("lose-node@2 node 'ps' lost in epoch 3, restored from 2")
    assert max(map(len, lines[6:])) <= 100
    if ok:
        assert " ".join(lines[3].split()).endswith("equal to A")
        assert " ".join(line.strip() for line in lines[6:]) == (
            "OK: job 'train' resumes exactly: every run equals reference A in every committed epoch (every "
            "blob of every node, the stop values and the metrics)"
        )
        return
    assert " ".join(lines[3].split()).endswith("2 divergences, first in epoch 2")
    assert lines[6] == "DIVERGES: job 'train' does not resume exactly; 2 divergences in stop@1 (2)"
    assert lines[7] == "first divergence: epoch 2, node 'ps', blob 'w', run stop@1 (resume)"
    assert lines[8] == "  float64 (4,): largest absolute difference 0.5 at [1]"
    assert " ".join(line.strip() for line in lines[9:11]) == (
        "likely causes (the uninterrupted runs agree, the interrupted run differs: state kept outside the workspaces):"
    )
    assert lines[11].startswith("  - the global random generator seeded once in init")
    assert unwrapped(lines[11:]) == [f"- {cause}" for cause in LIKELY_CAUSES["resume"]]


def unwrapped(lines: list[str]) -> list[str]:
    """The bullets of wrapped lines, each joined back into one line."""
    bullets: list[str] = []
    for line in lines:
        if line.startswith("  - "):
            bullets.append(line.strip())
        else:
            bullets[-1] += " " + line.strip()
    return bullets


@pytest.mark.parametrize("kind", ["nondeterministic", "resume", "missing", "extra", "metric"])
def test_every_kind_has_likely_causes_in_text_and_html(kind):
    """Each kind names its causes (global RNG, module state, clock, concurrent float sums, readers
    without state, PRIVATE accumulators between them), in the text and the HTML."""
    run = "B" if kind == "nondeterministic" else "stop@1"
    report = ResumeReport("j", "t", "w", RUNS, [Divergence(1, "a", "x", run, kind, "x <differs> & more")])
    lines, page = str(report).splitlines(), report._repr_html_()
    start = next(i for i, line in enumerate(lines) if line.startswith("  - "))
    assert unwrapped(lines[start:]) == [f"- {cause}" for cause in LIKELY_CAUSES[kind]]
    for cause in LIKELY_CAUSES[kind]:
        assert html.escape(cause) in page
    assert "x &lt;differs&gt; &amp; more" in page
    assert "<table>" in page
    assert (report.ok, report.deterministic) == (False, kind != "nondeterministic")
    everything = " ".join(" ".join(causes) for causes in LIKELY_CAUSES.values())
    for needle in ("global random generator", "module", "wall clock", "concurrent", "reader", "PRIVATE"):
        assert needle in everything


def test_report_json_and_raise():
    """``to_dict`` is JSON (runs, divergences, the first with its causes); ``raise_for_divergence``
    raises ResumeDivergenceError, an AssertionError carrying the summary."""
    report = ResumeReport("train", "t", "w", RUNS, FOUND)
    data = json.loads(json.dumps(report.to_dict()))
    assert (data["ok"], data["deterministic"], len(data["runs"]), len(data["divergences"])) == (False, True, 5, 2)
    assert data["first"]["blob"] == "w"
    assert data["first"]["likely_causes"] == list(LIKELY_CAUSES["resume"])
    assert data["runs"][4]["description"] == "node 'ps' lost in epoch 3, restored from 2"
    with pytest.raises(ResumeDivergenceError) as caught:
        report.raise_for_divergence()
    assert isinstance(caught.value, AssertionError)
    assert str(caught.value) == str(report)
    ResumeReport("train", "t", "w", RUNS, []).raise_for_divergence()
    assert repr(report) == (
        "ResumeReport(job='train', ok=False, deterministic=True, "
        "runs=['A', 'B', 'stop@1', 'kill@2', 'lose-node@2'], divergences=2)"
    )


def test_epoch_span():
    assert [epoch_span(e) for e in [(), (0,), (0, 1, 2), (0, 2, 3, 5)]] == ["none", "0", "0-2", "0,2-3,5"]


def make_job(draw_globally: bool) -> dj.Job:
    """A counter job; with ``draw_globally`` its step draws from the global random generator seeded in init."""

    def init(ws):
        np.random.seed(1)
        ws["x"] = np.float64(0)

    def step(ws):
        ws["x"] = ws["x"] + (np.random.random() if draw_globally else 1.0)

    with dj.Cluster(), dj.Job(name="counter") as job:
        with job.init_group:
            dj.Task(init)
        dj.Task(step, workspace_type=dj.WorkspaceType.GLOBAL)
        dj.epoch_limiter(job, 3)
    return job


def test_assert_resumes_exactly():
    """The pytest helper returns the report of a job that resumes exactly and raises an
    AssertionError naming the first divergence of one that does not."""
    assert dj.testing.assert_resumes_exactly(lambda: make_job(False), interrupt_at=1).ok
    with pytest.raises(AssertionError, match=r"first divergence: epoch 2, node 'local', blob 'x', run stop@1"):
        dj.testing.assert_resumes_exactly(lambda: make_job(True), interrupt_at=1)
