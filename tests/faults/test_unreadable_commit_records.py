"""An unreadable commit record: resume names it and the epoch that skips it, and following that
hint works; ``checkpoints prune`` refuses before it deletes anything.

Every case asserts the exact error and that nothing committed changed where nothing should.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from prefix_files import files

import daskjobs as dj
from daskjobs.cli import main
from daskjobs.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError

DAMAGE = {
    "empty": (lambda data: b"", CheckpointCorruptError),
    "garbage": (lambda data: b"\xff\x00{", CheckpointCorruptError),
    "format_v9": (lambda data: data.replace(b'"format_version":5', b'"format_version":9'), CheckpointFormatError),
}


def define(name: str = "records", node: str = "a") -> dj.Job:
    """One node counting epochs in ``n`` and adding the epoch to a 300-element array ``w``."""
    with dj.Cluster(), dj.Job(name=name) as job, dj.Node(node):
        with job.init_group:
            dj.Task(lambda ws: ws.update(n=np.int64(0), w=np.zeros(300)))

        def step(ws):
            ws["n"] = ws["n"] + 1
            ws["w"] = ws["w"] + ws.epoch

        dj.Task(step)
    return job


def train(prefix: str, job: dj.Job | None = None, **kwargs) -> tuple[int, dj.JobRunner, int]:
    """Train on a fresh LocalSession; return (last epoch, runner, final n)."""
    manager = kwargs.pop("manager", None) or dj.MultiNodeCheckpointManager(prefix)
    runner = dj.JobRunner(job or define(), manager, progress=False, **kwargs)
    with dj.LocalSession() as session:
        last = runner.train(session)
        return last, runner, int(session.fetch("n", "a"))


def record_path(prefix: str, epoch: int) -> Path:
    return Path(prefix) / "__daskjobs__" / "commits" / f"epoch-{epoch:012d}.json"


def damage(prefix: str, epoch: int, kind: str) -> None:
    path = record_path(prefix, epoch)
    path.write_bytes(DAMAGE[kind][0](path.read_bytes()))


def epoch_files(prefix: str, epochs: range) -> dict[str, bytes]:
    """The files of the groups and commit records of ``epochs``."""
    names = {f"a.{e}" for e in epochs} | {f"epoch-{e:012d}.json" for e in epochs}
    return {k: v for k, v in files(prefix).items() if names & set(k.split("/"))}


# -- resume: the hint works ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_following_the_hint_of_an_unreadable_latest_record_resumes(prefix, kind, caplog):
    """Latest record unreadable: resume names it and resume_from_epoch=2; passing that resumes, retiring epoch 3."""
    train(prefix, max_epochs=3)
    damage(prefix, 3, kind)
    before = files(prefix)
    with pytest.raises(DAMAGE[kind][1], match=r"epoch-000000000003\.json.*resume_from_epoch=2"):
        train(prefix, max_epochs=5)
    assert files(prefix) == before
    kept = epoch_files(prefix, range(3))
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        last, runner, n = train(prefix, max_epochs=5, resume_from_epoch=2)
    assert (last, [r.epoch for r in runner.history], n) == (5, [3, 4, 5], 5)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4, 5]
    assert epoch_files(prefix, range(3)) == kept
    retired = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    assert len(retired) == 1
    assert "[3]" in retired[0]
    view = dj.open_checkpoint(prefix, 3)
    assert view.verify() > 0
    assert int(view["a"]["n"]) == 3


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resuming_from_an_epoch_with_an_unreadable_record_names_it(prefix, kind):
    """resume_from_epoch naming the unreadable record: its error, naming the file; nothing changes."""
    train(prefix, max_epochs=3)
    damage(prefix, 1, kind)
    before = files(prefix)
    with pytest.raises(DAMAGE[kind][1], match=r"epoch-000000000001\.json"):
        train(prefix, max_epochs=5, resume_from_epoch=1)
    assert files(prefix) == before


def test_an_explicit_epoch_of_another_job_is_refused_by_its_own_record(prefix):
    """The job check of a resume from epoch k reads k's record: another job's epoch is named and refused."""
    train(prefix, max_epochs=3)
    damage(prefix, 3, "empty")
    before = files(prefix)
    with pytest.raises(CheckpointError, match=r"job 'records'.*\(epoch 2\).*this job is 'other'"):
        train(prefix, define(name="other"), max_epochs=5, resume_from_epoch=2)
    assert files(prefix) == before


# -- prune refuses before it deletes anything ------------------------------------------------------------


def prune(*args: str, capsys) -> tuple[int, str, str]:
    """``daskjobs checkpoints prune ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(["checkpoints", "prune", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize(("epoch", "kind"), [(3, "empty"), (1, "garbage"), (3, "format_v9")])
def test_prune_with_an_unreadable_record_deletes_nothing(prefix, epoch, kind, dry_run, capsys):
    """Exit 1 naming the record and what to do; every file (records, groups, leftovers) stays."""
    train(prefix, max_epochs=3)
    damage(prefix, epoch, kind)
    (Path(prefix) / "a.7").mkdir()  # an uncommitted leftover a prune would remove
    before = files(prefix)
    code, out, err = prune(prefix, "--keep-last", "1", *(["--dry-run"] if dry_run else []), capsys=capsys)
    assert code == 1
    assert "deleting" not in out
    assert f"refusing to prune {prefix}" in err
    assert f"epoch-{epoch:012d}.json" in err
    assert "nothing was deleted" in err
    assert "daskjobs checkpoints verify" in err
    assert "delete it by hand" in err
    assert files(prefix) == before
    assert (Path(prefix) / "a.7").is_dir()
    assert not (Path(prefix) / "__daskjobs__" / "lock.json").exists()


def test_prune_works_again_once_the_unreadable_record_is_deleted(prefix, capsys):
    """The way out the error names: delete the record by hand; the next prune removes that epoch's files."""
    train(prefix, max_epochs=3)
    damage(prefix, 3, "empty")
    record_path(prefix, 3).unlink()
    code, out, _ = prune(prefix, "--keep-last", "1", capsys=capsys)
    assert code == 0
    assert "kept epochs 2" in out
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [2]
    assert not (Path(prefix) / "a.3").exists()
    assert int(dj.open_checkpoint(prefix)["a"]["n"]) == 2
