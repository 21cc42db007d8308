"""Deleting checkpoint files: only what daskjobs provably wrote.

Two things prove a folder daskjobs' own, each made atomically before anything a crash could tear:

* **A staging folder's name.** On a local disk every group is written in a staging folder
  ``<node>.<epoch>.tmp-<16 hex><16 hex>`` — made fresh, or a retired group of the node renamed
  there to be written over (:func:`take_over_group`) — and renamed to ``<node>.<epoch>`` once
  all of it is durable. The name carries a check that only daskjobs makes (:func:`staging_name`,
  :func:`named_by_us`), and it appears with its folder, in one ``mkdir`` or ``rename``: whatever
  a crash or a power loss tore inside, the folder is provably ours.
* **A marker**: a group's ``zarr.json`` that is a Zarr v3 group carrying ``attributes["daskjobs"]``
  with that node and epoch. On object stores it is written first, before anything else of the
  group; on a local disk a group appears under its name only with its manifest — its marker —
  durable. A retired group written over keeps its ``zarr.json`` (its epoch's manifest) as it
  was until its staging name is durable; only then is the new manifest written over it, in
  place: a retired group that a crash left under its old name (the rename to the staging folder
  undone) still holds a whole marker, and a torn manifest is only ever in a folder whose staging
  name proves it ours.

A folder that merely looks like ``<name>.<number>`` (``mydata.2024``) or like a staging folder,
without the check or a marker, is never touched.

Inside an owned group only these are deleted: in each blob folder (a valid blob name) its
``zarr.json``, its chunk files (``c.<i>.<j>…``; for a committed group exactly the chunks its
shape and chunk shape give) and daskjobs' temp files (``*.tmp-<32 hex>``); then the empty blob
folders, then the marker ``zarr.json`` *last* (so an interrupted delete leaves a group that
is still recognisably ours), then the group folder if it is empty. Anything else — a user's
file, a nested folder, a symlink, a FIFO — stays, and so does every folder holding it.
Symlinks are never followed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import stat
import uuid
from collections.abc import Mapping
from typing import Any

import xxhash
from fsspec import AbstractFileSystem
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from ..._model.values import validate_name
from ...errors import CheckpointCorruptError, CheckpointWriteError, JobDefinitionError
from .._format.chunks import chunk_key
from .._format.entries import RESERVED_BLOB_NAMES, loads
from .._format.manifests import ENTRY_KEY, reference
from .._format.records import MANIFEST_KEY
from .base import LocalTree, Staged
from .local_reads import read_regular

logger = logging.getLogger("daskjobs")

GROUP_RE = re.compile(r"(.+)\.(0|[1-9][0-9]{0,11})")
"""A node group's folder name: ``<node>.<epoch>`` with a canonical epoch."""
STAGING_RE = re.compile(r"(.+)\.(0|[1-9][0-9]{0,11})\.tmp-([0-9a-f]{16})([0-9a-f]{16})")
"""A staging folder: a node's group of the epoch named being written (on a local disk), fresh or
over a retired group of the node; its name is daskjobs' own if it carries its check (see :func:`staging_name`)."""
TEMP_RE = re.compile(r"[A-Za-z0-9_.\-]+\.tmp-[0-9a-f]{32}")
"""daskjobs' own temp files: ``<name>.tmp-<32 hex digits>``."""
_CHUNK_RE = re.compile(r"c((?:\.(?:0|[1-9][0-9]*))*)")
_MARKER_LIMIT = 64 << 20
_META = "zarr.json"

FILE, DIR, OTHER = "file", "dir", "other"


