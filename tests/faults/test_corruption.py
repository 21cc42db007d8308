"""On-disk corruption x every read path: the exact error, never wrong data, nothing committed changed.

Corruption kinds damage epoch 2 of a real checkpoint (written by a real job on a LocalSession):
chunk bytes (flipped, truncated, extended, deleted, another epoch's), array metadata (byte
order, shape, chunks, codecs, fill value, data type), the node's manifest (the group's entry) and
the commit record (garbage, empty, truncated). Each is read through the eager view, the lazy
``dask.array`` view, ``verify``, a partial load and a resume, and must raise the exact error while
every committed byte stays as it was. The catalogue runs on a commit record of format 4 (naming
the manifest) and of format 3 (holding the node's entry itself, as an older daskjobs wrote it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable

import fsspec
import numpy as np
import pytest
from records import as_version, edit_entry

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.entries import max_stored_size
from daskjobs.checkpoint._format.manifests import reference
from daskjobs.checkpoint._format.records import seal
from daskjobs.checkpoint._storage import reader as _reader
from daskjobs.errors import CheckpointCorruptError, CheckpointFormatError

NODE = "local"
ROWS = 64


def build_job() -> dj.Job:
    """A job whose init creates a multi-chunk array ``w`` and another blob; each epoch changes ``w``."""
    with dj.Cluster(), dj.Job(name="faults") as job, dj.Node(NODE):
        with job.init_group:
            dj.Task(
                lambda ws: ws.update(w=np.arange(ROWS * 4, dtype="f4").reshape(ROWS, 4), bias=np.zeros(3)),
                name="init",
            )

        def step(ws):
            ws["w"] = ws["w"] + 1

        dj.Task(step, name="train")
        dj.epoch_limiter(job, 10)
    return job


@pytest.fixture
def committed(tmp_path, monkeypatch, request):
    """A prefix with epochs 0..2 committed, ``w`` split into several chunks; the record of epoch 2 is
    of format ``request.param`` (default 4, the one written now; 3: as an older daskjobs wrote it)."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 256)
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    assert runner.train(dj.LocalSession()) == 2
    as_version(CheckpointStore(prefix), 2, getattr(request, "param", 4))
    return prefix


def version_of(prefix: str) -> int:
    """The format version of epoch 2's commit record."""
    with open(commit_record(prefix), "rb") as file:
        return json.loads(file.read())["format_version"]


def group(prefix: str, epoch: int = 2) -> str:
    return os.path.join(prefix, f"{NODE}.{epoch}")


def chunk(prefix: str, epoch: int = 2, key: str = "c.1.0") -> str:
    return os.path.join(group(prefix, epoch), "w", key)


def edit_bytes(path: str, change: Callable[[bytes], bytes]) -> None:
    with open(path, "rb") as file:
        data = file.read()
    os.unlink(path)  # never write through a hard link shared with another epoch
    with open(path, "wb") as file:
        file.write(change(data))


def edit_meta(field: str, value: object) -> Callable[[str], None]:
    def apply(prefix: str) -> None:
        def change(data: bytes) -> bytes:
            meta = json.loads(data)
            meta[field] = value(meta) if callable(value) else value
            return json.dumps(meta).encode()

        edit_bytes(os.path.join(group(prefix), "w", "zarr.json"), change)

    return apply


def flip(data: bytes) -> bytes:
    return bytes([data[0] ^ 0x01]) + data[1:]


def foreign(prefix: str) -> None:
    os.unlink(chunk(prefix))
    with open(chunk(prefix, 1), "rb") as source, open(chunk(prefix), "wb") as target:
        target.write(source.read())


def commit_record(prefix: str) -> str:
    return os.path.join(prefix, "__daskjobs__", "commits", "epoch-000000000002.json")


def edit_record(change: Callable[[dict], None], *, reseal: bool = False) -> Callable[[str], None]:
    """Edit the commit record of epoch 2 as JSON (``change`` gets the record). ``reseal``: seal it
    again as daskjobs does, to reach the defences behind the seal (a writer's bug, not an editor)."""

    def apply(prefix: str) -> None:
        def rewrite(data: bytes) -> bytes:
            record = json.loads(data)
            change(record)
            return seal(record) if reseal else json.dumps(record).encode()

        edit_bytes(commit_record(prefix), rewrite)

    return apply


