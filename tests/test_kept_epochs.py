"""Kept epochs are not one file away from loss (SPEC §1.7): epochs divisible by ``full_every`` and the
epochs ``keep_every`` keeps are written in full, so a damaged file spoils only the epochs that share
it; ``daskjobs checkpoints verify`` names them and the newest epoch that verifies, a resume that
meets the damage names the ``--resume-from`` that gets past it, and that resume ends equal to an
uninterrupted run; ``daskjobs run --fresh`` starts over, deleting nothing before its epoch 0 commits.

The catalogue: a file shared by k epochs (damaged in place, so every hard link sees it) by
``full_every`` by ``keep_every`` (with ``keep_last`` retention), asserting exactly which epochs
verify. Checkpoints are built in this process; verify and resume run through the command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint._format.records import record_bytes
from daskjobs.checkpoint._protocol.retention import kept_epochs, writes_in_full
from daskjobs.cli import main
from daskjobs.errors import DefinitionTypeError, InvalidStateError, JobDefinitionError
from daskjobs.runner._targets import load_job

pytestmark = pytest.mark.timeout(120)

JOB = textwrap.dedent(
    '''
    """Node 'center': 'frozen' never changes (delta shares its file), 'c' and 'n' change every epoch."""

    import numpy as np

    import daskjobs as dj


    def init(ws):
        ws["frozen"] = np.arange(1000, dtype=np.float64)
        ws["c"] = np.zeros(4)
        ws["n"] = np.int64(0)


    def step(ws):
        ws["n"] = ws["n"] + 1
        ws["c"] = ws["c"] * 0.5 + float(ws["n"])
        ws.log("loss", 1.0 / float(ws["n"]))


    def make():
        with dj.Cluster(), dj.Job(name="kmeans") as job, dj.Node("center"):
            with job.init_group:
                dj.Task(init, name="init")
            dj.Task(step, name="step")
        return job


    job = make()
    '''
)
EPOCH_BYTES = 1000 * 8 + 4 * 8 + 8
"""What one epoch holds: ``frozen``, ``c`` and ``n``."""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A fresh folder holding the job file ``job.py``; commands run there."""
    (tmp_path / "job.py").write_text(JOB)
    return tmp_path


def env() -> dict[str, str]:
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def daskjobs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "daskjobs", *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=100
    )


