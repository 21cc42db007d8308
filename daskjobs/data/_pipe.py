"""pipe: a task on the reader's node whose threads read batches and hand each to a processor."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._model.task import Task, not_plain
from .._model.values import check_count
from ..errors import JobDefinitionError, StepTypeError
from ._reader import Reader, check_node, current_group

if TYPE_CHECKING:
    from .._model.workspace import Workspace

Processor = Callable[["Workspace", Any], Any]
"""``processor(ws, batch)``: consumes one batch in the pipe task's workspace."""


@dataclass(frozen=True)
class _PipeLoop:
    """One instance of a pipe: read (claiming under ``ws.lock``), process, until the reader stops."""

    reader: Reader
    processor: Processor

    @property
    def __name__(self) -> str:
        return "pipe"

    def __call__(self, ws: Workspace) -> None:
        while True:
            batch = self.reader._next(ws)
            if batch is None:
                return
            result = self.processor(ws, batch)
            if inspect.iscoroutine(result) or inspect.isgenerator(result):
                result.close()  # no "never awaited" warning: nothing of its body has run
            if inspect.isawaitable(result) or inspect.isgenerator(result):
                raise StepTypeError(
                    f"the processor of reader {self.reader.name!r} returned {type(result).__name__}: "
                    "processors are plain functions processor(ws, batch), not async or generator functions"
                )


def pipe(reader: Reader, processor: Processor, num_threads: int = 1, name: str | None = None) -> Task:
    """Read ``reader`` to its end (or its limit) in the current group, calling ``processor`` per batch.

    Adds a Task on the reader's node with ``num_threads`` instances. Each instance loops: take
    the next batch (its position advances under ``ws.lock``, so each batch goes to exactly one
    thread), then ``processor(ws, batch)`` outside the lock. With ``num_threads > 1`` the
    processors run concurrently (hogwild): hold ``ws.lock`` around read-modify-write of shared
    blobs. Every batch is processed exactly once, also across kills and resumes, because the
    reader's position is checkpointed with the epoch that processed it.

    Parameters
    ----------
    reader
        A :class:`Reader`, usually a :class:`ReaderWithLimit` built in the same group.
    processor
        ``processor(ws, batch)``.
    num_threads
        Concurrent instances of the loop.
    name
        The task's name (default ``"pipe"``).

    Returns
    -------
    Task
        Add outputs to it (``task.add_output``) or inputs (``task.add_input``) as to any Task.

    Raises
    ------
    StepTypeError
        Naming the reader: ``processor`` is not a plain synchronous callable (as for a step).
    JobDefinitionError
        Naming the reader: ``num_threads`` is not a positive int, no TaskGroup is active, or
        the call is inside another node's block.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> def accumulate(ws, batch):
    ...     with ws.lock:
    ...         ws["total"] = ws["total"] + batch.sum()
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         reader = dj.ArrayReader(np.arange(100), batch_size=10)
    ...         _ = dj.Task(lambda ws: ws.__setitem__("total", 0))
    ...     limited = dj.ReaderWithLimit(reader)
    ...     _ = dj.pipe(limited, accumulate, num_threads=4)
    ...     _ = job.add_stop_condition(limited.data_finished())
    >>> with dj.LocalSession() as session:
    ...     dj.JobRunner(job, progress=False).train(session), int(session.fetch("total"))
    (1, 4950)
    """
    if not isinstance(reader, Reader):
        raise JobDefinitionError(f"pipe needs a dj.Reader to read from, got {reader!r}")
    if not callable(processor):
        raise StepTypeError(
            f"pipe of reader {reader.name!r}: the processor must be a callable processor(ws, batch), got {processor!r}"
        )
    kind = not_plain(processor)
    if kind:
        raise StepTypeError(
            f"pipe of reader {reader.name!r}: the processor {processor!r} is {kind}, so calling it would not "
            "process the batch; use a plain function processor(ws, batch)"
        )
    num_threads = check_count(num_threads, f"pipe of reader {reader.name!r}: num_threads")
    group = current_group(reader.name, "pipe")
    check_node(reader, "pipe")
    loop = _PipeLoop(reader, processor)
    return Task(loop, group=group, node=reader.node, name=name or "pipe", num_instances=num_threads)
