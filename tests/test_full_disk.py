"""A checkpoint disk that fills up (ENOSPC) or turns read-only (EROFS) while a job runs, on a real
filesystem: a small tmpfs mounted for the test. The run fails with ``CheckpointWriteError`` naming
the real cause (the OSError and the path); no message blames a restarted worker ("its background
flush is gone"); ``on_epoch`` is called for the committed epochs only; what was committed stays
intact and a re-run resumes from it once the disk has room again."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.lock import unlock
from daskjobs.errors import CheckpointWriteError

pytestmark = pytest.mark.timeout(180)

CAUSES = {"ENOSPC": "[Errno 28] No space left on device", "EROFS": "[Errno 30] Read-only file system"}
BLAMES = ("background flush is gone", "worker restarted")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs mounted at ``tmp_path / "disk"``, unmounted afterwards; skipped where mounting
    is not permitted (not root, no CAP_SYS_ADMIN)."""
    where = tmp_path / "disk"
    where.mkdir()
    options = ["-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(where)]
    mounted = subprocess.run(["mount", *options], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


def fill(disk: Path) -> None:
    """Write zeros to a file on ``disk`` until no byte more fits."""
    for size in (1 << 16, 512, 1):
        with contextlib.suppress(OSError), (disk / f"filler-{size}").open("ab") as filler:
            while True:
                filler.write(b"\0" * size)
                filler.flush()
    with pytest.raises(OSError, match="No space left on device"):
        (disk / "probe").write_bytes(b"\0" * 4096)


def remount(disk: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True, capture_output=True)


def build_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="full") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("w", np.zeros(20000)))
                dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + ws.epoch))
    return job


@pytest.mark.parametrize("cause", sorted(CAUSES))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_disk_that_fills_up_or_turns_read_only_is_named_as_the_cause(session, small_disk, caplog, cause, async_save):
    """The disk fills up (or turns read-only) right after epoch 2 is committed: the run stops with
    CheckpointWriteError naming the OSError and a path under the prefix; every warning names it
    too, none blames a restarted worker; on_epoch saw epochs 1 and 2 only; epochs 0-2 verify; a
    re-run with room again resumes from epoch 2 and ends like an unbroken run."""
    prefix = str(small_disk / "ckpt")
    seen: list[int] = []

    def on_epoch(record: dj.EpochRecord) -> None:
        seen.append(record.epoch)
        if record.epoch == 2:
            fill(small_disk) if cause == "ENOSPC" else remount(small_disk, "ro")

    manager = dj.MultiNodeCheckpointManager(prefix, async_save=async_save)
    runner = dj.JobRunner(build_job(), manager, max_epochs=6, progress=False, on_epoch=on_epoch)
    with caplog.at_level(logging.WARNING, logger="daskjobs"), pytest.raises(CheckpointWriteError) as caught:
        runner.train(session)
    message = str(caught.value)
    failed = int(re.match(rf"could not write the checkpoint of epoch (\d+) under {re.escape(prefix)}: ", message)[1])
    assert failed >= 3, message
    assert CAUSES[cause] in message
    assert re.search(rf"{re.escape(prefix)}/(a|b)\.{failed}\b|{re.escape(prefix)}/__daskjobs__/commits/", message)
    warnings = [r.getMessage() for r in caplog.records if r.name == "daskjobs" and r.levelno >= logging.WARNING]
    for text in [message, *warnings]:
        assert not any(blame in text for blame in BLAMES), text
    assert all(CAUSES[cause] in text for text in warnings), warnings
    assert seen == [1, 2]
    if cause == "ENOSPC":
        for filler in small_disk.glob("filler-*"):
            filler.unlink()
    else:
        remount(small_disk, "rw")
        unlock(CheckpointStore(prefix), force=True)  # a read-only disk kept the lock: the user's unlock --force
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2]
    assert dj.open_checkpoint(prefix).verify() > 0
    again = dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix, async_save=async_save), max_epochs=6)
    again.progress = False
    assert again.train(session) == 6
    assert [r.epoch for r in again.history] == [3, 4, 5, 6]
    assert np.array_equal(dj.open_checkpoint(prefix)["a"]["w"], np.full(20000, float(sum(range(7)))))
