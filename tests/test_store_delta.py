"""Format v2 beyond numbers (JSON and string blobs, old records) and delta checkpoints, on every backend."""

from __future__ import annotations

import json
import os
import uuid
import warnings

import numpy as np
import pytest
import zarr

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.errors import BlobTypeError, CheckpointCorruptError, CheckpointFormatError


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path, monkeypatch):
    """A store on real disk, on ``memory://`` and on moto S3; chunks of 1 KiB so arrays have several."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 1024)
    if request.param == "local":
        return CheckpointStore(tmp_path / "ckpt")
    if request.param == "memory":
        return CheckpointStore(f"memory://delta-{uuid.uuid4().hex}")
    url, options = request.getfixturevalue("s3_prefix")
    return CheckpointStore(url, options)


def commit(store: CheckpointStore, epoch: int, entry: dict) -> dict:
    record = make_commit_record("job", epoch, {"n": entry}, {}, {})
    store.commit(record)
    return record


def open_plain(store: CheckpointStore, epoch: int):
    """The group as plain zarr sees it (zarr calls the string data types "unstable": silence that)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_group(store.db_name("n", epoch), mode="r", storage_options=store.storage_options or None)


VALUES = {
    "weights": np.arange(1000, dtype="f4").reshape(250, 4),
    "words": np.array(["alpha", "βeta", "", "🙂"]),
    "raw": np.array([b"x", b"yz", b""]),
    "config": {"lr": 0.1, "layers": [1, 2, [3, 4]], "name": "ünï", "none": None, "flag": True},
    "rng": np.random.default_rng(7).bit_generator.state,
    "big": {"n": 2**200, "neg": -(2**70)},
    "text": "just a string",
    "empty_list": [],
    "scalar": np.array(3.5),
}


