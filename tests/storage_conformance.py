"""The storage protocol's conformance tests (``daskjobs.checkpoint._storage.base``): every operation of
:class:`Files` with exact expected values, the optional sub-protocols (:class:`LocalTree`,
:class:`QueuedFiles`) exactly where a backend declares them, and capability flags that are honest.

Subclass :class:`FilesTests` once per backend (see ``test_files_conformance.py``), giving the
fixtures ``root`` (an empty folder of the backend), ``fs`` (its fsspec filesystem, to look at
what was written without the backend) and ``files`` (the backend), and the class attributes
naming what the backend declares.
"""

from __future__ import annotations

import os
import stat
from typing import Any, ClassVar

import numpy as np
import pytest
import xxhash

from daskjobs.checkpoint._storage.base import (
    Files,
    LocalTree,
    QueuedFiles,
    Staged,
    UnsafeFileError,
    local_tree,
    queued,
)

LOCAL_TREE = (
    *("overwrite", "reuse_over", "rename", "changed", "remove_folder"),
    *("publish", "publish_when_durable", "track_tree", "flush_soon"),
)
"""The operations of :class:`LocalTree` beyond :class:`Files`."""
QUEUED = ("settle",)
"""The operations of :class:`QueuedFiles` beyond :class:`Files`."""