def here(*args: str, cwd: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """``daskjobs ARGS`` in this process (no interpreter start: the matrix's cases)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def train(folder: Path, prefix: Path, epochs: int, **options) -> None:
    job = load_job(f"{folder / 'job.py'}:make")
    manager = dj.MultiNodeCheckpointManager(str(prefix), **options)
    dj.JobRunner(job, manager, max_epochs=epochs, progress=False).train(None)


def damage(chunk: Path) -> None:
    """Flip the first byte in place: every epoch whose group links this file sees it."""
    with open(chunk, "r+b") as file:
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 0xFF]))


def full_epochs(last: int, full_every: int, keep_every: int | None) -> list[int]:
    return [e for e in range(last + 1) if writes_in_full(e, full_every, keep_every)]


def spoiled_by(epoch: int, last: int, full_every: int, keep_every: int | None) -> set[int]:
    """The epochs a file of ``epoch`` (written at the last full epoch before it) belongs to."""
    fulls = full_epochs(last, full_every, keep_every)
    start = max(e for e in fulls if e <= epoch)
    stop = min([e for e in fulls if e > epoch] + [last + 1])
    return set(range(start, stop))


def span(epochs: list[int]) -> str:
    from daskjobs.checkpoint._managers.damage import epoch_span

    return epoch_span(epochs)


def final_state(prefix: Path) -> dict[str, np.ndarray]:
    view = dj.open_checkpoint(str(prefix))
    return {"epoch": np.int64(view.epoch), **view["center"].read()}


# -- the catalogue ----------------------------------------------------------------------------------
CASES = {
    # name: (epochs, full_every, keep_every, keep_last, damaged epoch)
    "delta-only-all-spoiled": (12, 0, None, None, 5),
    "full-every-10-latest-damaged": (24, 10, None, None, 22),
    "full-every-10-older-damaged": (24, 10, None, None, 12),
    "keep-every-5-keep-last-3": (12, 0, 5, 3, 11),
    "full-every-4-keep-every-3-keep-last-5": (11, 4, 3, 5, 7),
    "full-every-1": (6, 1, None, None, 4),
}
DEFAULT_LANE = ("full-every-10-latest-damaged", "keep-every-5-keep-last-3")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c in DEFAULT_LANE else pytest.mark.matrix) for c in CASES]
)
@pytest.mark.slow
def test_a_damaged_file_spoils_exactly_the_epochs_that_share_it(case, folder, monkeypatch, capsys):
    """verify marks exactly the epochs that share the damaged file CORRUPT and the others OK, names the
    file with those epochs and the newest epoch that verifies (exit 1); a resume then fails naming
    the ``--resume-from`` of that epoch, and following it ends equal to an uninterrupted run."""
    epochs, full_every, keep_every, keep_last, damaged = CASES[case]
    prefix, reference = folder / "ck", folder / "reference"
    options = {"full_every": full_every, "keep_every": keep_every, "keep_last": keep_last}
    train(folder, prefix, epochs, **options)
    train(folder, reference, epochs + 2, **options)
    every = list(range(epochs + 1))
    committed = every if keep_last is None and keep_every is None else sorted(kept_epochs(every, keep_last, keep_every))
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == committed
    damage(prefix / f"center.{damaged}" / "frozen" / "c.0")
    spoiled = sorted(spoiled_by(damaged, epochs, full_every, keep_every) & set(committed))
    intact = [e for e in committed if e not in spoiled]
    subprocess_lane = case == DEFAULT_LANE[0]
    run = (
        (lambda *a: daskjobs(*a, cwd=folder))
        if subprocess_lane
        else (lambda *a: here(*a, cwd=folder, monkeypatch=monkeypatch, capsys=capsys))
    )

    verified = run("checkpoints", "verify", str(prefix))
    assert verified.returncode == 1, verified.stderr
    lines = verified.stdout.splitlines()
    assert lines[: len(committed)] == [
        f"epoch {e}: CORRUPT" if e in spoiled else f"epoch {e}: OK ({EPOCH_BYTES} bytes verified)" for e in committed
    ]
    first = spoiled[0]
    assert lines[len(committed)] == (
        f"damaged file {prefix}/center.{first}/frozen/c.0 (node 'center', blob 'frozen'): epoch {first}, node "
        "'center', blob 'frozen': checksum mismatch in chunk c.0 (its bytes differ from what was committed)"
    )
    assert lines[len(committed) + 1] == f"  shared by epoch{'s' if len(spoiled) > 1 else ''} {span(spoiled)}"
    newest = intact[-1] if intact else None
    if newest is None:
        assert lines[-1] == (
            f"no committed epoch verifies: start afresh with `daskjobs run TARGET --checkpoint {prefix} --fresh` "
            "(the committed epochs are deleted when the new epoch 0 commits)"
        )
    elif newest == committed[-1]:
        assert lines[-1] == f"newest epoch that verifies: {newest}, the latest"
    else:
        assert lines[-1] == (
            f"newest epoch that verifies: {newest}; resume from it with `daskjobs run TARGET --checkpoint {prefix} "
            f"--resume-from {newest}` (the epochs after it are deleted when the first new epoch commits)"
        )
    assert verified.stderr.startswith(
        f"daskjobs checkpoints verify: error: verification failed under {prefix}: {len(spoiled)} damaged epoch(s): "
    )

    target = ["run", "job.py:job", "--checkpoint", str(prefix), "--local", "--no-progress"]
    resumed = run(*target, "--max-epochs", str(epochs + 2))
    if newest == committed[-1]:  # the latest verifies: a plain resume gets past the damage
        assert resumed.returncode == 0, resumed.stderr
    else:
        assert resumed.returncode == 1
        error = resumed.stderr.strip()
        assert error.startswith(f"daskjobs run: error: epoch {committed[-1]}, node 'center', blob 'frozen': checksum")
        sharing = "epochs " + span(spoiled) + " share" if len(spoiled) > 1 else f"epoch {spoiled[0]} holds"
        assert f"; {sharing} the damaged file {prefix}/center.{committed[-1]}/frozen/c.0 (node 'center', " in error
        if newest is None:
            assert "No committed epoch under" in error
            assert "start afresh with `daskjobs run ... --fresh`" in error
            resumed = run(*target, "--max-epochs", str(epochs + 2), "--fresh")
        else:
            assert (
                f"The newest epoch that verifies is {newest}: resume from it with `daskjobs run ... --resume-from "
                f"{newest}` (JobRunner(..., resume_from_epoch={newest})); the epochs after it are deleted when the "
                "first new epoch commits"
            ) in error
            assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == committed  # nothing was touched
            resumed = run(*target, "--max-epochs", str(epochs + 2), "--resume-from", str(newest))
        assert resumed.returncode == 0, resumed.stderr
    ended, expected = final_state(prefix), final_state(reference)
    assert ended.keys() == expected.keys()
    assert all(np.array_equal(ended[name], expected[name]) for name in expected)
    still = [e for e in spoiled if newest is not None and e < newest]  # older damage is never deleted silently
    assert run("checkpoints", "verify", str(prefix)).returncode == (1 if still else 0)


# -- what is written in full -----------------------------------------------------------------------
def test_full_epochs_share_no_file_with_earlier_ones(folder):
    """With full_every=4 and keep_every=3, epochs 0, 3, 4, 6, 8 and 9 link no file of an earlier epoch
    (each file's link count is 1 plus the later deltas that reuse it); the others reuse ``frozen``."""
    prefix = folder / "ck"
    train(folder, prefix, 9, full_every=4, keep_every=3, keep_last=100)
    inode = {e: os.stat(prefix / f"center.{e}" / "frozen" / "c.0").st_ino for e in range(10)}
    fulls = full_epochs(9, 4, 3)
    assert fulls == [0, 3, 4, 6, 8, 9]
    for epoch in range(1, 10):
        assert (inode[epoch] == inode[epoch - 1]) == (epoch not in fulls), epoch
    reused = {info.epoch: record_bytes(info.record)[2] for info in dj.list_checkpoints(str(prefix))}
    assert [e for e, n in reused.items() if n == 0] == fulls


def test_default_is_a_full_epoch_every_10(folder):
    prefix = folder / "ck"
    train(folder, prefix, 21)
    assert dj.MultiNodeCheckpointManager(str(prefix)).full_every == 10
    reused = {info.epoch: record_bytes(info.record)[2] for info in dj.list_checkpoints(str(prefix))}
    assert [e for e, n in reused.items() if n == 0] == [0, 10, 20]


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, JobDefinitionError), (True, DefinitionTypeError), (2.0, DefinitionTypeError), ("10", DefinitionTypeError)],
)
def test_full_every_must_be_an_int_of_at_least_0(tmp_path, value, error):
    with pytest.raises(error, match="full_every"):
        dj.MultiNodeCheckpointManager(str(tmp_path / "ck"), full_every=value)
    assert not (tmp_path / "ck").exists()


