"""The checkpoint store: one prefix's layout and node groups (commit records, listing, deletion and
cleanup come from :class:`~.commits.Commits`).

Layout under a prefix (a local directory or an fsspec URL)::

    <node>.<epoch>/                              one Zarr v3 group per node and epoch (``zarr_groups``)
    __daskjobs__/commits/epoch-000000000005.json   commit record of epoch 5, written last
    __daskjobs__/lock.json                       the writer lock

An epoch exists only once its commit record does. Node names cannot start with ``__``, so
nothing of daskjobs' own can collide with a node's group. File access goes through the storage
protocol (:mod:`.._storage.base`: plain ``os`` calls on local disks, fsspec elsewhere); the Zarr
side lives in :mod:`.._storage.zarr_groups`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._model.values import validate_name
from ...errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
)
from .._format.entries import SAVE_ID_RE, check_epoch
from .._format.records import MANIFEST_KEY, committed_entry
from .._storage.base import LocalTree, local_tree
from .._storage.cleanup import Tree, clear_for_write, staged_group, staging_name, take_over_group
from .._storage.group_metadata import read_group_entry, read_manifest
from .._storage.reader import GroupReader, read_group
from .._storage.zarr_groups import COMPRESSIONS, Location, describe_group, write_group
from .commits import Commits, RetiredEpoch

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import BlobMeta, CommitRecord, EntryRef, NodeEntry

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class GroupFlush:
    """Makes one group a node wrote durable: at once (call it), or in the process's next batch of
    syncs with the groups of the other nodes it serves (:meth:`soon`). Either fails with
    :class:`CheckpointWriteError` naming node and epoch."""

    store: CheckpointStore
    files: LocalTree
    node: str
    epoch: int

    def __call__(self) -> None:
        self.store._flush_group(self.files, self.node, self.epoch)

    def soon(self) -> Future[None]:
        """A future that is done once the group is durable."""
        done: Future[None] = Future()

        def report(synced: Future[None]) -> None:
            error = synced.exception()
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(self.store._flush_error(self.node, self.epoch, error))

        self.files.flush_soon().add_done_callback(report)
        return done


def _check_save(node: str, save_id: str) -> None:
    """Refuse a bad node name or save id before anything is written."""
    validate_name(node, "node")
    if not isinstance(save_id, str) or not SAVE_ID_RE.fullmatch(save_id):
        raise JobDefinitionError(f"save_id must be 1-128 characters from A-Z a-z 0-9 _ -, got {save_id!r}")


class CheckpointStore(Commits):
    """One checkpoint prefix: a local path or an fsspec URL. Picklable (shipped to Dask workers).

    Parameters
    ----------
    db_prefix, storage_options
        Where the prefix is, as for :class:`~.prefix.Prefix`.
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

    def has_group(self, node: str, epoch: int) -> bool:
        """Whether ``node``'s group of ``epoch`` is there (its folder, or any object under it); what
        it holds is checked when it is read. A store that cannot tell counts it as there."""
        try:
            return bool(self.fs.exists(self._path(f"{node}.{epoch}")))
        except OSError:
            return True

    def _group(self, node: str, epoch: int) -> Location:
        url = self.db_name(node, epoch)
        return Location(self._files(), self._path(f"{node}.{epoch}"), url, self.anchor)

    # -- node side --------------------------------------------------------------------------
    def write_node(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Value],
        *,
        save_id: str,
        previous: EntryRef | None = None,
    ) -> NodeEntry:
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
            "chunks", "codec", "hashes"}}, "bytes", "bytes_written", "bytes_reused", "seconds",
            "manifest": {"size", "xxh3"}}``, JSON-able: the node's manifest (everything but
            ``"manifest"``, which names the group's ``zarr.json`` holding the rest); pass it to
            :func:`~.._format.records.make_commit_record`.

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
        return self._files().defers_flush

    def write_node_unsynced(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Value],
        *,
        save_id: str,
        previous: EntryRef | None = None,
        retired: RetiredEpoch | None = None,
    ) -> tuple[NodeEntry, GroupFlush | None]:
        """:meth:`write_node` without the fsync: return the entry and the :class:`GroupFlush` that makes
        the group durable (``None`` when it already is: object stores, ``fsync=False``).

        Until that flush returned, the group must not be committed, and no later group may reuse
        its chunks. It raises :class:`CheckpointWriteError` when it fails.

        ``retired``: an epoch whose un-commit is durable and whose group of ``node`` is to go (see
        :meth:`remove_retired`). On a local disk that group is renamed and written over instead of
        deleted, when it holds exactly what its manifest lists (see
        :func:`~.._storage.cleanup.take_over_group`): the save then creates and deletes no file
        that did not change shape; otherwise it is deleted first.
        """
        return self._write_node(node, epoch, blobs, save_id, previous, sync=False, retired=retired)

    def describe_node(
        self,
        node: str,
        epoch: int,
        blobs: Mapping[str, Value],
        *,
        save_id: str,
        previous: EntryRef | None = None,
    ) -> NodeEntry:
        """The entry :meth:`write_node` would return, computed without touching storage (see
        :func:`~.._storage.zarr_groups.describe_group`): a node hands the write itself to its background thread.

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
        blobs: Mapping[str, Value],
        save_id: str,
        previous: EntryRef | None,
        *,
        sync: bool,
        retired: RetiredEpoch | None = None,
    ) -> tuple[NodeEntry, GroupFlush | None]:
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
            over=None if retired is None else self._take_over(node, retired, where),
        )
        if sync or not local_tree(where.files) or not where.files.defers_flush:
            return entry, None
        return entry, GroupFlush(self, where.files, node, epoch)

    def _take_over(self, node: str, retired: RetiredEpoch, where: Location) -> tuple[str, dict[str, BlobMeta]] | None:
        """Rename ``node``'s group of the ``retired`` epoch to a staging folder of the group at ``where``
        and return both with its blobs (see :func:`~.._storage.cleanup.take_over_group`), where the
        files can be written over in place; else delete it (a failure is a warning, as retention's)
        and return ``None``."""
        old, staging = self._path(f"{node}.{retired.epoch}"), staging_name(where.path)
        blobs = None
        if local_tree(where.files):
            with contextlib.suppress(OSError):  # unreadable: deleting it says why
                entry = retired.entries.get(node)
                blobs = take_over_group(Tree(self.fs), where.files, old, staging, node, retired.epoch, entry)
        if blobs is not None:
            return staging, blobs
        try:
            self.remove_retired(RetiredEpoch(retired.epoch, {node: retired.entries.get(node)}))
        except CheckpointError as exc:
            logger.warning(
                "retention: could not delete node %r's group of epoch %d under %s: %s",
                node,
                retired.epoch,
                self.url,
                exc,
            )
        return None

    def _flush_group(self, files: LocalTree, node: str, epoch: int, *, whole_tree: bool = False) -> None:
        """fsync what ``files`` wrote of ``node``'s group of ``epoch`` (``whole_tree``: every file and
        folder of the group, whoever wrote it); a failure is a :class:`CheckpointWriteError`."""
        try:
            if whole_tree:
                files.track_tree(self._path(f"{node}.{epoch}"))
            files.flush()
        except OSError as exc:
            raise self._flush_error(node, epoch, exc) from exc

    def _flush_error(self, node: str, epoch: int, exc: BaseException) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"could not make the checkpoint of node {node!r} at epoch {epoch} durable at "
            f"{self.db_name(node, epoch)}: {exc}"
        )

    def make_durable(self, node: str, epoch: int, entry: EntryRef) -> NodeEntry:
        """Make ``node``'s group of ``epoch`` durable from this process, for a node that wrote it and
        can no longer report its own flush (its worker died); return the entry the group holds.

        The group must hold the save ``entry`` (the node's entry, or its summary) describes: the
        same save id, blobs and manifest where ``entry`` names them. A group written over a
        retired one and still in its staging folder (see :meth:`write_node_unsynced`) is renamed
        into place first. Every chunk is read and
        verified against the group's manifest first (so the files here are whole), then every file
        and folder of the group is fsynced.

        Raises
        ------
        CheckpointCorruptError, CheckpointNotFoundError
            The group here is not what the node wrote (or not visible from this host).
        CheckpointWriteError
            The flush failed.
        """
        where, stored, _blobs = self._written_group(node, epoch, entry)
        if local_tree(where.files) and where.files.defers_flush:
            self._flush_group(where.files, node, epoch, whole_tree=True)
        return stored

    def read_unflushed(self, node: str, epoch: int, entry: EntryRef) -> dict[str, Value]:
        """The blobs of ``node``'s group of ``epoch`` whose flush failed, read back and verified: what
        a node writes again, as a new group, when the save is retried (see :meth:`make_durable` for
        ``entry`` and the staging folder).

        Raises
        ------
        CheckpointCorruptError, CheckpointNotFoundError
            The group here is not the save ``entry`` describes, or not whole.
        """
        return self._written_group(node, epoch, entry)[2]

    def _written_group(self, node: str, epoch: int, entry: EntryRef) -> tuple[Location, NodeEntry, dict[str, Value]]:
        """Where ``node``'s group of ``epoch`` holding the save ``entry`` describes is (renamed into place
        from its staging folder), the entry it holds and its blobs, every chunk verified."""
        where = self._group(node, epoch)
        files = where.files
        if local_tree(files) and not self.has_group(node, epoch):
            staged = staged_group(Tree(self.fs), self._root, node, epoch, entry.get("save_id"))
            if staged is not None:  # written whole, its worker died before the flush put it in place
                files.publish(staged)
        stored = self.read_node_entry(node, epoch)
        ref = entry.get(MANIFEST_KEY)
        if (
            stored["save_id"] != entry.get("save_id")
            or (isinstance(ref, Mapping) and stored[MANIFEST_KEY] != ref)
            or ("blobs" in entry and stored["blobs"] != entry["blobs"])
        ):
            raise CheckpointCorruptError(
                f"epoch {epoch}, node {node!r}: {self.db_name(node, epoch)} does not hold the save "
                f"{entry.get('save_id')} the node reported"
            )
        return where, stored, read_group(where, node, check_epoch(epoch), stored)

    def read_node_entry(self, node: str, epoch: int) -> NodeEntry:
        """The entry ``node`` wrote for ``epoch`` (validated, naming its manifest), whether committed or not.

        Raises
        ------
        CheckpointNotFoundError
            There is no such group.
        """
        entry = read_group_entry(self._group(node, epoch), node, check_epoch(epoch))
        if entry is None:
            raise CheckpointNotFoundError(f"no checkpoint of node {node!r} at epoch {epoch} under {self.url}")
        return entry

    def resolve_entry(self, node: str, epoch: int, entry: EntryRef) -> NodeEntry:
        """``node``'s whole entry of committed ``epoch`` from what its commit record holds of it: a
        summary's manifest read and verified (see :func:`~.._storage.group_metadata.read_manifest`), or the entry
        itself (records before format version 4, and entries a write returned).

        Raises
        ------
        CheckpointCorruptError
            The manifest is missing, truncated, edited, or another node's or epoch's.
        CheckpointFormatError
            The manifest is not a regular file, or names a dtype or codec daskjobs does not read.
        """
        if "blobs" in entry:
            return entry.copy()
        return read_manifest(self._group(validate_name(node, "node"), epoch), node, check_epoch(epoch), entry)

    def node_entries(self, epoch: int, record: CommitRecord | None = None) -> dict[str, NodeEntry]:
        """Every checkpointed node's entry of committed ``epoch``: its blobs with kind, dtype, shape,
        chunks and the XXH3-128 digest of every chunk file (see :mod:`.._format.entries`), validated.

        From format version 4 on, each node's manifest is read and verified against the commit
        record (its size and digest); earlier records hold the entries themselves. ``record`` is the
        epoch's commit record when the caller has read it already. This is the one way to get at
        the entries: callers do not look inside a record for them.

        Raises
        ------
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointFormatError
            As :meth:`read_commit`, and :meth:`resolve_entry` for a manifest.
        """
        record = self.read_commit(epoch) if record is None else record
        return {node: self.resolve_entry(node, epoch, committed_entry(record, node)) for node in record["nodes"]}

    def reader(self, node: str, epoch: int, entry: EntryRef, *, entry_validated: bool = False) -> GroupReader:
        """A reader of ``node``'s group of ``epoch`` that validated ``entry`` once (for many reads);
        ``entry``: as in :meth:`read_node`."""
        validate_name(node, "node")
        return GroupReader(self._group(node, epoch), node, check_epoch(epoch), entry, validated=entry_validated)

    def read_node(
        self,
        node: str,
        epoch: int,
        entry: EntryRef,
        names: Iterable[str] | None = None,
        *,
        entry_validated: bool = False,
    ) -> dict[str, Value]:
        """Read ``node``'s blobs of ``epoch``, verified against ``entry`` (from the commit record).

        Parameters
        ----------
        entry
            The node's entry, or its summary from a commit record (its manifest is then read and
            verified first, see :meth:`resolve_entry`).
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
