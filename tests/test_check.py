"""``dj.testing.check_resume``: jobs that resume exactly pass in every mode and on every session kind;
each kind of defect is reported with exactly its kind, epoch, node and blob; runs that fail or
miss their deadline raise naming the run; nothing but temporary prefixes is ever written.

The jobs live in ``check_jobs.py``, copied into a temp folder and named as ``file.py:function``
targets (every run in a new process) or imported and passed as callables (runs in this process).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import cloudpickle
import pytest

import daskjobs as dj
from daskjobs.errors import DefinitionTypeError, JobDefinitionError, ResumeCheckError

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).with_name("check_jobs.py")

MODES = {"local": ("stop", "kill"), "dask": ("stop", "kill", "lose-node")}
"""The modes of a string target's check, by session kind (a node loss needs a cluster)."""

DEFECTS = {
    # defect: its blob in ``check_jobs.defects()`` and the first divergence of that blob in every
    # interrupted run (kind, epoch, node, blob) on LocalSessions and on a cluster, where a job file's
    # module state lives on in the worker from run to run
    "global_rng": ("x", {"local": ("resume", 3, "a", "x"), "dask": ("resume", 3, "a", "x")}),
    "module_global": ("n", {"local": ("resume", 3, "b", "n"), "dask": ("nondeterministic", 1, "b", "n")}),
    "clock": ("t", {"local": ("nondeterministic", 1, "c", "t"), "dask": ("nondeterministic", 1, "c", "t")}),
    "extra_blob": (
        "resynced_at",
        {"local": ("extra", 3, "ps", "resynced_at"), "dask": ("nondeterministic", 1, "ps", "resynced_at")},
    ),
    "concurrent_average": (
        "avg",
        {"local": ("nondeterministic", 1, "trainer_0", "avg"), "dask": ("nondeterministic", 1, "trainer_0", "avg")},
    ),
    "metric": ("lr", {"local": ("metric", 3, None, "lr"), "dask": ("nondeterministic", 1, None, "lr")}),
    "unseeded_rng": (
        "r",
        {"local": ("nondeterministic", 1, "local", "r"), "dask": ("nondeterministic", 1, "local", "r")},
    ),
}


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temp folder holding ``check_jobs.py``, the current directory of the string targets' runs."""
    folder = tmp_path_factory.mktemp("jobs")
    shutil.copy(JOBS, folder / "check_jobs.py")
    return folder


