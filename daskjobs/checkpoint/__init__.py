"""Checkpoints: Zarr v3 groups per node and epoch, committed atomically.

The package is layered; each part imports only the parts above it in this list:

* :mod:`._format` -- the format on paper: entries, commit records, manifests, chunks (pure);
* :mod:`._storage` -- bytes on local disks and object stores, one node's Zarr group (the only
  place in daskjobs importing ``zarr``), verified reads, deleting only what daskjobs wrote;
* :mod:`._protocol` -- one prefix: its store, commit records, writer lock, retention, staging;
* :mod:`._node` -- the save and load steps that run on a node's worker;
* :mod:`._managers` -- the managers, metadata handlers, upload builders and read-only views that
  this package exports.

The package may import :mod:`daskjobs.errors`, :mod:`daskjobs._version`, :mod:`daskjobs._config`
(the deadline of its waits for storage), :mod:`daskjobs._model` and :mod:`daskjobs._execution`;
never sessions, the runner or ``distributed``.
"""

from ._format.naming import db_name, get_ckpt_filename
from ._managers.manager import MultiNodeCheckpointManager
from ._managers.metadata import CommitRecordHandler, MetadataHandler
from ._managers.single import CheckpointManager
from ._managers.upload import CopyCheckpointUploader, UploadTaskGroupBuilder
from ._managers.views import CheckpointInfo, CheckpointView, NodeCheckpoint, list_checkpoints, open_checkpoint
from ._protocol.store import CheckpointStore

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