# -- --fresh ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fresh_starts_over_and_retires_the_old_commits_once_epoch_0_commits(folder):
    """``run --fresh`` on a prefix of this job: a run failing before its epoch 0 commits leaves every commit as
    it was; one that gets there retires them all (one warning) and goes on from epoch 1."""
    prefix = folder / "ck"
    train(folder, prefix, 6)
    before = {p.name: p.stat().st_ino for p in prefix.rglob("*") if p.is_file()}
    (folder / "broken.py").write_text(JOB.replace('ws["n"] = np.int64(0)', 'ws["n"] = np.int64(0); 1 / 0'))
    failed = daskjobs(
        "run", "broken.py:job", "--checkpoint", str(prefix), "--local", "--fresh", "--max-epochs", "2", cwd=folder
    )
    assert failed.returncode == 1
    assert "ZeroDivisionError" in failed.stderr
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == list(range(7))
    assert {p.name: p.stat().st_ino for p in prefix.rglob("*") if p.is_file() and "staging" not in p.parts} == before
    fresh = daskjobs(
        "run", "job.py:job", "--checkpoint", str(prefix), "--local", "--fresh", "--max-epochs", "2", cwd=folder
    )
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stderr == (
        f"started afresh: retired the committed epochs [0, 1, 2, 3, 4, 5, 6] under {prefix} now that epoch 0 commits\n"
    )
    assert fresh.stdout.splitlines()[-1] == f"job 'kmeans': last epoch 2, committed under {prefix}; ran epochs 1-2"
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == [0, 1, 2]
    assert int(dj.open_checkpoint(str(prefix))["center"]["n"]) == 2


