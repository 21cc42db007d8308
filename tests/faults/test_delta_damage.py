"""Fault catalogue, delta checkpoints: a chunk file of the previous epoch damaged on disk between
two saves is not reused — the damage does not spread to the new epoch.

Classes (SPEC §1.7 "every epoch a complete Zarr group, verifiable and restorable alone"):

* D1 kind of damage, for each session kind: the chunk file modified in place (the same inode: every epoch
  sharing it is damaged) or replaced by a file with other bytes (a new inode: only that epoch).
  The new epoch writes the chunk anew and reads back exactly; the damaged epoch stays corrupt on
  read (``CheckpointCorruptError`` naming it), never silently repaired or deleted.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointCorruptError

FROZEN = np.arange(4096, dtype="f8")
"""A blob that never changes: delta reuses its chunk from one epoch to the next."""


def chunk_of(group: Path, blob: str) -> Path:
    """The one chunk file of a single-chunk blob."""
    (chunk,) = [p for p in (group / blob).rglob("*") if p.is_file() and p.name != "zarr.json"]
    return chunk


def in_place(chunk: Path) -> None:
    with open(chunk, "r+b") as file:
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 0xFF]))


def replaced(chunk: Path) -> None:
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    temp = chunk.with_name("replacement")
    temp.write_bytes(bytes(data))
    os.replace(temp, chunk)


DAMAGE = {"in_place": in_place, "replaced": replaced}


def define(prefix: str, kind: str) -> dj.Job:
    """Node ``a`` holds ``frozen`` and ``w`` (grows by one per epoch); in epoch 3, once epoch 2's
    group is complete, a step damages epoch 2's chunk of ``frozen``."""
    group = Path(prefix) / "a.2"

    def in_place_with_entry() -> bool:
        """Whether epoch 2's group is in place with its entry (it is flushed in the background and
        renamed into place from its staging folder)."""
        try:
            return b'"bytes_written"' in (group / "zarr.json").read_bytes()
        except FileNotFoundError:
            return False

    def damage(ws):
        if ws.epoch != 3:
            return
        deadline = time.monotonic() + 30
        while not in_place_with_entry():
            assert time.monotonic() < deadline, "epoch 2's group never got its entry"
            time.sleep(0.005)
        time.sleep(0.02)  # a later clock tick than the entry's
        DAMAGE[kind](chunk_of(group, "frozen"))

    with dj.Cluster(), dj.Job(name="delta-damage") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(frozen=FROZEN.copy(), w=np.zeros(8)), name="init")
        dj.Task(damage, name="damage")
        dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1), name="train")
    return job


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_chunk_damaged_after_its_save_is_written_anew_not_reused(session, prefix, kind, caplog):
    runner = dj.JobRunner(define(prefix, kind), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False)
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        assert runner.train(session) == 3
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2, 3]
    newest = dj.open_checkpoint(prefix, 3)["a"]
    np.testing.assert_array_equal(newest["frozen"], FROZEN)
    np.testing.assert_array_equal(newest["w"], np.full(8, 3.0))
    assert runner.history[-1].bytes_written >= FROZEN.nbytes  # written, not linked
    assert runner.history[-2].bytes_reused >= FROZEN.nbytes  # epoch 2 had reused it from epoch 1
    with pytest.raises(CheckpointCorruptError, match=r"epoch 2, node 'a', blob 'frozen'"):
        dj.open_checkpoint(prefix, 2)["a"]["frozen"]
    sound = dj.open_checkpoint(prefix, 1)["a"]
    if kind == "in_place":  # the same inode as epoch 2's: damaged too
        with pytest.raises(CheckpointCorruptError, match=r"epoch 1, node 'a', blob 'frozen'"):
            sound["frozen"]
    else:
        np.testing.assert_array_equal(sound["frozen"], FROZEN)
    if isinstance(session, dj.LocalSession):  # a DaskSession's worker logs it in its own process
        assert "was modified after its epoch was saved" in caplog.text