def assert_equal_values(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[name].dtype == value.dtype.newbyteorder("<") if value.dtype.kind != "S" else value.dtype
            assert got[name].shape == value.shape
            assert np.array_equal(got[name], value), name
        else:
            assert got[name] == json.loads(json.dumps(value)), name
            assert type(got[name]) is type(json.loads(json.dumps(value))), name


def test_json_and_string_blobs_round_trip(store):
    entry = store.write_node("n", 1, VALUES, save_id="a")
    record = commit(store, 1, entry)
    assert_equal_values(store.read_node("n", 1, record["manifests"]["n"]), VALUES)
    assert entry["blobs"]["config"]["kind"] == "json"
    view = dj.open_checkpoint(store.url, storage_options=store.storage_options)
    assert view["n"]["rng"] == VALUES["rng"]
    assert np.array_equal(view["n"].lazy("words").compute(scheduler="sync"), VALUES["words"])
    with pytest.raises(TypeError, match="JSON value"):
        view["n"].lazy("config")
    plain = open_plain(store, 1)
    assert np.array_equal(plain["words"][...], VALUES["words"])
    assert np.array_equal(plain["raw"][...], VALUES["raw"])
    assert json.loads(bytes(plain["config"][...])) == VALUES["config"]
    assert plain["config"].attrs["daskjobs"] == {"encoding": "json"}


def test_tuples_become_lists_and_other_objects_are_refused(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    entry = store.write_node("n", 1, {"t": {"pair": (1, (2, 3))}}, save_id="a")
    assert store.read_node("n", 1, entry)["t"] == {"pair": [1, [2, 3]]}
    for bad in ({1, 2}, object(), {"x": float("nan")}, {"x": b"bytes"}):
        with pytest.raises(BlobTypeError, match="blob 'bad'"):
            store.write_node("n", 2, {"bad": bad}, save_id="b")


def test_compressed_json_and_strings(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", compression="zstd")
    entry = store.write_node("n", 1, VALUES, save_id="a")
    assert_equal_values(store.read_node("n", 1, entry), VALUES)
    again = store.write_node("n", 2, VALUES, save_id="b", previous=entry)
    assert again["bytes_written"] == 0
    assert again["bytes_reused"] == again["bytes"]
    assert_equal_values(store.read_node("n", 2, again), VALUES)


def test_version_1_records_are_refused_by_name(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    record = commit(store, 1, store.write_node("n", 1, {"w": np.ones(2)}, save_id="a"))
    path = os.path.join(store.url, "__daskjobs__", "commits", "epoch-000000000001.json")
    with open(path, "w") as file:
        json.dump({**record, "format_version": 1}, file)
    with pytest.raises(CheckpointFormatError, match=r"epoch-000000000001.json: .*format version 1 .*no longer read"):
        store.read_commit(1)


def test_delta_writes_only_changed_chunks(store):
    frozen = np.arange(4096, dtype="f8")  # 32 KiB: 32 chunks
    model = np.zeros(256, dtype="f4")  # 1 KiB: one chunk
    first = store.write_node("n", 0, {"frozen": frozen, "model": model, "cfg": {"a": 1}}, save_id="e0")
    assert first["bytes_written"] == first["bytes"]
    assert first["bytes_reused"] == 0
    commit(store, 0, first)
    changed = frozen.copy()
    changed[100] = -1  # one chunk of 32
    second = store.write_node(
        "n", 1, {"frozen": changed, "model": model + 1, "cfg": {"a": 1}}, save_id="e1", previous=first
    )
    commit(store, 1, second)
    assert second["bytes_written"] == 1024 + model.nbytes
    assert second["bytes_reused"] == second["bytes"] - second["bytes_written"]
    store.delete_epoch(0, ["n"])  # retention removed the epoch the chunks came from
    got = dj.open_checkpoint(store.url, 1, storage_options=store.storage_options)
    assert got.verify() == second["bytes"]
    assert np.array_equal(got["n"]["frozen"], changed)
    assert np.array_equal(open_plain(store, 1)["frozen"][...], changed)
    assert got["n"]["cfg"] == {"a": 1}


def test_delta_uses_hard_links_locally_and_falls_back_to_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 1024)
    store = CheckpointStore(tmp_path / "ckpt")
    blobs = {"w": np.arange(1024, dtype="f4")}
    first = store.write_node("n", 0, blobs, save_id="e0")
    second = store.write_node("n", 1, blobs, save_id="e1", previous=first)
    chunk = os.path.join(store.url, "n.1", "w", "c.0")
    assert os.stat(chunk).st_nlink == 2
    assert second["bytes_reused"] == blobs["w"].nbytes

    def no_links(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    third = store.write_node("n", 2, blobs, save_id="e2", previous=second)
    assert third["bytes_written"] == blobs["w"].nbytes
    assert third["bytes_reused"] == 0
    assert os.stat(os.path.join(store.url, "n.2", "w", "c.0")).st_nlink == 1
    assert np.array_equal(store.read_node("n", 2, third)["w"], blobs["w"])


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.astype("f8"),
        lambda w: w.reshape(2, -1),
        lambda w: w[:-1],
    ],
    ids=["dtype", "shape", "length"],
)
def test_delta_never_reuses_across_layouts(tmp_path, change):
    store = CheckpointStore(tmp_path / "ckpt")
    w = np.zeros(512, dtype="f4")
    first = store.write_node("n", 0, {"w": w}, save_id="e0")
    second = store.write_node("n", 1, {"w": change(w)}, save_id="e1", previous=first)
    assert second["bytes_reused"] == 0
    assert np.array_equal(store.read_node("n", 1, second)["w"], change(w))


def test_previous_of_another_node_or_a_later_epoch_is_ignored(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    blobs = {"w": np.ones(8)}
    other = store.write_node("m", 0, blobs, save_id="e0")
    assert store.write_node("n", 1, blobs, save_id="e1", previous=other)["bytes_reused"] == 0
    later = store.write_node("n", 5, blobs, save_id="e5")
    assert store.write_node("n", 2, blobs, save_id="e2", previous=later)["bytes_reused"] == 0


@pytest.mark.parametrize("modified", ["after_the_entry", "with_the_entry"])
def test_a_source_damaged_after_its_save_is_written_anew_or_caught_on_read(tmp_path, modified):
    """A chunk file modified after its group's entry was written is not linked: the new epoch writes
    the bytes and reads back exactly. Modified within the entry's clock tick, it cannot be told from
    a sound one: it is linked, and reading the new epoch catches it (verification is the safety net)."""
    store = CheckpointStore(tmp_path / "ckpt")
    blobs = {"w": np.arange(64, dtype="f8")}
    first = store.write_node("n", 0, blobs, save_id="e0")
    chunk = os.path.join(store.url, "n.0", "w", "c.0")
    with open(chunk, "r+b") as file:  # damage in place, same size
        file.write(b"\xff")
    sealed = os.lstat(os.path.join(store.url, "n.0", "zarr.json")).st_mtime_ns
    later = sealed + (10**9 if modified == "after_the_entry" else 0)
    os.utime(chunk, ns=(later, later))
    second = store.write_node("n", 1, blobs, save_id="e1", previous=first)
    if modified == "after_the_entry":
        assert (second["bytes_written"], second["bytes_reused"]) == (blobs["w"].nbytes, 0)
        np.testing.assert_array_equal(store.read_node("n", 1, second)["w"], blobs["w"])
    else:
        assert second["bytes_reused"] == blobs["w"].nbytes
        with pytest.raises(
            CheckpointCorruptError, match=r"epoch 1, node 'n', blob 'w': checksum mismatch in chunk c\.0"
        ):
            store.read_node("n", 1, second)
    with pytest.raises(CheckpointCorruptError, match=r"epoch 0, node 'n', blob 'w'"):
        store.read_node("n", 0, first)


def build_job(frozen_rows: int = 4096) -> dj.Job:
    with dj.Cluster(), dj.Job(name="delta") as job, dj.Node("local"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(frozen=np.arange(frozen_rows, dtype="f8"), model=np.zeros(16)), name="init")

        def step(ws):
            ws["model"] = ws["model"] + 1

        dj.Task(step, name="train")
        dj.epoch_limiter(job, 3)
    return job


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "full"])
def test_manager_passes_the_previous_entry(tmp_path, monkeypatch, async_save, delta):
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 1024)
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save, delta=delta, keep_last=1)
    assert dj.JobRunner(build_job(), manager, progress=False).train(dj.LocalSession()) == 3
    (info,) = dj.list_checkpoints(prefix)
    entry = info.record["manifests"]["local"]
    assert (4096 * 8 <= entry["bytes_reused"] < entry["bytes"]) if delta else entry["bytes_reused"] == 0
    assert entry["bytes_written"] + entry["bytes_reused"] == entry["bytes"]
    assert manager.last_commit_reused == entry["bytes_reused"]
    assert manager.last_commit_written == entry["bytes_written"]
    view = dj.open_checkpoint(prefix)
    assert view.verify() == entry["bytes"]
    assert np.array_equal(view["local"]["model"], np.full(16, 3.0))
