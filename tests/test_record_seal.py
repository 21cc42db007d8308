"""A commit record is sealed (XXH3-128 of its bytes, as its first field): any change to the file
after it was written is refused, never read as the truth.

Exhaustively: flipping any bit of any byte of a record file makes ``read_commit`` raise
``CheckpointCorruptError`` or ``CheckpointFormatError`` — never return a record, let alone a
different one. Records of format version 2 (written before seals existed) still read.
The record names each node's manifest by its digest, inside the seal: a record cannot be made to
name another manifest without breaking its seal.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from records import as_version, raw_record

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.errors import CheckpointCorruptError, CheckpointFormatError


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> tuple[CheckpointStore, bytes, dict]:
    """A store with epoch 1 committed (two blobs, metrics, stop values); its record's bytes and record."""
    store = CheckpointStore(tmp_path_factory.mktemp("seal") / "ckpt")
    entry = store.write_node("n", 1, {"w": np.arange(6.0), "meta": {"step": 3}}, save_id="s1")
    timings = {"save_seconds": 0.25}
    record = make_commit_record("sealed", 1, {"n": entry}, {"done": False}, timings, metrics={"loss": 0.5})
    store.commit(record)
    with open(_path(store), "rb") as file:
        return store, file.read(), store.read_commit(1)


def _path(store: CheckpointStore) -> str:
    return os.path.join(store.url, "__daskjobs__", "commits", "epoch-000000000001.json")


def _write(store: CheckpointStore, data: bytes) -> None:
    with open(_path(store), "wb") as file:
        file.write(data)


def test_a_sealed_record_reads_back_without_its_seal(sealed):
    _store, data, record = sealed
    assert data.startswith(b'{"sealed":"')
    assert "sealed" not in record
    assert record["metrics"] == {"loss": 0.5}
    assert record["stop_values"] == {"done": False}


@pytest.mark.slow
def test_every_flipped_bit_is_refused(sealed):
    """Each of the record's bits flipped in turn (some thousands of reads): never a record back."""
    store, data, _record = sealed
    believed = []
    try:
        for at in range(len(data)):
            for bit in range(8):
                damaged = bytearray(data)
                damaged[at] ^= 1 << bit
                _write(store, bytes(damaged))
                try:
                    store.read_commit(1)
                except (CheckpointCorruptError, CheckpointFormatError):
                    continue
                believed.append((at, bit))
    finally:
        _write(store, data)
    assert believed == []


@pytest.mark.parametrize(("version", "reads"), [(2, True), (3, False), (4, False)])
def test_an_unsealed_record_reads_only_as_format_version_2(sealed, version, reads):
    """A record of format version 2 (written before seals existed, no ``sealed`` field) is validated
    and read as before; a record of version 3 or 4 without its seal is corrupt."""
    store, data, _record = sealed
    try:
        as_version(store, 1, version)
        plain = raw_record(store, 1)
        _write(store, json.dumps(plain).encode())
        if reads:
            assert store.read_commit(1) == plain
            assert store.read_commit(1)["node_entries"]["n"] == {
                k: v for k, v in store.node_entries(1)["n"].items() if k != "manifest"
            }
        else:
            with pytest.raises(CheckpointCorruptError, match="lacks its seal"):
                store.read_commit(1)
    finally:
        _write(store, data)
