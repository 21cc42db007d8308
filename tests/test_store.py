"""CheckpointStore on a real disk and on ``memory://``: round trips, commits, corruption, names, lock."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import sys
import threading
import uuid
from collections.abc import Iterator
from unittest import mock

import fsspec
import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from records import as_version, edit_entry, manifest_path, raw_record, record_path, write_record

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.entries import validate_node_entry
from daskjobs.checkpoint._format.manifests import reference
from daskjobs.checkpoint._format.records import (
    RECORD_FORMAT_VERSION,
    committed_entry,
    make_commit_record,
    validate_commit_record,
)
from daskjobs.checkpoint._storage import durable as _durable
from daskjobs.checkpoint._storage import files as _files
from daskjobs.errors import (
    BlobTypeError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)

ALLOWED = ["b1", "i1", "u1", "i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
HOLDER = {"host": "hostA", "pid": 4242, "job": "train", "started": "2026-01-01T00:00:00"}


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[CheckpointStore]:
    """An empty store on real disk or in this process's ``memory://`` filesystem."""
    if request.param == "local":
        yield CheckpointStore(tmp_path / "ckpt")
        return
    url = f"memory://dj-{uuid.uuid4().hex}"
    yield CheckpointStore(url)
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(url, recursive=True)


def fs_path(store: CheckpointStore, *parts: str) -> str:
    """The filesystem path of ``parts`` under the store's prefix."""
    return store.fs._strip_protocol("/".join([store.url, *parts]))


def put(store: CheckpointStore, relative: str, data: bytes) -> None:
    """Write a file under the prefix, creating its folder if needed."""
    path = fs_path(store, relative)
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def commit(store: CheckpointStore, epoch: int, entries: dict, stop: bool = False) -> dict:
    record = make_commit_record("job", epoch, entries, {"done": stop}, {"save_seconds": 0.5})
    store.commit(record)
    return record


def save(store: CheckpointStore, epoch: int, nodes: dict[str, dict[str, np.ndarray]]) -> dict:
    """Write every node's blobs for ``epoch`` and commit; return the record."""
    return commit(store, epoch, {n: store.write_node(n, epoch, b, save_id=f"s{epoch}") for n, b in nodes.items()})


def entry_of(store: CheckpointStore, epoch: int, node: str = "a") -> dict:
    """What the commit record of ``epoch`` holds of ``node``: the summary naming its manifest."""
    return committed_entry(store.read_commit(epoch), node)


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        expected = np.asarray(array)
        assert got[name].shape == expected.shape, name
        assert got[name].dtype == expected.dtype.newbyteorder("<"), name
        assert got[name].tobytes() == expected.astype(expected.dtype.newbyteorder("<")).tobytes(), name


def every_kind() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    blobs = {f"a_{code}": (rng.standard_normal(12) * 100).astype(code).reshape(3, 4) for code in ALLOWED}
    blobs.update(
        {
            "scalar": np.array(3.25),
            "scalar_bool": np.array(True),
            "empty": np.zeros((0, 3), "f4"),
            "empty_inner": np.zeros((4, 0), "i8"),
            "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
            "big_endian": np.arange(10, dtype=">i4"),
            "big_endian_c": np.array([1 + 2j, -3j], ">c16"),
            "zeros": np.zeros((5, 5), "f8"),
            "false": np.zeros(7, bool),
            "strided": np.arange(20.0)[::3],
            "cube": rng.integers(0, 9, (2, 3, 4), dtype="u2"),
            "nan": np.array([np.nan, np.inf, -0.0], "f4"),
        }
    )
    return blobs


# -- round trips ---------------------------------------------------------------------------------
def test_round_trip_every_dtype_and_layout(store):
    blobs = every_kind()
    record = save(store, 3, {"a": blobs})
    assert_same(store.read_node("a", 3, committed_entry(record, "a")), blobs)
    entry = store.node_entries(3)["a"]
    assert entry["blobs"]["big_endian"]["dtype"] == "<i4"
    assert entry["blobs"]["a_b1"]["dtype"] == "|b1"
    assert entry["bytes"] == sum(np.asarray(b).nbytes for b in blobs.values())
    json.dumps(entry)  # JSON-able as is


def test_the_group_is_plain_zarr_v3(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    blobs = every_kind()
    entry = store.write_node("a", 1, blobs, save_id="s1")
    group = zarr.open_group(store.db_name("a", 1), mode="r", zarr_format=3)
    assert group.attrs["daskjobs"] == {key: value for key, value in entry.items() if key != "manifest"}
    assert entry["manifest"] == reference(store.fs.cat_file(fs_path(store, "a.1", "zarr.json")))
    for name, array in blobs.items():
        assert np.array_equal(np.asarray(group[name][...]), array, equal_nan=array.dtype.kind in "fc"), name
    assert store.read_node_entry("a", 1) == entry


def test_multi_chunk_arrays_with_padding(store, monkeypatch):
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 100)
    blobs = {"rows": np.arange(91 * 3, dtype="f4").reshape(91, 3), "long": np.arange(1000, dtype="i2")}
    save(store, 1, {"a": blobs})
    entry = entry_of(store, 1)
    assert store.node_entries(1)["a"]["blobs"]["rows"]["chunks"] == [9, 3]
    assert_same(store.read_node("a", 1, entry), blobs)
    if "://" not in store.url:
        assert np.array_equal(zarr.open_array(f"{store.db_name('a', 1)}/rows", mode="r")[...], blobs["rows"])
    last = fs_path(store, "a.1", "rows", "c.10.0")
    data = bytearray(store.fs.cat_file(last))
    data[-1] ^= 0xFF  # in the padding past row 91
    store.fs.pipe_file(last, bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"blob 'rows': checksum mismatch in chunk c\.10\.0"):
        store.read_node("a", 1, entry)


