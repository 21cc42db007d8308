"""A save writes over its node's retired group instead of deleting it and creating a new one.

Creating and deleting files is most of what a small save costs a local file system (SPEC §6 Scale
b); a save with a retired group of its node at hand (retention, ``flush_later``) renames it to a
staging folder, writes its files in place, removes what no longer belongs, replaces the manifest
and renames the folder to the new group's name. What it leaves must be exactly what a fresh save
writes, every kept epoch must stay exact (its hard links are never written through), anything
daskjobs did not write stops it (the group is then deleted as before), and a save killed midway
leaves debris that cleanup removes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import stop_group

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.checkpoint._protocol.commits import RetiredEpoch

NODE = "n"


def save(store: CheckpointStore, epoch: int, blobs: dict, previous=None, retired=None) -> dict:
    """Write and flush ``NODE``'s group of ``epoch`` as a retention-driven save does, then commit it."""
    entry, flush = store.write_node_unsynced(
        NODE, epoch, blobs, save_id=f"s{epoch}", previous=previous, retired=retired
    )
    if flush is not None:
        flush()
    store.commit(make_commit_record("job", epoch, {NODE: entry}, {}, {}))
    return entry


def files(group: str) -> dict[str, bytes]:
    """Every file under ``group`` (relative path → bytes) but the manifest, which holds a timing."""
    out = {}
    for root, _dirs, names in os.walk(group):
        for name in names:
            path = os.path.join(root, name)
            if path != f"{group}/zarr.json":
                with open(path, "rb") as file:
                    out[os.path.relpath(path, group)] = file.read()
    return out


def inode(path: str) -> int:
    return os.lstat(path).st_ino


def read_all(store: CheckpointStore, epoch: int) -> dict:
    return store.read_node(NODE, epoch, store.node_entries(epoch)[NODE])


