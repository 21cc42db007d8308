"""ReaderWithLimit: at most ``num_iter`` batches per epoch, and a ``data_finished`` flag."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._model.group import TaskGroup
from .._model.job import Job
from .._model.task import SetupNets, Task, TaskOutput
from .._model.values import check_count
from ..errors import JobDefinitionError
from ._reader import Reader, check_node, current_group

if TYPE_CHECKING:
    from .._model.workspace import Workspace

_limits: weakref.WeakKeyDictionary[TaskGroup, list[tuple[str, str]]] = weakref.WeakKeyDictionary()
"""``(node, reader name)`` of the limiters built in each group, so that each gets its own blobs."""
_finished_outputs: weakref.WeakKeyDictionary[TaskOutput, ReaderWithLimit] = weakref.WeakKeyDictionary()


def epochs_until_finished(output: TaskOutput) -> int | None:
    """For a :meth:`ReaderWithLimit.data_finished` output: the epoch (counted from scratch) in
    which it turns true, when the client can tell; ``None`` for any other output.

    A progress bar can show it as its total when the output is a stop condition.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         reader = dj.ArrayReader(np.arange(100), batch_size=10, num_passes=3)
    ...     limited = dj.ReaderWithLimit(reader, num_iter=7)
    >>> epochs_until_finished(limited.data_finished())
    5
    """
    limited = _finished_outputs.get(output)
    return None if limited is None else limited.epochs_until_finished()


@dataclass(frozen=True)
class _Reset:
    """Node-local init of each group run: zero the counter, clear ``data_finished``."""

    limited: ReaderWithLimit

    def __call__(self, ws: Workspace) -> None:
        self.limited._reset(ws)


class ReaderWithLimit(Reader):
    """Reads at most ``num_iter`` batches of ``reader`` per run of the group it is built in.

    Build it in the epoch group (``with job.epoch_group:`` or directly inside ``with Job()``),
    after the reader itself. Each epoch starts its counter at zero (a node-local init of the
    group, before any task of the node runs); :func:`pipe` stops once the limit is hit or the
    underlying reader is exhausted. Its blobs, ``reader.<name>.limit.counter`` and
    ``reader.<name>.limit.data_finished``, belong to the epoch; the reader's position, in the
    GLOBAL workspace, is what is checkpointed.

    Parameters
    ----------
    reader
        The :class:`Reader` to limit.
    num_iter
        Batches per epoch at most; ``None`` reads until the reader is exhausted; ``0`` reads
        nothing.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         reader = dj.ArrayReader(np.arange(10), batch_size=2)
    ...     limited = dj.ReaderWithLimit(reader, num_iter=2)
    ...     _ = dj.pipe(limited, lambda ws, batch: None)
    ...     _ = job.add_stop_condition(limited.data_finished())
    >>> runner = dj.JobRunner(job, progress=False)
    >>> runner.train(None), int(limited.counter().fetch())
    (3, 1)
    """

    def __init__(self, reader: Reader, num_iter: int | None = None) -> None:
        if not isinstance(reader, Reader):
            raise JobDefinitionError(f"ReaderWithLimit needs a dj.Reader, got {reader!r}")
        if num_iter is not None:
            num_iter = check_count(num_iter, f"ReaderWithLimit of reader {reader.name!r}: num_iter (or None)", 0)
        group = current_group(reader.name, "ReaderWithLimit")
        job = Job.current(required=False)
        if job is not None and group is job.init_group:
            raise JobDefinitionError(
                f"ReaderWithLimit of reader {reader.name!r} counts batches per epoch: build it in the epoch group "
                "('with job.epoch_group:'), not in the init group"
            )
        check_node(reader, "ReaderWithLimit")
        taken = _limits.setdefault(group, [])
        suffix = taken.count((reader.node, reader.name))
        taken.append((reader.node, reader.name))
        self.reader, self.num_iter = reader, num_iter
        self._node = reader.node
        self._name = f"{reader.name}.limit" + (str(suffix) if suffix else "")
        group.add_local_setup(SetupNets(init_nets=[_Reset(self)]), node=self._node)
        outputs = Task(group=group, node=self._node, name=f"reader.{self._name}").add_outputs(
            [self.blob("data_finished"), self.blob("counter")]
        )
        self._finished, self._counter = outputs
        _finished_outputs[self._finished] = self

    def blob(self, key: str) -> str:
        """The name of the limiter's blob ``key``: ``"reader.<reader>.limit.<key>"``."""
        return f"reader.{self._name}.{key}"

    def data_finished(self) -> TaskOutput:
        """A bool that turns true once the underlying reader is exhausted (not when the limit is hit).

        Ready for ``job.add_stop_condition``; it is fetched after each epoch.
        """
        return self._finished

    def epochs_until_finished(self) -> int | None:
        """The epoch (from scratch) in which :meth:`data_finished` turns true, if the client can tell."""
        total = getattr(self.reader, "total_batches", lambda: None)()
        if total is None or self.num_iter == 0:
            return None
        return 1 if self.num_iter is None else max(1, -(-total // self.num_iter))

    def counter(self) -> TaskOutput:
        """The number of batches read in the last epoch."""
        return self._counter

    # -- on the node ---------------------------------------------------------------------------
    def _reset(self, ws: Workspace) -> None:
        self._check_ws(ws)
        ws[self.blob("counter")] = np.int64(0)
        ws[self.blob("data_finished")] = bool(self.reader.exhausted(ws))

    def exhausted(self, ws: Workspace) -> bool | None:
        """Whether the underlying reader is exhausted."""
        return self.reader.exhausted(ws)

    def _claim(self, ws: Workspace) -> Any:
        count = int(self._state(ws, "counter"))
        if self.num_iter is not None and count >= self.num_iter:
            return None
        claim = self.reader._claim(ws)
        if claim is None:
            ws[self.blob("data_finished")] = True
            return None
        ws[self.blob("counter")] = np.int64(count + 1)
        if self.reader.exhausted(ws):
            ws[self.blob("data_finished")] = True
        return claim

    def _load(self, ws: Workspace, claim: Any) -> Any:
        return self.reader._load(ws, claim)

    def _state(self, ws: Workspace, key: str) -> Any:
        self._check_ws(ws)
        try:
            return ws[self.blob(key)]
        except KeyError:
            raise JobDefinitionError(
                f"reader {self._name!r} is read outside the group it was built in (no blob {self.blob(key)!r} on "
                f"node {ws.node!r}); pipe it in that group"
            ) from None

    def read(self, ws: Workspace) -> Any:
        """The next batch within this epoch's limit, or ``None``."""
        return self._next(ws)

    def __repr__(self) -> str:
        return f"ReaderWithLimit(reader={self.reader!r}, num_iter={self.num_iter})"
