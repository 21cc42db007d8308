"""Reader: a resumable source of batches bound to one node, its state kept in blobs."""

from __future__ import annotations

import html
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._model.group import TaskGroup
from .._model.job import Job
from .._model.node import Node
from .._model.task import Task, WorkspaceType
from .._model.values import validate_name
from ..errors import JobDefinitionError

if TYPE_CHECKING:
    from .._model.workspace import Workspace

_names: weakref.WeakKeyDictionary[TaskGroup, list[tuple[str, str]]] = weakref.WeakKeyDictionary()
"""``(node, name)`` of the readers whose setup task each group holds, in creation order."""


class _Ready:
    """A batch that a reader has already produced (see :meth:`Reader._claim`)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def check_node(reader: Reader, what: str) -> None:
    """Refuse to use ``reader`` inside another node's block than the one it was built on.

    Outside any ``Node`` block (the default node ``"local"``) the reader's own node is used.
    """
    current = str(Node.current())
    if current not in (reader.node, "local"):
        raise JobDefinitionError(
            f"{what}: reader {reader.name!r} was built on node {reader.node!r} and is read there, but this is "
            f"inside Node({current!r}); call it inside 'with dj.Node({reader.node!r}):' (readers never move "
            "data between nodes)"
        )


def current_group(reader_name: str, what: str) -> TaskGroup:
    """The active TaskGroup, or an error naming the reader."""
    group = TaskGroup.current(required=False)
    if group is None:
        raise JobDefinitionError(
            f"{what} for reader {reader_name!r} needs an active TaskGroup: call it inside "
            "'with job.epoch_group:' (or 'with dj.Job() as job:', or any 'with dj.TaskGroup():')"
        )
    return group


class Reader:
    """Base class of a resumable source of batches, bound to the node it is built on.

    Build a reader inside ``with job.init_group:`` (inside a :class:`~daskjobs.Job` its setup
    task always goes to the job's init group): it adds an init task on its node that calls
    :meth:`setup`. A subclass keeps **all** of its state in blobs of the node's workspace,
    named under :meth:`blob` (``reader.<name>.<key>``), so the state is checkpointed with the
    model and a resumed or recovered job continues exactly where the last committed epoch was.

    Subclasses implement :meth:`setup` (create the state blobs) and :meth:`read` (return the
    next batch and advance the state, or ``None`` once exhausted); they may implement
    :meth:`exhausted` so that :meth:`ReaderWithLimit.data_finished` turns true in the epoch that
    read the last batch rather than in the next one. :func:`pipe` calls :meth:`read` under
    ``ws.lock``, so ``read`` needs no locking of its own.

    Parameters
    ----------
    name
        Names the reader's blobs. Default: ``reader<k>`` for the k-th reader of the init group,
        so a job defined again (to resume it) gets the same names.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> class Countdown(dj.Reader):
    ...     def setup(self, ws):
    ...         ws[self.blob("left")] = 3
    ...     def read(self, ws):
    ...         left = int(ws[self.blob("left")])
    ...         if left == 0:
    ...             return None
    ...         ws[self.blob("left")] = left - 1
    ...         return np.array([left])
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         countdown = Countdown(name="countdown")
    ...     _ = dj.Task(lambda ws: ws.__setitem__("total", 0), group=job.init_group)
    ...     _ = dj.pipe(countdown, lambda ws, batch: ws.__setitem__("total", ws["total"] + batch.sum()))
    >>> with dj.LocalSession() as session:
    ...     _ = dj.JobRunner(job, max_epochs=1, progress=False).train(session)
    ...     int(session.fetch("total"))
    6
    """

    _node: str
    _name: str

    def __init__(self, name: str | None = None) -> None:
        node = str(Node.current())
        group = self._init_group(name)
        taken = _names.setdefault(group, [])
        if name is None:
            name = f"reader{len(taken)}"
        validate_name(f"reader.{name}.position", f"reader {name!r}: blob")
        if (node, name) in taken:
            raise JobDefinitionError(
                f"reader {name!r} already exists on node {node!r} in this job: give each reader its own name="
            )
        self._node, self._name = node, name
        Task(self._init_step(), group=group, node=node, name=f"reader.{name}", workspace_type=WorkspaceType.GLOBAL)
        taken.append((node, name))

    @classmethod
    def _label(cls, name: str | None) -> str:
        """The name a reader built here with ``name`` gets (``readerN`` when ``None``), for messages
        raised before it is built."""
        if name is not None:
            return name
        try:
            group = cls._init_group(None)
        except JobDefinitionError:
            return "(unnamed)"
        return f"reader{len(_names.get(group, []))}"

    @staticmethod
    def _init_group(name: str | None) -> TaskGroup:
        label = repr(name) if name is not None else "(unnamed)"
        job = Job.current(required=False)
        group = TaskGroup.current(required=False)
        if job is not None and (group is None or any(group is g for g in job.groups().values())):
            group = job.init_group
        if group is None:
            raise JobDefinitionError(
                f"reader {label} must be built inside 'with job.init_group:' (or a TaskGroup that you run "
                "before reading): that is where it adds the task creating its state blobs"
            )
        if group.workspace_type() is WorkspaceType.PRIVATE:
            raise JobDefinitionError(
                f"reader {label} is built in a PRIVATE TaskGroup, where its state blobs would vanish after the "
                "run; build it in the job's init group (GLOBAL)"
            )
        return group

    def _init_step(self) -> Callable[[Workspace], None]:
        """The step of the reader's init task (default: :meth:`setup`)."""
        return self.setup

    # -- identity --------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The reader's name; its blobs are ``reader.<name>.<key>``."""
        return self._name

    @property
    def node(self) -> str:
        """The node the reader was built on; it is read only there."""
        return self._node

    def blob(self, key: str) -> str:
        """The name of the reader's state blob ``key``: ``"reader.<name>.<key>"``."""
        return f"reader.{self._name}.{key}"

    # -- to implement ------------------------------------------------------------------------
    def setup(self, ws: Workspace) -> None:
        """Create the reader's state blobs in ``ws`` (the node's GLOBAL workspace)."""

    def read(self, ws: Workspace) -> Any:
        """The next batch, advancing the state blobs; ``None`` once the reader is exhausted."""
        raise NotImplementedError(f"{type(self).__name__} must implement read(ws)")

    def exhausted(self, ws: Workspace) -> bool | None:
        """Whether :meth:`read` would return ``None`` now; ``None`` when the reader cannot tell."""
        return None

    # -- used by ReaderWithLimit and pipe -----------------------------------------------------
    def _claim(self, ws: Workspace) -> Any:
        """Under ``ws.lock``: advance the state for one batch; ``None`` when exhausted.

        Returns what :meth:`_load` turns into the batch outside the lock, so that the slow part
        of reading can overlap between the threads of a pipe.
        """
        self._check_ws(ws)
        batch = self.read(ws)
        return None if batch is None else _Ready(batch)

    def _load(self, ws: Workspace, claim: Any) -> Any:
        """Outside the lock: the batch of a :meth:`_claim`."""
        return claim.batch

    def _next(self, ws: Workspace) -> Any:
        """Claim under ``ws.lock``, then load: the next batch or ``None``."""
        with ws.lock:
            claim = self._claim(ws)
        return None if claim is None else self._load(ws, claim)

    def _check_ws(self, ws: Workspace) -> None:
        if ws.node != self._node:
            raise JobDefinitionError(
                f"reader {self._name!r} was built on node {self._node!r} but is read on node {ws.node!r}; "
                f"read it in a task of node {self._node!r} (dj.pipe places its task there)"
            )

    def _state(self, ws: Workspace, key: str) -> Any:
        """State blob ``key``, or an error saying the reader's init task has not run on this node."""
        self._check_ws(ws)
        name = self.blob(key)
        try:
            return ws[name]
        except KeyError:
            raise JobDefinitionError(
                f"reader {self._name!r} has no state blob {name!r} on node {ws.node!r}: its init task has not "
                "run; build the reader inside 'with job.init_group:' and run the job with a JobRunner"
            ) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, node={self._node!r})"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"