def claim_a_tebibyte(prefix: str) -> None:
    """Make the record and ``w``'s ``zarr.json`` agree that ``w`` holds 1 TiB (the largest blob a record may
    claim) in 4 chunks of 256 GiB; the chunk files stay as they were (256 bytes each)."""
    shape, chunks = [1 << 36, 4], [1 << 34, 4]

    def change(entry: dict) -> None:
        blob = entry["blobs"]["w"]
        grown = 4 * shape[0] * shape[1] - blob["nbytes"]
        blob.update(shape=shape, chunks=chunks, nbytes=blob["nbytes"] + grown, hashes=blob["hashes"][:4])
        entry.update(bytes=entry["bytes"] + grown, bytes_written=entry["bytes_written"] + grown)

    edit_entry(CheckpointStore(prefix), 2, NODE, change)
    metadata = _chunks.raw_metadata("<f4", tuple(shape), tuple(chunks), "array")
    edit_bytes(os.path.join(group(prefix), "w", "zarr.json"), lambda d: metadata)


def drop_node(record: dict) -> None:
    """Remove the node from the record, names and entries (or manifests) alike (a consistent edit)."""
    record["nodes"].remove(NODE)
    record.get("manifests", record.get("node_entries")).pop(NODE)


def reformat(data: bytes) -> bytes:
    """The same record, pretty-printed (equal as JSON, not as bytes)."""
    return json.dumps(json.loads(data), indent=2).encode()


def flip_seal(data: bytes) -> bytes:
    """Change one hex digit of the record's seal."""
    at = data.index(b'"sealed":"') + len(b'"sealed":"')
    return data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :]


def drop_blob(record: dict) -> None:
    """Remove ``w`` from the record's entry, keeping its byte totals consistent (as a careful editor would);
    a record of format 4 holds no blobs (see the manifest kinds)."""
    entry = record["node_entries"][NODE]
    del entry["blobs"]["w"]
    total = sum(blob["nbytes"] for blob in entry["blobs"].values())
    entry.update(bytes=total, bytes_reused=min(entry["bytes_reused"], total))
    entry["bytes_written"] = total - entry["bytes_reused"]


def edit_group_entry(change: Callable[[dict], None]) -> Callable[[str], None]:
    """Edit the node's own entry in the group's ``zarr.json`` of epoch 2 (``change`` gets the entry)."""

    def apply(prefix: str) -> None:
        def rewrite(data: bytes) -> bytes:
            group_metadata = json.loads(data)
            change(group_metadata["attributes"]["daskjobs"])
            return json.dumps(group_metadata).encode()

        edit_bytes(os.path.join(group(prefix), "zarr.json"), rewrite)

    return apply


def drop_blob_of_entry(entry: dict) -> None:
    """Remove ``w`` from the node's own entry in its group, keeping its byte totals consistent."""
    drop_blob({"node_entries": {NODE: entry}})


def manifest_of_epoch_1(prefix: str) -> None:
    """Epoch 1's group metadata (a valid manifest, of another epoch) in place of epoch 2's."""
    with open(os.path.join(group(prefix, 1), "zarr.json"), "rb") as file:
        data = file.read()
    edit_bytes(os.path.join(group(prefix), "zarr.json"), lambda d: data)


def on_manifest(change: Callable[[bytes], bytes]) -> Callable[[str], None]:
    """Change the bytes of epoch 2's manifest (its group's ``zarr.json``)."""
    return lambda prefix: edit_bytes(os.path.join(group(prefix), "zarr.json"), change)


ONLY = {"blob_dropped_from_commit": 3, "manifest_reformatted": 4}
"""Kinds that exist in one record version only: a record of format 4 lists no blobs, and a record of
format 3 holds the entries itself (the group's own copy is compared with it as JSON, not as bytes)."""

