"""Upload builders: what runs once after the epoch loop, given the last epoch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .._model.group import TaskGroup
from .._model.task import Task, WorkspaceType
from ..errors import JobDefinitionError
from ._files import make_dirs, write_file

if TYPE_CHECKING:
    from .._workspace import Workspace
    from ._manager import MultiNodeCheckpointManager

logger = logging.getLogger("daskjobs")


class UploadTaskGroupBuilder:
    """Builds the TaskGroup a :class:`~daskjobs.JobRunner` runs once after the epoch loop.

    Subclasses implement :meth:`build`; :class:`CopyCheckpointUploader` is a ready one.
    """

    def build(self, epoch: int, checkpoint_manager: MultiNodeCheckpointManager | None) -> TaskGroup:
        """The group to run, given the last epoch and the job's checkpoint manager."""
        raise NotImplementedError("subclass UploadTaskGroupBuilder and implement build(epoch, checkpoint_manager)")


_DONE = "daskjobs.upload_done"


@dataclass(frozen=True)
class _CopyStep:
    """Copies a file or a folder tree between fsspec locations."""

    source: str
    destination: str
    source_options: dict[str, Any]
    destination_options: dict[str, Any]

    def __call__(self, ws: Workspace) -> None:
        src_fs, src_root = fsspec.core.url_to_fs(self.source, **self.source_options)
        dst_fs, dst_root = fsspec.core.url_to_fs(self.destination, **self.destination_options)
        if src_fs.isfile(src_root):
            pairs = [(src_root, dst_root)]
        else:
            pairs = [
                (path, f"{dst_root.rstrip('/')}/{path[len(src_root.rstrip('/')) + 1 :]}")
                for path in src_fs.find(src_root)
            ]
        local = isinstance(dst_fs, LocalFileSystem)
        for source, target in pairs:
            data = src_fs.cat_file(source)
            if local:  # daskjobs' own file modes: never group- or world-writable
                make_dirs(target.rsplit("/", 1)[0])
                write_file(target, [data])
            else:
                dst_fs.pipe_file(target, data)
        ws[_DONE] = True
        logger.info("uploaded %s to %s", self.source, self.destination)


class CopyCheckpointUploader(UploadTaskGroupBuilder):
    """Copies the final epoch's checkpoint (every node's group, then its commit record) to ``destination``.

    The copy is itself a valid checkpoint prefix that ``dj.open_checkpoint(destination)`` reads.
    Each node copies its own group on its worker; the commit record is copied last, after all
    of them (an ``inputs`` edge orders it).

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
        """
        if checkpoint_manager is None:
            raise JobDefinitionError(
                "CopyCheckpointUploader needs the job's checkpoint manager: give the JobRunner a checkpoint_manager"
            )
        store = checkpoint_manager.store
        group = TaskGroup(WorkspaceType.PRIVATE)
        done = {}
        for node in checkpoint_manager.nodes():
            step = _CopyStep(
                store.db_name(node, epoch),
                f"{self.destination}/{node}.{epoch}",
                store.storage_options,
                self.storage_options,
            )
            done[f"{_DONE}.{node}"] = Task(
                step, group=group, node=node, name="checkpoint_upload", outputs=_DONE
            ).outputs()[0]
        commit = store.commit_path(epoch)
        relative = commit[len(store.url) + 1 :]
        step = _CopyStep(commit, f"{self.destination}/{relative}", store.storage_options, self.storage_options)
        Task(step, group=group, node=checkpoint_manager.nodes()[0], name="checkpoint_upload_commit", inputs=done)
        return group