def import_jobs(folder: Path) -> ModuleType:
    """``check_jobs.py`` of ``folder`` imported afresh (its own module state), its steps pickled by value."""
    name = f"check_jobs_{folder.name}_{time.monotonic_ns()}"
    spec = importlib.util.spec_from_file_location(name, folder / "check_jobs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module


def session_of(kind: str, request: pytest.FixtureRequest) -> object:
    return None if kind == "local" else request.getfixturevalue("shared_cluster")


def first_of(report: dj.testing.ResumeReport, run: str, blob: str | None = None) -> tuple | None:
    """The first divergence of ``run`` (of ``blob`` only, when given) as (kind, epoch, node, blob)."""
    found = next((d for d in report.divergences if d.run == run and blob in (None, d.blob)), None)
    return None if found is None else (found.kind, found.epoch, found.node, found.blob)


_reports: dict[tuple[str, str], dj.testing.ResumeReport] = {}


@pytest.fixture
def string_report(jobs_dir: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The report of ``check_jobs.py:<job>`` interrupted after epoch 2 in every mode of a session
    kind, made once per job and session kind for the whole module."""

    def report(job: str, kind: str) -> dj.testing.ResumeReport:
        if (job, kind) not in _reports:
            monkeypatch.chdir(jobs_dir)
            session = session_of(kind, request)
            scratch = Path(tempfile.mkdtemp(dir=jobs_dir))
            monkeypatch.setattr(tempfile, "tempdir", str(scratch))
            _reports[job, kind] = dj.testing.check_resume(
                f"check_jobs.py:{job}", interrupt_at=2, modes=MODES[kind], session=session, timeout=120
            )
            assert list(scratch.iterdir()) == []  # every temporary prefix and process file is gone
        return _reports[job, kind]

    return report


def matrix(kinds: dict[str, tuple[str, ...]]) -> list:
    """(defect, mode, session kind) for every mode of each kind, marked slow (child drivers), cluster ones cluster."""
    cases = []
    for defect in DEFECTS:
        for kind, modes in kinds.items():
            marks = [pytest.mark.cluster, pytest.mark.slow] if kind == "dask" else [pytest.mark.slow]
            cases += [pytest.param(defect, mode, kind, marks=marks, id=f"{defect}-{mode}-{kind}") for mode in modes]
    return cases


@pytest.mark.parametrize(("defect", "mode", "kind"), matrix(MODES))
def test_each_defect_is_named_in_each_mode(string_report, defect, mode, kind):
    """A job file with one defect per node: in every interrupted run, each defect's blob first
    diverges with exactly the expected kind, epoch and node; B differs there exactly when the
    defect makes the job unreproducible."""
    report = string_report("defects", kind)
    blob, expected = DEFECTS[defect][0], DEFECTS[defect][1][kind]
    assert first_of(report, f"{mode}@2", blob) == expected
    assert first_of(report, "B", blob) == (expected if expected[0] == "nondeterministic" else None)
    assert report.ok is False
    assert report.deterministic is False
    run = next(r for r in report.runs if r.name == f"{mode}@2")
    assert (run.mode, run.interrupt_at, run.resumed_from, run.epochs) == (mode, 2, 2, (0, 1, 2, 3, 4))


@pytest.mark.slow
def test_the_first_divergence_is_the_earliest(string_report):
    """The report's first divergence is the earliest (nondeterminism before the rest), and the
    divergences are sorted by epoch; one defect alone is reported as the whole job's."""
    report = string_report("defects", "local")
    assert (report.first.epoch, report.first.kind, report.first.run) == (1, "nondeterministic", "B")
    assert [d.epoch for d in report.divergences] == sorted(d.epoch for d in report.divergences)
    alone = string_report("global_rng", "local")
    assert (alone.deterministic, first_of(alone, "B")) == (True, None)
    assert alone.first == next(d for d in alone.divergences if d.run == "stop@2")
    assert (alone.first.kind, alone.first.epoch, alone.first.node, alone.first.blob) == ("resume", 3, "a", "x")


@pytest.mark.slow
def test_each_run_of_a_string_target_is_a_new_process(jobs_dir, monkeypatch):
    """Every run's process seeds its global random generators afresh, and reference B runs with a
    hash seed of its own (also when Dask fixed it in this process's environment): an unseeded NumPy
    draw differs in every run, the order of a set of strings between A and B (the interrupted runs
    share A's hash seed)."""
    monkeypatch.chdir(jobs_dir)
    monkeypatch.setenv("PYTHONHASHSEED", "6640")  # what a Dask cluster started in this process leaves behind
    report = dj.testing.check_resume("check_jobs.py:unreproducible", interrupt_at=2, modes="stop", timeout=60)
    assert first_of(report, "B", "u") == ("nondeterministic", 1, "a", "u")
    assert first_of(report, "B", "names") == ("nondeterministic", 1, "b", "names")
    assert first_of(report, "stop@2", "u") == ("nondeterministic", 1, "a", "u")
    assert first_of(report, "stop@2", "names") is None


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_is_named_in_process(in_process_defects, defect):
    """The same job given as a callable, each run in this process on a new LocalSession: a resume
    starts with module state (and the global random generator) as another run left it."""
    blob, expected = DEFECTS[defect][0], DEFECTS[defect][1]["local"]
    assert [r.name for r in in_process_defects.runs] == ["A", "B", "stop@2"]
    assert first_of(in_process_defects, "stop@2", blob) == expected


@pytest.fixture(scope="module")
def in_process_defects(jobs_dir: Path) -> dj.testing.ResumeReport:
    return dj.testing.check_resume(import_jobs(jobs_dir).defects, interrupt_at=2, timeout=60)


CLUSTER = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        pytest.param("string", "local", marks=pytest.mark.slow),
        ("callable", "local"),
        pytest.param("string", "dask", marks=CLUSTER),
        pytest.param("callable", "dask", marks=CLUSTER),
    ],
)
def test_a_job_that_resumes_exactly_passes_in_every_mode(jobs_dir, string_report, request, target, kind, caplog):
    """Arrays of several dtypes, JSON values, a Generator's state, a reader through pipe and metrics
    resume exactly: every run, in every mode the target and session allow, equals A. The check's own
    interruptions log nothing (a node it loses on purpose is no warning of the user's)."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    points = [2]
    if target == "string":
        report = string_report("exact", kind)
        modes = MODES[kind]
    elif kind == "dask":
        modes = ("stop", "lose-node")
        report = dj.testing.check_resume(
            import_jobs(jobs_dir).exact, interrupt_at=2, modes=modes, session=session_of(kind, request), timeout=120
        )
    else:  # the default interruption points: epoch 1, the middle epoch and the last but one
        modes, points = ("stop",), [1, 2, 3]
        report = dj.testing.check_resume(import_jobs(jobs_dir).exact, timeout=60)
    assert report.ok, str(report)
    assert report.deterministic
    assert [r.name for r in report.runs] == ["A", "B", *(f"{mode}@{k}" for k in points for mode in modes)]
    assert [(r.resumed_from, r.epochs) for r in report.runs[2:]] == [
        (k, (0, 1, 2, 3, 4)) for k in points for _ in modes
    ]
    assert report.divergences == []
    assert not [r.getMessage() for r in caplog.records if "restoring all nodes from" in r.getMessage()]


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a digest of its bytes."""
    files = (p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.slow
def test_only_temporary_prefixes_are_written(jobs_dir, tmp_path, monkeypatch):
    """A check that fails (here in the resume of an interrupted run) leaves the job's own checkpoints
    as they were, removes every temporary prefix and process file it made, leaves no process behind
    and names the run that failed. (Passing and diverging checks: see ``string_report``.)"""
    psutil = pytest.importorskip("psutil")
    users = tmp_path / "users-checkpoints"
    job = import_jobs(jobs_dir).fails_when_resumed()
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(str(users)), progress=False).train(None)
    before = tree(users)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(jobs_dir)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ResumeCheckError, match=r"run stop@2 \(check_jobs.py:fails_when_resumed\) failed: ") as caught:
        dj.testing.check_resume("check_jobs.py:fails_when_resumed", interrupt_at=2, modes=("stop", "kill"), timeout=60)
    assert caught.value.run == "stop@2"
    assert "RuntimeError: the init group did not run in this process" in str(caught.value)
    assert tree(users) == before
    assert len(before) > 10
    assert list(scratch.iterdir()) == []
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