def test_many_small_blobs_read_back_as_separate_writable_arrays(store, monkeypatch):
    """The small blobs of a read share a few buffers (one allocation each scales badly): each array
    still starts on a 64-byte boundary, holds exactly its blob, and writing it changes no other."""
    monkeypatch.setattr(_chunks, "_ARENA_BYTES", 8 << 10)  # a few buffers for these 40 blobs
    blobs = {f"b{i:02d}": np.full(50 * (i + 1), i, dtype=["<f8", "<i2", "|u1", "<c16"][i % 4]) for i in range(40)}
    blobs["big"] = np.arange(20_000, dtype="<i8")  # 160 KB: a buffer of its own
    blobs["empty"] = np.zeros((0, 3), dtype="<f4")
    save(store, 1, {"a": blobs})
    got = store.read_node("a", 1, entry_of(store, 1))
    assert_same(got, blobs)
    small = [got[f"b{i:02d}"] for i in range(40)]
    assert all(array.ctypes.data % 64 == 0 and array.flags.writeable for array in small)
    assert 1 < len({id(array.base) for array in small}) < 40
    assert got["big"].base is not small[0].base
    for index, array in enumerate(small):
        array[...] = 100 + index
    assert [int(array.real.max()) for array in small] == [100 + i for i in range(40)]
    assert [int(array.real.min()) for array in small] == [100 + i for i in range(40)]


def test_parallel_reads_and_aligned_outputs(store, monkeypatch):
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(_files, "_PARALLEL_FROM", 0)  # read chunks in the thread pool even when small
    monkeypatch.setattr(_files, "_THREADS", 4)
    monkeypatch.setattr(_chunks, "_ALIGN_FROM", 0)
    blobs = {"w": np.arange(10_000, dtype="f8"), "v": np.arange(3000, dtype="i4").reshape(1000, 3)}
    save(store, 1, {"a": blobs})
    entry = entry_of(store, 1)
    threads = threading.active_count()
    got = store.read_node("a", 1, entry)
    assert_same(got, blobs)
    assert all(array.ctypes.data % 4096 == 0 for array in got.values())
    CHUNK_FAULTS["flip"](store.fs, fs_path(store, "a.1", "w", "c.5"))
    with pytest.raises(CheckpointCorruptError, match=r"blob 'w': checksum mismatch in chunk c\.5"):
        store.read_node("a", 1, entry)
    CHUNK_FAULTS["truncate_by_one"](store.fs, fs_path(store, "a.1", "v", "c.2.0"))
    with pytest.raises(CheckpointCorruptError, match=r"blob 'v', chunk c\.2\.0: the chunk file has 4007 bytes"):
        store.read_node("a", 1, entry, ["v"])
    assert threading.active_count() == threads


@pytest.mark.parametrize("compression", ["zstd", "blosc", "gzip"])
def test_compressed_round_trip_and_corruption(tmp_path, compression):
    store = CheckpointStore(tmp_path / "ckpt", compression=compression)
    blobs = every_kind()
    save(store, 2, {"a": blobs})
    entry = entry_of(store, 2)
    assert_same(store.read_node("a", 2, entry), blobs)
    assert np.array_equal(zarr.open_array(f"{store.db_name('a', 2)}/a_f4", mode="r")[...], blobs["a_f4"])
    os.remove(os.path.join(store.db_name("a", 2), "zeros", "c.0.0"))  # all-zero chunks are written too
    with pytest.raises(CheckpointCorruptError, match=r"epoch 2, node 'a', blob 'zeros', chunk c\.0\.0"):
        store.read_node("a", 2, entry, ["zeros"])
    path = os.path.join(store.db_name("a", 2), "a_f8", "c.0.0")
    with open(path, "r+b") as file:
        data = bytearray(file.read())
        data[len(data) // 2] ^= 0x55
        file.seek(0)
        file.write(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="blob 'a_f8'"):
        store.read_node("a", 2, entry, ["a_f8"])


def test_compressed_on_memory():
    store = CheckpointStore(f"memory://dj-{uuid.uuid4().hex}", compression="zstd")
    blobs = {"w": np.arange(50.0).reshape(10, 5), "s": np.array(7, "u1")}
    assert_same(store.read_node("n", 0, store.write_node("n", 0, blobs, save_id="x")), blobs)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([np.dtype(c) for c in ALLOWED] + [np.dtype(f">{c}") for c in ALLOWED[3:]]).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
    )
)
def test_property_round_trip(array):
    store = CheckpointStore(f"memory://dj-{uuid.uuid4().hex}")
    with mock.patch.object(_chunks, "CHUNK_BYTES", 24):
        entry = store.write_node("n", 5, {"x": array}, save_id="p")
        assert_same(store.read_node("n", 5, entry), {"x": array})
    store.fs.rm(store.fs._strip_protocol(store.url), recursive=True)


