"""Upload builders: what runs once after the epoch loop, given the last epoch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..._execution.node_run import INTERNAL
from ..._model.group import TaskGroup
from ..._model.task import Task, WorkspaceType
from ...errors import CheckpointError, JobDefinitionError
from .._format.manifests import group_document, reference
from .._format.naming import get_ckpt_filename
from .._format.records import MANIFEST_KEY, committed_entry
from .._protocol.store import CheckpointStore
from .._storage.files import make_dirs, write_file
from .._storage.zarr_groups import expected_metadata

if TYPE_CHECKING:
    from ..._model.workspace import Workspace
    from .._format.documents import CommittedEntry
    from .manager import MultiNodeCheckpointManager

logger = logging.getLogger("daskjobs")


class UploadTaskGroupBuilder:
    """Builds the TaskGroup a :class:`~daskjobs.JobRunner` runs once after the epoch loop.

    Subclasses implement :meth:`build`; :class:`CopyCheckpointUploader` is a ready one.
    """

    def build(self, epoch: int, checkpoint_manager: MultiNodeCheckpointManager | None) -> TaskGroup:
        """The group to run, given the last epoch and the job's checkpoint manager."""
        raise NotImplementedError("subclass UploadTaskGroupBuilder and implement build(epoch, checkpoint_manager)")


_DONE = "daskjobs.upload_done"


class _Destination:
    """Writes files under an fsspec URL; on a local disk with daskjobs' own file modes (never group-
    or world-writable)."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def write(self, relative: str, data: bytes | memoryview) -> None:
        target = f"{self.root}/{relative}"
        if self.local:
            make_dirs(target.rsplit("/", 1)[0])
            write_file(target, [data])
        else:
            self.fs.pipe_file(target, bytes(data))


@dataclass(frozen=True)
class _CopyGroupStep:
    """Copies one node's group of a committed epoch: exactly the files its entry lists, each read
    like any checkpoint read (regular files only, bounded, every chunk verified against its digest
    before it is written), the group's own metadata (its manifest, byte for byte) last.

    ``entry`` is what the commit record holds of the node (the summary naming its manifest from
    format version 4 on): the node reads and verifies its manifest itself."""

    prefix: str
    prefix_options: dict[str, Any]
    node: str
    epoch: int
    entry: CommittedEntry
    destination: str
    destination_options: dict[str, Any]

    def __call__(self, ws: Workspace) -> None:
        store = CheckpointStore(self.prefix, self.prefix_options)
        reader = store.reader(self.node, self.epoch, self.entry, entry_validated=True)
        target = _Destination(self.destination, self.destination_options)
        group = get_ckpt_filename(self.node, self.epoch)
        manifest = group_document(reader.entry)
        ref = reader.entry.get(MANIFEST_KEY)
        if isinstance(ref, dict) and reference(manifest) != ref:
            raise CheckpointError(
                f"epoch {self.epoch}, node {self.node!r}: its manifest does not come out the same when written "
                "again; not uploading a group the commit record would not match"
            )
        for name, meta in reader.blobs.items():
            for key, data in reader.stored_chunks(name):
                target.write(f"{group}/{name}/{key}", data)
            target.write(f"{group}/{name}/zarr.json", expected_metadata(meta))
        target.write(f"{group}/zarr.json", manifest)
        ws[_DONE] = True
        logger.info("uploaded %s to %s", store.db_name(self.node, self.epoch), self.destination)


@dataclass(frozen=True)
class _CopyCommitStep:
    """Copies the commit record of a committed epoch, read and validated (seal included), last."""

    prefix: str
    prefix_options: dict[str, Any]
    epoch: int
    destination: str
    destination_options: dict[str, Any]

    def __call__(self, ws: Workspace) -> None:
        store = CheckpointStore(self.prefix, self.prefix_options)
        _record, data = store.commit_record_bytes(self.epoch)
        _Destination(self.destination, self.destination_options).write(
            store.commit_path(self.epoch)[len(store.url) + 1 :], data
        )
        logger.info("uploaded the commit record of epoch %d to %s", self.epoch, self.destination)


for _step in (_CopyGroupStep, _CopyCommitStep):  # their daskjobs errors surface as themselves
    setattr(_step, INTERNAL, True)


class CopyCheckpointUploader(UploadTaskGroupBuilder):
    """Copies the final epoch's checkpoint (every node's group, then its commit record) to ``destination``.

    The copy is itself a valid checkpoint prefix that ``dj.open_checkpoint(destination)`` reads.
    Each node copies its own group on its worker: exactly the files the commit record lists, each
    read and verified like any checkpoint read (a damaged chunk fails the upload instead of being
    copied); the commit record is copied last, after all of them (an ``inputs`` edge orders it).

    Parameters
    ----------
    destination
        A local path or fsspec URL.
    storage_options
        fsspec options for the destination.
    """

    def __init__(self, destination: str, storage_options: dict[str, Any] | None = None) -> None:
        self.destination = str(destination).rstrip("/")
        self.storage_options = dict(storage_options or {})

    def build(self, epoch: int, checkpoint_manager: MultiNodeCheckpointManager | None) -> TaskGroup:
        """Per-node copy tasks and a commit-record copy that waits for them, as one group.

        Raises
        ------
        JobDefinitionError
            ``checkpoint_manager`` is ``None``: the runner has no checkpoints to copy.
        CheckpointNotFoundError
            ``epoch`` is not committed (its save failed, or the job ran without checkpoints).
        CheckpointCorruptError, CheckpointFormatError
            Its commit record is damaged; the copy itself raises them for a damaged group.
        """
        if checkpoint_manager is None:
            raise JobDefinitionError(
                "CopyCheckpointUploader needs the job's checkpoint manager: give the JobRunner a checkpoint_manager"
            )
        store = checkpoint_manager.store
        record = store.read_commit(epoch)
        group = TaskGroup(WorkspaceType.PRIVATE)
        done = {}
        for node in checkpoint_manager.nodes():
            step = _CopyGroupStep(
                store.url,
                store.storage_options,
                node,
                epoch,
                committed_entry(record, node),
                self.destination,
                self.storage_options,
            )
            done[f"{_DONE}.{node}"] = Task(
                step, group=group, node=node, name="checkpoint_upload", outputs=_DONE
            ).outputs()[0]
        commit_step = _CopyCommitStep(store.url, store.storage_options, epoch, self.destination, self.storage_options)
        Task(commit_step, group=group, node=checkpoint_manager.nodes()[0], name="checkpoint_upload_commit", inputs=done)
        return group
