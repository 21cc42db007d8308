"""A checkpoint prefix: where it is (a local directory or an fsspec URL), and who may write to it.

:class:`Prefix` resolves the location once, gives access to its files (the storage protocol, :mod:`.._storage.base`) and
holds the writer lock (:mod:`.lock`); :class:`~.store.CheckpointStore` adds what is stored.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ...errors import CheckpointFormatError, CheckpointLockedError, CheckpointWriteError
from .._format.entries import MAX_JSON_BYTES
from .._storage.base import Files, UnsafeFileError
from .._storage.remote import files_for
from . import lock as _lock
from .lock import LOCK_NAME

OWN = "__daskjobs__"
"""The folder of daskjobs' own files under a prefix (commit records, the lock, staging)."""


class Prefix:
    """A checkpoint prefix and its writer lock. Picklable (the filesystem is made again after unpickling).

    Parameters
    ----------
    db_prefix
        A local path (``~`` and relative paths are resolved once, here), a ``file://`` URL, or
        any fsspec URL (``memory://``, ``s3://`` …). ``memory://`` is private to each process.
    storage_options
        fsspec options (credentials, endpoint …); never written to a checkpoint or shown in ``repr``.
    fsync
        Make what is written durable on local disks before it counts.
    """

    def __init__(
        self, db_prefix: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, fsync: bool = True
    ) -> None:
        self.storage_options = dict(storage_options or {})
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
        self.anchor: str | None = None
        """Once :meth:`check_writable` made sure the prefix exists: the folder that must exist for
        a node group to be written below it, never created again once it vanished (``None``:
        missing folders are created)."""
        self._lock_token: str | None = None

    # -- plumbing -------------------------------------------------------------------------
    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem of the prefix (created again after unpickling)."""
        if self._fs is None:
            self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
        return self._fs

    def _files(self) -> Files:
        return files_for(self.fs, self.fsync)

    def _path(self, *parts: str) -> str:
        return "/".join([self._root, *parts])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    def _read(self, path: str) -> bytes | OSError:
        return self._files().read_small([path], MAX_JSON_BYTES)[0]

    def own_folder(self, *parts: str) -> str:
        """The path of daskjobs' own folder ``__daskjobs__`` (or of the folder ``parts`` inside it),
        checked first: nothing is read or written through a symlink there.

        Folders that do not exist yet are fine (they are created when written to). Object stores
        have no symlinks; there is nothing to check.

        Raises
        ------
        CheckpointFormatError
            ``__daskjobs__`` or a folder of ``parts`` is a symbolic link (which could lead outside
            the prefix), a file or anything else but a real directory.
        """
        files = self._files()
        folders = [self._path(OWN, *parts[:depth]) for depth in range(len(parts) + 1)]
        for folder in folders:
            try:
                files.check_directory(folder)
            except (FileNotFoundError, NotADirectoryError):  # nothing there yet: writing it fails or creates it
                break
            except UnsafeFileError as exc:
                raise CheckpointFormatError(
                    f"checkpoint prefix {self.url}: {exc}; commit records and the lock must be in real "
                    "folders inside the prefix: replace the link by the folder it leads to"
                ) from None
        return folders[-1]

    # -- writability and the writer lock ------------------------------------------------------
    def check_writable(self) -> None:
        """Create a missing local prefix, then write, read back and delete a probe under ``__daskjobs__/``.

        From then on the prefix is this store's :attr:`anchor`: should it vanish, saves fail
        instead of creating it again.

        Raises
        ------
        CheckpointWriteError
            Naming the prefix and the underlying error.
        CheckpointFormatError
            ``__daskjobs__`` is a symlink or not a directory (see :meth:`own_folder`).
        """
        probe = f"{self.own_folder()}/probe.tmp-{uuid.uuid4().hex}"
        data = uuid.uuid4().hex.encode()
        files = self._files()
        try:  # a probe need not survive a crash: no fsync (every save syncs, and fails if it cannot)
            files.replace(probe, data, sync_folder=False, sync_file=False)
            back = self._read(probe)
            files.remove(probe, sync_folder=False)
        except OSError as exc:
            raise CheckpointWriteError(f"checkpoint prefix {self.url} is not writable: {exc}") from exc
        if back != data:
            raise CheckpointWriteError(
                f"checkpoint prefix {self.url} is not usable: a probe file read back "
                f"{back!r} instead of what was written"
            )
        self.anchor = self._root

    # -- probe files (see ._sharing) --------------------------------------------------------
    def new_probe(self) -> str:
        """The path of a new probe file in ``__daskjobs__/``: a daskjobs temp file name
        (``probe.tmp-<32 hex digits>``), so the cleanup before a run removes any left behind."""
        return f"{self.own_folder()}/probe.tmp-{uuid.uuid4().hex}"

    def write_probe(self, path: str, data: bytes) -> None:
        """Write a probe file (not fsynced: it need not survive a crash); raises ``OSError``."""
        self._files().replace(path, data, sync_folder=False, sync_file=False)

    def read_probes(self, paths: Sequence[str]) -> list[bytes | OSError]:
        """The bytes of each probe file, or the error reading it (``FileNotFoundError``: not there)."""
        return self._files().read_small(list(paths), MAX_JSON_BYTES)

    def _own_path(self) -> str:
        return self.own_folder()

    def _lock_file(self) -> str:
        return f"{self.own_folder()}/{LOCK_NAME}"

    def acquire_lock(self, holder: Mapping[str, Any], *, break_lock: bool = False) -> None:
        """Become the one writer of the prefix, taking over a provably stale lock atomically.

        The lock is ``__daskjobs__/lock.json``, created exclusively (``O_EXCL`` locally, a PUT
        with ``If-None-Match: *`` on S3). A lock whose holder provably no longer runs (this
        host, no such process) is taken over with a warning; of several processes racing for
        it exactly one wins (see :mod:`.lock`). A foreign lock (another host, or a pid no
        process can have) is refused unless ``break_lock``.

        Parameters
        ----------
        holder
            Who is writing, e.g. ``{"host", "pid", "job", "started"}``; shown to anyone refused.
        break_lock
            Take over the lock even if its holder may still run (another host, a pid no process
            can have, a damaged lock file).

        Raises
        ------
        CheckpointLockedError
            Another holder has the lock; the message names it.
        CheckpointWriteError
            The lock could not be written.
        CheckpointFormatError
            ``__daskjobs__`` is a symlink or not a directory (see :meth:`own_folder`).

        Examples
        --------
        >>> import tempfile
        >>> from daskjobs.checkpoint import CheckpointStore
        >>> store = CheckpointStore(tempfile.mkdtemp())
        >>> store.acquire_lock({"host": "here", "pid": 1, "job": "train"})
        >>> store.check_lock()
        >>> store.release_lock()
        """
        self._lock_token = _lock.acquire(self._files(), self._lock_file(), self.url, holder, break_lock=break_lock)

    def check_lock(self) -> None:
        """Check that this store still holds its lock (one small read); :meth:`commit` calls it first.

        Raises
        ------
        CheckpointLockedError
            The lock file (or the whole prefix) vanished, or holds another writer's token, or
            this store never acquired the lock.
        """
        if self._lock_token is None:
            raise CheckpointLockedError(f"this store does not hold the writer lock of {self.url}")
        try:
            path = self._lock_file()
        except CheckpointFormatError as exc:
            raise CheckpointLockedError(f"the writer lock of {self.url} is no longer in the prefix: {exc}") from None
        _lock.check(self._files(), path, self.url, self._lock_token)

    def check_not_taken(self) -> None:
        """Before writing on after a failure, or a node's save: raise :class:`CheckpointLockedError`
        only if the lock this store acquired provably vanished or changed hands (one small read).
        A lock file that cannot be read is left to the write itself, whose error is a save error;
        :meth:`check_lock` (before every commit) stays strict."""
        if self._lock_token is None:
            return
        holder = self.read_lock()
        if holder is None or ("unreadable" not in holder and holder.get("token") != self._lock_token):
            self.check_lock()

    def _check_held(self) -> None:
        """Before a commit or a deletion: a store holding the lock checks it still does; one
        holding none checks that no other writer holds it (one small read either way).

        Raises
        ------
        CheckpointLockedError
            The lock changed hands, or another writer not provably gone (see
            :func:`~.lock.holder_alive`) holds the prefix; the message names it. A lock file
            that cannot be read or parsed is left to the write itself (only taking the lock
            refuses it).
        """
        if self._lock_token is not None:
            self.check_lock()
            return
        holder = self.read_lock()
        if holder is not None and "unreadable" not in holder and _lock.holder_alive(holder) is not False:
            raise _lock.refused(self.url, holder)

    def release_lock(self) -> None:
        """Remove the lock this store acquired; a store that acquired none removes any lock (explicit unlock).

        A lock taken over by someone else (after ``break_lock``) is left alone, with a warning.
        """
        mine, self._lock_token = self._lock_token, None
        _lock.release(self._files(), self._lock_file(), self.url, mine)

    def read_lock(self) -> dict[str, Any] | None:
        """The lock holder, ``None`` if unlocked, or ``{"unreadable": reason}`` for a damaged lock file
        (or one that would be read through a symlink, see :meth:`own_folder`)."""
        try:
            path = self._lock_file()
        except CheckpointFormatError as exc:
            return {"unreadable": str(exc)}
        return _lock.read(self._files(), path)