@pytest.mark.slow
def test_fresh_refuses_another_jobs_prefix_and_needs_a_prefix(folder):
    prefix = folder / "ck"
    train(folder, prefix, 2)
    (folder / "other.py").write_text(JOB.replace('name="kmeans"', 'name="other"'))
    other = daskjobs(
        "run", "other.py:job", "--checkpoint", str(prefix), "--local", "--fresh", "--max-epochs", "2", cwd=folder
    )
    assert other.returncode == 1
    assert other.stderr.startswith(f"daskjobs run: error: {prefix} holds checkpoints of job 'kmeans' with nodes")
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == [0, 1, 2]
    both = daskjobs("run", "job.py:job", "--checkpoint", str(prefix), "--fresh", "--resume-from", "1", cwd=folder)
    assert (both.returncode, both.stderr.strip()) == (
        2,
        "daskjobs run: error: --fresh starts from epoch 0 and --resume-from N from epoch N: give one of them",
    )
    alone = daskjobs("run", "job.py:job", "--fresh", cwd=folder)
    assert (alone.returncode, alone.stderr.strip()) == (
        2,
        "daskjobs run: error: --fresh needs a checkpoint prefix: add --checkpoint PREFIX",
    )


@pytest.mark.slow
def test_help_says_what_resume_from_and_fresh_delete(folder):
    result = daskjobs("run", "--help", cwd=folder)
    text = " ".join(result.stdout.split())
    assert (
        "resume from committed epoch N (default: the latest); the epochs after N are deleted when the first new "
        "epoch commits" in text
    )
    assert (
        "start from epoch 0 on a prefix that holds this job's commits; they are deleted when the new epoch 0 "
        "commits (not before)" in text
    )


def test_start_fresh_in_python(folder):
    """``manager.start_fresh()`` before ``train``: the run starts at epoch 1 after init, and the old
    commits go once epoch 0 commits; with ``resume_from_epoch`` as well it is refused, nothing read."""
    prefix = folder / "ck"
    train(folder, prefix, 4)
    job = load_job(f"{folder / 'job.py'}:make")
    manager = dj.MultiNodeCheckpointManager(str(prefix))
    manager.start_fresh()
    runner = dj.JobRunner(job, manager, max_epochs=2, progress=False)
    assert runner.train(None) == 2
    assert [r.epoch for r in runner.history] == [1, 2]
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == [0, 1, 2]
    again = dj.MultiNodeCheckpointManager(str(prefix))
    again.start_fresh()
    with pytest.raises(InvalidStateError, match=r"start_fresh\(\) starts from epoch 0 and resume_from_epoch=1"):
        dj.JobRunner(job, again, resume_from_epoch=1, max_epochs=2, progress=False).train(None)
    assert [info.epoch for info in dj.list_checkpoints(str(prefix))] == [0, 1, 2]