def assert_equal_blobs(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(got[name], value, strict=True)
        else:
            assert got[name] == value


def test_a_save_writes_over_the_retired_group_in_place(tmp_path):
    """No new chunk file: the retired chunk's inode now holds the new epoch's bytes; the folder of
    the retired epoch is gone; the result is byte for byte what a fresh save writes, and the kept
    epoch that shares a hard link with the retired one is unchanged."""
    store = CheckpointStore(tmp_path / "ckpt")
    kept_value = np.arange(8, dtype="i4")
    e0 = save(store, 0, {"w": np.zeros(16), "k": kept_value})
    e1 = save(store, 1, {"w": np.ones(16), "k": kept_value}, previous=e0)  # k hard-linked from epoch 0
    shared = inode(f"{store.url}/n.0/k/c.0")
    assert shared == inode(f"{store.url}/n.1/k/c.0")
    retired = store.retire_epoch(0, [NODE])

    with open(f"{store.url}/n.0/w/c.0", "rb") as old_chunk:  # open: its inode number cannot be reused
        e2 = save(store, 2, {"w": np.full(16, 2.0), "k": kept_value}, previous=e1, retired=retired)
        assert inode(f"{store.url}/n.2/w/c.0") == os.fstat(old_chunk.fileno()).st_ino
        assert old_chunk.read() == np.full(16, 2.0).tobytes()  # the retired file now holds epoch 2

    assert sorted(os.listdir(store.url)) == ["__daskjobs__", "n.1", "n.2"]
    assert inode(f"{store.url}/n.2/k/c.0") == shared  # the same link, kept, never written through
    fresh = CheckpointStore(tmp_path / "fresh")
    save(fresh, 2, {"w": np.full(16, 2.0), "k": kept_value})
    assert files(f"{store.url}/n.2") == files(f"{fresh.url}/n.2")
    assert (e2["bytes_written"], e2["bytes_reused"]) == (128, 32)
    assert_equal_blobs(read_all(store, 2), {"w": np.full(16, 2.0), "k": kept_value})
    assert_equal_blobs(read_all(store, 1), {"w": np.ones(16), "k": kept_value})
    dj.open_checkpoint(store.url, 1).verify()
    dj.open_checkpoint(store.url, 2).verify()


def test_the_group_appears_under_its_name_only_once_durable(tmp_path):
    """Until its flush, the group written over a retired one is a staging folder (debris to a
    crash); the flush renames it into place. A driver making it durable for a node whose worker
    died (``make_durable``) renames it too, after verifying every chunk."""
    store = CheckpointStore(tmp_path / "ckpt")
    e0 = save(store, 0, {"w": np.zeros(16)})
    retired = store.retire_epoch(0, [NODE])
    entry, flush = store.write_node_unsynced(NODE, 1, {"w": np.ones(16)}, save_id="s1", previous=e0, retired=retired)
    (staged,) = [name for name in os.listdir(store.url) if name.startswith("n.")]
    assert staged.startswith("n.1.tmp-")
    assert not store.has_group(NODE, 1)
    flush.soon().result(timeout=30)
    assert sorted(os.listdir(store.url)) == ["__daskjobs__", "n.1"]

    retired = RetiredEpoch(1, {NODE: entry})  # as retention hands it out once epoch 1 is retired
    entry2, _flush = store.write_node_unsynced(NODE, 2, {"w": np.full(16, 2.0)}, save_id="s2", retired=retired)
    assert not store.has_group(NODE, 2)  # its worker "dies" here: the flush never runs
    assert store.make_durable(NODE, 2, entry2)["save_id"] == "s2"
    assert sorted(os.listdir(store.url)) == ["__daskjobs__", "n.2"]
    assert_equal_blobs(store.read_node(NODE, 2, entry2), {"w": np.full(16, 2.0)})


LAYOUTS = {
    # name: (blobs of the retired epoch, blobs written over it)
    "blob-removed": ({"a": np.zeros(40), "b": np.ones(3)}, {"a": np.full(40, 7.0)}),
    "blob-added": ({"a": np.zeros(40)}, {"a": np.zeros(40), "c": np.arange(5)}),
    "fewer-chunks": ({"a": np.arange(100.0)}, {"a": np.arange(10.0)}),
    "chunks-shrink": ({"a": np.random.default_rng(0).random(40)}, {"a": np.zeros(40)}),
    "more-chunks": ({"a": np.arange(10.0)}, {"a": np.arange(100.0)}),
    "dtype-changed": ({"a": np.arange(40.0)}, {"a": np.arange(40, dtype="i2")}),
    "ndim-changed": ({"a": np.arange(40.0)}, {"a": np.arange(40.0).reshape(8, 5)}),
    "json-and-strings": ({"a": {"x": [1, 2]}, "s": np.array(["ab", "c"])}, {"a": "text", "s": np.array(["xyz"])}),
    "empty-workspace": ({"a": np.zeros(3)}, {}),
}


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_changed_layout_leaves_exactly_what_a_fresh_save_writes(tmp_path, monkeypatch, layout, compression):
    """Blobs added or removed, chunk grids grown or shrunk, dtypes and dimensions changed, chunk
    files that shrink (compressed): the group written over the retired one holds the same files and
    bytes as a fresh save."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 64)
    before, after = LAYOUTS[layout]
    store = CheckpointStore(tmp_path / "ckpt", compression=compression)
    e0 = save(store, 0, before)
    retired = store.retire_epoch(0, [NODE])
    save(store, 1, after, previous=e0, retired=retired)
    fresh = CheckpointStore(tmp_path / "fresh", compression=compression)
    save(fresh, 1, after)

    assert sorted(os.listdir(store.url)) == ["__daskjobs__", "n.1"]
    assert files(f"{store.url}/n.1") == files(f"{fresh.url}/n.1")
    assert_equal_blobs(read_all(store, 1), after)
    dj.open_checkpoint(store.url, 1).verify()


small_arrays = st.one_of(
    st.integers(0, 30).map(lambda n: np.arange(n, dtype="f8")),
    st.integers(1, 6).map(lambda n: np.arange(n * 4, dtype="i4").reshape(n, 4)),
    st.sampled_from([np.zeros(12), np.ones(12)]),  # repeated values: chunks linked across epochs
)
workspaces = st.dictionaries(st.sampled_from(["a", "b", "c"]), small_arrays, max_size=3)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(workspaces, min_size=2, max_size=7), keep=st.integers(1, 3))
def test_any_sequence_of_saves_with_retention_keeps_every_kept_epoch_exact(monkeypatch, steps, keep):
    """Property: saves of random workspaces, each writing over the group ``keep`` epochs back once
    that epoch is retired; after every save, the new group equals a fresh save's and every kept
    epoch reads back exactly what was saved."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 64)
    with tempfile.TemporaryDirectory() as root:
        store, fresh = CheckpointStore(f"{root}/ckpt"), CheckpointStore(f"{root}/fresh")
        previous, saved = None, {}
        for epoch, blobs in enumerate(steps):
            retired = store.retire_epoch(epoch - keep, [NODE]) if epoch >= keep else None
            saved.pop(epoch - keep, None)
            previous = save(store, epoch, blobs, previous=previous, retired=retired)
            saved[epoch] = blobs
            save(fresh, epoch, blobs)
            assert files(f"{store.url}/n.{epoch}") == files(f"{fresh.url}/n.{epoch}")
            for kept, want in saved.items():
                assert_equal_blobs(read_all(store, kept), want)
            assert sorted(os.listdir(store.url)) == ["__daskjobs__", *sorted(f"n.{e}" for e in saved)]


def retired_with(tmp_path, put_foreign) -> tuple[CheckpointStore, dict, RetiredEpoch]:
    store = CheckpointStore(tmp_path / "ckpt")
    e0 = save(store, 0, {"w": np.zeros(16)})
    put_foreign(f"{store.url}/n.0")
    return store, e0, store.retire_epoch(0, [NODE])


def user_file(group: str) -> None:
    with open(f"{group}/w/notes.txt", "w") as file:
        file.write("mine")


def swapped_manifest(group: str) -> None:
    other = CheckpointStore(os.path.dirname(group) + "-other")
    save(other, 0, {"w": np.ones(16)})
    os.replace(f"{other.url}/n.0/zarr.json", f"{group}/zarr.json")


def chunk_as_symlink(group: str) -> None:
    os.replace(f"{group}/w/c.0", f"{group}/w/c.0.real")
    os.symlink(f"{group}/w/c.0.real", f"{group}/w/c.0")


@pytest.mark.parametrize("foreign", [user_file, swapped_manifest, chunk_as_symlink], ids=lambda f: f.__name__)
def test_a_retired_group_holding_anything_else_is_deleted_as_before_not_written_over(tmp_path, foreign):
    """A user's file, a manifest that is not the one committed, a symlink: the retired group is not
    taken over; the new group is written fresh and the retired one goes as retention deletes it
    (what daskjobs did not write stays, symlinks too)."""
    store, e0, retired = retired_with(tmp_path, foreign)
    with open(f"{store.url}/n.0/w/c.0", "rb") as old_chunk:  # open: its inode number cannot be reused
        save(store, 1, {"w": np.full(16, 3.0)}, previous=e0, retired=retired)
        assert inode(f"{store.url}/n.1/w/c.0") != os.fstat(old_chunk.fileno()).st_ino
        assert old_chunk.read() == np.zeros(16).tobytes()

    assert_equal_blobs(read_all(store, 1), {"w": np.full(16, 3.0)})
    retired_folder = f"{store.url}/n.0"
    left = {os.path.relpath(os.path.join(d, f), retired_folder) for d, _, fs in os.walk(retired_folder) for f in fs}
    expected = {"user_file": {"w/notes.txt"}, "swapped_manifest": set(), "chunk_as_symlink": {"w/c.0", "w/c.0.real"}}
    assert left == expected[foreign.__name__]


def test_a_save_killed_while_writing_over_leaves_debris_that_cleanup_removes(tmp_path):
    """A kill after the retired group was renamed (a staging folder with the node's old manifest)
    or after the new manifest replaced it: the next run's cleanup removes that staging folder, and
    one of another node or without a marker stays."""
    store = CheckpointStore(tmp_path / "ckpt")
    e0 = save(store, 0, {"w": np.zeros(16)})
    save(store, 1, {"w": np.ones(16)}, previous=e0)
    store.retire_epoch(0, [NODE])
    staged = f"{store.url}/n.2.tmp-{uuid.uuid4().hex}"
    os.rename(f"{store.url}/n.0", staged)  # where a kill right after the rename leaves it
    written = f"{store.url}/n.3.tmp-{uuid.uuid4().hex}"
    CheckpointStore(tmp_path / "other").write_node(NODE, 3, {"w": np.ones(2)}, save_id="x")
    os.rename(f"{tmp_path}/other/n.3", written)  # a staging folder with the new epoch's manifest
    foreign = f"{store.url}/m.2.tmp-{uuid.uuid4().hex}"
    os.makedirs(f"{foreign}/w")
    with open(f"{foreign}/w/c.0", "wb") as file:
        file.write(b"user")

    removed = store.cleanup_uncommitted([NODE, "m"])

    assert sorted(removed) == sorted(f"{store.url}/{os.path.basename(p)}" for p in (staged, written))
    assert sorted(os.listdir(store.url)) == ["__daskjobs__", os.path.basename(foreign), "n.1"]
    assert os.listdir(f"{foreign}/w") == ["c.0"]
    dj.open_checkpoint(store.url, 1).verify()


@pytest.mark.cluster
def test_a_job_with_retention_writes_over_retired_groups_and_resumes_exactly(tmp_path):
    """The user's path: ``train`` with ``keep_last`` on a cluster of worker processes, stopped and
    resumed. Once retention runs, each epoch's chunk file is a retired epoch's, written over (fewer
    distinct files than epochs), and the run ends where an uninterrupted one does."""
    prefix = str(tmp_path / "ckpt")
    job, opened = recycling_job(), {}

    def keep_open(record) -> None:  # an open file's inode number cannot be reused by a new file
        for name in os.listdir(prefix):
            path = f"{prefix}/{name}/w/c.0"
            if name.startswith("a.") and path not in opened and os.path.exists(path):
                opened[path] = open(path, "rb")  # noqa: SIM115 (closed below)

    try:
        with dj.node_cluster({"w0": ["a"], "w1": ["b"]}, processes=True) as cluster, dj.DaskSession(cluster) as session:
            for epochs in (8, 20):
                manager = dj.MultiNodeCheckpointManager(prefix, keep_last=2)
                runner = dj.JobRunner(job, manager, max_epochs=epochs, progress=False, on_epoch=keep_open)
                assert runner.train(session) == epochs
        files_used = {os.fstat(file.fileno()).st_ino for file in opened.values()}
    finally:
        for file in opened.values():
            file.close()
    assert sorted(os.listdir(prefix)) == ["__daskjobs__", "a.19", "a.20", "b.19", "b.20"]
    assert len(opened) >= 18
    assert len(files_used) <= len(opened) - 8, "later epochs write over the retired groups' files"
    want = np.arange(6.0)
    for _ in range(20):
        want = want * 1.5 + 1
    checkpoint = dj.open_checkpoint(prefix, 20)
    for node in ("a", "b"):
        np.testing.assert_array_equal(checkpoint[node]["w"], want)
    assert checkpoint.verify() > 0
    dj.open_checkpoint(prefix, 19).verify()


def _init(ws):
    ws["w"] = np.arange(6.0)


def _step(ws):
    ws["w"] = ws["w"] * 1.5 + 1


def recycling_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="recycle") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(_init, name="init")
                dj.Task(_step, name="step")
    return job


