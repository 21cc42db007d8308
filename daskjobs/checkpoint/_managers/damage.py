"""Damage under a prefix: which files of an epoch do not verify, which epochs share each of them,
and the newest epoch that still verifies (what ``daskjobs checkpoints verify`` and a resume that
meets a damaged epoch tell the user).

Delta checkpoints hard-link a chunk that did not change (local disks), so one file can belong to
every epoch since the last one written in full: damage to it spoils all of them. On object stores
a reused chunk is a server-side copy, a file of its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from fsspec.implementations.local import LocalFileSystem

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .._format.records import committed_entry
from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class DamagedFile:
    """A file of a committed epoch that does not verify.

    Attributes
    ----------
    epoch, node : int, str
        The epoch and node whose group holds it.
    blob : str or None
        The blob it belongs to; ``None`` for the node's manifest (the group's ``zarr.json``) or the
        epoch's commit record (``node`` is then ``""``).
    path : str
        Its path relative to the node's group (``"zarr.json"``, ``"w/c.0.0"``), or the commit record's URL.
    url : str
        Where it is.
    problem : str
        What is wrong with it.
    """

    epoch: int
    node: str
    blob: str | None
    path: str
    url: str
    problem: str

    def describe(self) -> str:
        """``file <url> (node 'ps', blob 'w')``."""
        if not self.node:
            return f"commit record {self.url}"
        owner = f"node {self.node!r}" + (f", blob {self.blob!r}" if self.blob is not None else ", its manifest")
        return f"file {self.url} ({owner})"


def damaged_files(store: CheckpointStore, epoch: int) -> list[DamagedFile]:
    """Every file of committed ``epoch`` that does not verify (reading it all once more, one chunk at a
    time); ``[]`` when the epoch verifies."""
    try:
        record = store.read_commit(epoch)
    except CheckpointNotFoundError:
        return []
    except CheckpointError as exc:
        return [DamagedFile(epoch, "", None, "", store.commit_path(epoch), str(exc))]
    found = []
    for node in record["nodes"]:
        url = store.db_name(node, epoch)
        try:
            reader = store.reader(node, epoch, committed_entry(record, node), entry_validated=True)
        except CheckpointError as exc:  # the manifest itself
            found.append(DamagedFile(epoch, node, None, "zarr.json", f"{url}/zarr.json", str(exc)))
            continue
        found += [
            DamagedFile(epoch, node, blob, path, f"{url}/{path}", str(exc))
            for blob, path, exc in reader.damaged_files()
        ]
    return found


def sharing_epochs(store: CheckpointStore, damaged: DamagedFile, epochs: Iterable[int]) -> list[int]:
    """The epochs of ``epochs`` (and ``damaged.epoch``) whose group holds the very file ``damaged`` is:
    the same file hard-linked into them on a local disk. On object stores, and for a file that is
    gone or a commit record, only its own epoch."""
    if not damaged.node or not isinstance(store.fs, LocalFileSystem):
        return [damaged.epoch]
    try:
        info = os.stat(damaged.url)
    except OSError:
        return [damaged.epoch]
    shared = {damaged.epoch}
    for epoch in epochs:
        try:
            other = os.stat(f"{store.db_name(damaged.node, epoch)}/{damaged.path}")
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino):
            shared.add(epoch)
    return sorted(shared)


def verifies(store: CheckpointStore, epoch: int) -> bool:
    """Whether committed ``epoch`` reads back whole: every node, blob and chunk against its digest."""
    from .views import open_checkpoint

    try:
        open_checkpoint(store.url, epoch, store.storage_options).verify()
    except CheckpointError:
        return False
    return True


def newest_intact(store: CheckpointStore, epochs: Iterable[int], spoiled: Iterable[int] = ()) -> int | None:
    """The newest of ``epochs`` that verifies, trying them newest first (skipping ``spoiled``, known
    damaged); ``None`` when none does."""
    known = set(spoiled)
    for epoch in sorted(set(epochs) - known, reverse=True):
        if verifies(store, epoch):
            return epoch
    return None


def with_intact_epoch(error: CheckpointCorruptError, store: CheckpointStore, epoch: int) -> CheckpointCorruptError:
    """``error`` (resuming from damaged ``epoch`` failed) told with the newest epoch that verifies,
    the epochs that share the damaged files, and how to resume from that epoch or start afresh.

    Examples
    --------
    The message then ends like::

        ...; epochs 11-14 share the damaged file /ck/ps.11/w/c.0.0 (node 'ps', blob 'w'). The newest
        epoch that verifies is 10: resume from it with `daskjobs run ... --resume-from 10`
        (JobRunner(..., resume_from_epoch=10)); the epochs after it are deleted when the first new
        epoch commits
    """
    try:
        committed = store.committed_epochs()
        shared = [(file, sharing_epochs(store, file, committed)) for file in damaged_files(store, epoch)]
        spoiled = {e for _, sharing in shared for e in sharing} | {epoch}
        intact = newest_intact(store, committed, spoiled)
    except Exception as exc:  # the hint is a courtesy: never hide the error itself
        logger.debug("could not look for an intact epoch under %s: %s", store.url, exc)
        return error
    said = [
        (f"epochs {epoch_span(sharing)} share" if len(sharing) > 1 else f"epoch {sharing[0]} holds")
        + f" the damaged {file.describe()}"
        for file, sharing in shared
    ]
    told = f"{error}" + (f"; {'; '.join(said)}" if said else "")
    if intact is None:
        told += (
            f". No committed epoch under {store.url} verifies: start afresh with `daskjobs run ... --fresh` "
            "(the committed epochs are deleted when the new epoch 0 commits), or under another prefix"
        )
    else:
        told += (
            f". The newest epoch that verifies is {intact}: resume from it with `daskjobs run ... --resume-from "
            f"{intact}` (JobRunner(..., resume_from_epoch={intact})); the epochs after it are deleted when the "
            "first new epoch commits"
        )
    return CheckpointCorruptError(told)


def epoch_span(epochs: list[int]) -> str:
    """``3``, ``3-7`` or ``3-5,8`` for ascending ``epochs``.

    Examples
    --------
    >>> epoch_span([3]), epoch_span([0, 1, 2, 5])
    ('3', '0-2,5')
    """
    runs: list[list[int]] = []
    for epoch in epochs:
        if runs and epoch == runs[-1][1] + 1:
            runs[-1][1] = epoch
        else:
            runs.append([epoch, epoch])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