def test_write_replaces_an_earlier_attempt(store):
    store.write_node("a", 4, {"old": np.ones(3), "w": np.ones(3)}, save_id="first")
    entry = store.write_node("a", 4, {"w": np.arange(3.0)}, save_id="second")
    assert "old" not in store.fs.ls(fs_path(store, "a.4"), detail=False)
    assert_same(store.read_node("a", 4, entry), {"w": np.arange(3.0)})


def test_read_selected_names_skips_unknown(store):
    blobs = {"w": np.ones(2), "b": np.zeros(3, "i4")}
    entry = store.write_node("a", 1, blobs, save_id="x")
    assert sorted(store.read_node("a", 1, entry, ["b", "nope"])) == ["b"]
    assert store.read_node("a", 1, entry, []) == {}


def test_without_syncfs_every_path_is_fsynced(tmp_path, monkeypatch):
    monkeypatch.setattr(_durable, "_libc_syncfs", lambda: None)
    synced = []
    monkeypatch.setattr(_durable, "fsync_path", lambda path: synced.append(path) or _real_fsync(path))
    store = CheckpointStore(tmp_path / "ckpt")
    entry = store.write_node("a", 1, {"w": np.ones(4)}, save_id="x")
    (chunk,) = [path for path in synced if path.endswith("/w/c.0")]  # in its staging folder, before the rename
    assert chunk.startswith(store.db_name("a", 1) + ".tmp-")
    assert str(tmp_path / "ckpt") in synced
    assert_same(store.read_node("a", 1, entry), {"w": np.ones(4)})


_real_fsync = _durable.fsync_path


# -- commits, listing, deletion, cleanup -----------------------------------------------------------
def test_only_committed_epochs_count(store):
    assert store.committed_epochs() == []
    assert store.latest_commit() is None
    save(store, 0, {"a": {"w": np.zeros(2)}, "b": {"w": np.ones(2)}})
    save(
        store,
        2,
        {"a": {"w": np.full(2, 2.0)}, "b": {"w": np.ones(2)}},
    )
    store.write_node("a", 3, {"w": np.full(2, 3.0)}, save_id="s3")  # never committed
    assert store.committed_epochs() == [0, 2]
    latest = store.latest_commit()
    assert latest["epoch"] == 2
    assert latest["nodes"] == ["a", "b"]
    assert latest["stop_values"] == {"done": False}
    assert latest["format_version"] == RECORD_FORMAT_VERSION
    assert latest["job"] == "job"
    assert_same(store.read_node("a", 2, committed_entry(latest, "a")), {"w": np.full(2, 2.0)})
    with pytest.raises(CheckpointNotFoundError):
        store.read_commit(3)
    assert store.read_node_entry("a", 3)["save_id"] == "s3"
    with pytest.raises(CheckpointNotFoundError):
        store.read_node_entry("a", 9)


def test_another_store_object_sees_new_commits(store):
    other = CheckpointStore(store.url)
    save(store, 1, {"a": {"w": np.ones(1)}})
    assert other.committed_epochs() == [1]
    save(store, 2, {"a": {"w": np.ones(1)}})
    assert other.committed_epochs() == [1, 2]
    assert other.latest_commit()["epoch"] == 2


def test_cleanup_removes_only_uncommitted_groups_and_own_temp_files(store):
    save(store, 1, {"a": {"w": np.ones(2)}})
    for epoch in (2, 3):
        store.write_node("a", epoch, {"w": np.ones(2)}, save_id="x")
    store.write_node("b.x", 7, {"w": np.ones(2)}, save_id="x")
    fs = store.fs
    foreign = {
        "notes.txt": b"mine",
        "foo.partial": b"p",
        "x.tmp-1": b"t",
        "a.7": b"a file, not a group",
        "weird/data.bin": b"w",
        "a.07/zarr.json": b"{}",
        "__x.3/f": b"f",
        "a.3.tmp-1/f": b"f",
        "__daskjobs__/commits/notes.json": b"n",
        "__daskjobs__/commits/epoch-5.json": b"{}",
    }
    for name, data in foreign.items():
        put(store, name, data)
    own_temp = f"__daskjobs__/commits/epoch-000000000004.json.tmp-{uuid.uuid4().hex}"
    put(store, own_temp, b"{")
    assert store.cleanup_uncommitted(["a"]) == [f"{store.url}/a.2", f"{store.url}/a.3", f"{store.url}/{own_temp}"]
    assert store.cleanup_uncommitted() == []  # by default only the committed job's nodes
    assert store.cleanup_uncommitted(["b.x"]) == [f"{store.url}/b.x.7"]
    assert store.cleanup_uncommitted() == []
    for name, data in foreign.items():
        assert fs.cat_file(fs_path(store, name)) == data, name
    assert store.committed_epochs() == [1]
    assert_same(store.read_node("a", 1, entry_of(store, 1)), {"w": np.ones(2)})


