"""Fault catalogue, deletion: daskjobs deletes only what it provably wrote (SPEC §3).

Classes:

* D1 foreign files x operations: each kind of foreign file or folder under a prefix survives
  byte-identical every deleting operation — debris cleanup by a new ``train()``, retention
  (``keep_last=1``), ``daskjobs checkpoints prune`` — while our own debris goes and the
  committed checkpoints that should stay are unchanged and verify.
* D2 interrupted and failing deletes: a delete stopped midway leaves an uncommitted group that
  cleanup finishes; a retention failure after a commit is a warning, never a failed save.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._storage import cleanup as _cleanup

NODE = "trainer_0"
DEBRIS = 96


def make_job():
    with dj.Cluster(), dj.Job(name="foreign") as job, dj.Node(NODE):
        with job.init_group:
            dj.Task(lambda ws: ws.update(n=0, w=np.zeros((6, 3), "f4")), name="init")
        dj.Task(lambda ws: ws.update(n=ws["n"] + 1, w=ws["w"] + 1), name="step")
    return job


def write(path: str, data: bytes = b"user data\n") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as file:
        file.write(data)


def marker_json(node: str, epoch: int) -> bytes:
    attributes = {"daskjobs": {"node": node, "epoch": epoch, "save_id": "x", "state": "writing"}}
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes}).encode()


# Each kind creates foreign things under (or beside) the prefix and returns the paths to watch.
def user_folder_like_a_group(prefix: str, outside: str) -> list[str]:
    write(f"{prefix}/mydata.2024/data.bin", os.urandom(64))
    write(f"{prefix}/mydata.2024/sub/zarr.json", b"{}")
    write(f"{prefix}/{NODE}.77/notes.txt")  # our node's name, an uncommitted epoch, no marker
    write(f"{prefix}/{NODE}.77/w/c.0", b"\0" * 8)
    write(f"{prefix}/{NODE}.78/zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    write(f"{prefix}/{NODE}.78/w/zarr.json", b"{}")
    return [f"{prefix}/mydata.2024", f"{prefix}/{NODE}.77", f"{prefix}/{NODE}.78"]


def foreign_marker(prefix: str, outside: str) -> list[str]:
    write(f"{prefix}/{NODE}.79/zarr.json", marker_json("other_node", 79))  # another node's marker
    write(f"{prefix}/{NODE}.79/w/c.0", b"\1")
    write(f"{prefix}/{NODE}.80/zarr.json", marker_json(NODE, 81))  # another epoch's marker
    write(f"{prefix}/{NODE}.80/w/zarr.json", b"{}")
    write(f"{prefix}/{NODE}.82/zarr.json", b"\xff not json")
    staged = [f"{prefix}/{NODE}.83.tmp-{uuid.uuid4().hex}", f"{prefix}/{NODE}.84.tmp-{uuid.uuid4().hex}"]
    write(f"{staged[0]}/w/c.0", b"\1")  # named like a staging folder of ours, no marker
    write(f"{staged[1]}/zarr.json", marker_json("other_node", 3))  # a staging name, another node's marker
    write(f"{staged[1]}/w/zarr.json", b"{}")
    return [f"{prefix}/{NODE}.79", f"{prefix}/{NODE}.80", f"{prefix}/{NODE}.82", *staged]


def user_files_in_committed_groups(prefix: str, outside: str) -> list[str]:
    paths = [
        f"{prefix}/{NODE}.1/notes.txt",
        f"{prefix}/{NODE}.1/w/notes.txt",
        f"{prefix}/{NODE}.1/w/c.7.0",  # a chunk name outside the blob's chunk grid
        f"{prefix}/{NODE}.1/n/c.0",  # a 0-d blob has exactly one chunk, "c"
        f"{prefix}/{NODE}.1/extra/zarr.json",  # a folder that is no blob of the commit
        f"{prefix}/{NODE}.2/w/sub/c.0",
    ]
    for path in paths:
        write(path)
    return paths


def stray_files_in_own_folder(prefix: str, outside: str) -> list[str]:
    paths = [
        f"{prefix}/__daskjobs__/notes.txt",
        f"{prefix}/__daskjobs__/lock.json.bak",
        f"{prefix}/__daskjobs__/commits/notes.json",
        f"{prefix}/__daskjobs__/commits/epoch-000000000001.json.tmp-short",
        f"{prefix}/__daskjobs__/commits/epoch-000000000002.json~",
        f"{prefix}/__daskjobs__/commits/epoch-7.json",
    ]
    for path in paths:
        write(path)
    folder = f"{prefix}/__daskjobs__/dir.tmp-{uuid.uuid4().hex}"  # a folder, not our temp file
    os.makedirs(folder)
    return [*paths, folder]


def symlinks_like_groups(prefix: str, outside: str) -> list[str]:
    write(f"{outside}/plain/data.bin")
    write(f"{outside}/lookalike/zarr.json", marker_json(NODE, 91))  # looks ours, but is reached by a link
    write(f"{outside}/lookalike/w/c.0", b"\2" * 4)
    write(f"{outside}/inside/c.0", b"\3")
    os.symlink(f"{outside}/plain", f"{prefix}/{NODE}.90")
    os.symlink(f"{outside}/lookalike", f"{prefix}/{NODE}.91")
    os.symlink(f"{outside}/inside", f"{prefix}/{NODE}.{DEBRIS}/w2")  # a link inside our own debris
    os.symlink(f"{outside}/plain/data.bin", f"{prefix}/{NODE}.{DEBRIS}/w/c.5")
    return [f"{prefix}/{NODE}.90", f"{prefix}/{NODE}.91", outside]


def editor_files(prefix: str, outside: str) -> list[str]:
    paths = [f"{prefix}/x.json~", f"{prefix}/{NODE}.1/zarr.json~", f"{prefix}/{NODE}.1/w/zarr.json~"]
    for path in paths:
        write(path)
    return paths


KINDS = {
    f.__name__: f
    for f in (
        user_folder_like_a_group,
        foreign_marker,
        user_files_in_committed_groups,
        stray_files_in_own_folder,
        symlinks_like_groups,
        editor_files,
    )
}


def state(paths: list[str]) -> dict[str, object]:
    """What is at each path and below it, without following symlinks: bytes, link targets, folders."""
    found: dict[str, object] = {}

    def visit(path: str) -> None:
        if os.path.islink(path):
            found[path] = ("link", os.readlink(path))
        elif os.path.isdir(path):
            found[path] = "dir"
            for name in os.listdir(path):
                visit(os.path.join(path, name))
        elif os.path.exists(path):
            with open(path, "rb") as file:
                found[path] = file.read()
        else:
            found[path] = None

    for path in paths:
        visit(path)
    return found


def committed_bytes(prefix: str, epochs: list[int]) -> dict[str, bytes]:
    """The bytes of every file a commit record lists (and the record itself) for ``epochs``."""
    store = CheckpointStore(prefix)
    out = {}
    for epoch in epochs:
        blobs = store.node_entries(epoch)[NODE]["blobs"]
        group = f"{prefix}/{NODE}.{epoch}"
        names = ["zarr.json"] + [f"{b}/zarr.json" for b in blobs]
        names += [f"{b}/{c}" for b in blobs for c in os.listdir(f"{group}/{b}")]
        for name in names:
            if name.rsplit("/", 1)[-1].startswith(("zarr.json", "c")) and not name.endswith("~"):
                with open(f"{group}/{name}", "rb") as file:
                    out[f"{group}/{name}"] = file.read()
        with open(f"{prefix}/__daskjobs__/commits/epoch-{epoch:012d}.json", "rb") as file:
            out[f"epoch {epoch} record"] = file.read()
    return out


def run_train(prefix: str, keep_last: int | None = None) -> None:
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=keep_last)
    assert dj.JobRunner(make_job(), manager, max_epochs=5, progress=False).train() == 5


def run_prune(prefix: str) -> None:
    from daskjobs.cli import main

    assert main(["checkpoints", "prune", "--keep-last", "1", prefix]) == 0


OPERATIONS = {
    # operation: (run it, committed epochs afterwards, epochs that must be byte-identical)
    "cleanup-by-train": (lambda p: run_train(p), [0, 1, 2, 3, 4, 5], [0, 1, 2, 3]),
    "retention-keep-last-1": (lambda p: run_train(p, keep_last=1), [5], []),
    "prune-keep-last-1": (run_prune, [3], [3]),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_foreign_files_survive_every_deleting_operation(tmp_path, kind, operation):
    """D1: foreign things byte-identical; our debris gone; kept commits unchanged and verifying."""
    prefix, outside = str(tmp_path / "ckpt"), str(tmp_path / "user")
    assert dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train() == 3
    CheckpointStore(prefix).write_node(NODE, DEBRIS, {"w": np.ones((4, 2))}, save_id="debris")  # ours, uncommitted
    watched = KINDS[kind](prefix, outside)
    run, after, unchanged = OPERATIONS[operation]
    before, committed = state(watched), committed_bytes(prefix, unchanged)

    run(prefix)

    assert state(watched) == before
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == after
    assert committed_bytes(prefix, unchanged) == committed
    for epoch in after:
        dj.open_checkpoint(prefix, epoch).verify()
    leftover = os.path.join(prefix, f"{NODE}.{DEBRIS}")
    assert not os.path.exists(leftover) or sorted(os.listdir(leftover)) == ["w", "w2"], "our debris stays"
    if os.path.exists(leftover):  # only the user's links kept it
        assert os.listdir(f"{leftover}/w") == ["c.5"]
    for epoch in sorted(set(range(6)) - set(after)):  # deleted epochs: only foreign files remain
        group = f"{prefix}/{NODE}.{epoch}"
        kept = {os.path.relpath(os.path.join(d, f), group) for d, _, fs in os.walk(group) for f in fs}
        assert kept == {os.path.relpath(p, group) for p in watched if p.startswith(group + "/")}, (epoch, kept)


def test_foreign_objects_on_s3_survive_cleanup_and_delete(s3_prefix):
    """D1 on an object store: a look-alike folder without our marker survives cleanup and delete_epoch."""
    url, options = s3_prefix
    store = CheckpointStore(url, options)
    entry = store.write_node(NODE, 1, {"w": np.arange(6.0)}, save_id="one")
    from daskjobs.checkpoint._format.records import make_commit_record

    store.commit(make_commit_record("foreign", 1, {NODE: entry}, {}, {}))
    store.write_node(NODE, 2, {"w": np.arange(6.0)}, save_id="two")  # ours, uncommitted
    fs, root = store.fs, url[len("s3://") :]
    foreign = {
        f"{root}/mydata.2024/zarr.json": marker_json("mydata", 2024) + b" ",
        f"{root}/{NODE}.3/zarr.json": b'{"zarr_format": 3, "node_type": "group", "attributes": {}}',
        f"{root}/{NODE}.3/w/c.0": b"x",
        f"{root}/{NODE}.1/notes.txt": b"mine",
        f"{root}/__daskjobs__/notes.txt": b"mine",
    }
    fs.pipe(foreign)
    assert store.cleanup_uncommitted() == [f"{url}/{NODE}.2"]
    store.delete_epoch(1, [NODE])
    fs.invalidate_cache()
    assert {path: fs.cat_file(path) for path in foreign} == foreign
    assert sorted(fs.find(root)) == sorted(foreign)


# -- D2: interrupted and failing deletes ------------------------------------------------------------
def test_a_delete_stopped_midway_leaves_an_uncommitted_group_that_cleanup_finishes(tmp_path, monkeypatch):
    """D2: the commit record goes first; a crash after some files leaves cleanable debris, never a damaged commit."""
    prefix = str(tmp_path / "ckpt")
    dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train()
    store = CheckpointStore(prefix)
    real, calls = _cleanup.Tree.unlink, []

    def crash_after_first(self, paths):
        calls.append(paths)
        if len(calls) > 1:
            raise OSError(5, "Input/output error (simulated crash)")
        real(self, paths[:1])

    monkeypatch.setattr(_cleanup.Tree, "unlink", crash_after_first)
    with pytest.raises(dj.errors.CheckpointWriteError, match="could not delete epoch 1"):
        store.delete_epoch(1, [NODE])
    monkeypatch.undo()
    assert store.committed_epochs() == [0, 2]
    assert os.path.exists(f"{prefix}/{NODE}.1/zarr.json")  # the marker goes last
    assert store.cleanup_uncommitted() == [f"{store.url}/{NODE}.1"]
    assert not os.path.exists(f"{prefix}/{NODE}.1")
    for epoch in (0, 2):
        dj.open_checkpoint(prefix, epoch).verify()


def test_retention_failure_after_a_commit_is_a_warning(tmp_path, monkeypatch, caplog):
    """D2: deleting old epochs fails; every epoch still commits and train() returns normally."""
    prefix = str(tmp_path / "ckpt")

    def failing(self, paths):
        if paths:
            raise OSError(13, "Permission denied (simulated)")

    monkeypatch.setattr(_cleanup.Tree, "unlink", failing)
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1)
        assert dj.JobRunner(make_job(), manager, max_epochs=3, progress=False).train() == 3
    assert "retention: could not delete epoch" in caplog.text
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [3]  # records went first; files stayed
    monkeypatch.undo()
    assert sorted(CheckpointStore(prefix).cleanup_uncommitted()) == [f"{prefix}/{NODE}.{e}" for e in (0, 1, 2)]
    dj.open_checkpoint(prefix, 3).verify()


# -- D3: writing a group never deletes what is not ours ---------------------------------------------
CLEAR_CASES = {
    # name: (files to create under <prefix>/trainer_0.5, whether writing may go ahead)
    "nothing-there": ({}, True),
    "our-earlier-attempt": ({"zarr.json": marker_json(NODE, 5), "w/zarr.json": b"{}", "w/c.0.0": b"\0"}, True),
    "our-marker-only": ({"zarr.json": marker_json(NODE, 5)}, True),
    "user-folder": ({"data.bin": b"mine"}, False),
    "unmarked-lookalike": ({"zarr.json": b'{"zarr_format": 3, "node_type": "group"}', "w/c.0": b"\0"}, False),
    "our-attempt-plus-user-file": ({"zarr.json": marker_json(NODE, 5), "w/c.0": b"\0", "notes.txt": b"m"}, False),
}


@pytest.mark.parametrize("case", sorted(CLEAR_CASES))
def test_clear_for_write_removes_only_our_earlier_attempt(tmp_path, case):
    """D3: before a node group is (re)written, an earlier attempt of ours goes; anything else is refused."""
    files, allowed = CLEAR_CASES[case]
    group = tmp_path / "ckpt" / f"{NODE}.5"
    for name, data in files.items():
        write(str(group / name), data)
    before = state([str(group)])
    tree = _cleanup.Tree(CheckpointStore(tmp_path / "ckpt").fs)
    if allowed:
        _cleanup.clear_for_write(tree, str(group), "url", NODE, 5)
        assert not group.exists() or os.listdir(group) == []
        return
    with pytest.raises(dj.errors.CheckpointWriteError, match=f"node '{NODE}' at epoch 5 to url: .*move it away"):
        _cleanup.clear_for_write(tree, str(group), "url", NODE, 5)
    if case != "our-attempt-plus-user-file":
        assert state([str(group)]) == before
    else:
        assert sorted(os.listdir(group)) == ["notes.txt"]


def test_clear_for_write_refuses_a_symlink_in_place_of_a_group(tmp_path):
    """D3: a symlink named like the group is refused; its target is untouched."""
    target = tmp_path / "user"
    write(str(target / "zarr.json"), marker_json(NODE, 5))
    (tmp_path / "ckpt").mkdir()
    os.symlink(target, tmp_path / "ckpt" / f"{NODE}.5")
    tree = _cleanup.Tree(CheckpointStore(tmp_path / "ckpt").fs)
    with pytest.raises(dj.errors.CheckpointWriteError, match="symlink"):
        _cleanup.clear_for_write(tree, str(tmp_path / "ckpt" / f"{NODE}.5"), "url", NODE, 5)
    assert (target / "zarr.json").read_bytes() == marker_json(NODE, 5)
