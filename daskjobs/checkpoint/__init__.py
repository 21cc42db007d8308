"""Checkpoints: Zarr v3 groups per node and epoch, committed atomically. The only package importing ``zarr``."""

from ._manager import CheckpointManager, MultiNodeCheckpointManager, db_name, get_ckpt_filename
from ._metadata import CommitRecordHandler, MetadataHandler
from ._store import CheckpointStore
from ._upload import CopyCheckpointUploader, UploadTaskGroupBuilder

__all__ = [
    "CheckpointManager",
    "CheckpointStore",
    "CommitRecordHandler",
    "CopyCheckpointUploader",
    "MetadataHandler",
    "MultiNodeCheckpointManager",
    "UploadTaskGroupBuilder",
    "db_name",
    "get_ckpt_filename",
]
