"""Commit records of a prefix, and deleting epochs: what makes an epoch exist, and what removes it.

``__daskjobs__/commits/epoch-<12 digits>.json`` holds the commit record of an epoch, written last
and atomically; listing, loading and resuming see committed epochs only. Deleting an epoch
un-commits it first, then removes what its record lists of its groups.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._model.values import validate_name
from ...errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from .._format.entries import check_epoch, loads
from .._format.records import committed_entry, seal, unseal, validate_commit_record
from .._storage.base import UnsafeFileError
from .._storage.cleanup import Tree, remove_debris, remove_group
from .prefix import OWN, Prefix

if TYPE_CHECKING:
    from .._format.documents import CommitRecord, CommittedEntry

logger = logging.getLogger("daskjobs")

_COMMIT_RE = re.compile(r"epoch-(\d{12})\.json")


@dataclass(frozen=True)
class RetiredEpoch:
    """An un-committed epoch whose groups are still to be deleted: per node, what its commit record
    held of it, its entry or the summary naming its manifest (``None``: the record named none; only
    daskjobs' own files go)."""

    epoch: int
    entries: dict[str, CommittedEntry | None]


class Commits(Prefix):
    """The commit records of a prefix and the deletion of its epochs (the base of
    :class:`~.store.CheckpointStore`)."""

    def commit_path(self, epoch: int) -> str:
        """Where the commit record of ``epoch`` lives (under :attr:`url`)."""
        return f"{self.url}/{OWN}/commits/epoch-{check_epoch(epoch):012d}.json"

    def _commit_file(self, epoch: int) -> str:
        """The commit record's path; raises :class:`CheckpointFormatError` if its folder is a symlink (see
        :meth:`~.prefix.Prefix.own_folder`)."""
        return f"{self.own_folder('commits')}/epoch-{check_epoch(epoch):012d}.json"

    # -- commits ------------------------------------------------------------------------------
    def commit(self, record: CommitRecord, *, sync_folder: bool = True) -> None:
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
        data = seal(validate_commit_record(dict(record), epoch))
        self._check_held()
        path = self._commit_file(epoch)
        try:
            self._files().replace(path, data, sync_folder=sync_folder)
        except OSError as exc:
            raise CheckpointWriteError(
                f"could not write the commit record of epoch {epoch} under {self.url} ({path}): {exc}"
            ) from exc

    def committed_epochs(self) -> list[int]:
        """The committed epochs, ascending, listed afresh from the commit records (never cached).

        Raises
        ------
        CheckpointFormatError
            ``__daskjobs__`` or its ``commits`` folder is a symbolic link or not a directory:
            nothing outside the prefix is listed (see :meth:`~.prefix.Prefix.own_folder`).
        """
        names = self._files().listdir(self.own_folder("commits"))
        return sorted(int(m.group(1)) for name in names if (m := _COMMIT_RE.fullmatch(name)))

    def read_commit(self, epoch: int) -> CommitRecord:
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
        return self.commit_record_bytes(epoch)[0]

    def commit_record_bytes(self, epoch: int) -> tuple[CommitRecord, bytes]:
        """The validated commit record of ``epoch`` and the very bytes it was read from (for a copy).

        Raises
        ------
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointFormatError
            As :meth:`read_commit`.
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
            what = f"commit record of epoch {epoch}"
            return unseal(data, validate_commit_record(loads(data, what), check_epoch(epoch)), what), data
        except (CheckpointCorruptError, CheckpointFormatError) as exc:
            raise type(exc)(f"{url}: {exc}") from None

    def scan_commits(self) -> list[tuple[int, CommitRecord | CheckpointError]]:
        """Every committed epoch, ascending, with its record or the error reading it raised.

        For listings that must show the good epochs and mark the damaged ones.
        """
        scanned: list[tuple[int, CommitRecord | CheckpointError]] = []
        for epoch in self.committed_epochs():
            try:
                scanned.append((epoch, self.read_commit(epoch)))
            except CheckpointNotFoundError:  # deleted since it was listed
                continue
            except CheckpointError as exc:
                scanned.append((epoch, exc))
        return scanned

    def latest_commit(self) -> CommitRecord | None:
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
        :mod:`.._storage.cleanup`). A crash midway leaves an uncommitted group that
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
        self, epoch: int, nodes: Iterable[str], *, sync_folder: bool = True, record: CommitRecord | None = None
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
        if record is None or nodes is not record["nodes"]:  # a record's nodes were validated with it
            nodes = [validate_name(node, "node") for node in nodes]
        epoch = check_epoch(epoch)
        self._check_held()
        entries: Mapping[str, CommittedEntry]
        try:
            record = record or self.read_commit(epoch)
            entries = record.get("manifests") or {node: committed_entry(record, node) for node in record["nodes"]}
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
        (``mydata.2024``), a user's file, a symlink are never touched (see :mod:`.._storage.cleanup`).
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