@pytest.mark.parametrize(
    ("job", "run", "message"),
    [
        ("failing", "A", "ZeroDivisionError: division by zero on purpose"),
        ("not_a_job", "A", "is not a Job or a callable returning one"),
    ],
)
@pytest.mark.slow
def test_a_failing_run_raises_naming_it(jobs_dir, monkeypatch, job, run, message):
    """A run that fails raises ResumeCheckError naming the run and saying why."""
    monkeypatch.chdir(jobs_dir)
    with pytest.raises(ResumeCheckError, match=f"run {run} ") as caught:
        dj.testing.check_resume(f"check_jobs.py:{job}", interrupt_at=2, timeout=60)
    assert caught.value.run == run
    assert message in str(caught.value)


@pytest.mark.parametrize("target", [pytest.param("string", marks=pytest.mark.slow), "callable"])
def test_every_run_has_a_deadline(jobs_dir, monkeypatch, target):
    """A run longer than ``timeout`` is ended (a child process killed at its deadline; a run in this
    process stopped after its running epoch) and the check raises naming it."""
    monkeypatch.chdir(jobs_dir)
    job = "check_jobs.py:slow" if target == "string" else import_jobs(jobs_dir).slow
    started = time.monotonic()
    with pytest.raises(ResumeCheckError, match=r"run A .*deadline of 1.5 s") as caught:
        dj.testing.check_resume(job, timeout=1.5)
    assert caught.value.run == "A"
    assert time.monotonic() - started < 8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"modes": ("stop", "pause")}, JobDefinitionError, "modes must be some of"),
        ({"modes": ()}, JobDefinitionError, "modes must be some of"),
        ({"modes": "kill"}, JobDefinitionError, "mode 'kill' needs a string target"),
        ({"modes": "lose-node"}, JobDefinitionError, "needs a cluster"),
        ({"interrupt_at": 0}, JobDefinitionError, "interrupt_at must be >= 1"),
        ({"interrupt_at": True}, DefinitionTypeError, "interrupt_at must be an int"),
        ({"interrupt_at": []}, JobDefinitionError, "at least one epoch"),
        ({"interrupt_at": 4}, JobDefinitionError, r"reference run A ended at epoch 4.*epochs 1 to 3"),
        ({"max_epochs": 0}, JobDefinitionError, "max_epochs"),
        ({"timeout": -1}, JobDefinitionError, "timeout"),
        ({"session": dj.LocalSession}, DefinitionTypeError, "DaskSession needs"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_arguments_are_refused(jobs_dir, kwargs, error, match):
    """Invalid arguments raise a ValueError/TypeError subclass naming what is wrong."""
    with pytest.raises(error, match=match):
        dj.testing.check_resume(import_jobs(jobs_dir).exact, **kwargs)


@pytest.mark.parametrize(
    ("target", "match"),
    [(42, "check_resume needs a Job"), (lambda: 42, "returned int, not a Job"), ("endless", "no stop condition")],
)
def test_targets_that_are_not_jobs_are_refused(jobs_dir, target, match):
    """A target that is no job, or a job that would never stop, is refused before anything runs."""
    if target == "endless":
        target = import_jobs(jobs_dir).endless
    with pytest.raises((JobDefinitionError, DefinitionTypeError), match=match):
        dj.testing.check_resume(target)


def test_dj_testing_is_the_public_module():
    """``dj.testing`` is ``daskjobs.testing``, in ``dj.__all__``, with its documented names."""
    import daskjobs.testing

    assert dj.testing is daskjobs.testing
    assert "testing" in dj.__all__
    assert {"check_resume", "assert_resumes_exactly", "ResumeReport", "Divergence"} <= set(dj.testing.__all__)
    assert os.path.basename(dj.testing.__file__) == "__init__.py"
