"""Fault catalogue, debris: a power loss at any moment of a save leaves nothing of daskjobs' own
behind once cleanup ran (SPEC §3), however the files were torn.

The power loss is modelled in the test process (``power_loss.PowerLoss``): after the "crash" the
prefix holds exactly what was durable at that moment — files written since their last fsync torn
(NUL-padded to their size, or their old bytes), folder entries created, renamed or removed since
their folder's last fsync undone, each folder on its own.

Classes:

* P1 crash points of a save writing over retired groups (two nodes, each taking over its group of
  the epoch retention retired): after the take-over rename, during the in-place writes, after the
  manifest, during the batched sync, before the staged renames, before and after the folder's
  rename, before the commit. Then cleanup, as the next run and ``daskjobs checkpoints prune``
  call it, removes every staging folder, temp file and uncommitted group of daskjobs'; the
  committed epochs read back what was saved and ``checkpoints verify`` passes; foreign files (one
  in a folder named like a staging folder) are untouched. Also: fresh groups, one node's flush
  making the prefix folder durable while another node's group is half written.
* P2 a save that fails while it writes (a full disk) removes its own staging folder at once.
* P3 (``matrix``) P1 for a crash after every single file operation of such a save, and of a save
  of fresh groups, x files torn with NUL bytes or back to their old bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from power_loss import Event, PowerLoss

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.checkpoint._storage.cleanup import STAGING_RE, named_by_us, staging_name
from daskjobs.cli import main
from daskjobs.errors import CheckpointWriteError

NODES = ("a", "b")
FOREIGN = {
    f"a.3.tmp-{uuid.UUID(int=7).hex}/w/c.0": b"user bytes in a folder named like a staging folder",
    "mydata.2024/zarr.json": b'{"zarr_format": 3, "node_type": "group", "attributes": {}}',
    "notes.txt": b"mine",
}


def blobs(epoch: int) -> dict:
    """``w`` changes every epoch, ``k`` never (its chunk is linked from epoch to epoch), ``odd``
    only in epoch 1 (the group written over it drops it)."""
    found = {"w": np.full(64, float(epoch)), "k": np.arange(32, dtype="i4")}
    if epoch == 1:
        found["odd"] = np.ones(5)
    return found


def save(store: CheckpointStore, epoch: int, previous: dict | None, keep: int = 2) -> dict:
    """Save ``epoch`` as a runner with ``keep_last=keep`` and background flushes does: retire the
    epoch that falls out (its un-commit durable), each node writes over its group of that epoch,
    the groups are flushed in the process's batch of syncs, then the commit record is written."""
    retired = store.retire_epoch(epoch - keep, NODES) if epoch >= keep else None
    written = {}
    for node in NODES:
        entry, flush = store.write_node_unsynced(
            node,
            epoch,
            blobs(epoch),
            save_id=f"{node}{epoch}",
            previous=None if previous is None else previous[node],
            retired=retired,
        )
        written[node] = (entry, flush.soon())
    for _entry, flushed in written.values():
        flushed.result(timeout=30)
    entries = {node: entry for node, (entry, _flushed) in written.items()}
    store.commit(make_commit_record("debris", epoch, entries, {}, {}))
    return entries


def saved(prefix: str, epochs: int) -> dict:
    """A prefix with foreign files and ``epochs`` saved epochs; the entries of the last."""
    for name, data in FOREIGN.items():
        os.makedirs(os.path.dirname(f"{prefix}/{name}"), exist_ok=True)
        with open(f"{prefix}/{name}", "wb") as file:
            file.write(data)
    store = CheckpointStore(prefix)
    store.check_writable()
    previous = None
    for epoch in range(epochs):
        previous = save(store, epoch, previous)
    return previous


def crash_in_save(tmp_path, epoch: int, when: Callable[[Event], bool] | None, tear: str) -> tuple[str, PowerLoss]:
    """Save epochs ``0 .. epoch - 1``, then save ``epoch`` with the power lost at the first event
    ``when`` matches (never: ``None``); the prefix is then restored to what was durable."""
    prefix = str(tmp_path / "ckpt")
    os.makedirs(prefix)
    previous = saved(prefix, epoch)
    loss = PowerLoss(prefix, tear=tear)
    if when is not None:
        loss.crash_when(when)
    with loss:
        save(CheckpointStore(prefix), epoch, previous)
    loss.restore()
    return prefix, loss


