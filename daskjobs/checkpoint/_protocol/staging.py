"""Resuming from an older epoch while newer ones are committed: the first new epoch is staged.

Nothing is deleted when the run resumes: the newer commits stay until the first new epoch is
committed. That epoch's groups are written to a staging folder under ``__daskjobs__/``; right
before its commit record is written, the newer epochs are retired (newest first, one warning
listing them) and the staged groups moved into place.
"""

from __future__ import annotations

import logging
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ...errors import CheckpointCorruptError, CheckpointFormatError
from .._storage.durable import fsync_path
from .commits import RetiredEpoch
from .store import CheckpointStore

logger = logging.getLogger("daskjobs")

_STAGING = "__daskjobs__/staging"
"""Where the first save after resuming from an older epoch is written (see :meth:`Staging.resume_older`)."""


class Staging:
    """The newer commits to retire and the epochs written to the staging folder of a store.

    Each method takes the store, so a manager whose ``store`` is replaced keeps working.
    """

    def __init__(self) -> None:
        self.retire: list[int] = []
        """Committed epochs newer than the resumed one: retired when the first new epoch commits."""
        self.staged: set[int] = set()
        """Epochs whose groups are being written to the staging folder."""
        self.fresh = False
        """Whether the run starts afresh (``epoch=-1``): every commit is to be retired."""

    def resume_older(self, store: CheckpointStore, epoch: int) -> list[int]:
        """Prepare to resume from committed ``epoch`` (``-1``: to start afresh); return the newer
        committed epochs (kept for now)."""
        self.fresh = epoch < 0
        self.retire = [e for e in store.committed_epochs() if e > epoch]
        self.staged = set()
        clear_staging(store)
        return list(self.retire)

    def target(self, store: CheckpointStore, epoch: int) -> CheckpointStore:
        """Where a new save of ``epoch`` is written: the staging folder while its place holds a commit to retire."""
        if epoch in self.retire:  # its place still holds a commit that is kept until ours
            self.staged.add(epoch)
            return staging_store(store)
        self.staged.discard(epoch)
        return store

    def before_commit(self, store: CheckpointStore, epoch: int, nodes: list[str]) -> None:
        """Right before ``epoch``'s commit record is written: retire the newer commits, adopt staged groups."""
        if self.retire:
            self.retire_newer(store, epoch, nodes)
        if epoch in self.staged:
            self.staged.discard(epoch)
            adopt_staged(store, epoch, nodes)

    def retire_newer(self, store: CheckpointStore, epoch: int, nodes: list[str]) -> None:
        """Delete the commits newer than the resumed epoch, newest first, right before ``epoch`` commits.

        A newer commit whose record cannot be read (the one a resume from an older epoch skips)
        is retired too: its record goes, and of the groups of ``nodes`` (this job's) only
        daskjobs' own files.
        """
        retired = sorted(self.retire, reverse=True)
        for old in retired:
            try:
                record = store.read_commit(old)
            except (CheckpointCorruptError, CheckpointFormatError):
                store.uncommit(old)
                store.remove_retired(RetiredEpoch(old, dict.fromkeys(nodes)))
                continue
            store.delete_epoch(old, record["nodes"])
        logger.warning(
            "%s: retired the %scommitted epochs %s under %s now that epoch %d commits",
            "started afresh" if self.fresh else "resumed from an older epoch",
            "" if self.fresh else "newer ",
            sorted(retired),
            store.url,
            epoch,
        )
        self.retire = []


def staging_store(store: CheckpointStore) -> CheckpointStore:
    """The store of ``store``'s staging folder (same options, anchored at ``store``'s prefix)."""
    staging = CheckpointStore(
        f"{store.url}/{_STAGING}", store.storage_options, compression=store.compression, fsync=store.fsync
    )
    staging.anchor = store.anchor
    return staging


def clear_staging(store: CheckpointStore) -> None:
    """Remove ``store``'s staging folder and whatever it holds."""
    fs, root = fsspec.core.url_to_fs(staging_store(store).url, **store.storage_options)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def adopt_staged(store: CheckpointStore, epoch: int, nodes: list[str]) -> None:
    """Move ``epoch``'s groups from the staging folder to their place (a rename on local disks)."""
    staging = staging_store(store)
    for node in nodes:
        fs, source = fsspec.core.url_to_fs(staging.db_name(node, epoch), **store.storage_options)
        target = fsspec.core.url_to_fs(store.db_name(node, epoch), **store.storage_options)[1]
        if fs.exists(target):
            fs.rm(target, recursive=True)
        if isinstance(fs, LocalFileSystem):
            os.rename(source, target)
            if store.fsync:
                fsync_path(os.path.dirname(target))
        else:
            fs.mv(source, target, recursive=True)