CORRUPTIONS: dict[str, tuple[Callable[[str], None], type[Exception]]] = {
    "flipped_byte": (lambda p: edit_bytes(chunk(p), flip), CheckpointCorruptError),
    "truncated_chunk": (lambda p: edit_bytes(chunk(p), lambda d: d[:-1]), CheckpointCorruptError),
    "extra_long_chunk": (lambda p: edit_bytes(chunk(p), lambda d: d + b"\0"), CheckpointCorruptError),
    "deleted_chunk": (lambda p: os.unlink(chunk(p)), CheckpointCorruptError),
    "foreign_chunk": (foreign, CheckpointCorruptError),
    "byte_swapped": (
        edit_meta("codecs", [{"name": "bytes", "configuration": {"endian": "big"}}]),
        CheckpointCorruptError,
    ),
    "other_dtype": (edit_meta("data_type", "int32"), CheckpointCorruptError),
    "edited_shape": (edit_meta("shape", [ROWS - 1, 4]), CheckpointCorruptError),
    "edited_chunks": (
        edit_meta("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [8, 4]}}),
        CheckpointCorruptError,
    ),
    "added_codec": (
        edit_meta("codecs", lambda m: [*m["codecs"], {"name": "gzip", "configuration": {"level": 1}}]),
        CheckpointCorruptError,
    ),
    "added_crc32c_codec": (
        edit_meta("codecs", lambda m: [*m["codecs"], {"name": "crc32c"}]),
        CheckpointCorruptError,
    ),
    "added_transpose_codec": (
        edit_meta("codecs", lambda m: [{"name": "transpose", "configuration": {"order": [1, 0]}}, *m["codecs"]]),
        CheckpointCorruptError,
    ),
    "unknown_codec": (
        edit_meta("codecs", lambda m: [*m["codecs"], {"name": "numcodecs.pickle"}]),
        CheckpointFormatError,
    ),
    "unknown_dtype": (edit_meta("data_type", "|O"), CheckpointFormatError),
    "edited_fill_value": (edit_meta("fill_value", 7.0), CheckpointCorruptError),
    "edited_key_encoding": (
        edit_meta("chunk_key_encoding", {"name": "default", "configuration": {"separator": "/"}}),
        CheckpointCorruptError,
    ),
    "garbage_record": (lambda p: edit_bytes(commit_record(p), lambda d: b"\x00\xffgarbage"), CheckpointCorruptError),
    "empty_record": (lambda p: edit_bytes(commit_record(p), lambda d: b""), CheckpointCorruptError),
    "truncated_record": (lambda p: edit_bytes(commit_record(p), lambda d: d[: len(d) // 2]), CheckpointCorruptError),
    "claimed_tebibyte": (claim_a_tebibyte, CheckpointCorruptError),
    "blob_dropped_from_commit": (edit_record(drop_blob, reseal=True), CheckpointCorruptError),
    "blob_dropped_from_manifest": (edit_group_entry(drop_blob_of_entry), CheckpointCorruptError),
    "manifest_of_another_epoch": (manifest_of_epoch_1, CheckpointCorruptError),
    "manifest_truncated": (
        lambda p: edit_bytes(os.path.join(group(p), "zarr.json"), lambda d: d[:-1]),
        CheckpointCorruptError,
    ),
    "manifest_reformatted": (
        lambda p: edit_bytes(os.path.join(group(p), "zarr.json"), reformat),
        CheckpointCorruptError,
    ),
    "node_dropped_from_record": (edit_record(drop_node), CheckpointCorruptError),
    "timing_edited_in_record": (edit_record(lambda r: r["timings"].update(save_seconds=1.5)), CheckpointCorruptError),
    "creation_time_edited_in_record": (
        edit_record(lambda r: r.update(created="2020-01-01T00:00:00+00:00")),
        CheckpointCorruptError,
    ),
    "reformatted_record": (lambda p: edit_bytes(commit_record(p), reformat), CheckpointCorruptError),
    "seal_of_record_flipped": (lambda p: edit_bytes(commit_record(p), flip_seal), CheckpointCorruptError),
    "group_entry_hash_edited": (
        edit_group_entry(lambda entry: entry["blobs"]["w"]["hashes"].__setitem__(0, "0" * 32)),
        CheckpointCorruptError,
    ),
    "group_entry_dtype_edited": (
        edit_group_entry(lambda entry: entry["blobs"]["w"].update(dtype="<i4")),
        CheckpointCorruptError,
    ),
}


def read_eager(prefix: str) -> object:
    return dj.open_checkpoint(prefix, 2)[NODE]["w"]


def read_lazy(prefix: str) -> object:
    return dj.open_checkpoint(prefix, 2)[NODE].lazy("w").compute(scheduler="sync")


def read_verify(prefix: str) -> object:
    return dj.open_checkpoint(prefix, 2).verify()


def read_partial(prefix: str) -> object:
    manager = dj.MultiNodeCheckpointManager(prefix)
    with dj.LocalSession() as session:
        return manager.load_blobs_locally([NODE], ["w"], 2, session)


def read_resume(prefix: str) -> object:
    manager = dj.MultiNodeCheckpointManager(prefix)
    with dj.LocalSession() as session:
        return dj.JobRunner(build_job(), manager, max_epochs=4, progress=False).train(session)


READ_PATHS = {
    "eager": read_eager,
    "lazy": read_lazy,
    "verify": read_verify,
    "partial_load": read_partial,
    "resume": read_resume,
}


def cases() -> list[object]:
    out = []
    for version in (4, 3):
        for kind in sorted(CORRUPTIONS):
            if ONLY.get(kind, version) != version:
                continue
            for path in sorted(READ_PATHS):
                out.append(pytest.param(version, kind, path, id=f"v{version}-{kind}-{path}"))
    return out


def snapshot(prefix: str) -> dict[str, bytes]:
    """Every file under the prefix (except the lock), by relative path."""
    files = {}
    for root, _dirs, names in os.walk(prefix):
        for name in names:
            path = os.path.join(root, name)
            if name != "lock.json" and not os.path.islink(path) and os.path.isfile(path):
                with open(path, "rb") as file:
                    files[os.path.relpath(path, prefix)] = file.read()
    return files


@pytest.mark.parametrize(("committed", "kind", "path"), cases(), indirect=["committed"])
def test_corruption_is_refused_on_every_read_path(committed, kind, path):
    corrupt, error = CORRUPTIONS[kind]
    version = version_of(committed)
    corrupt(committed)
    before, listed = snapshot(committed), dj.list_checkpoints(committed)
    with pytest.raises(error, match=r"epoch 2") as caught:
        READ_PATHS[path](committed)
    message = str(caught.value)
    if "record" in kind:
        assert "epoch-000000000002.json" in message
    elif "manifest" in kind or "group_entry" in kind:  # the group's own entry: from format 4 on, its manifest
        assert (
            f"node '{NODE}'" + (f": the node's manifest {group(committed)}/zarr.json" if version == 4 else "")
            in message
        )
    else:
        assert f"node '{NODE}', blob 'w'" in message
    assert snapshot(committed) == before
    assert dj.list_checkpoints(committed) == listed


def test_intact_checkpoint_reads_on_every_path(committed):
    expected = np.arange(ROWS * 4, dtype="f4").reshape(ROWS, 4) + 2
    assert np.array_equal(read_eager(committed), expected)
    assert np.array_equal(read_lazy(committed), expected)
    assert read_verify(committed) > 0
    assert read_partial(committed) is True
    assert read_resume(committed) == 4


def test_bad_record_is_listed_by_scan_and_skipped_by_list(committed, caplog):
    edit_bytes(commit_record(committed), lambda d: b"")
    scanned = CheckpointStore(committed).scan_commits()
    assert [e for e, _ in scanned] == [0, 1, 2]
    assert isinstance(scanned[2][1], CheckpointCorruptError)
    assert "epoch-000000000002.json" in str(scanned[2][1])
    assert [info.epoch for info in dj.list_checkpoints(committed)] == [0, 1]
    assert "skipping epoch 2" in caplog.text
    with pytest.raises(CheckpointCorruptError, match="resume_from_epoch=1"):
        read_resume(committed)


# -- compressed chunks whose stored sizes the record overstates ----------------------------------


@pytest.fixture(params=["zstd", "gzip", "blosc"])
def compressed(request, tmp_path, monkeypatch):
    """Like ``committed``, compressed with each codec."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 256)
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, compression=request.param)
    assert dj.JobRunner(build_job(), manager, max_epochs=2, progress=False).train(dj.LocalSession()) == 2
    return prefix


@pytest.mark.parametrize("version", [4, 3])
@pytest.mark.parametrize("claimed", [1 << 40, 50 << 30, 1 << 20])
@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_stored_size_beyond_the_codec_bound_is_refused_before_allocating(compressed, claimed, path, version):
    """A record (format 3) or a manifest the record names (format 4) claiming a compressed chunk far
    bigger than its raw bytes could ever become raises CheckpointCorruptError naming the record or the
    manifest, node, blob and the claim, not MemoryError."""

    def overstate(entry: dict) -> None:
        entry["blobs"]["w"]["sizes"][1] = claimed

    as_version(CheckpointStore(compressed), 2, version)
    if version == 3:
        edit_record(lambda record: overstate(record["node_entries"][NODE]))(compressed)
    else:
        edit_entry(CheckpointStore(compressed), 2, NODE, overstate)
    before = snapshot(compressed)
    with pytest.raises(CheckpointCorruptError, match=r"epoch 2") as caught:
        READ_PATHS[path](compressed)
    message = str(caught.value)
    if version == 3:
        assert "epoch-000000000002.json" in message
        assert f"node '{NODE}', blob 'w': sizes holds {claimed}" in message
    else:
        assert f"node '{NODE}': the node's manifest {group(compressed)}/zarr.json, blob 'w': sizes holds {claimed}" in (
            message
        )
    assert snapshot(compressed) == before


@pytest.mark.parametrize("version", [4, 3])
@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_stored_size_larger_than_the_file_is_refused(compressed, path, monkeypatch, version):
    """A claimed size within the codec's bound but not the file's (in the record and the group's entry alike;
    from format 4 on, in the manifest the record names) is refused naming the chunk, when it is checked
    before allocating (every blob beyond the trusted budget)."""
    monkeypatch.setattr(_reader, "_TRUSTED_BYTES", 0)

    def overstate(entry: dict) -> None:
        entry["blobs"]["w"]["sizes"][1] += 1

    as_version(CheckpointStore(compressed), 2, version)
    if version == 3:
        edit_record(lambda record: overstate(record["node_entries"][NODE]), reseal=True)(compressed)
        edit_group_entry(overstate)(compressed)  # both agree: only the file's size tells
    else:
        edit_entry(CheckpointStore(compressed), 2, NODE, overstate)  # manifest and record agree
    before = snapshot(compressed)
    with pytest.raises(
        CheckpointCorruptError, match=r"epoch 2, node 'local', blob 'w', chunk c\.1\.0: the chunk file has"
    ):
        READ_PATHS[path](compressed)
    assert snapshot(compressed) == before


@pytest.mark.parametrize("codec", ["zstd", "gzip", "blosc"])
@pytest.mark.parametrize("nbytes", [0, 1, 8, 255, 4096, 131071, 131072, 1 << 20])
def test_codec_bound_holds_for_incompressible_chunks(codec, nbytes):
    """Random bytes compressed by each codec never exceed max_stored_size: a true chunk is never refused."""
    data = np.random.default_rng(nbytes).integers(0, 256, max(nbytes, 1), dtype=np.uint8)[:nbytes]
    store = CheckpointStore(tempfile.mkdtemp(), compression=codec, fsync=False)
    entry = store.describe_node(NODE, 0, {"x": data, "y": np.float64(nbytes)}, save_id="s")
    for meta in entry["blobs"].values():
        raw = np.dtype(meta["dtype"]).itemsize * math.prod(meta["chunks"])
        assert all(size <= max_stored_size(codec, raw) for size in meta["sizes"])


# -- lazy views of arrays without chunks -----------------------------------------------------------


@pytest.fixture
def with_empty(tmp_path):
    """Epochs 0..2 of a job whose node also holds ``empty``, an array of shape (0, 3): no chunk files."""
    with dj.Cluster(), dj.Job(name="empty") as job, dj.Node(NODE):
        with job.init_group:
            dj.Task(lambda ws: ws.update(empty=np.zeros((0, 3), "f4"), x=np.arange(10.0)), name="init")
        dj.Task(lambda ws: ws.update(x=ws["x"] + 1), name="train")
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    assert runner.train(dj.LocalSession()) == 2
    return prefix


EMPTY_DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    "dtype_edited": (
        lambda p: edit_bytes(
            os.path.join(group(p), "empty", "zarr.json"),
            lambda d: json.dumps({**json.loads(d), "data_type": "int32"}).encode(),
        ),
        r"epoch 2, node 'local', blob 'empty': zarr.json differs from the commit record \(data_type",
    ),
    "metadata_deleted": (
        lambda p: os.unlink(os.path.join(group(p), "empty", "zarr.json")),
        r"epoch 2, node 'local', blob 'empty': array metadata .* is missing",
    ),
    "group_deleted": (lambda p: shutil.rmtree(group(p)), r"epoch 2, node 'local': the node's manifest .* is missing"),
}


@pytest.mark.parametrize("damage", sorted(EMPTY_DAMAGE))
def test_lazy_view_of_an_empty_array_is_verified_like_an_eager_read(with_empty, damage):
    """Computing the lazy view of a (0, 3) array checks its group and metadata: CheckpointCorruptError as the
    eager read raises, never an unverified empty array; nothing committed changes."""
    corrupt, message = EMPTY_DAMAGE[damage]
    corrupt(with_empty)
    before = snapshot(with_empty)
    if damage == "group_deleted":  # the node's view reads its manifest first
        with pytest.raises(CheckpointCorruptError, match=message):
            dj.open_checkpoint(with_empty, 2)[NODE]
        return
    view = dj.open_checkpoint(with_empty, 2)[NODE]
    with pytest.raises(CheckpointCorruptError, match=message):
        view["empty"]
    lazy = view.lazy("empty")
    assert lazy.shape == (0, 3)
    with pytest.raises(CheckpointCorruptError, match=message):
        lazy.compute(scheduler="sync")
    assert snapshot(with_empty) == before


def test_lazy_view_of_an_intact_empty_array(with_empty):
    """An intact (0, 3) array computes to an empty float32 array of that shape."""
    got = dj.open_checkpoint(with_empty, 2)[NODE].lazy("empty").compute(scheduler="sync")
    assert got.shape == (0, 3)
    assert got.dtype == np.float32


@pytest.mark.parametrize("where", ["local", "memory"])
def test_overstated_stored_size_is_refused_before_allocating_on_every_backend(tmp_path, monkeypatch, where):
    """With the entry and the group agreeing on a size the last chunk's file does not have, the size check before
    allocating (one lstat locally, one listing on object stores) raises CheckpointCorruptError naming that
    chunk, before the damaged first chunk is even read."""
    monkeypatch.setattr(_reader, "_TRUSTED_BYTES", 0)
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 4096)
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://dj-{uuid.uuid4().hex}"
    store = CheckpointStore(url, compression="zstd", fsync=False)
    entry = store.write_node(NODE, 0, {"w": np.random.default_rng(0).random(4096)}, save_id="s")
    entry["blobs"]["w"]["sizes"][-1] += 1
    first = store.fs._strip_protocol(f"{store.db_name(NODE, 0)}/w/c.0")
    store.fs.pipe_file(first, flip(store.fs.cat_file(first)))
    group_metadata = store.fs._strip_protocol(f"{store.db_name(NODE, 0)}/zarr.json")
    document = json.loads(store.fs.cat_file(group_metadata))
    document["attributes"]["daskjobs"] = {key: value for key, value in entry.items() if key != "manifest"}
    data = json.dumps(document).encode()
    store.fs.pipe_file(group_metadata, data)
    entry["manifest"] = reference(data)
    message = rf"epoch 0, node '{NODE}', blob 'w', chunk c\.7: the chunk file has"
    with pytest.raises(CheckpointCorruptError, match=message):
        store.read_node(NODE, 0, entry)
    if where == "memory":
        fsspec.filesystem("memory").rm(url, recursive=True)