def staged(path: str | None) -> bool:
    """Whether ``path`` is a staging folder (``<node>.<epoch>.tmp-<32 hex>``)."""
    return path is not None and STAGING_RE.fullmatch(os.path.basename(path)) is not None


def in_staging(event: Event) -> bool:
    return staged(os.path.dirname(event.path)) or staged(os.path.dirname(os.path.dirname(event.path)))


def nth(k: int, match: Callable[[Event], bool]) -> Callable[[Event], bool]:
    """The ``k``-th event (from 1) ``match`` returns True for."""
    seen = [0]

    def when(event: Event) -> bool:
        if not match(event):
            return False
        seen[0] += 1
        return seen[0] == k

    return when


def taken_over(event: Event) -> bool:
    """The rename of a retired group to a staging folder."""
    return event.kind == "rename" and staged(event.target)


def staged_rename(event: Event) -> bool:
    """A rename in or of a staging folder that puts the written group in place."""
    return event.kind == "rename" and not staged(event.target) and (staged(event.path) or in_staging(event))


def folder_renamed(event: Event) -> bool:
    return event.kind == "rename" and staged(event.path) and not staged(event.target)


def group_manifest(event: Event) -> bool:
    return (
        in_staging(event)
        and os.path.basename(event.path).startswith("zarr.json")
        and staged(os.path.dirname(event.path))
    )


def batch_sync(event: Event) -> bool:
    return event.kind in ("fsync", "syncfs") and event.thread.startswith("daskjobs-")


CRASHES: dict[str, Callable[[], Callable[[Event], bool]]] = {
    "after-the-take-over-rename": lambda: lambda e: taken_over(e) and not e.before,
    "during-take-over-writes": lambda: nth(3, lambda e: e.kind == "write" and e.before and in_staging(e)),
    "after-the-manifest": lambda: lambda e: e.kind == "write" and not e.before and group_manifest(e),
    "during-the-batched-sync": lambda: nth(2, lambda e: batch_sync(e) and not e.before),
    "before-the-staged-renames": lambda: lambda e: staged_rename(e) and e.before,
    "before-the-folder-rename": lambda: lambda e: folder_renamed(e) and e.before,
    "after-the-folder-rename": lambda: lambda e: folder_renamed(e) and not e.before,
    "before-the-commit": lambda: lambda e: e.kind == "rename" and ".json.tmp-" in e.path and "commits" in e.path,
}
"""Crash points of the save of epoch 3 (a new predicate each, see :meth:`PowerLoss.crash_when`)."""


def own_debris(prefix: str) -> list[str]:
    """daskjobs' temp files and staging folders, and groups of uncommitted epochs, under ``prefix``
    (the foreign files excepted)."""
    committed = set(CheckpointStore(prefix).committed_epochs())
    found = []
    for folder, dirs, names in os.walk(prefix):
        for name in [*dirs, *names]:
            path = os.path.relpath(os.path.join(folder, name), prefix)
            if any(path == f or f.startswith(path + "/") or path.startswith(f) for f in FOREIGN):
                continue
            top = path.split("/")[0]
            group = top.rsplit(".", 1)
            uncommitted = len(group) == 2 and group[0] in NODES and int(group[1]) not in committed
            if ".tmp-" in name or (path == top and uncommitted):
                found.append(path)
    return sorted(found)