KILL_EPOCHS = 24


def _count(ws):
    ws["w"] = ws["w"] + ws.epoch


def kill_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="recycle-kill") as job:
        for node in ("a", "b", "c", "d"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(_init, name="init")
                dj.Task(_count, name="count")
    return job


def kill_child(prefix: str) -> None:
    """Train on a cluster of worker processes with ``keep_last=2``, printing each finished epoch."""
    with (
        dj.node_cluster({"w0": ["a", "b"], "w1": ["c", "d"]}, processes=True) as cluster,
        dj.DaskSession(cluster) as session,
    ):
        runner = dj.JobRunner(
            kill_job(),
            dj.MultiNodeCheckpointManager(prefix, keep_last=2),
            max_epochs=KILL_EPOCHS,
            progress=False,
            on_epoch=lambda record: print(f"epoch {record.epoch}", flush=True),
        )
        runner.train(session)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.representative("4-0.0", "13-0.023")  # the other moments: -m matrix
@pytest.mark.parametrize(("after_epoch", "delay"), [(4, 0.0), (6, 0.004), (9, 0.011), (13, 0.023), (17, 0.037)])
def test_a_process_group_killed_while_groups_are_written_over_resumes_exactly(tmp_path, after_epoch, delay):
    """SIGKILL to the whole process group (driver and workers, as a batch system's kill) while nodes
    write over retired groups: every commit left verifies and holds the expected values, no staging
    folder outlives the resumed run's cleanup, and the resumed run ends equal to an uninterrupted one."""
    prefix = str(tmp_path / "ckpt")
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_recycled_groups as t; t.kill_child({prefix!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if line.strip() == f"epoch {after_epoch}" or not line:
                break
        time.sleep(delay)
    finally:
        stop_group(child, timeout=30)
    committed = [info.epoch for info in dj.list_checkpoints(prefix)]
    assert committed, "the kill came after some commits"
    for epoch in committed:
        view = dj.open_checkpoint(prefix, epoch)
        assert view.verify() == 4 * 6 * 8
        for node in ("a", "b", "c", "d"):
            np.testing.assert_array_equal(view[node]["w"], np.arange(6.0) + epoch * (epoch + 1) / 2)

    with dj.node_cluster({"w0": ["a", "b"], "w1": ["c", "d"]}, processes=True) as cluster, dj.DaskSession(cluster) as s:
        runner = dj.JobRunner(kill_job(), dj.MultiNodeCheckpointManager(prefix, keep_last=2), max_epochs=KILL_EPOCHS)
        assert runner.train(s) == KILL_EPOCHS
    assert [record.epoch for record in runner.history] == list(range(committed[-1] + 1, KILL_EPOCHS + 1))
    view = dj.open_checkpoint(prefix)
    for node in ("a", "b", "c", "d"):
        np.testing.assert_array_equal(view[node]["w"], np.arange(6.0) + KILL_EPOCHS * (KILL_EPOCHS + 1) / 2)
    left = sorted(name for name in os.listdir(prefix) if name != "__daskjobs__")
    assert left == sorted(f"{n}.{e}" for n in "abcd" for e in (KILL_EPOCHS - 1, KILL_EPOCHS)), left
