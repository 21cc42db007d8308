"""The checkpoint store: one prefix's layout, commit records, listing, deletion, cleanup and lock.

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

import logging
import operator
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from .._validation import validate_name
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    JobDefinitionError,
)
from ._files import LocalFiles, RemoteFiles, UnsafeFileError, files_for
from ._format import MAX_EPOCH, MAX_JSON_BYTES, dumps, loads, validate_commit_record, validate_node_entry
from ._reader import GroupReader, read_group, read_group_entry
from ._zarr import COMPRESSIONS, Location, write_group

logger = logging.getLogger("daskjobs")

_OWN = "__daskjobs__"
_COMMIT_RE = re.compile(r"epoch-(\d{12})\.json")
_TEMP_RE = re.compile(r"[A-Za-z0-9_.\-]+\.tmp-[0-9a-f]{32}")
_GROUP_RE = re.compile(r"(.+)\.(0|[1-9][0-9]{0,11})")
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_\-]{1,128}")


def _epoch(epoch: Any) -> int:
    try:
        value = operator.index(epoch)
    except TypeError:
        raise JobDefinitionError(f"epoch must be an int, got {type(epoch).__name__}: {epoch!r}") from None
    if isinstance(epoch, bool) or not 0 <= value <= MAX_EPOCH:
        raise JobDefinitionError(f"epoch must be an int from 0 to {MAX_EPOCH}, got {epoch!r}")
    return value


class CheckpointStore:
    """One checkpoint prefix: a local path or an fsspec URL. Picklable (shipped to Dask workers).

    Parameters
    ----------
    db_prefix
        A local path (``~`` and relative paths are resolved once, here), a ``file://`` URL, or
        any fsspec URL (``memory://``, ``s3://`` …). ``memory://`` is private to each process.
    storage_options
        fsspec options (credentials, endpoint …); never written to a checkpoint or shown in ``repr``.
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
        self.storage_options = dict(storage_options or {})
        self.compression = compression
        self.fsync = bool(fsync)
        prefix = os.fspath(db_prefix)
        if "://" not in prefix:
            prefix = os.path.abspath(os.path.expanduser(prefix))
        fs, root = fsspec.core.url_to_fs(prefix, **self.storage_options)
        self._fs: AbstractFileSystem | None = fs
        if isinstance(fs, LocalFileSystem):
            root = os.path.abspath(os.path.expanduser(root))
            self.url = root.rstrip("/") or "/"
        else:
            self.url = prefix.rstrip("/")
        self._root = root.rstrip("/")
        self._lock_token: str | None = None

    # -- plumbing -------------------------------------------------------------------------
    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem of the prefix (created again after unpickling)."""
        if self._fs is None:
            self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
        return self._fs

    def _files(self) -> LocalFiles | RemoteFiles:
        return files_for(self.fs, self.fsync)

    def _path(self, *parts: str) -> str:
        return "/".join([self._root, *parts])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def db_name(self, node: str, epoch: int) -> str:
        """Where ``node``'s group of ``epoch`` lives: ``f"{url}/{node}.{epoch}"`` (Caffe2's naming)."""
        return f"{self.url}/{validate_name(node, 'node')}.{_epoch(epoch)}"

    def commit_path(self, epoch: int) -> str:
        """Where the commit record of ``epoch`` lives (under :attr:`url`)."""
        return f"{self.url}/{_OWN}/commits/epoch-{_epoch(epoch):012d}.json"

    def _group(self, node: str, epoch: int) -> Location:
        url = self.db_name(node, epoch)
        return Location(self._files(), self._path(f"{node}.{epoch}"), url)

    def _commit_file(self, epoch: int) -> str:
        return self._path(_OWN, "commits", f"epoch-{_epoch(epoch):012d}.json")

    def _read(self, path: str) -> bytes | OSError:
        return self._files().read_small([path], MAX_JSON_BYTES)[0]

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
        into the group's attributes.

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
        """
        validate_name(node, "node")
        if not isinstance(save_id, str) or not _SAVE_ID_RE.fullmatch(save_id):
            raise JobDefinitionError(f"save_id must be 1-128 characters from A-Z a-z 0-9 _ -, got {save_id!r}")
        return write_group(
            self._group(node, epoch),
            node,
            _epoch(epoch),
            blobs,
            save_id=save_id,
            compression=self.compression,
            previous=previous,
        )

    def read_node_entry(self, node: str, epoch: int) -> dict[str, Any]:
        """The entry ``node`` wrote for ``epoch`` (validated), whether committed or not.

        Raises
        ------
        CheckpointNotFoundError
            There is no such group.
        """
        entry = read_group_entry(self._group(node, epoch), node, _epoch(epoch))
        if entry is None:
            raise CheckpointNotFoundError(f"no checkpoint of node {node!r} at epoch {epoch} under {self.url}")
        return entry

    def reader(self, node: str, epoch: int, entry: Mapping[str, Any]) -> GroupReader:
        """A reader of ``node``'s group of ``epoch`` that validated ``entry`` once (for many reads)."""
        validate_name(node, "node")
        checked = validate_node_entry(entry, node, epoch, f"entry of epoch {epoch}, node {node!r}")
        return GroupReader(self._group(node, epoch), node, _epoch(epoch), checked, validated=True)

    def read_node(
        self, node: str, epoch: int, entry: Mapping[str, Any], names: Iterable[str] | None = None
    ) -> dict[str, Any]:
        """Read ``node``'s blobs of ``epoch``, verified against ``entry`` (from the commit record).

        Parameters
        ----------
        names
            Blobs to read; names the entry lacks are skipped. Default: all of the entry's.

        Raises
        ------
        CheckpointCorruptError
            A chunk is missing, has the wrong size or digest, or array metadata differs from the
            entry; the message names epoch, node, blob and (when known) the chunk.
        CheckpointFormatError
            A data type or codec daskjobs does not read, or a checkpoint file that is not a
            regular file (FIFO, device, symlink …); nothing was decoded.
        """
        return read_group(self._group(node, epoch), node, _epoch(epoch), entry, names)

    # -- commits ------------------------------------------------------------------------------
    def commit(self, record: Mapping[str, Any]) -> None:
        """Write the commit record of ``record["epoch"]``, atomically (this is what makes the epoch exist).

        Local disks: temp file, fsync, ``os.replace``, fsync of the directory. Object stores: one PUT.
        """
        epoch = _epoch(record.get("epoch"))
        data = dumps(validate_commit_record(dict(record), epoch))
        try:
            self._files().replace(self._commit_file(epoch), data)
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write the commit record of epoch {epoch} under {self.url}: {exc}"
            ) from exc

    def committed_epochs(self) -> list[int]:
        """The committed epochs, ascending, listed afresh from the commit records (never cached)."""
        names = self._files().listdir(self._path(_OWN, "commits"))
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
            The record has another ``format_version``, is not a daskjobs record, or is not a
            regular file.
        """
        url = self.commit_path(epoch)
        data = self._read(self._commit_file(epoch))
        if isinstance(data, FileNotFoundError):
            raise CheckpointNotFoundError(f"epoch {epoch} is not committed under {self.url}")
        if isinstance(data, UnsafeFileError):
            raise CheckpointFormatError(f"commit record of epoch {epoch} ({url}): {data}")
        if isinstance(data, OSError):
            raise CheckpointError(f"cannot read the commit record of epoch {epoch} ({url}): {data}")
        try:
            return validate_commit_record(loads(data, f"commit record of epoch {epoch}"), _epoch(epoch))
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

    def uncommit(self, epoch: int) -> None:
        """Delete the commit record of ``epoch`` (the first step of overwriting or deleting it)."""
        try:
            self._files().remove(self._commit_file(epoch))
        except OSError as exc:
            raise CheckpointWriteError(f"could not un-commit epoch {epoch} under {self.url}: {exc}") from exc

    def delete_epoch(self, epoch: int, nodes: Iterable[str]) -> None:
        """Delete ``epoch``: its commit record first, then the groups of ``nodes``."""
        nodes = [validate_name(node, "node") for node in nodes]
        self.uncommit(epoch)
        try:
            for node in nodes:
                self._files().clear(self._path(f"{node}.{_epoch(epoch)}"))
        except OSError as exc:
            raise CheckpointWriteError(f"could not delete epoch {epoch} under {self.url}: {exc}") from exc

    def cleanup_uncommitted(self, nodes: Iterable[str] | None = None) -> list[str]:
        """Remove debris of saves that never committed; return what was removed.

        Removed: directories named exactly ``<node>.<epoch>`` (a valid node name, of ``nodes`` if
        given, and a canonical integer epoch) whose epoch has no commit record, and daskjobs' own
        temp files under ``__daskjobs__/``. Nothing else is ever touched. Do not call it while a
        save to the prefix is in flight.
        """
        wanted = None if nodes is None else {validate_name(n, "node") for n in nodes}
        committed = set(self.committed_epochs())
        files, removed = self._files(), []
        try:
            for name, is_dir in sorted(files.listdir(self._root).items()):
                match = _GROUP_RE.fullmatch(name)
                if not (
                    is_dir and match and self._is_node(match.group(1), wanted) and int(match.group(2)) not in committed
                ):
                    continue
                files.clear(self._path(name))
                removed.append(f"{self.url}/{name}")
            for folder in (self._path(_OWN), self._path(_OWN, "commits")):
                for name, is_dir in sorted(files.listdir(folder).items()):
                    if not is_dir and _TEMP_RE.fullmatch(name):
                        files.remove(f"{folder}/{name}")
                        removed.append(f"{self.url}{folder[len(self._root) :]}/{name}")
        except OSError as exc:
            raise CheckpointWriteError(f"cleaning up {self.url} failed: {exc}") from exc
        if removed:
            logger.info("removed uncommitted checkpoint debris under %s: %s", self.url, removed)
        return removed

    @staticmethod
    def _is_node(name: str, wanted: set[str] | None) -> bool:
        try:
            validate_name(name, "node")
        except JobDefinitionError:
            return False
        return wanted is None or name in wanted

    # -- writability and the writer lock ------------------------------------------------------
    def check_writable(self) -> None:
        """Create a missing local prefix, then write, read back and delete a probe under ``__daskjobs__/``.

        Raises
        ------
        CheckpointWriteError
            Naming the prefix and the underlying error.
        """
        probe = self._path(_OWN, f"probe.tmp-{uuid.uuid4().hex}")
        data = uuid.uuid4().hex.encode()
        files = self._files()
        try:
            files.replace(probe, data)
            back = self._read(probe)
            files.remove(probe)
        except OSError as exc:
            raise CheckpointWriteError(f"checkpoint prefix {self.url} is not writable: {exc}") from exc
        if back != data:
            raise CheckpointWriteError(
                f"checkpoint prefix {self.url} is not usable: a probe file read back "
                f"{back!r} instead of what was written"
            )

    def acquire_lock(self, holder: Mapping[str, Any], *, break_lock: bool = False) -> None:
        """Become the one writer of the prefix.

        Local disks create ``__daskjobs__/lock.json`` with ``O_EXCL``; other filesystems use an
        exclusive create (on S3 a PUT with ``If-None-Match: *``).

        Parameters
        ----------
        holder
            Who is writing, e.g. ``{"host", "pid", "job", "started"}``; shown to anyone refused.
        break_lock
            Remove an existing lock first (when its holder is known to be gone).

        Raises
        ------
        CheckpointLockedError
            Another holder has the lock; the message names it.
        """
        path = self._path(_OWN, "lock.json")
        token = uuid.uuid4().hex
        data = dumps({**holder, "token": token})
        if break_lock:
            logger.warning("breaking the checkpoint lock of %s held by %s", self.url, self.read_lock())
            self._files().remove(path)
        try:
            self._files().create(path, data)
        except FileExistsError:  # s3fs reports a failed If-None-Match precondition as this too
            raise self._locked() from None
        except OSError as exc:
            raise CheckpointWriteError(f"could not lock checkpoint prefix {self.url}: {exc}") from exc
        self._lock_token = token

    def _locked(self) -> CheckpointLockedError:
        held = self.read_lock() or {}
        who = ", ".join(f"{k} {held[k]}" for k in ("host", "pid", "job", "started") if k in held) or str(held)
        return CheckpointLockedError(
            f"checkpoint prefix {self.url} is locked by another writer ({who}); if it is "
            "gone, run `daskjobs checkpoints unlock "
            f"{self.url}` or pass JobRunner(..., break_lock=True)"
        )

    def release_lock(self) -> None:
        """Remove the lock this store acquired; a store that acquired none removes any lock (explicit unlock).

        A lock taken over by someone else (after ``break_lock``) is left alone, with a warning.
        """
        current = self.read_lock()
        mine, self._lock_token = self._lock_token, None
        if current is None:
            return
        if mine is not None and current.get("token") != mine:
            logger.warning("not releasing the checkpoint lock of %s: it is now held by %s", self.url, current)
            return
        self._files().remove(self._path(_OWN, "lock.json"))

    def read_lock(self) -> dict[str, Any] | None:
        """The lock holder, ``None`` if unlocked, or ``{"unreadable": reason}`` for a damaged lock file."""
        data = self._read(self._path(_OWN, "lock.json"))
        if isinstance(data, FileNotFoundError):
            return None
        try:
            if isinstance(data, OSError):
                raise CheckpointCorruptError(str(data))
            holder = loads(data, "lock file")
        except CheckpointCorruptError as exc:
            return {"unreadable": str(exc)}
        return holder if isinstance(holder, dict) else {"unreadable": f"lock file holds {type(holder).__name__}"}
