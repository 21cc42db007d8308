"""Data input: resumable readers whose position is ordinary blobs, ``ReaderWithLimit`` and ``pipe``.

A reader lives on one node and keeps all of its state in that node's GLOBAL workspace, so the
state is checkpointed with the model in the same epoch and a resumed or recovered job neither
repeats nor skips a record. This package sits on the job model and the workspaces; it imports
neither ``distributed`` nor ``zarr`` when it is imported (a Zarr source is opened on its node,
on first use, through :mod:`daskjobs.checkpoint`'s verified Zarr access). The runner imports it.
"""

from ._array import ArrayReader
from ._limit import ReaderWithLimit, epochs_until_finished
from ._pipe import pipe
from ._reader import Reader

__all__ = ["ArrayReader", "Reader", "ReaderWithLimit", "epochs_until_finished", "pipe"]
