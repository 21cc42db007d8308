"""daskjobs: epoch-checkpointed jobs on Dask, with Zarr checkpoints that resume exactly."""

from . import errors
from ._model.group import TaskGroup
from ._model.job import Job, epoch_limiter
from ._model.node import Cluster, Node
from ._model.task import SetupNets, Task, TaskOutput, TaskOutputList, WorkspaceType, final_output
from ._version import __version__
from ._workspace import Workspace
from .checkpoint import (
    CheckpointManager,
    CopyCheckpointUploader,
    MultiNodeCheckpointManager,
    UploadTaskGroupBuilder,
    db_name,
    get_ckpt_filename,
    list_checkpoints,
    open_checkpoint,
)
from .runner import EpochRecord, JobRunner
from .session import DaskSession, LocalSession, Session, node_cluster, node_resource

__all__ = [
    "CheckpointManager",
    "Cluster",
    "CopyCheckpointUploader",
    "DaskSession",
    "EpochRecord",
    "Job",
    "JobRunner",
    "LocalSession",
    "MultiNodeCheckpointManager",
    "Node",
    "Session",
    "SetupNets",
    "Task",
    "TaskGroup",
    "TaskOutput",
    "TaskOutputList",
    "UploadTaskGroupBuilder",
    "Workspace",
    "WorkspaceType",
    "__version__",
    "db_name",
    "epoch_limiter",
    "errors",
    "final_output",
    "get_ckpt_filename",
    "list_checkpoints",
    "node_cluster",
    "node_resource",
    "open_checkpoint",
]
