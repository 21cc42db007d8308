"""Commit records of earlier format versions stay readable on every path (SPEC §3 "Scale").

A prefix whose epochs 0..2 were committed by an older daskjobs (format 4: arrays without dimension
names; format 3: the same, every node's entry in the sealed record; format 2: the same, unsealed) is
read, verified, listed, shown, resumed, pruned and written on by this daskjobs: a resume loads it,
the next epoch reuses its chunks (delta) and is committed in the current format beside it, and
retention deletes exactly the files its record lists.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from records import as_version, raw_record

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.records import RECORD_FORMAT_VERSION
from daskjobs.cli import main

FROZEN = np.arange(4096.0)


def build_job() -> dj.Job:
    """Node a holds ``frozen`` (never changes) and ``w`` (one more per epoch, logs its loss)."""
    with dj.Cluster(), dj.Job(name="versions") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(frozen=FROZEN.copy(), w=np.zeros(8), meta={"seed": 7}), name="init")

        def step(ws):
            ws["w"] = ws["w"] + 1
            ws.log("loss", 1.0 / (1 + ws.epoch))

        dj.Task(step, name="train")
    return job


@pytest.fixture(params=[2, 3, 4])
def legacy(request, tmp_path) -> str:
    """Epochs 0..2 committed, every record rewritten as format ``request.param`` held it."""
    prefix = str(tmp_path / "ckpt")
    assert dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train() == 2
    store = CheckpointStore(prefix)
    for epoch in (0, 1, 2):
        as_version(store, epoch, request.param)
    assert {raw_record(store, e)["format_version"] for e in (0, 1, 2)} == {request.param}
    return prefix


def cli(*args: str, capsys) -> tuple[int, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().out


def test_every_read_path_reads_an_older_record(legacy, capsys, request):
    store = CheckpointStore(legacy)
    view = dj.open_checkpoint(legacy)
    assert view.epoch == 2
    assert np.array_equal(view["a"]["w"], np.full(8, 2.0))
    assert np.array_equal(view["a"].lazy("frozen").compute(scheduler="sync"), FROZEN)
    assert view["a"]["meta"] == {"seed": 7}
    assert view.verify() == 8 * 8 + 4096 * 8 + len(b'{"seed":7}')
    entries = store.node_entries(2)
    assert sorted(entries["a"]["blobs"]) == ["frozen", "meta", "w"]
    assert [i.epoch for i in dj.list_checkpoints(legacy)] == [0, 1, 2]
    assert dj.list_checkpoints(legacy)[2].nbytes == view.verify()
    assert dj.open_checkpoint(legacy, "best").epoch == 2
    code, out = cli("checkpoints", "verify", legacy, capsys=capsys)
    assert (code, out.count(": OK (")) == (0, 3)
    code, out = cli("checkpoints", "show", legacy, capsys=capsys)
    assert code == 0
    assert "  a/frozen: <f8 (4096,)" in out
    code, out = cli("checkpoints", "list", legacy, "--json", capsys=capsys)
    assert [row["bytes"] for row in json.loads(out)] == [view.verify()] * 3
    assert [row["format_version"] for row in json.loads(out)] == [request.node.callspec.params["legacy"]] * 3


def test_a_resume_from_an_older_record_reuses_its_chunks_and_commits_the_current_format(legacy):
    store = CheckpointStore(legacy)
    manager = dj.MultiNodeCheckpointManager(legacy, keep_last=2)
    runner = dj.JobRunner(build_job(), manager, max_epochs=4, progress=False)
    with dj.LocalSession() as session:
        assert runner.train(session) == 4
        assert np.array_equal(session.fetch("w", node="a"), np.full(8, 4.0))
    assert [r.bytes_reused for r in runner.history] == [4096 * 8 + len(b'{"seed":7}')] * 2  # frozen and meta
    assert store.committed_epochs() == [3, 4]  # retention deleted the older records' epochs
    assert raw_record(store, 4)["format_version"] == RECORD_FORMAT_VERSION
    assert not any(os.path.exists(os.path.join(legacy, f"a.{e}")) for e in (0, 1, 2))
    assert np.array_equal(dj.open_checkpoint(legacy, 3)["a"]["frozen"], FROZEN)


def test_prune_deletes_exactly_what_an_older_record_lists(legacy, capsys):
    user_file = os.path.join(legacy, "a.1", "frozen", "notes.txt")
    with open(user_file, "w") as file:
        file.write("mine")
    code, _out = cli("checkpoints", "prune", legacy, "--keep-last", "1", capsys=capsys)
    assert code == 0
    assert CheckpointStore(legacy).committed_epochs() == [2]
    assert not os.path.exists(os.path.join(legacy, "a.0"))
    assert sorted(os.listdir(os.path.join(legacy, "a.1"))) == ["frozen"]  # the user's file and its folder stay
    assert os.listdir(os.path.join(legacy, "a.1", "frozen")) == ["notes.txt"]