class FilesTests:
    """Conformance of one backend; see the module."""

    capabilities: ClassVar[dict[str, bool]]
    """The flags the backend must declare: ``supports_overwrite``, ``queues_writes``, ``defers_flush``."""
    too_long: ClassVar[str]
    """What :meth:`Files.read_chunks` says of a 5-byte file read as 4 bytes (a backend that reads
    no more than it may cannot tell by how much)."""

    @pytest.fixture
    def root(self) -> str:
        raise NotImplementedError

    @pytest.fixture
    def fs(self) -> Any:
        raise NotImplementedError

    @pytest.fixture
    def files(self) -> Files:
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def done(files: Files) -> None:
        """Whatever the backend queues or defers is done and durable."""
        files.flush()

    @staticmethod
    def raw(fs: Any, path: str) -> bytes | None:
        """The bytes at ``path``, read without the backend; ``None`` if absent."""
        fs.invalidate_cache()
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            return None

    @staticmethod
    def plant(fs: Any, path: str, data: bytes) -> None:
        """Write ``path`` without the backend (its folder too)."""
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data)
        fs.invalidate_cache()

    # -- capabilities ---------------------------------------------------------------------------
    def test_the_capabilities_are_the_declared_ones(self, files: Files) -> None:
        found = {name: getattr(files, name) for name in self.capabilities}
        assert found == self.capabilities
        assert all(type(value) is bool for value in found.values())
        assert isinstance(files, Files)

    def test_a_sub_protocol_is_there_whole_exactly_where_its_flag_says(self, files: Files) -> None:
        assert local_tree(files) is files.supports_overwrite
        assert queued(files) is files.queues_writes
        assert isinstance(files, LocalTree) is files.supports_overwrite
        assert isinstance(files, QueuedFiles) is files.queues_writes
        assert [hasattr(files, name) for name in LOCAL_TREE] == [files.supports_overwrite] * len(LOCAL_TREE)
        assert [hasattr(files, name) for name in QUEUED] == [files.queues_writes] * len(QUEUED)
        assert not files.defers_flush or files.supports_overwrite  # only a LocalTree defers its flush

    def test_writes_are_visible_when_they_return_unless_queued(self, root: str, fs: Any, files: Files) -> None:
        files.put(f"{root}/a", b"abc")
        assert self.raw(fs, f"{root}/a") == (None if files.queues_writes else b"abc")
        if queued(files):
            assert files.settle() == []
            assert self.raw(fs, f"{root}/a") == b"abc"

    # -- writing --------------------------------------------------------------------------------
    def test_put_joins_its_parts_byte_for_byte(self, root: str, fs: Any, files: Files) -> None:
        files.mkdir(root, parents=True)
        words = np.arange(3, dtype="<u4")
        files.put(f"{root}/f", b"ab", memoryview(words), bytearray(b"z"), b"")
        self.done(files)
        assert self.raw(fs, f"{root}/f") == b"ab" + words.tobytes() + b"z"
        files.put(f"{root}/f", b"x")  # truncated: no old byte stays
        self.done(files)
        assert self.raw(fs, f"{root}/f") == b"x"

    def test_put_atomic_replaces_whole_and_leaves_no_temp_file(self, root: str, fs: Any, files: Files) -> None:
        files.put_atomic(f"{root}/m.json", b"old, and longer")
        self.done(files)
        files.put_atomic(f"{root}/m.json", b"new")
        self.done(files)
        assert self.raw(fs, f"{root}/m.json") == b"new"
        assert files.listdir(root) == {"m.json": False}

    def test_mkdir_makes_folders_where_the_backend_has_them(self, root: str, files: Files) -> None:
        files.mkdir(f"{root}/g/h/i", parents=True, within=root)
        files.mkdir(f"{root}/g/h/i/j")
        expected = {"g": True} if files.supports_overwrite else {}
        assert files.listdir(root) == expected
        if files.supports_overwrite:
            assert files.listdir(f"{root}/g/h/i") == {"j": True}
            with pytest.raises(FileExistsError):
                files.mkdir(f"{root}/g/h/i/j")
            with pytest.raises(FileNotFoundError):  # a prefix that vanished is not made again
                files.mkdir(f"{root}/gone/x/y", parents=True, within=f"{root}/gone")

    def test_replace_makes_its_folders_and_is_whole(self, root: str, fs: Any, files: Files) -> None:
        files.replace(f"{root}/own/commits/c.json", b"first")
        files.replace(f"{root}/own/commits/c.json", b"2nd", sync_folder=False)
        files.sync_folder(f"{root}/own/commits")
        assert self.raw(fs, f"{root}/own/commits/c.json") == b"2nd"
        assert files.listdir(f"{root}/own/commits") == {"c.json": False}

    def test_create_is_exclusive(self, root: str, fs: Any, files: Files) -> None:
        files.create(f"{root}/own/lock.json", b"mine")
        with pytest.raises(FileExistsError):
            files.create(f"{root}/own/lock.json", b"yours")
        files.create(f"{root}/own/soon.json", b"later", sync_soon=True)
        assert self.raw(fs, f"{root}/own/lock.json") == b"mine"
        assert self.raw(fs, f"{root}/own/soon.json") == b"later"

    def test_remove_takes_a_file_away_and_a_missing_one_is_fine(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/own/x", b"1")
        self.plant(fs, f"{root}/own/y", b"2")
        files.remove(f"{root}/own/x")
        files.remove(f"{root}/own/y", sync_folder=False)
        files.remove(f"{root}/own/never-there")
        assert files.listdir(f"{root}/own") == {}

    # -- reusing an earlier save's file ---------------------------------------------------------
    def test_reuse_makes_the_target_hold_the_sources_bytes(self, root: str, fs: Any, files: Files) -> None:
        data = np.arange(8, dtype="<f8")
        files.mkdir(f"{root}/old", parents=True)
        files.mkdir(f"{root}/new", parents=True)
        files.put(f"{root}/old/c.0", memoryview(data))
        self.done(files)
        parts = (memoryview(data),)
        assert files.reuse(f"{root}/old/c.0", f"{root}/new/c.0", parts, files.sealed_at(f"{root}/old")) is True
        if queued(files):
            assert files.settle() == []
        self.done(files)
        assert self.raw(fs, f"{root}/new/c.0") == data.tobytes()
        assert self.raw(fs, f"{root}/old/c.0") == data.tobytes()

    def test_reuse_of_a_missing_source_writes_nothing_or_falls_back(self, root: str, fs: Any, files: Files) -> None:
        files.mkdir(f"{root}/new", parents=True)
        reused = files.reuse(f"{root}/gone/c.0", f"{root}/new/c.0", (b"bytes",))
        assert reused is files.queues_writes  # queued: the copy fails later, and the bytes are written then
        if queued(files):
            assert files.settle() == [f"{root}/new/c.0"]
            assert self.raw(fs, f"{root}/new/c.0") == b"bytes"
        else:
            assert self.raw(fs, f"{root}/new/c.0") is None

    def test_sealed_at_tells_when_a_group_got_its_entry_where_files_change_in_place(
        self, root: str, fs: Any, files: Files
    ) -> None:
        self.plant(fs, f"{root}/g/zarr.json", b"{}")
        sealed = files.sealed_at(f"{root}/g")
        if files.supports_overwrite:
            assert sealed == os.lstat(f"{root}/g/zarr.json").st_mtime_ns
            assert files.sealed_at(f"{root}/nothing") is None
        else:
            assert sealed is None

    def test_reuse_refuses_a_source_changed_after_its_group_was_sealed(self, root: str, fs: Any, files: Files) -> None:
        files.mkdir(f"{root}/old", parents=True)
        files.mkdir(f"{root}/new", parents=True)
        files.put(f"{root}/old/c.0", b"abcd")
        self.done(files)
        reused = files.reuse(f"{root}/old/c.0", f"{root}/new/c.0", (b"abcd",), sealed=1)
        if files.supports_overwrite:  # a file that can change in place, changed after its group's ns 1
            assert reused is False
            assert self.raw(fs, f"{root}/new/c.0") is None
        else:  # objects are never modified in place: nothing to refuse
            assert reused is True

    # -- reading --------------------------------------------------------------------------------
    def test_read_small_reads_at_most_one_byte_past_the_limit(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/ten", b"0123456789")
        ten, missing = files.read_small([f"{root}/ten", f"{root}/missing"], 4)
        assert ten == b"01234"
        assert isinstance(missing, FileNotFoundError)
        assert files.read_small([f"{root}/ten"], 100) == [b"0123456789"]

    def test_read_chunks_fills_the_views_and_hashes_whole_files(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/c.0", b"abcdefgh")
        self.plant(fs, f"{root}/c.1", b"abc")
        self.plant(fs, f"{root}/c.2", b"abcde")
        views = [memoryview(bytearray(8)), memoryview(bytearray(4)), memoryview(bytearray(4)), memoryview(bytearray(2))]
        reads = [(f"{root}/c.0", views[0], 8), (f"{root}/c.1", views[1], 4), (f"{root}/c.2", views[2], 4)]
        reads.append((f"{root}/c.9", views[3], 2))
        found = files.read_chunks(reads)
        assert found == [
            (xxhash.xxh3_128(b"abcdefgh").hexdigest(), None),
            (None, "has 3 bytes, expected 4"),
            (None, self.too_long),
            (None, "is missing"),
        ]
        assert bytes(views[0]) == b"abcdefgh"

    def test_read_chunks_hashes_the_bytes_past_the_view(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/c.0", b"valid" + b"\0\0\0")
        view = memoryview(bytearray(5))
        assert files.read_chunks([(f"{root}/c.0", view, 8)]) == [(xxhash.xxh3_128(b"valid\0\0\0").hexdigest(), None)]
        assert bytes(view) == b"valid"

    def test_check_sizes_opens_nothing_and_says_what_differs(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/b/c.0", b"1234")
        self.plant(fs, f"{root}/b/c.1", b"12")
        checks = [(f"{root}/b/c.0", 4), (f"{root}/b/c.1", 4), (f"{root}/b/c.2", 4)]
        assert files.check_sizes(checks) == [None, "has 2 bytes, expected 4", "is missing"]

    def test_listdir_names_files_and_folders(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/d/a.json", b"{}")
        self.plant(fs, f"{root}/d/sub/c.0", b"x")
        assert files.listdir(f"{root}/d") == {"a.json": False, "sub": True}
        assert files.listdir(f"{root}/nothing-here") == {}

    def test_check_directory_refuses_what_is_no_real_folder(self, root: str, fs: Any, files: Files) -> None:
        self.plant(fs, f"{root}/d/f", b"x")
        files.check_directory(f"{root}/d")
        if not files.supports_overwrite:  # no folders, symlinks or special files: nothing to refuse
            files.check_directory(f"{root}/not-there")
            return
        os.symlink(f"{root}/d", f"{root}/link")
        with pytest.raises(UnsafeFileError, match="is a symbolic link, not a directory"):
            files.check_directory(f"{root}/link")
        with pytest.raises(FileNotFoundError):
            files.check_directory(f"{root}/not-there")

    # -- a local tree ---------------------------------------------------------------------------
    def test_overwrite_writes_in_place_unless_another_epoch_shares_the_file(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree: no file is written over in place")
        files.mkdir(f"{root}/g")
        files.put(f"{root}/g/c.0", b"retired, longer")
        files.put(f"{root}/g/c.1", b"shared")
        os.link(f"{root}/g/c.1", f"{root}/kept")
        inode = os.lstat(f"{root}/g/c.0").st_ino
        files.overwrite(f"{root}/g/c.0", b"new")
        files.overwrite(f"{root}/g/c.1", b"other")
        files.overwrite(f"{root}/g/c.2", b"fresh")
        self.done(files)
        assert (os.lstat(f"{root}/g/c.0").st_ino, _read(f"{root}/g/c.0")) == (inode, b"new")
        assert (_read(f"{root}/g/c.1"), _read(f"{root}/kept"), os.lstat(f"{root}/kept").st_nlink) == (
            b"other",
            b"shared",
            1,
        )
        assert _read(f"{root}/g/c.2") == b"fresh"

    def test_reuse_links_and_reuse_over_keeps_a_link_that_is_there(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree")
        for folder in ("old", "over", "new"):
            files.mkdir(f"{root}/{folder}")
        files.put(f"{root}/old/c.0", b"same")
        files.put(f"{root}/over/c.0", b"retired")
        self.done(files)
        assert files.reuse(f"{root}/old/c.0", f"{root}/new/c.0", (b"same",)) is True
        assert os.path.samefile(f"{root}/old/c.0", f"{root}/new/c.0")
        assert files.reuse(f"{root}/old/c.0", f"{root}/new/c.9", (b"other size",)) is False
        assert files.reuse_over(f"{root}/old/c.0", f"{root}/over/c.0", (b"same",)) is True  # the retired file goes
        assert files.reuse_over(f"{root}/old/c.0", f"{root}/over/c.0", (b"same",)) is True  # already this link
        assert os.lstat(f"{root}/old/c.0").st_nlink == 3
        assert _read(f"{root}/over/c.0") == b"same"

    def test_a_staged_group_is_published_once_durable_with_its_manifest(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree: nothing is staged")
        files.mkdir(f"{root}/retired")
        files.put(f"{root}/retired/zarr.json", b"the retired group's marker")
        self.done(files)
        files.rename(f"{root}/retired", f"{root}/n.2.tmp-{'a' * 32}")
        staging = f"{root}/n.2.tmp-{'a' * 32}"
        files.await_renames()
        files.overwrite(f"{staging}/zarr.json", b"manifest")
        files.publish_when_durable(Staged(staging, f"{root}/n.2"))
        assert os.listdir(root) == ([f"n.2.tmp-{'a' * 32}"] if files.defers_flush else ["n.2"])
        future = files.flush_soon()
        assert future.result(timeout=30) is None
        assert os.listdir(root) == ["n.2"]
        assert (os.listdir(f"{root}/n.2"), _read(f"{root}/n.2/zarr.json")) == (["zarr.json"], b"manifest")

    def test_publish_puts_a_staged_group_in_place_at_once(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree")
        files.mkdir(f"{root}/s", parents=True)
        files.put(f"{root}/s/zarr.json", b"manifest")
        files.publish(Staged(f"{root}/s", f"{root}/n.1"))
        assert os.listdir(root) == ["n.1"]
        self.done(files)
        assert _read(f"{root}/n.1/zarr.json") == b"manifest"

    def test_remove_folder_and_changed_folders_are_synced_by_the_flush(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree")
        files.mkdir(f"{root}/g/b", parents=True)
        files.remove_folder(f"{root}/g/b")
        files.changed(f"{root}/g")
        self.done(files)
        assert os.listdir(f"{root}/g") == []

    def test_track_tree_takes_write_permission_from_group_and_world(self, root: str, files: Files) -> None:
        if not local_tree(files):
            pytest.skip("not a LocalTree")
        os.makedirs(f"{root}/g/b")
        with open(f"{root}/g/b/c.0", "wb") as file:
            file.write(b"x")
        os.chmod(f"{root}/g/b/c.0", 0o666)
        os.chmod(f"{root}/g/b", 0o777)
        files.track_tree(f"{root}/g")
        self.done(files)
        assert [stat.S_IMODE(os.lstat(p).st_mode) & 0o022 for p in (f"{root}/g/b/c.0", f"{root}/g/b")] == [0, 0]

    def test_what_the_flush_did_not_make_durable_a_power_loss_may_take(self, root: str, files: Files) -> None:
        """``defers_flush`` is honest: after a power loss, what was flushed (and what :meth:`replace`
        wrote, in the folders it made) is there whole, and a file written since the flush is not."""
        if not files.defers_flush:
            pytest.skip("durable when a write returns: nothing to lose")
        from power_loss import PowerLoss

        with PowerLoss(root) as loss:
            files.mkdir(f"{root}/g", parents=True)
            files.put(f"{root}/g/kept", b"flushed")
            files.flush()
            files.put(f"{root}/g/lost", b"not flushed")
            files.replace(f"{root}/own/commits/record.json", b"record")
        loss.restore()
        assert (os.listdir(f"{root}/g"), _read(f"{root}/g/kept")) == (["kept"], b"flushed")
        assert (os.listdir(f"{root}/own/commits"), _read(f"{root}/own/commits/record.json")) == (
            ["record.json"],
            b"record",
        )


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()