def check_after_cleanup(
    prefix: str, loss: PowerLoss, cleanup: str, kept: list[int], crashed: int, retired: int | None = None
) -> None:
    """After the crash in the save of epoch ``crashed``: the epochs ``kept`` are committed (and
    ``crashed`` too if its commit record was durable, or ``retired`` if its un-commit was not),
    each reads back what was saved; cleanup leaves no debris of daskjobs' and every foreign file
    as it was."""
    committed = CheckpointStore(prefix).committed_epochs()
    allowed = [kept, [*kept, crashed], *([sorted([retired, *kept])] if retired is not None else [])]
    assert committed in allowed, (loss.crashed, committed)
    if cleanup == "next-run":
        CheckpointStore(prefix).cleanup_uncommitted(NODES)
    else:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["checkpoints", "prune", prefix]) == 0
    assert own_debris(prefix) == [], (loss.crashed, loss.torn)
    groups = [f"{node}.{epoch}" for epoch in committed for node in NODES]
    assert sorted(os.listdir(prefix)) == sorted(["__daskjobs__", *groups, *{f.split("/")[0] for f in FOREIGN}])
    assert CheckpointStore(prefix).committed_epochs() == committed
    for epoch in committed:
        view = dj.open_checkpoint(prefix, epoch)
        assert view.verify() > 0
        for node in NODES:
            got = view[node]
            assert sorted(got) == sorted(blobs(epoch))
            for name, value in blobs(epoch).items():
                np.testing.assert_array_equal(got[name], value, strict=True)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["checkpoints", "verify", prefix]) == 0
    for name, data in FOREIGN.items():
        with open(f"{prefix}/{name}", "rb") as file:
            assert file.read() == data


@pytest.mark.parametrize("cleanup", ["next-run", "prune"])
@pytest.mark.parametrize("crash", sorted(CRASHES))
def test_a_power_loss_while_groups_are_written_over_leaves_no_debris_after_cleanup(tmp_path, crash, cleanup):
    prefix, loss = crash_in_save(tmp_path, 3, CRASHES[crash](), "nul")
    assert loss.crashed is not None
    assert loss.crashed.kind != "now"  # the crash point was reached
    check_after_cleanup(prefix, loss, cleanup, [2], 3)


def test_the_marker_of_a_group_written_over_is_written_only_under_a_durable_staging_name(tmp_path):
    """Were it written over earlier, a power loss could leave the retired group under its old name
    (the rename to its staging folder undone) with a ``zarr.json`` of the old marker's bytes padded
    with NUL bytes, which nothing proves daskjobs'. The save writes the retired group's files in
    place, its ``zarr.json`` last, and that only after a sync of the prefix folder made the
    folder's staging name durable; no file is created beside the marker."""
    prefix, loss = crash_in_save(tmp_path, 3, None, "nul")
    root = os.path.realpath(prefix)
    for node in NODES:
        renamed = next(
            i for i, e in enumerate(loss.events) if taken_over(e) and not e.before and e.path.endswith(f"/{node}.1")
        )
        staging = loss.events[renamed].target
        marker = next(i for i, e in enumerate(loss.events) if e.kind == "write" and e.path == f"{staging}/zarr.json")
        assert any(
            e.kind in ("fsync", "syncfs") and not e.before and e.path == root for e in loss.events[renamed:marker]
        ), node
        assert not [e for e in loss.events[renamed:] if e.path.startswith(f"{staging}/zarr.json.")]
    writes = {
        os.path.relpath(e.path, prefix).split("/", 1)[1] for e in loss.events if e.kind == "write" and in_staging(e)
    }
    assert "w/c.0" in writes  # the retired epoch's chunk of w, written over in place
    check_after_cleanup(prefix, loss, "next-run", [2], 3)


@pytest.mark.parametrize("tear", ["nul", "old"])
def test_a_power_loss_while_the_manifest_is_written_over_the_marker_leaves_no_debris(tmp_path, tear):
    """The manifest torn as it is written over the retired marker, in place: the folder's durable
    staging name proves it ours, and cleanup removes it."""
    prefix, loss = crash_in_save(tmp_path, 3, lambda e: e.kind == "write" and e.before and group_manifest(e), tear)
    assert loss.crashed is not None
    check_after_cleanup(prefix, loss, "next-run", [2], 3)