def test_delete_epoch_and_uncommit(store):
    for epoch in (1, 10):
        save(store, epoch, {"a": {"w": np.full(2, float(epoch))}, "b": {"w": np.ones(1)}})
    store.delete_epoch(1, ["a", "b"])
    assert store.committed_epochs() == [10]
    assert not store.fs.exists(fs_path(store, "a.1"))
    assert not store.fs.exists(fs_path(store, "b.1"))
    assert_same(store.read_node("a", 10, entry_of(store, 10)), {"w": np.full(2, 10.0)})
    store.uncommit(10)
    store.uncommit(10)  # idempotent
    assert store.committed_epochs() == []
    assert store.read_node_entry("a", 10)["epoch"] == 10  # data stays until deleted or cleaned up
    store.delete_epoch(99, ["a"])  # nothing there: no error


def test_commit_is_atomic_and_leaves_no_temp(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "ckpt")
    save(store, 1, {"a": {"w": np.ones(1)}})
    commits = tmp_path / "ckpt" / "__daskjobs__" / "commits"
    assert sorted(os.listdir(commits)) == ["epoch-000000000001.json"]
    before = (commits / "epoch-000000000001.json").read_bytes()
    entry = store.write_node("a", 1, {"w": np.zeros(1)}, save_id="again")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointWriteError, match=r"epoch 1 under .*No space left"):
        commit(store, 1, {"a": entry})
    assert sorted(os.listdir(commits)) == ["epoch-000000000001.json"]
    assert (commits / "epoch-000000000001.json").read_bytes() == before


def test_no_rename_on_memory_filesystem(monkeypatch):
    store = CheckpointStore(f"memory://dj-{uuid.uuid4().hex}")

    def refuse(*args, **kwargs):
        raise AssertionError("no rename or move on object stores")

    for method in ("mv", "rename", "move", "copy", "cp_file"):
        monkeypatch.setattr(type(store.fs), method, refuse)
    save(store, 1, {"a": {"w": np.ones(3)}})
    store.write_node("a", 2, {"w": np.ones(3)}, save_id="x")
    assert store.cleanup_uncommitted() == [f"{store.url}/a.2"]
    store.delete_epoch(1, ["a"])
    assert store.fs.find(fs_path(store)) == []


# -- corrupt checkpoints -----------------------------------------------------------------------------
def _corrupt_store(store: CheckpointStore) -> dict:
    blobs = {"w": np.arange(24, dtype="f4").reshape(6, 4), "zeros": np.zeros(8, "i4"), "s": np.array(1.5)}
    save(store, 3, {"a": blobs})
    return store.node_entries(3)["a"]


def _flip(data: bytes) -> bytes:
    return data[:5] + bytes([data[5] ^ 0x01]) + data[6:]


CHUNK_FAULTS = {
    "flip": lambda fs, p: fs.pipe_file(p, _flip(fs.cat_file(p))),
    "truncate_by_one": lambda fs, p: fs.pipe_file(p, fs.cat_file(p)[:-1]),
    "truncate_to_zero": lambda fs, p: fs.pipe_file(p, b""),
    "extend": lambda fs, p: fs.pipe_file(p, fs.cat_file(p) + b"\0"),
    "delete": lambda fs, p: fs.rm_file(p),
}


@pytest.mark.parametrize("fault", sorted(CHUNK_FAULTS))
@pytest.mark.parametrize("blob", ["w", "zeros", "s"])
def test_chunk_faults_are_named(store, fault, blob):
    entry = _corrupt_store(store)
    key = "c" if blob == "s" else "c.0.0" if blob == "w" else "c.0"
    CHUNK_FAULTS[fault](store.fs, fs_path(store, "a.3", blob, key))
    assert set(store.read_node("a", 3, entry, [n for n in entry["blobs"] if n != blob])) == set(entry["blobs"]) - {blob}
    pattern = rf"epoch 3, node 'a', blob '{blob}'" + ("" if fault == "flip" else rf", chunk {key}")
    with pytest.raises(CheckpointCorruptError, match=pattern):
        store.read_node("a", 3, entry)


@pytest.mark.parametrize(
    ("field", "value"), [("data_type", "int32"), ("data_type", "float64"), ("shape", [4, 6]), ("shape", [6, 5])]
)
def test_edited_array_metadata_is_detected(store, field, value):
    entry = _corrupt_store(store)
    path = fs_path(store, "a.3", "w", "zarr.json")
    meta = json.loads(store.fs.cat_file(path))
    meta[field] = value
    store.fs.pipe_file(path, json.dumps(meta).encode())
    with pytest.raises(CheckpointCorruptError, match=rf"epoch 3, node 'a', blob 'w': zarr.json differs .*{field} is"):
        store.read_node("a", 3, entry)


