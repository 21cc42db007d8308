"""The checkpoint store: one prefix's layout, node groups, commit records, listing, deletion and cleanup.

Layout under a prefix (a local directory or an fsspec URL)::

    <node>.<epoch>/                              one Zarr v3 group per node and epoch (see ``_zarr``)
    __daskjobs__/commits/epoch-000000000005.json   commit record of epoch 5, written last
    __daskjobs__/lock.json                       the writer lock

An epoch exists only once its commit record does. Node names cannot start with ``__``, so
nothing of daskjobs' own can collide with a node's group. File access goes through
:mod:`._files` (plain ``os`` calls on local disks, fsspec elsewhere); the Zarr side lives in
:mod:`._zarr`.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._validation import validate_name
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
)
from ._cleanup import Tree, clear_for_write, remove_debris, remove_group
from ._files import LocalFiles, UnsafeFileError
from ._format import (
    SAVE_ID_RE,
    check_epoch,
    dumps,
    loads,
    validate_commit_record,
)
from ._prefix import OWN, Prefix
from ._reader import GroupReader, read_group, read_group_entry
from ._zarr import COMPRESSIONS, Location, describe_group, write_group

logger = logging.getLogger("daskjobs")

_COMMIT_RE = re.compile(r"epoch-(\d{12})\.json")


@dataclass(frozen=True)
class RetiredEpoch:
    """An un-committed epoch whose groups are still to be deleted: per node, its entry from the
    commit record (``None``: the record named no entry; only daskjobs' own files go)."""

    epoch: int
    entries: dict[str, Mapping[str, Any] | None]


def _check_save(node: str, save_id: str) -> None:
    """Refuse a bad node name or save id before anything is written."""
    validate_name(node, "node")
    if not isinstance(save_id, str) or not SAVE_ID_RE.fullmatch(save_id):
        raise JobDefinitionError(f"save_id must be 1-128 characters from A-Z a-z 0-9 _ -, got {save_id!r}")


class CheckpointStore(Prefix):
    """One checkpoint prefix: a local path or an fsspec URL. Picklable (shipped to Dask workers).

    Parameters
    ----------
    db_prefix, storage_options
        Where the prefix is, as for :class:`~._prefix.Prefix`.
    compression
        ``None`` (default: uncompressed, fastest) or one of ``"zstd"``, ``"blosc"``, ``"gzip"``.
    fsync
        Make node groups and commit records durable on local disks before they count.

    Attributes
    ----------
    url : str
        The normalised prefix: an absolute path for local disks, else the URL without a trailing ``/``.
    storage_options : dict
        As given.

    Notes
    -----
    Methods may be called from several threads at once for different nodes or epochs. Writing
    the same node and epoch from two places at once is not supported; :meth:`acquire_lock`
    keeps a second runner off the prefix.
    """

    def __init__(
        self,
        db_prefix: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        compression: str | None = None,
        fsync: bool = True,
    ) -> None:
        if compression is not None and compression not in COMPRESSIONS:
            raise JobDefinitionError(f"unknown compression {compression!r}: use None or one of {list(COMPRESSIONS)}")
        super().__init__(db_prefix, storage_options, fsync=fsync)
        self.compression = compression

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def db_name(self, node: str, epoch: int) -> str:
        """Where ``node``'s group of ``epoch`` lives: ``f"{url}/{node}.{epoch}"`` (Caffe2's naming)."""
        return f"{self.url}/{validate_name(node, 'node')}.{check_epoch(epoch)}"

    def commit_path(self, epoch: int) -> str:
        """Where the commit record of ``epoch`` lives (under :attr:`url`)."""
        return f"{self.url}/{OWN}/commits/epoch-{check_epoch(epoch):012d}.json"

    def _group(self, node: str, epoch: int) -> Location:
        url = self.db_name(node, epoch)
        return Location(self._files(), self._path(f"{node}.{epoch}"), url, self.anchor)

    def _commit_file(self, epoch: int) -> str:
        """The commit record's path; raises :class:`CheckpointFormatError` if its folder is a symlink (see
        :meth:`~._prefix.Prefix.own_folder`)."""
        return f"{self.own_folder('commits')}/epoch-{check_epoch(epoch):012d}.json"

    # -- node side --------------------------------------------------------------------------
    def write_node(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Any],
        *,
        save_id: str,
        previous: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write ``node``'s blobs as its Zarr v3 group of ``epoch`` and return the node's entry.

        Whatever an earlier attempt left at that place is replaced. Names and dtypes are checked
        before anything is written; data is fsynced (local disks) before the entry is written last,
        into the group's attributes. A store holding the writer lock checks it first (one small
        read, see :meth:`check_not_taken`): a prefix that changed hands gets nothing more from this writer.

        Parameters
        ----------
        blobs
            Blob values: numpy arrays (numeric, bool, fixed-width ``U``/``S``) or JSON values.
        previous
            The node's entry of the previous committed epoch (delta checkpoints): chunks whose
            XXH3-128 digest is unchanged are hard-linked (server-side copied on object stores)
            from that epoch instead of written. Each epoch stays complete on its own.

        Returns
        -------
        dict
            ``{"node", "epoch", "save_id", "blobs": {name: {"kind", "dtype", "shape", "nbytes",
            "chunks", "codec", "hashes"}}, "bytes", "bytes_written", "bytes_reused", "seconds"}``,
            JSON-able; pass it to :func:`make_commit_record`.

        Examples
        --------
        >>> import tempfile, numpy as np
        >>> store = CheckpointStore(tempfile.mkdtemp(), fsync=False)
        >>> first = store.write_node("ps", 0, {"w": np.zeros(4)}, save_id="a")
        >>> again = store.write_node("ps", 1, {"w": np.zeros(4)}, save_id="b", previous=first)
        >>> again["bytes_written"], again["bytes_reused"]
        (0, 32)

        Raises
        ------
        JobDefinitionError
            A bad node or blob name (a ``ValueError``).
        BlobTypeError
            A blob whose dtype cannot be stored (a ``TypeError``).
        CheckpointWriteError
            Storage failed; no commit record refers to the partial group.
        CheckpointLockedError
            This store acquired the writer lock, and the lock (or the prefix) vanished or changed hands.
        """
        return self._write_node(node, epoch, blobs, save_id, previous, sync=True)[0]

    @property
    def defers_flush(self) -> bool:
        """Whether :meth:`write_node_unsynced` leaves a flush to its caller (local disk, fsync on)."""
        return self.fsync and isinstance(self._files(), LocalFiles)

    def write_node_unsynced(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Any],
        *,
        save_id: str,
        previous: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """:meth:`write_node` without the fsync: return the entry and the function that makes the
        group durable (``None`` when it already is: object stores, ``fsync=False``).

        Until that function returned, the group must not be committed, and no later group may
        reuse its chunks. It raises :class:`CheckpointWriteError` when the flush fails.
        """
        return self._write_node(node, epoch, blobs, save_id, previous, sync=False)

    def describe_node(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Any],
        *,
        save_id: str,
        previous: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The entry :meth:`write_node` would return, computed without touching storage (see
        :func:`._zarr.describe_group`): a node hands the write itself to its background thread.

        Raises
        ------
        JobDefinitionError, BlobTypeError
            As :meth:`write_node`, before anything is written.
        """
        _check_save(node, save_id)
        return describe_group(
            node, check_epoch(epoch), blobs, save_id=save_id, compression=self.compression, previous=previous
        )

    def _write_node(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Any],
        save_id: str,
        previous: Mapping[str, Any] | None,
        *,
        sync: bool,
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        _check_save(node, save_id)
        url = self.db_name(node, epoch)
        self.check_not_taken()
        try:  # an earlier attempt of ours goes; anything daskjobs did not write stays, and nothing is written
            clear_for_write(Tree(self.fs), self._path(f"{node}.{epoch}"), url, node, epoch)
        except OSError as exc:
            if isinstance(exc, CheckpointWriteError):
                raise
            raise CheckpointWriteError(
                f"could not write the checkpoint of node {node!r} at epoch {epoch} to {url}: {exc}"
            ) from exc
        where = self._group(node, epoch)
        entry = write_group(
            where,
            node,
            check_epoch(epoch),
            blobs,
            save_id=save_id,
            compression=self.compression,
            previous=previous,
            sync=sync,
        )
        if sync or not self.defers_flush:
            return entry, None
        return entry, functools.partial(self._flush_group, where.files, node, epoch)

    def _flush_group(self, files: LocalFiles, node: str, epoch: int, *, whole_tree: bool = False) -> None:
        """fsync what ``files`` wrote of ``node``'s group of ``epoch`` (``whole_tree``: every file and
        folder of the group, whoever wrote it); a failure is a :class:`CheckpointWriteError`."""
        try:
            if whole_tree:
                files.track_tree(self._path(f"{node}.{epoch}"))
            files.flush()
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not make the checkpoint of node {node!r} at epoch {epoch} durable at "
                f"{self.db_name(node, epoch)}: {exc}"
            ) from exc

    def make_durable(self, node: str, epoch: int, entry: Mapping[str, Any]) -> None:
        """Make ``node``'s group of ``epoch`` durable from this process, for a node that wrote it and
        can no longer report its own flush (its worker died).

        Every chunk is read and verified against ``entry`` first (so the files here are the ones
        the node wrote), then every file and folder of the group is fsynced.

        Raises
        ------
        CheckpointCorruptError, CheckpointNotFoundError
            The group here is not what the node wrote (or not visible from this host).
        CheckpointWriteError
            The flush failed.
        """
        where = self._group(node, epoch)
        read_group(where, node, check_epoch(epoch), entry)
        if self.defers_flush:
            self._flush_group(where.files, node, epoch, whole_tree=True)

    def read_node_entry(self, node: str, epoch: int) -> dict[str, Any]:
        """The entry ``node`` wrote for ``epoch`` (validated), whether committed or not.

        Raises
        ------
        CheckpointNotFoundError
            There is no such group.
        """
        entry = read_group_entry(self._group(node, epoch), node, check_epoch(epoch))
        if entry is None:
            raise CheckpointNotFoundError(f"no checkpoint of node {node!r} at epoch {epoch} under {self.url}")
        return entry

    def reader(self, node: str, epoch: int, entry: Mapping[str, Any], *, entry_validated: bool = False) -> GroupReader:
        """A reader of ``node``'s group of ``epoch`` that validated ``entry`` once (for many reads);
        ``entry_validated``: as in :meth:`read_node`."""
        validate_name(node, "node")
        return GroupReader(self._group(node, epoch), node, check_epoch(epoch), entry, validated=entry_validated)

    def read_node(
        self,
        node: str,
        epoch: int,
        entry: Mapping[str, Any],
        names: Iterable[str] | None = None,
        *,
        entry_validated: bool = False,
    ) -> dict[str, Any]:
        """Read ``node``'s blobs of ``epoch``, verified against ``entry`` (from the commit record).

        Parameters
        ----------
        names
            Blobs to read; names the entry lacks are skipped. Default: all of the entry's.
        entry_validated
            ``entry`` comes from a record :meth:`read_commit` returned (validated there): it is
            not validated again. The group's files are verified against it either way.

        Raises
        ------
        CheckpointCorruptError
            A chunk is missing, has the wrong size or digest, or array metadata differs from the
            entry; the message names epoch, node, blob and (when known) the chunk.
        CheckpointFormatError
            A data type or codec daskjobs does not read, or a checkpoint file that is not a
            regular file (FIFO, device, symlink …); nothing was decoded.
        """
        where = self._group(node, epoch)
        return GroupReader(where, node, check_epoch(epoch), entry, validated=entry_validated).read(names)

    # -- commits ------------------------------------------------------------------------------
    def commit(self, record: Mapping[str, Any], *, sync_folder: bool = True) -> None:
        """Write the commit record of ``record["epoch"]``, atomically (this is what makes the epoch exist).

        Local disks: temp file, fsync, ``os.replace``, fsync of the directory (with
        ``sync_folder=False`` left to :meth:`sync_commits`). Object stores: one PUT.
        A store holding the writer lock first checks it still does (:meth:`check_lock`).

        Raises
        ------
        CheckpointLockedError
            This store's lock vanished or changed hands; nothing was written.
        CheckpointFormatError
            The folder of commit records is a symbolic link or not a directory; nothing was written.
        CheckpointWriteError
            Storage failed.
        """
        epoch = check_epoch(record.get("epoch"))
        data = dumps(validate_commit_record(dict(record), epoch))
        self._check_held()
        path = self._commit_file(epoch)
        try:
            self._files().replace(path, data, sync_folder=sync_folder)
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write the commit record of epoch {epoch} under {self.url}: {exc}"
            ) from exc

    def committed_epochs(self) -> list[int]:
        """The committed epochs, ascending, listed afresh from the commit records (never cached).

        Raises
        ------
        CheckpointFormatError
            ``__daskjobs__`` or its ``commits`` folder is a symbolic link or not a directory:
            nothing outside the prefix is listed (see :meth:`~._prefix.Prefix.own_folder`).
        """
        names = self._files().listdir(self.own_folder("commits"))
        return sorted(int(m.group(1)) for name in names if (m := _COMMIT_RE.fullmatch(name)))

    def read_commit(self, epoch: int) -> dict[str, Any]:
        """The validated commit record of ``epoch``.

        Raises
        ------
        CheckpointNotFoundError
            ``epoch`` is not committed.
        CheckpointCorruptError
            The record is empty, truncated, not JSON, or has missing or invalid fields; the
            message names the file.
        CheckpointFormatError
            The record has another ``format_version``, is not a daskjobs record, is not a
            regular file, or its folder is a symbolic link.
        """
        url = self.commit_path(epoch)
        try:
            path = self._commit_file(epoch)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"commit record of epoch {epoch} ({url}): {exc}") from None
        data = self._read(path)
        if isinstance(data, FileNotFoundError):
            raise CheckpointNotFoundError(f"epoch {epoch} is not committed under {self.url}")
        if isinstance(data, UnsafeFileError):
            raise CheckpointFormatError(f"commit record of epoch {epoch} ({url}): {data}")
        if isinstance(data, OSError):
            raise CheckpointError(f"cannot read the commit record of epoch {epoch} ({url}): {data}")
        try:
            return validate_commit_record(loads(data, f"commit record of epoch {epoch}"), check_epoch(epoch))
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            raise type(exc)(f"{url}: {exc}") from None

    def scan_commits(self) -> list[tuple[int, dict[str, Any] | CheckpointError]]:
        """Every committed epoch, ascending, with its record or the error reading it raised.

        For listings that must show the good epochs and mark the damaged ones.
        """
        scanned: list[tuple[int, dict[str, Any] | CheckpointError]] = []
        for epoch in self.committed_epochs():
            try:
                scanned.append((epoch, self.read_commit(epoch)))
            except CheckpointNotFoundError:  # deleted since it was listed
                continue
            except CheckpointError as exc:
                scanned.append((epoch, exc))
        return scanned

    def latest_commit(self) -> dict[str, Any] | None:
        """The commit record of the newest committed epoch, or ``None`` if there is none.

        Raises
        ------
        CheckpointCorruptError, CheckpointFormatError
            The newest record cannot be read; the message names it and the epoch to resume from
            instead. Never silently falls back to an older epoch.
        """
        epochs = self.committed_epochs()
        if not epochs:
            return None
        try:
            return self.read_commit(epochs[-1])
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            hint = (
                f"; pass resume_from_epoch={epochs[-2]} to resume from the commit before it"
                if len(epochs) > 1
                else "; it is the only commit"
            )
            raise type(exc)(f"the latest commit is unreadable: {exc}{hint}") from None

    def uncommit(self, epoch: int, *, sync_folder: bool = True) -> None:
        """Delete the commit record of ``epoch`` (the first step of overwriting or deleting it).

        ``sync_folder=False`` leaves making that durable to :meth:`sync_commits`.
        """
        path = self._commit_file(epoch)
        try:
            self._files().remove(path, sync_folder=sync_folder)
        except OSError as exc:
            raise CheckpointWriteError(f"could not un-commit epoch {epoch} under {self.url}: {exc}") from exc

    def sync_commits(self) -> None:
        """Make commits and un-commits written with ``sync_folder=False`` durable."""
        folder = self.own_folder("commits")
        try:
            self._files().sync_folder(folder)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CheckpointWriteError(f"could not flush the commit records under {self.url}: {exc}") from exc

    def delete_epoch(self, epoch: int, nodes: Iterable[str]) -> None:
        """Delete ``epoch``: its commit record first, then what it recorded of the groups of ``nodes``.

        Only the files the commit record lists (each blob's ``zarr.json`` and chunks) and the
        group's own ``zarr.json`` are deleted, folders only once empty; a group without
        daskjobs' marker, a user's file inside a group, a symlink are left alone (see
        :mod:`._cleanup`). A crash midway leaves an uncommitted group that
        :meth:`cleanup_uncommitted` finishes, never a damaged committed one.

        Raises
        ------
        CheckpointLockedError
            This store holds the writer lock and it vanished or changed hands.
        CheckpointWriteError
            Storage failed.
        """
        self.remove_retired(self.retire_epoch(epoch, nodes))

    def retire_epoch(
        self, epoch: int, nodes: Iterable[str], *, sync_folder: bool = True, record: Mapping[str, Any] | None = None
    ) -> RetiredEpoch:
        """Un-commit ``epoch`` and return what :meth:`remove_retired` must delete of its groups.

        With ``sync_folder=False``, call :meth:`sync_commits` before :meth:`remove_retired`: until
        then a crash may bring the commit record back, so its groups must stay whole. ``record``:
        the epoch's commit record as this store wrote it (else it is read).

        Raises
        ------
        CheckpointLockedError, CheckpointWriteError
            As :meth:`delete_epoch`.
        """
        nodes = [validate_name(node, "node") for node in nodes]
        epoch = check_epoch(epoch)
        self._check_held()
        try:
            entries = (record or self.read_commit(epoch))["node_entries"]
        except CheckpointNotFoundError:
            entries = {}
        self.uncommit(epoch, sync_folder=sync_folder)
        return RetiredEpoch(epoch, {node: entries.get(node) for node in nodes})

    def remove_retired(self, retired: RetiredEpoch) -> None:
        """Delete what ``retired`` (from :meth:`retire_epoch`, un-commit durable) recorded of its groups.

        Raises
        ------
        CheckpointLockedError, CheckpointWriteError
            As :meth:`delete_epoch`.
        """
        self._check_held()
        tree = Tree(self.fs)
        try:
            for node, entry in retired.entries.items():
                remove_group(tree, self._path(f"{node}.{retired.epoch}"), node, retired.epoch, entry)
        except OSError as exc:
            raise CheckpointWriteError(f"could not delete epoch {retired.epoch} under {self.url}: {exc}") from exc

    def cleanup_uncommitted(self, nodes: Iterable[str] | None = None) -> list[str]:
        """Remove debris of saves that never committed; return what was removed.

        Removed: daskjobs' files in directories named ``<node>.<epoch>`` whose epoch has no
        commit record and that carry daskjobs' marker for that node and epoch, and daskjobs' own
        temp files under ``__daskjobs__/``. ``nodes`` defaults to the nodes of the latest commit
        (any node while nothing is committed). A folder that merely looks like a group
        (``mydata.2024``), a user's file, a symlink are never touched (see :mod:`._cleanup`).
        Do not call it while a save to the prefix is in flight.
        """
        wanted = None if nodes is None else {validate_name(n, "node") for n in nodes}
        self._check_held()
        committed = set(self.committed_epochs())
        if wanted is None and committed:  # the prefix holds one job: its nodes are the latest commit's
            wanted = set(self.read_commit(max(committed))["nodes"])
        try:
            debris = remove_debris(Tree(self.fs), self._root, committed, wanted, OWN)
            removed = [f"{self.url}/{path}" for path in debris]
        except OSError as exc:
            raise CheckpointWriteError(f"cleaning up {self.url} failed: {exc}") from exc
        if removed:
            logger.info("removed uncommitted checkpoint debris under %s: %s", self.url, removed)
        return removed
