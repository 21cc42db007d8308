"""daskjobs: epoch-checkpointed jobs on Dask, with Zarr checkpoints that resume exactly."""

from . import errors
from ._model.group import TaskGroup
from ._model.job import Job, epoch_limiter
from ._model.node import Cluster, Node
from ._model.task import SetupNets, Task, TaskOutput, TaskOutputList, WorkspaceType, final_output
from ._model.workspace import Workspace
from ._version import __version__

# Sessions import ``distributed`` and checkpoints import ``zarr``: load them on first use, so that
# importing the pure model (and ``import daskjobs`` itself) stays light.
_LAZY = {
    "ArrayReader": "data",
    "Reader": "data",
    "ReaderWithLimit": "data",
    "pipe": "data",
    "CheckpointManager": "checkpoint",
    "CopyCheckpointUploader": "checkpoint",
    "MultiNodeCheckpointManager": "checkpoint",
    "UploadTaskGroupBuilder": "checkpoint",
    "db_name": "checkpoint",
    "get_ckpt_filename": "checkpoint",
    "list_checkpoints": "checkpoint",
    "open_checkpoint": "checkpoint",
    "EpochRecord": "runner",
    "JobRunner": "runner",
    "RunnerHooks": "runner",
    "DaskSession": "session",
    "LocalSession": "session",
    "Session": "session",
    "node_cluster": "session",
    "node_resource": "session",
}


_SUBMODULES = {"testing"}
"""Public submodules loaded on first use: ``dj.testing``."""


def __getattr__(name: str) -> object:
    from importlib import import_module

    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'daskjobs' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (``__all__``, ``testing`` included) and the module's dunder attributes: no
    helper imports, no private modules."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})


__all__ = [
    "ArrayReader",
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
    "Reader",
    "ReaderWithLimit",
    "RunnerHooks",
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
    "pipe",
    "testing",
]