def test_missing_metadata_or_group_is_detected(store):
    entry = _corrupt_store(store)
    store.fs.rm_file(fs_path(store, "a.3", "w", "zarr.json"))
    with pytest.raises(CheckpointCorruptError, match=r"blob 'w': array metadata .* is missing"):
        store.read_node("a", 3, entry)
    store.fs.rm(fs_path(store, "a.3"), recursive=True)
    with pytest.raises(CheckpointCorruptError, match=r"the node's manifest .*/a\.3/zarr\.json is missing"):
        store.read_node("a", 3, entry)


def test_group_overwritten_after_commit_is_detected(store):
    entry = _corrupt_store(store)
    store.write_node("a", 3, {"w": np.arange(24, dtype="f4").reshape(6, 4)}, save_id="later")
    with pytest.raises(CheckpointCorruptError, match="holds save later, not the committed save s3"):
        store.read_node("a", 3, entry)


COMMIT_FAULTS = {
    "empty": lambda d: b"",
    "truncated": lambda d: d[: len(d) // 2],
    "garbage": lambda d: b"\x00\xffnot json",
    "not_an_object": lambda d: b"[1, 2]",
    "missing_field": lambda d: json.dumps({k: v for k, v in json.loads(d).items() if k != "manifests"}).encode(),
    "wrong_epoch": lambda d: d.replace(b'"epoch":3', b'"epoch":4'),
    "stop_not_bool": lambda d: d.replace(b'"done":false', b'"done":0'),
    "manifest_digest": lambda d: d.replace(b'"xxh3":"', b'"xxh3":"0'),
    "manifest_size": lambda d: d.replace(b'"manifest":{"size":', b'"manifest":{"size":-'),
}


@pytest.mark.parametrize("fault", sorted(COMMIT_FAULTS))
def test_corrupt_commit_record(store, fault):
    _corrupt_store(store)
    path = fs_path(store, "__daskjobs__", "commits", "epoch-000000000003.json")
    before = store.fs.cat_file(path)
    store.fs.pipe_file(path, COMMIT_FAULTS[fault](before))
    assert store.fs.cat_file(path) != before
    assert store.committed_epochs() == [3]
    with pytest.raises(CheckpointCorruptError, match="commit record of epoch 3"):
        store.read_commit(3)


LOOKALIKE_LAYOUTS = {
    "shape_of_bools": lambda meta: meta.update(shape=[True], chunks=[True]),
    "nbytes_as_a_float": lambda meta: meta.update(nbytes=8.0),
    "null_dimension_names": lambda meta: meta.update(dimension_names=None),
    "other_dimension_names": lambda meta: meta.update(dimension_names=["flag/dim_1"]),
    "nbytes_off_by_one": lambda meta: meta.update(nbytes=9),
}


@pytest.mark.parametrize("change", sorted(LOOKALIKE_LAYOUTS))
def test_an_entry_equal_to_a_valid_one_but_for_one_field_is_refused_after_it(store, change):
    """Blob layouts found good are remembered (a node's blobs keep them from epoch to epoch): an
    entry that differs from a remembered one in one field, or only in a field's type (``True`` for
    ``1``), is still checked and refused."""
    save(store, 1, {"a": {"flag": np.ones(1, dtype="<f8")}})
    entry = store.read_node_entry("a", 1)
    for _ in range(2):
        validate_node_entry(copy.deepcopy(entry), "a", 1)
    damaged = copy.deepcopy(entry)
    LOOKALIKE_LAYOUTS[change](damaged["blobs"]["flag"])
    with pytest.raises(CheckpointCorruptError, match="blob 'flag'"):
        validate_node_entry(damaged, "a", 1)
    validate_node_entry(copy.deepcopy(entry), "a", 1)


ENTRY_FAULTS = {
    "bad_hash": lambda d: d.replace(b'"hashes":["', b'"hashes":["md5:'),
    "negative_shape": lambda d: d.replace(b'"shape":[6,4]', b'"shape":[-6,4]'),
    "nbytes_mismatch": lambda d: d.replace(b'"shape":[6,4]', b'"shape":[6,5]'),
    "truncated": lambda d: d[:-1],
    "extended": lambda d: d + b" ",
    "empty": lambda d: b"",
}


@pytest.mark.parametrize("fault", sorted(ENTRY_FAULTS))
@pytest.mark.parametrize("version", [3, 4])
def test_damaged_entry_in_the_record_or_the_manifest(store, fault, version):
    """Where the record holds the entries (format 3) a damaged one makes the record unreadable; from
    format 4 on the damaged manifest makes that node unreadable on every read, naming the manifest."""
    _corrupt_store(store)
    as_version(store, 3, version)
    path = record_path(store, 3) if version < 4 else manifest_path(store, "a", 3)
    store.fs.pipe_file(path, ENTRY_FAULTS[fault](store.fs.cat_file(path)))
    if version < 4:
        with pytest.raises(CheckpointCorruptError, match="commit record of epoch 3"):
            store.read_commit(3)
        return
    summary = entry_of(store, 3)
    for read in (
        lambda: store.read_node("a", 3, summary),
        lambda: store.node_entries(3),
        lambda: store.reader("a", 3, summary),
    ):
        with pytest.raises(CheckpointCorruptError, match=r"epoch 3, node 'a': the node's manifest .*a\.3/zarr\.json"):
            read()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"format_version": RECORD_FORMAT_VERSION + 1},
            f"format version {RECORD_FORMAT_VERSION + 1} is newer than supported version {RECORD_FORMAT_VERSION}",
        ),
        ({"format_version": 1}, "format version 1 .* is no longer read"),
        ({"format": "orbax"}, "not 'daskjobs-checkpoint'"),
        ({"manifests": {"a": {"save_id": "x"}}, "nodes": ["a"]}, None),
    ],
)
def test_commit_record_format(store, edit, message):
    record = _corrupt_store(store) and store.read_commit(3)
    store.fs.pipe_file(
        fs_path(store, "__daskjobs__", "commits", "epoch-000000000003.json"), json.dumps({**record, **edit}).encode()
    )
    error = CheckpointFormatError if message else CheckpointCorruptError
    with pytest.raises(error, match=message or "lacks"):
        store.read_commit(3)


