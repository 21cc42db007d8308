"""Checkpoints: Zarr v3 groups per node and epoch, committed atomically. The only package importing ``zarr``."""

from ._inspect import CheckpointInfo, CheckpointView, NodeCheckpoint, list_checkpoints, open_checkpoint
from ._manager import MultiNodeCheckpointManager
from ._metadata import CommitRecordHandler, MetadataHandler
from ._naming import db_name, get_ckpt_filename
from ._single import CheckpointManager
from ._store import CheckpointStore
from ._upload import CopyCheckpointUploader, UploadTaskGroupBuilder

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointStore",
    "CheckpointView",
    "CommitRecordHandler",
    "CopyCheckpointUploader",
    "MetadataHandler",
    "MultiNodeCheckpointManager",
    "NodeCheckpoint",
    "UploadTaskGroupBuilder",
    "db_name",
    "get_ckpt_filename",
    "list_checkpoints",
    "open_checkpoint",
]