class Tree:
    """Listing and deleting under a prefix without following symlinks (local disk or fsspec)."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self._fs = fs
        self._local = isinstance(fs, LocalFileSystem)
        self.objects = isinstance(fs, AsyncFileSystem) and not self._local
        """An object store (S3, GCS, Azure …: fsspec's async filesystems): no folders, symlinks or
        special files, so none is looked for, listed or removed (each would cost a request)."""

    def kind(self, path: str) -> str | None:
        """``FILE``, ``DIR``, ``OTHER`` (symlink, FIFO, device …) or ``None`` if nothing is there."""
        if self._local:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return None
            return DIR if stat.S_ISDIR(mode) else FILE if stat.S_ISREG(mode) else OTHER
        self._fs.invalidate_cache(path)
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            return None
        return {"directory": DIR, "file": FILE}.get(info.get("type"), OTHER)

    def entries(self, path: str) -> dict[str, str]:
        """Name → kind of the entries directly under ``path`` (``{}`` if it is no directory)."""
        if self._local:
            try:
                with os.scandir(path) as found:
                    return {
                        e.name: DIR
                        if e.is_dir(follow_symlinks=False)
                        else FILE
                        if e.is_file(follow_symlinks=False)
                        else OTHER
                        for e in found
                    }
            except (FileNotFoundError, NotADirectoryError):
                return {}
        self._fs.invalidate_cache(path)
        try:
            listing = self._fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        root = self._fs._strip_protocol(path).rstrip("/")
        return {
            item["name"].rstrip("/").rsplit("/", 1)[-1]: {"directory": DIR, "file": FILE}.get(item["type"], OTHER)
            for item in listing
            if item["name"].rstrip("/") != root
        }

    def read_small(self, path: str) -> bytes | None:
        """A regular file's bytes (bounded); ``None`` if it is missing, not a regular file or unreadable."""
        if self._local:
            try:
                return read_regular(path, _MARKER_LIMIT)
            except OSError:
                return None
        try:
            return self._fs.cat_file(path, start=0, end=_MARKER_LIMIT + 1)
        except (OSError, ValueError):
            return None

    def unlink(self, paths: list[str]) -> None:
        """Remove these files (missing ones are fine); a symlink would lose only itself."""
        if not paths:
            return
        if self._local:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return
        try:
            self._fs.rm(paths)
        except FileNotFoundError:  # fsspec refuses the whole batch when one path is missing
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(path)
        for folder in {p.rsplit("/", 1)[0] for p in paths}:
            self._fs.invalidate_cache(folder)

    def rmdir(self, path: str) -> None:
        """Remove ``path`` if it is an empty directory (object stores have none to remove)."""
        if self._local:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        elif not self.objects and not self.entries(path):
            with contextlib.suppress(Exception):
                self._fs.rmdir(path)
            self._fs.invalidate_cache(path.rsplit("/", 1)[0])


def marker(tree: Tree, group: str, node: str, epoch: int | None) -> dict[str, Any] | None:
    """daskjobs' marker in the group at ``group`` for ``node`` and ``epoch`` (``None``: any epoch), or
    ``None`` if it is not ours; it names the document it was read from (the group's ``zarr.json``,
    its manifest once the save finished) under ``"manifest"``."""
    if not tree.objects and tree.kind(group) != DIR:
        return None
    return _read_marker(tree, f"{group}/{_META}", node, epoch)


def _read_marker(tree: Tree, path: str, node: str, epoch: int | None) -> dict[str, Any] | None:
    data = tree.read_small(path)
    if data is None or len(data) > _MARKER_LIMIT:
        return None
    try:
        meta = loads(data, "group metadata")
    except CheckpointCorruptError:
        return None
    attributes = meta.get("attributes") if isinstance(meta, dict) else None
    found = attributes.get(ENTRY_KEY) if isinstance(attributes, dict) else None
    if (
        isinstance(meta, dict)
        and meta.get("zarr_format") == 3
        and meta.get("node_type") == "group"
        and isinstance(found, dict)
        and found.get("node") == node
        and type(found.get("epoch")) is int
        and (epoch is None or found["epoch"] == epoch)
    ):
        return {**found, MANIFEST_KEY: reference(data)}
    return None


def staging_name(group: str) -> str:
    """A new staging folder of the group at ``group`` (``<node>.<epoch>``): ``<group>.tmp-<16 hex><16 hex>``,
    a random number and its check (see :func:`named_by_us`)."""
    number = uuid.uuid4().hex[:16]
    return f"{group}.tmp-{number}{_check(os.path.basename(group), number)}"


def named_by_us(name: str) -> bool:
    """Whether the folder name ``name`` is a staging folder named by :func:`staging_name`: its check
    is the XXH3-64 of daskjobs' own text with its group's name and number, which no name made
    by anyone else carries but by a chance of 2**-64. The name is made atomically with the folder
    (``mkdir``, ``rename``), so it proves the folder daskjobs' own whatever a crash did to its files."""
    match = STAGING_RE.fullmatch(name)
    return match is not None and match.group(4) == _check(f"{match.group(1)}.{match.group(2)}", match.group(3))


def _check(group: str, number: str) -> str:
    return xxhash.xxh3_64_hexdigest(f"daskjobs staging folder {group} {number}".encode())


def _valid(name: str, what: str) -> bool:
    try:
        validate_name(name, what)
    except JobDefinitionError:
        return False
    return not (what == "blob" and name in RESERVED_BLOB_NAMES)


def _chunk_counts(meta: Any) -> list[int] | None:
    """Chunks per axis of a blob from its entry, or ``None`` if the entry does not say."""
    if not isinstance(meta, Mapping):
        return None
    shape, chunks = meta.get("shape"), meta.get("chunks")
    if not (isinstance(shape, list) and isinstance(chunks, list)) or len(shape) != len(chunks):
        return None
    if not all(type(v) is int and v >= 0 for v in shape) or not all(type(c) is int and c > 0 for c in chunks):
        return None
    return [math.ceil(s / c) for s, c in zip(shape, chunks, strict=True)]


def _ours_in_blob(name: str, counts: list[int] | None) -> bool:
    """Whether a file of a blob folder is one daskjobs writes (exactly the chunk grid when known)."""
    if name == _META or TEMP_RE.fullmatch(name):
        return True
    match = _CHUNK_RE.fullmatch(name)
    if match is None:
        return False
    if counts is None:
        return True
    index = [int(i) for i in match.group(1).split(".")[1:]]
    return len(index) == len(counts) and all(i < n for i, n in zip(index, counts, strict=True))


def remove_group(tree: Tree, group: str, node: str, epoch: int, entry: Mapping[str, Any] | None = None) -> bool:
    """Delete daskjobs' files of the node group at ``group``; ``False`` (nothing touched) if it is not ours.

    Parameters
    ----------
    entry
        What the commit record of a committed group held of it: the node's entry, or the summary
        naming its manifest (which must match the group's ``zarr.json``): only its blobs' folders
        and exactly their chunks are deleted. ``None`` (uncommitted debris), or a manifest that
        does not match: blob folders with valid names and files of daskjobs' name patterns.
    """
    found = marker(tree, group, node, epoch)
    if found is None:
        return False
    if entry is not None and "blobs" not in entry:  # a summary: the group's own entry, if it is the manifest named
        entry = found if found[MANIFEST_KEY] == entry.get(MANIFEST_KEY) else None
    blobs = entry.get("blobs") if entry is not None and found.get("save_id") == entry.get("save_id") else None
    _remove_own_files(tree, group, blobs)
    return True


def _remove_own_files(tree: Tree, group: str, blobs: Mapping[str, Any] | None) -> None:
    """Delete daskjobs' files of an owned group (see :func:`remove_group`): exactly those of ``blobs``
    (its blob entries) if known, else those of daskjobs' name patterns; the marker last."""
    doomed, folders = [], []
    # an object store holds no temp objects of ours: a committed group's entry says what is there
    listed = dict.fromkeys(blobs, DIR) if tree.objects and isinstance(blobs, Mapping) else tree.entries(group)
    for name, kind in listed.items():
        if kind == FILE and TEMP_RE.fullmatch(name):
            doomed.append(f"{group}/{name}")
        if kind != DIR or not _valid(name, "blob") or (isinstance(blobs, Mapping) and name not in blobs):
            continue
        counts = _chunk_counts(blobs[name]) if isinstance(blobs, Mapping) else None
        folders.append(f"{group}/{name}")
        if tree.objects and counts is not None:  # exactly the objects the entry lists: no listing needed
            keys = [chunk_key(i, len(counts)) for i in range(math.prod(counts))]
            doomed.extend(f"{group}/{name}/{file}" for file in (_META, *keys))
            continue
        doomed.extend(
            f"{group}/{name}/{file}"
            for file, kind in tree.entries(f"{group}/{name}").items()
            if kind == FILE and _ours_in_blob(file, counts)
        )
    tree.unlink(doomed)
    for folder in folders:
        tree.rmdir(folder)
    tree.unlink([f"{group}/{_META}"])
    tree.rmdir(group)


def take_over_group(
    tree: Tree, files: LocalTree, group: str, target: str, node: str, epoch: int, entry: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Rename ``node``'s retired group of ``epoch`` at ``group`` to ``target`` (a staging folder of a
    new group, see :data:`STAGING_RE`) to be written over; return the blobs it holds (from its
    manifest), or ``None`` and touch nothing.

    Only a group that holds exactly what its manifest lists is taken: the manifest named by
    ``entry`` (what the commit record held of the group: the entry, or the summary naming the
    manifest), every blob folder with exactly its ``zarr.json`` and its chunk grid, all regular
    files. Anything else (a user's file, a symlink, a temp file, a manifest that does not match)
    leaves it to :func:`remove_group`. Writing over a retired group costs the file system no new
    files and no deletions but the manifest's: on small groups, most of a save's cost (see
    :mod:`.zarr_groups`).
    """
    if entry is None or not STAGING_RE.fullmatch(os.path.basename(target)):
        return None
    found = marker(tree, group, node, epoch)
    if found is None or found[MANIFEST_KEY] != entry.get(MANIFEST_KEY) or not isinstance(found.get("blobs"), dict):
        return None
    blobs = found["blobs"]
    listed = tree.entries(group)
    if listed != {_META: FILE, **dict.fromkeys(blobs, DIR)}:
        return None
    for name, meta in blobs.items():
        counts = _chunk_counts(meta)
        if counts is None:
            return None
        keys = [chunk_key(i, len(counts)) for i in range(math.prod(counts))]
        if tree.entries(f"{group}/{name}") != dict.fromkeys([_META, *keys], FILE):
            return None
    try:
        files.rename(group, target)
    except OSError:
        return None
    return blobs


def staged_group(tree: Tree, root: str, node: str, epoch: int, save_id: Any) -> Staged | None:
    """The staging folder under ``root`` holding ``node``'s save ``save_id`` of ``epoch``, written
    whole (its manifest written) but not yet put in place, and where it goes; ``None`` if there is none."""
    for name, _node, staged in group_folders(tree, root, {node}, STAGING_RE):
        found = marker(tree, f"{root}/{name}", node, epoch) if staged == epoch else None
        if found is not None and found.get("save_id") == save_id and "blobs" in found:
            return Staged(f"{root}/{name}", f"{root}/{node}.{epoch}")
    return None


def remove_staging(path: str) -> None:
    """Delete, as far as possible, daskjobs' files of the local staging folder at ``path`` (a save
    that failed while writing it) and the folder once empty; nothing if its name is not daskjobs'."""
    if named_by_us(os.path.basename(path)):
        with contextlib.suppress(OSError):
            _remove_own_files(Tree(LocalFileSystem()), path, None)


def clear_for_write(tree: Tree, group: str, url: str, node: str, epoch: int) -> None:
    """Make room for writing ``node``'s group of ``epoch`` at ``group``: remove an earlier attempt of ours.

    Raises
    ------
    CheckpointWriteError
        Something daskjobs did not write is there (a user's folder or file, a symlink); it is
        left as it is and nothing is written.
    """
    kind = tree.kind(group)
    if kind is None:
        return
    if kind == DIR:
        remove_group(tree, group, node, epoch)
        entries = tree.entries(group)
        if entries and all(k == FILE and TEMP_RE.fullmatch(n) for n, k in entries.items()):
            tree.unlink([f"{group}/{n}" for n in entries])  # a save killed before its marker was in place
            entries = {}
        left = sorted(entries)
        if not left:
            return
        found = f"it holds {left[:5]}{' …' if len(left) > 5 else ''}, which daskjobs did not write"
    else:
        found = "it is a file or symlink daskjobs did not write"
    raise CheckpointWriteError(
        f"not writing the checkpoint of node {node!r} at epoch {epoch} to {url}: {found}; move it away"
    )


def remove_temp_files(tree: Tree, folder: str) -> list[str]:
    """Delete daskjobs' temp files directly in ``folder``; return their names."""
    names = [n for n, kind in tree.entries(folder).items() if kind == FILE and TEMP_RE.fullmatch(n)]
    tree.unlink([f"{folder}/{n}" for n in names])
    return names


def group_folders(
    tree: Tree, root: str, nodes: set[str] | None, pattern: re.Pattern[str] = GROUP_RE
) -> list[tuple[str, str, int]]:
    """``(folder name, node, epoch)`` of the directories under ``root`` named like a group of ``nodes``
    (``pattern``: or like a staging folder, :data:`STAGING_RE`)."""
    found = []
    for name, kind in sorted(tree.entries(root).items()):
        match = pattern.fullmatch(name)
        if kind != DIR or match is None or not _valid(match.group(1), "node"):
            continue
        if nodes is None or match.group(1) in nodes:
            found.append((name, match.group(1), int(match.group(2))))
    return found


def remove_debris(tree: Tree, root: str, committed: set[int], nodes: set[str] | None, own: str) -> list[str]:
    """Remove what saves that never committed left under ``root``; return the removed paths, relative to ``root``.

    Removed: daskjobs' files in the groups of ``nodes`` (any node: ``None``) whose epoch is not in
    ``committed`` (see :func:`remove_group`) and in their staging folders (see the module), and
    daskjobs' temp files in ``own`` and ``own/commits``.
    """
    removed = []
    for name, node, epoch in group_folders(tree, root, nodes):
        if epoch not in committed and remove_group(tree, f"{root}/{name}", node, epoch):
            removed.append(name)
    for name, node, _epoch in group_folders(tree, root, nodes, STAGING_RE):
        if named_by_us(name) or marker(tree, f"{root}/{name}", node, None) is not None:
            _remove_own_files(tree, f"{root}/{name}", None)
            removed.append(name)
    for where in (own, f"{own}/commits"):
        removed.extend(f"{where}/{name}" for name in remove_temp_files(tree, f"{root}/{where}"))
    return removed