def test_absurd_sizes_are_refused_before_allocating(store):
    entry = _corrupt_store(store)
    huge = json.loads(json.dumps(entry))
    huge["blobs"]["w"].update(shape=[2**30, 2**12], nbytes=2**44, chunks=[2**14, 2**12])
    with pytest.raises(CheckpointCorruptError, match="more than the limit"):
        store.read_node("a", 3, huge)
    many = json.loads(json.dumps(entry))
    many["blobs"]["w"].update(shape=[2**21], nbytes=2**23, chunks=[1], dtype="<f4")
    with pytest.raises(CheckpointCorruptError, match="more than 1048576 chunks"):
        store.read_node("a", 3, many)


# -- hostile inputs: nothing is ever unpickled ------------------------------------------------------
_FIND_CLASS_EVENTS: list[tuple] = []
sys.addaudithook(lambda event, args: _FIND_CLASS_EVENTS.append(args) if event == "pickle.find_class" else None)


class _Payload:
    """Unpickling this creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def no_unpickling(monkeypatch, tmp_path):
    """Fail on any unpickling during the test; yields pickle bytes that would create a marker file."""
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(_Payload(str(marker)))

    def refuse(*args, **kwargs):
        raise AssertionError("something was unpickled")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    seen = len(_FIND_CLASS_EVENTS)
    yield payload
    assert len(_FIND_CLASS_EVENTS) == seen, "pickle.find_class was called"
    assert not marker.exists()


def _zarr_v2_object_array(fs, folder: str, payload: bytes) -> None:
    fs.rm(folder, recursive=True)
    fs.makedirs(folder, exist_ok=True)
    zarray = {
        "zarr_format": 2,
        "shape": [1],
        "chunks": [1],
        "dtype": "|O",
        "compressor": None,
        "fill_value": None,
        "filters": [{"id": "pickle"}],
        "order": "C",
    }
    fs.pipe_file(f"{folder}/.zarray", json.dumps(zarray).encode())
    fs.pipe_file(f"{folder}/0", payload)


HOSTILE_METADATA = {
    "v2_in_zarr_json": lambda m: {**m, "zarr_format": 2},
    "object_dtype": lambda m: {**m, "data_type": "|O"},
    "string_dtype": lambda m: {**m, "data_type": "string"},
    "struct_dtype": lambda m: {**m, "data_type": {"name": "structured", "configuration": {"fields": []}}},
    "datetime_dtype": lambda m: {**m, "data_type": "numpy.datetime64"},
    "pickle_codec": lambda m: {**m, "codecs": [*m["codecs"], {"name": "numcodecs.pickle"}]},
    "vlen_codec": lambda m: {**m, "codecs": [{"name": "vlen-bytes"}]},
    "unknown_extension": lambda m: {**m, "my_extension": {"must_understand": True}},
    "storage_transformer": lambda m: {**m, "storage_transformers": [{"name": "chunk-manifest-json"}]},
    "bad_codec_config": lambda m: {**m, "codecs": [{"name": "bytes", "configuration": "little"}]},
}


DAMAGED_METADATA = {
    "sharding": lambda m: {**m, "codecs": [{"name": "sharding_indexed", "configuration": {}}]},
    "flipped_key": lambda m: {("shapf" if k == "shape" else k): v for k, v in m.items()},
    "not_an_array": lambda m: {**m, "node_type": "group"},
    "a_list": lambda m: [m],
}
"""Metadata that names nothing unknown but disagrees with the commit record: corruption."""


@pytest.mark.parametrize(
    ("kind", "error"),
    [(k, CheckpointFormatError) for k in sorted(HOSTILE_METADATA)]
    + [(k, CheckpointCorruptError) for k in sorted(DAMAGED_METADATA)],
)
def test_hostile_or_damaged_array_metadata_is_refused_before_decoding(store, no_unpickling, kind, error):
    """Unknown data types, codecs, extensions: CheckpointFormatError; metadata that merely differs from
    the commit record (a known Zarr codec added, a key's byte flipped, another node type): corrupt."""
    entry = _corrupt_store(store)
    path = fs_path(store, "a.3", "w", "zarr.json")
    edit = {**HOSTILE_METADATA, **DAMAGED_METADATA}[kind]
    store.fs.pipe_file(path, json.dumps(edit(json.loads(store.fs.cat_file(path)))).encode())
    store.fs.pipe_file(fs_path(store, "a.3", "w", "c.0.0"), no_unpickling)
    with pytest.raises(error, match=r"blob 'w': .*nothing was decoded") as raised:
        store.read_node("a", 3, entry)
    assert type(raised.value) is error


def test_zarr_v2_pickled_object_array_is_refused(store, no_unpickling):
    entry = _corrupt_store(store)
    _zarr_v2_object_array(store.fs, fs_path(store, "a.3", "w"), no_unpickling)
    with pytest.raises(CheckpointFormatError, match="Zarr v2"):
        store.read_node("a", 3, entry)


def test_pickle_instead_of_metadata_or_record(store, no_unpickling):
    entry = _corrupt_store(store)
    store.fs.pipe_file(fs_path(store, "a.3", "w", "zarr.json"), no_unpickling)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        store.read_node("a", 3, entry)
    store.fs.pipe_file(fs_path(store, "a.3", "zarr.json"), no_unpickling)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        store.read_node_entry("a", 3)
    store.fs.pipe_file(fs_path(store, "__daskjobs__", "commits", "epoch-000000000003.json"), no_unpickling)
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        store.read_commit(3)


def test_npy_object_array_instead_of_a_chunk(store, no_unpickling, tmp_path):
    entry = _corrupt_store(store)
    npy = tmp_path / "obj.npy"
    with open(npy, "wb") as file:  # np.save pickles object arrays itself; only loading is guarded
        file.write(
            b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
            + b" " * 53
            + b"\n"
            + no_unpickling
        )
    store.fs.pipe_file(fs_path(store, "a.3", "w", "c.0.0"), npy.read_bytes())
    with pytest.raises(CheckpointCorruptError, match=r"blob 'w', chunk c\.0\.0"):
        store.read_node("a", 3, entry)


# -- names and paths -----------------------------------------------------------------------------------
BAD_NAMES = ["../x", "/abs", "a/b", "__x", "..", ".", "", "a\\b", "a b", "x" * 129, "a\x00b", "c:/win", "a..b"]


def _tree(root) -> dict[str, bytes]:
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs} | {
        d: b"<dir>" for d, _, _ in os.walk(root)
    }


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_write_nothing(tmp_path, name):
    (tmp_path / "keep.txt").write_text("x")
    store = CheckpointStore(tmp_path / "ckpt")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=r"invalid node name|must be a str"):
        store.write_node(name, 1, {"w": np.ones(1)}, save_id="x")
    with pytest.raises(ValueError, match="invalid blob name"):
        store.write_node("a", 1, {"w": np.ones(1), name: np.ones(1)}, save_id="x")
    with pytest.raises(ValueError, match="invalid node name"):
        store.db_name(name, 1)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    "value",
    [
        np.array([object()]),
        np.zeros(2, "M8[s]"),
        np.zeros(2, [("a", "f4")]),
        np.zeros(2, np.longdouble),
    ],
)
def test_unstorable_dtypes_write_nothing(tmp_path, value):
    store = CheckpointStore(tmp_path / "ckpt")
    if value.dtype == np.longdouble and value.dtype.itemsize == 8:
        pytest.skip("longdouble is float64 here")
    with pytest.raises(BlobTypeError, match="blob 'bad'"):
        store.write_node("a", 1, {"ok": np.ones(1), "bad": value}, save_id="x")
    assert not (tmp_path / "ckpt").exists()


