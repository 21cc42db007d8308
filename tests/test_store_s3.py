"""CheckpointStore on S3, emulated by a moto server on 127.0.0.1 and reached through s3fs (catalogue H)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointLockedError, CheckpointWriteError

boto3 = pytest.importorskip("boto3")
s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "daskjobs-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3() -> Iterator[dict]:
    """A moto S3 server on loopback with one bucket; yields the s3fs storage options."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        try:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            yield {
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
        finally:
            server.stop()


@pytest.fixture
def url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def no_rename(monkeypatch):
    """Fail the test if anything copies, moves or renames objects."""

    def refuse(*args, **kwargs):
        raise AssertionError("no rename, move or copy on object stores")

    for method in ("mv", "rename", "move", "copy", "_copy", "cp_file", "_cp_file", "_copy_basic", "_copy_managed"):
        monkeypatch.setattr(s3fs.S3FileSystem, method, refuse)


def save(store: CheckpointStore, epoch: int, nodes: dict[str, dict[str, np.ndarray]]) -> dict:
    entries = {node: store.write_node(node, epoch, blobs, save_id=f"s{epoch}") for node, blobs in nodes.items()}
    record = make_commit_record("job", epoch, entries, {"done": False}, {})
    store.commit(record)
    return record


def blobs_of(epoch: int) -> dict[str, np.ndarray]:
    return {
        "w": np.arange(300, dtype="f4").reshape(100, 3) + epoch,
        "zeros": np.zeros(40, "i8"),
        "step": np.array(epoch),
        "flag": np.array([True, False]),
    }


def test_full_cycle(s3, url, no_rename, monkeypatch):
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 256)  # several chunks per array, with padding
    store = CheckpointStore(url, s3)
    store.check_writable()
    store.acquire_lock({"host": "h", "pid": 1, "job": "job", "started": "t"})
    for epoch in (1, 10):
        save(store, epoch, {"ps": blobs_of(epoch), "trainer": blobs_of(-epoch)})
    store.write_node("ps", 11, blobs_of(11), save_id="uncommitted")
    assert store.committed_epochs() == [1, 10]
    record = store.read_commit(1)
    for node, sign in (("ps", 1), ("trainer", -1)):
        got = store.read_node(node, 1, record["manifests"][node])
        for name, array in blobs_of(sign).items():
            assert np.array_equal(got[name], array)
            assert got[name].dtype == array.dtype
    fs, root = store.fs, url[len("s3://") :]
    chunk = f"{root}/ps.1/w/c.3.0"
    data = fs.cat_file(chunk)
    fs.pipe_file(chunk, data[:7] + bytes([data[7] ^ 1]) + data[8:])
    with pytest.raises(CheckpointCorruptError, match="epoch 1, node 'ps', blob 'w': checksum mismatch"):
        store.read_node("ps", 1, record["manifests"]["ps"])
    fs.rm_file(f"{root}/ps.1/zeros/c.1")
    with pytest.raises(CheckpointCorruptError, match=r"blob 'zeros', chunk c\.1: the chunk file is missing"):
        store.read_node("ps", 1, record["manifests"]["ps"], ["zeros"])
    store.delete_epoch(1, record["nodes"])
    assert store.committed_epochs() == [10]
    assert store.cleanup_uncommitted() == [f"{url}/ps.11"]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == ["__daskjobs__", "ps.10", "trainer.10"]
    latest = store.latest_commit()
    assert np.array_equal(store.read_node("ps", 10, latest["manifests"]["ps"])["w"], blobs_of(10)["w"])
    store.release_lock()
    assert store.read_lock() is None


def test_lock_is_a_conditional_put(s3, url):
    first = CheckpointStore(url, s3)
    second = CheckpointStore(url, {**s3, "skip_instance_cache": True})
    assert first.fs is not second.fs
    first.acquire_lock({"host": "hostA", "pid": 11, "job": "job", "started": "t"})
    with pytest.raises(CheckpointLockedError, match="host hostA, pid 11"):
        second.acquire_lock({"host": "hostB", "pid": 22, "job": "job", "started": "t"})
    with pytest.raises(FileExistsError):  # the primitive itself: a PUT with If-None-Match: *
        second.fs.pipe_file(f"{url[5:]}/__daskjobs__/lock.json", b"{}", mode="create")
    second.acquire_lock({"host": "hostB", "pid": 22, "job": "job", "started": "t"}, break_lock=True)
    first.release_lock()
    assert first.read_lock()["host"] == "hostB"
    second.release_lock()
    assert first.read_lock() is None


@pytest.mark.slow
def test_another_process_commit_is_seen_at_once(s3, url):
    reader = CheckpointStore(url, {**s3, "skip_instance_cache": True})
    writer = CheckpointStore(url, s3)
    save(writer, 1, {"ps": blobs_of(1)})
    assert reader.committed_epochs() == [1]
    reader.fs.ls(f"{url[5:]}/__daskjobs__/commits")  # a listing now sits in the reader's cache
    save(writer, 2, {"ps": blobs_of(2)})
    assert reader.committed_epochs() == [1, 2]
    script = (
        "import json, sys, numpy as np\n"
        "from daskjobs.checkpoint import CheckpointStore\n"
        "from daskjobs.checkpoint._format.records import make_commit_record\n"
        "store = CheckpointStore(sys.argv[1], json.loads(sys.argv[2]))\n"
        "entry = store.write_node('ps', 3, {'w': np.ones(3)}, save_id='other')\n"
        "store.commit(make_commit_record('job', 3, {'ps': entry}, {}, {}))\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, url, json.dumps(s3)], check=True, timeout=60, env={**os.environ, **CREDENTIALS}
    )
    assert reader.committed_epochs() == [1, 2, 3]
    latest = reader.latest_commit()
    assert latest["epoch"] == 3
    assert np.array_equal(reader.read_node("ps", 3, latest["manifests"]["ps"])["w"], np.ones(3))


def test_missing_bucket_is_not_writable(s3):
    store = CheckpointStore(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt", s3)
    with pytest.raises(CheckpointWriteError, match=r"s3://no-such-bucket-\w+/ckpt is not writable"):
        store.check_writable()


def test_compressed_through_zarr(s3, url, no_rename):
    store = CheckpointStore(url, s3, compression="zstd")
    record = save(store, 4, {"ps": blobs_of(4)})
    got = store.read_node("ps", 4, record["manifests"]["ps"])
    for name, array in blobs_of(4).items():
        assert np.array_equal(got[name], array)


def test_hostile_metadata_on_s3(s3, url):
    store = CheckpointStore(url, s3)
    record = save(store, 1, {"ps": blobs_of(1)})
    path = f"{url[5:]}/ps.1/w/zarr.json"
    meta = json.loads(store.fs.cat_file(path))
    store.fs.pipe_file(path, json.dumps({**meta, "data_type": "|O"}).encode())
    with pytest.raises(CheckpointFormatError, match=re.escape("data type '|O'")):
        store.read_node("ps", 1, record["manifests"]["ps"])