def test_a_power_loss_while_another_nodes_group_is_flushed_leaves_no_debris(tmp_path):
    """Node a's flush makes the prefix folder durable while node b's fresh group is written, not
    yet durable: b's folder survives the power loss, empty or torn. Its staging name proves it ours."""
    prefix = str(tmp_path / "ckpt")
    os.makedirs(prefix)
    saved(prefix, 1)
    store = CheckpointStore(prefix)
    with PowerLoss(prefix) as loss:
        _entry, flush_a = store.write_node_unsynced("a", 1, blobs(1), save_id="a1")
        _entry, flush_b = store.write_node_unsynced("b", 1, blobs(1), save_id="b1")
        flush_a()
        loss.crash_now()
        flush_b()
    loss.restore()
    (left,) = [name for name in os.listdir(prefix) if name.startswith("b.1.tmp-")]
    assert os.listdir(f"{prefix}/{left}") == []  # its own entries were never durable
    check_after_cleanup(prefix, loss, "next-run", [0], 1)


def test_only_a_name_daskjobs_made_proves_a_staging_folder():
    made = os.path.basename(staging_name("/prefix/trainer_0.12"))
    number, check = made[-32:-16], made[-16:]
    assert made == f"trainer_0.12.tmp-{number}{check}"
    assert named_by_us(made)
    assert not named_by_us(f"trainer_0.13.tmp-{number}{check}")  # the check binds node and epoch
    assert not named_by_us(f"trainer_1.12.tmp-{number}{check}")
    assert not named_by_us(f"trainer_0.12.tmp-{uuid.uuid4().hex}")
    assert not named_by_us(made[:-1] + ("0" if made[-1] != "0" else "1"))
    assert not named_by_us("trainer_0.12")


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at ``tmp_path / "disk"``, unmounted afterwards; skipped where mounting
    is not permitted."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield str(where)
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.parametrize("how", ["fresh", "written-over"])
def test_a_save_that_fails_while_writing_removes_its_staging_folder(small_disk, how):
    """P2: a group that does not fit on the disk (ENOSPC mid-write) fails its save with
    CheckpointWriteError, and leaves no staging folder behind: its space is free again."""
    prefix = f"{small_disk}/ckpt"
    store = CheckpointStore(prefix)
    first = store.write_node("a", 0, {"w": np.zeros(1000)}, save_id="a0")
    store.commit(make_commit_record("debris", 0, {"a": first}, {}, {}))
    retired = store.retire_epoch(0, ["a"]) if how == "written-over" else None
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        store.write_node_unsynced("a", 1, {"w": np.ones(1 << 19)}, save_id="a1", retired=retired)
    kept = [] if retired else ["a.0"]  # a retired group written over goes with the failed save
    assert sorted(os.listdir(prefix)) == ["__daskjobs__", *kept]
    _entry, flush = store.write_node_unsynced("a", 1, {"w": np.ones(1000)}, save_id="a1")  # room again
    flush()
    assert sorted(os.listdir(prefix)) == ["__daskjobs__", *kept, "a.1"]


def every_event(tmp_path, epoch: int) -> int:
    _prefix, loss = crash_in_save(tmp_path / "dry", epoch, None, "nul")
    return len(loss.events)


@pytest.mark.matrix
@pytest.mark.parametrize("tear", ["nul", "old"])
@pytest.mark.parametrize("epoch", [1, 3], ids=["fresh-groups", "written-over"])
def test_a_power_loss_after_any_file_operation_of_a_save_leaves_no_debris(tmp_path, epoch, tear):
    count = every_event(tmp_path, epoch)
    failures = []
    for index in range(count):
        seen = [0]

        def when(event: Event, index: int = index) -> bool:
            seen[0] += 1
            return seen[0] > index

        case = tmp_path / f"crash-{index}"
        prefix, loss = crash_in_save(case, epoch, when, tear)
        try:
            if epoch == 3:  # epoch 1 is retired first: its commit record goes
                check_after_cleanup(prefix, loss, "next-run", [2], 3, retired=1)
            else:
                check_after_cleanup(prefix, loss, "next-run", [0], 1)
        except AssertionError as exc:
            failures.append((index, loss.crashed, str(exc)[:300]))
    assert failures == []