def test_reserved_blob_name_and_bad_epochs(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="reserved for Zarr"):
        store.write_node("a", 1, {"zarr.json": np.ones(1)}, save_id="x")
    for epoch in (-1, 1.5, True, 10**12, "3"):
        with pytest.raises(ValueError, match="epoch"):
            store.write_node("a", epoch, {"w": np.ones(1)}, save_id="x")
    with pytest.raises(ValueError, match="save_id"):
        store.write_node("a", 1, {"w": np.ones(1)}, save_id="../x")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("where", ["blob", "node"])
def test_hostile_names_in_a_commit_record_are_rejected(store, where, version):
    """Written consistently (sealed, the manifest named by its digest), a hostile name is refused by the
    record's validation (format 3, or a node name) or the manifest's (a blob name from format 4 on)."""
    entry = _corrupt_store(store)
    as_version(store, 3, version)
    if where == "blob":
        edit_entry(store, 3, "a", lambda e: e["blobs"].__setitem__("../../x", e["blobs"].pop("w")))
    else:
        record = raw_record(store, 3)
        field = "manifests" if version == 4 else "node_entries"
        record[field]["../x"] = dict(record[field].pop("a"), node="../x")
        record["nodes"] = ["../x"]
        write_record(store, 3, record)
    if where == "node" or version < 4:
        with pytest.raises(CheckpointCorruptError, match=r"invalid \w+ name '\.\./"):
            store.read_commit(3)
    else:
        with pytest.raises(CheckpointCorruptError, match=r"the node's manifest .*invalid blob name '\.\./"):
            store.read_node("a", 3, entry_of(store, 3))
    hostile = dict(entry, blobs={"../../x": entry["blobs"]["w"]})
    with pytest.raises(CheckpointCorruptError, match="invalid blob name"):
        store.read_node("a", 3, hostile)


