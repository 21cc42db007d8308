"""Data input: resumable readers whose position is ordinary blobs, ``ReaderWithLimit`` and ``pipe``.

A reader lives on one node and keeps all of its state in that node's GLOBAL workspace, so the
state is checkpointed with the model in the same epoch and a resumed or recovered job neither
repeats nor skips a record. This package sits on the job model and the workspaces: it imports
neither ``distributed`` nor ``zarr`` (Zarr sources are opened on the node, on first use).
"""

from ._array import ArrayReader
from ._limit import ReaderWithLimit, epochs_until_finished
from ._pipe import pipe
from ._reader import Reader

__all__ = ["ArrayReader", "Reader", "ReaderWithLimit", "epochs_until_finished", "pipe"]
