"""The ready upload (``dj.CopyCheckpointUploader``) is a read path like any other (SPEC §3): it copies
exactly the files the commit record lists, each read bounded and verified, never follows a link out of
the prefix, never blocks on a FIFO, and a damaged or uncommitted final epoch fails the upload with the
checkpoint error itself, leaving no commit record at the destination and nothing committed changed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointNotFoundError


def define() -> dj.Job:
    with dj.Cluster(), dj.Job(name="upload") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(w=np.arange(1000.0), meta={"k": 1}))
        dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1))
    return job


def train(prefix: str, destination: str, **runner_options) -> int:
    manager = dj.MultiNodeCheckpointManager(prefix)
    upload = dj.CopyCheckpointUploader(destination)
    runner = dj.JobRunner(
        define(), manager, upload_task_group_builder=upload, max_epochs=2, progress=False, **runner_options
    )
    return runner.train(None)


def snapshot(prefix: str) -> dict[str, bytes]:
    files = {}
    for root, _dirs, names in os.walk(prefix):
        for name in names:
            path = os.path.join(root, name)
            if name != "lock.json" and os.path.isfile(path) and not os.path.islink(path):
                files[os.path.relpath(path, prefix)] = Path(path).read_bytes()
    return files


def chunk(prefix: str) -> Path:
    return Path(prefix, "a.2", "w", "c.0")


def flip(prefix: str) -> None:
    data = bytearray(chunk(prefix).read_bytes())
    data[7] ^= 0x01
    chunk(prefix).write_bytes(bytes(data))


def fifo_for_chunk(prefix: str) -> None:
    chunk(prefix).unlink()
    os.mkfifo(chunk(prefix))


def link_out_for_chunk(prefix: str) -> None:
    outside = Path(prefix).parent / "outside"
    outside.write_bytes(chunk(prefix).read_bytes())
    chunk(prefix).unlink()
    chunk(prefix).symlink_to(outside)


DAMAGE: dict[str, tuple[Callable[[str], None], type[Exception], str]] = {
    "flipped_chunk": (flip, CheckpointCorruptError, r"epoch 2, node 'a', blob 'w': checksum mismatch"),
    "fifo_for_chunk": (fifo_for_chunk, CheckpointFormatError, r"epoch 2, node 'a', blob 'w', chunk c\.0"),
    "link_out_for_chunk": (link_out_for_chunk, CheckpointFormatError, r"epoch 2, node 'a', blob 'w', chunk c\.0"),
    "chunk_deleted": (lambda p: chunk(p).unlink(), CheckpointCorruptError, r"epoch 2, node 'a', blob 'w', chunk c\.0"),
}


def test_the_upload_is_a_verified_checkpoint(tmp_path):
    """The destination is a prefix that open_checkpoint reads and verifies: the same epoch and blobs."""
    prefix, destination = str(tmp_path / "ckpt"), str(tmp_path / "dest")
    assert train(prefix, destination) == 2
    view = dj.open_checkpoint(destination)
    assert view.epoch == 2
    assert np.array_equal(view["a"]["w"], np.arange(1000.0) + 2)
    assert view["a"]["meta"] == {"k": 1}
    assert view.verify() > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_final_epoch_fails_the_upload(tmp_path, kind):
    """Damage to the final epoch between its commit and the upload (``on_epoch`` strikes then): the
    checkpoint error itself, naming epoch, node and blob; no commit record at the destination; nothing
    under the prefix changed by the upload; never a hang on a FIFO."""
    prefix, destination = str(tmp_path / "ckpt"), str(tmp_path / "dest")
    damage, error, message = DAMAGE[kind]
    damaged = {}

    def strike(record) -> None:
        if record.epoch == 2:
            damage(prefix)
            damaged.update(snapshot(prefix))

    with pytest.raises(error, match=message):
        train(prefix, destination, on_epoch=strike)
    before = damaged
    assert dj.list_checkpoints(destination) == []
    assert not Path(destination, "__daskjobs__").exists()
    assert snapshot(prefix) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", ["fifo", "link_out", "file"])
def test_files_the_record_does_not_list_are_not_read_nor_copied(tmp_path, extra):
    """A FIFO, a link leading out of the prefix or a stray file inside the final epoch's group: not
    opened (no hang, nothing read from outside), not copied; the upload succeeds."""
    prefix, destination = str(tmp_path / "ckpt"), str(tmp_path / "dest")
    train(prefix, str(tmp_path / "first"))
    stray = Path(prefix, "a.2", "stray")
    if extra == "fifo":
        os.mkfifo(stray)
    elif extra == "link_out":
        secret = tmp_path / "secret"
        secret.write_text("outside the prefix")
        stray.symlink_to(secret)
    else:
        stray.write_text("not daskjobs'")
    assert train(prefix, destination) == 2
    assert not Path(destination, "a.2", "stray").exists()
    assert dj.open_checkpoint(destination).verify() > 0


def test_an_uncommitted_final_epoch_is_not_uploaded_silently(tmp_path):
    """The job ran without checkpoints (an unwritable prefix and on_save_error="warn"), or the final
    epoch is not committed: the upload raises a CheckpointError naming the epoch instead of copying
    nothing and reporting success."""
    blocker = tmp_path / "file"
    blocker.write_text("a file where the prefix's parent should be")
    with pytest.raises(CheckpointError, match="epoch 2"):
        train(str(blocker / "ckpt"), str(tmp_path / "dest"), on_save_error="warn")
    assert not (tmp_path / "dest").exists()
    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "empty"))
    manager.set_params(["a"])
    with pytest.raises(CheckpointNotFoundError, match="epoch 5 is not committed"):
        dj.CopyCheckpointUploader(str(tmp_path / "dest")).build(5, manager)