def test_absurd_sizes_in_a_manifest_are_refused_before_allocating(store):
    """A manifest claiming 16 TiB (named by its record, so the claim passes the digest) is refused by
    its validation before anything is allocated."""
    _corrupt_store(store)
    edit_entry(
        store, 3, "a", lambda e: e["blobs"]["w"].update(shape=[2**30, 2**12], nbytes=2**44, chunks=[2**14, 2**12])
    )
    with pytest.raises(CheckpointCorruptError, match="more than the limit"):
        store.read_node("a", 3, entry_of(store, 3))


def test_prefix_normalisation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CheckpointStore("rel/ckpt").url == str(tmp_path / "rel" / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CheckpointStore("~/ckpt/").url == str(tmp_path / "home" / "ckpt")
    assert CheckpointStore(f"file://{tmp_path}/x").url == str(tmp_path / "x")
    assert CheckpointStore("memory://bucket/ckpt/").url == "memory://bucket/ckpt"
    store = CheckpointStore(tmp_path / "p", {"auto_mkdir": True})
    assert store.db_name("trainer_0", 12) == f"{tmp_path}/p/trainer_0.12"
    assert store.commit_path(5) == f"{tmp_path}/p/__daskjobs__/commits/epoch-000000000005.json"
    with pytest.raises(ValueError, match="unknown compression"):
        CheckpointStore(tmp_path, compression="lz77")


def test_store_pickles_without_its_filesystem(store):
    entry = store.write_node("a", 1, {"w": np.arange(4)}, save_id="x")
    copy = pickle.loads(pickle.dumps(store))
    assert copy._fs is None
    assert copy.url == store.url
    assert repr(copy) == f"CheckpointStore({store.url!r})"
    assert_same(copy.read_node("a", 1, entry), {"w": np.arange(4)})


def test_commit_refuses_an_invalid_record(store):
    entry = store.write_node("a", 1, {"w": np.ones(1)}, save_id="x")
    with pytest.raises(TypeError, match="stop value 'done' must be a bool"):
        make_commit_record("job", 1, {"a": entry}, {"done": 1}, {})
    bad = make_commit_record("job", 1, {"a": entry}, {}, {})
    bad["nodes"] = ["a", "b"]
    with pytest.raises(CheckpointCorruptError, match="nodes must be the sorted names"):
        store.commit(bad)
    with pytest.raises(CheckpointCorruptError, match="record says epoch 1"):
        validate_commit_record(make_commit_record("job", 1, {"a": entry}, {}, {}), 2)
    assert store.committed_epochs() == []


# -- writability and lock ---------------------------------------------------------------------------
def test_check_writable_creates_a_missing_directory(tmp_path):
    store = CheckpointStore(tmp_path / "new" / "deeper")
    store.check_writable()
    assert (tmp_path / "new" / "deeper" / "__daskjobs__").is_dir()
    assert os.listdir(tmp_path / "new" / "deeper" / "__daskjobs__") == []


def test_unwritable_prefix(tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    store = CheckpointStore(tmp_path / "file.txt" / "sub")
    with pytest.raises(CheckpointWriteError, match=rf"{tmp_path}/file.txt/sub is not writable: .*Not a directory"):
        store.check_writable()
    with pytest.raises(CheckpointWriteError, match="node 'a' at epoch 1"):
        store.write_node("a", 1, {"w": np.ones(1)}, save_id="x")
    with pytest.raises(CheckpointWriteError, match="commit record of epoch 1"):
        commit(store, 1, {"a": CheckpointStore(tmp_path / "ok").write_node("a", 1, {"w": np.ones(1)}, save_id="x")})


def test_lock(store):
    first, second = store, CheckpointStore(store.url)
    assert first.read_lock() is None
    first.acquire_lock(HOLDER)
    assert {k: first.read_lock()[k] for k in HOLDER} == HOLDER
    with pytest.raises(CheckpointLockedError, match=r"locked by another writer .*host hostA, pid 4242, job train"):
        second.acquire_lock({"host": "hostB", "pid": 1, "job": "train", "started": "now"})
    second.acquire_lock({"host": "hostB", "pid": 1, "job": "train", "started": "now"}, break_lock=True)
    first.release_lock()  # taken over: left alone
    assert second.read_lock()["host"] == "hostB"
    with pytest.raises(CheckpointLockedError, match="hostB"):
        first.acquire_lock(HOLDER)
    second.release_lock()
    assert second.read_lock() is None
    first.acquire_lock(HOLDER)
    CheckpointStore(store.url).release_lock()  # a store without a lock of its own: explicit unlock
    assert first.read_lock() is None


def test_damaged_lock_file(store):
    put(store, "__daskjobs__/lock.json", b"{trunc")
    assert "not valid JSON" in store.read_lock()["unreadable"]
    with pytest.raises(CheckpointLockedError, match="unreadable"):
        store.acquire_lock(HOLDER)
    store.acquire_lock(HOLDER, break_lock=True)
    assert store.read_lock()["pid"] == 4242
