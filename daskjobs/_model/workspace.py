"""Workspaces: named values (numpy arrays and JSON values) per node, with child scopes (pure: no Dask, no I/O)."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING

import numpy as np

from ..errors import DefinitionTypeError, InvalidStateError, JobDefinitionError
from .values import BlobValue, Value, as_value, check_label, validate_name

if TYPE_CHECKING:
    from .._execution.node_run import NodeState
    from .metrics import MetricLog


Writer = tuple[int | None, int, str]
"""Who last assigned a blob: ``(epoch or None, task index in its group, task name)``."""


class Scope:
    """One level of blobs. A child scope reads through to its parent; assigning a name that
    exists in an ancestor writes there; new names stay in the child.

    ``reserved`` names (the outputs of a running group) are created at this level even when
    assigned from a descendant, like Caffe2's pre-created output blobs.

    ``traps`` is set on the scope of a PRIVATE run (its root) and shared by its descendants: it
    collects the names a descendant looked up, found missing (``misses``) and then created in a
    scope that the run discards (see :meth:`Workspace.__setitem__`).

    ``writers`` says which task last assigned each blob of this level: ``(epoch, task index in its
    group, task name)``; a blob assigned outside a task has none, and a change in place
    (``ws["w"][:] = ...``) is no assignment.
    """

    __slots__ = ("blobs", "misses", "parent", "reserved", "traps", "writers")

    def __init__(self, parent: Scope | None = None) -> None:
        self.blobs: dict[str, Value] = {}
        self.writers: dict[str, Writer] = {}
        self.parent = parent
        self.reserved: frozenset[str] = frozenset()
        self.traps: dict[str, None] | None = parent.traps if parent is not None else None
        self.misses: set[str] = set()

    def find(self, name: str) -> Scope | None:
        """The nearest scope holding ``name``."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope.blobs:
                return scope
            scope = scope.parent
        return None

    def owner_for_new(self, name: str) -> Scope:
        """Where a new blob ``name`` assigned in this scope lives."""
        scope: Scope | None = self
        while scope is not None:
            if name in scope.reserved:
                return scope
            scope = scope.parent
        return self

    def names(self) -> list[str]:
        """Every visible name, nearest scope first."""
        seen: dict[str, None] = {}
        scope: Scope | None = self
        while scope is not None:
            seen.update(dict.fromkeys(scope.blobs))
            scope = scope.parent
        return list(seen)

    def note_miss(self, name: str) -> None:
        """Remember that a lookup of ``name`` here found nothing (only inside a PRIVATE run)."""
        if self.traps is not None:
            self.misses.add(name)

    def _is_run_root(self) -> bool:
        return self.parent is None or self.parent.traps is not self.traps

    def missed(self, name: str) -> bool:
        """Whether this scope, or an ancestor of the same PRIVATE run below its root, saw ``name`` missing.

        The root of a run is shared by every step of the node that runs outside a task (report
        steps, node-local setup): what they found missing counts only for what they create
        themselves, never for a blob a task creates.
        """
        if self.traps is None:
            return False
        if name in self.misses:
            return True
        scope = self.parent
        while scope is not None and not scope._is_run_root():
            if name in scope.misses:
                return True
            scope = scope.parent
        return False


class Workspace(MutableMapping[str, BlobValue]):
    """A node's blobs as seen by one step: a mutable mapping from name to value.

    A value is a ``numpy.ndarray`` (bool, integer, float, complex or fixed-width strings;
    numbers become 0-d arrays) or a JSON value (``None``, ``str``, ``bool``, ``int``, finite
    ``float``, ``list``, ``dict`` with ``str`` keys; tuples become lists). Assignment
    normalises once, so what a step reads back is what a restore from a checkpoint gives;
    anything else raises :class:`~daskjobs.errors.BlobTypeError` naming the blob.
    Arrays are stored as given (not copied); JSON values are stored as a normalised copy.
    Concurrent tasks of one node share the workspace: hold ``ws.lock`` around
    read-modify-write of shared blobs.

    Attributes
    ----------
    node : str
        The node's name.
    epoch : int or None
        The current epoch while the epoch group runs, else ``None``.
    instance_id : int
        ``0..n-1`` inside a multi-instance task, else 0.
    lock : threading.RLock
        Shared by all tasks of the node.

    Examples
    --------
    >>> import threading
    >>> ws = Workspace(Scope(), node="local", lock=threading.RLock())
    >>> ws["x"] = 3
    >>> ws["x"], ws["x"].shape
    (array(3), ())
    >>> ws["state"] = {"files": ("a.csv", "b.csv"), "position": np.int64(7)}
    >>> ws["state"]
    {'files': ['a.csv', 'b.csv'], 'position': 7}
    """

    def __init__(
        self,
        scope: Scope,
        *,
        node: str,
        lock: threading.RLock,
        epoch: int | None = None,
        instance_id: int = 0,
        state: NodeState | None = None,
        metrics: MetricLog | None = None,
        task: tuple[int, str] | None = None,
    ) -> None:
        self._scope = scope
        self.node = node
        self.lock = lock
        self.epoch = epoch
        self.instance_id = instance_id
        self._state = state
        self._metrics = metrics
        self._task = task
        """``(index in its group, name)`` of the task whose steps use this workspace, if any."""

    def child(self, instance_id: int | None = None) -> Workspace:
        """A new child workspace that reads through to this one."""
        return Workspace(
            Scope(self._scope),
            node=self.node,
            lock=self.lock,
            epoch=self.epoch,
            instance_id=self.instance_id if instance_id is None else instance_id,
            state=self._state,
            metrics=self._metrics,
            task=self._task,
        )

    def for_task(self, index: int, name: str) -> Workspace:
        """This workspace (the same blobs) as task ``name`` (``index`` in its group) sees it: what it
        assigns is recorded as that task's (see ``Scope.writers``)."""
        return Workspace(
            self._scope,
            node=self.node,
            lock=self.lock,
            epoch=self.epoch,
            instance_id=self.instance_id,
            state=self._state,
            metrics=self._metrics,
            task=(index, name),
        )

    def log(self, name: str, value: float) -> None:
        """Record ``value`` of metric ``name`` (e.g. a loss) for the current run.

        An epoch's value of a metric is the mean of everything logged under that name by all
        steps on all nodes during that epoch; it shows in ``runner.history``, the progress bar
        and the epoch's commit record.

        Raises
        ------
        DefinitionTypeError
            A ``TypeError``: ``value`` is not a real number (a one-element array is fine).
        JobDefinitionError
            A ``ValueError``: ``value`` is NaN, infinite or beyond a float, or ``name`` is not
            1-128 printable characters.
        """
        check_label(name, "metric")
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(())[()]
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise DefinitionTypeError(
                f"metric {name!r} must be a real number, got {type(value).__name__}: {value!r}"[:300]
            )
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise JobDefinitionError(f"metric {name!r} must be a finite float, got {number}")
        if self._metrics is not None:
            self._metrics.add(name, number)

    def __getitem__(self, name: str) -> BlobValue:
        scope = self._scope.find(name)
        if scope is None:
            self._scope.note_miss(name)
            raise KeyError(f"blob {name!r} is not in the workspace of node {self.node!r}")
        return scope.blobs[name]

    def __setitem__(self, name: str, value: object) -> None:
        validate_name(name, "blob")
        normalised = as_value(value, name)
        scope = self._scope.find(name)
        if scope is None:
            scope = self._scope.owner_for_new(name)
            if scope.traps is not None and name not in scope.reserved and self._scope.missed(name):
                # Looked up, found missing, created where the run discards it: the accumulate trap.
                scope.traps[name] = None
        scope.blobs[name] = normalised
        if self._task is None:
            scope.writers.pop(name, None)
        else:
            scope.writers[name] = (self.epoch, *self._task)

    def __delitem__(self, name: str) -> None:
        scope = self._scope.find(name)
        if scope is None:
            raise KeyError(f"blob {name!r} is not in the workspace of node {self.node!r}")
        del scope.blobs[name]
        scope.writers.pop(name, None)

    def pop(self, name: str, *default: object) -> BlobValue:
        """Remove ``name`` and return its value (or ``default`` if given and ``name`` is missing)."""
        scope = self._scope.find(name)
        if scope is None:
            if default:
                return default[0]
            raise KeyError(f"blob {name!r} is not in the workspace of node {self.node!r}")
        scope.writers.pop(name, None)
        return scope.blobs.pop(name)

    def setdefault(self, name: str, default: object = None) -> BlobValue:
        """``self[name]``; when missing, assign ``default`` first and return the value stored.

        Like any assignment, ``default`` is normalised, so ``ws.setdefault("n", 0)`` returns
        ``array(0)``, exactly what ``ws["n"]`` holds afterwards.
        """
        try:
            return self[name]
        except KeyError:
            self[name] = default
            return self[name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if self._scope.find(name) is None:
            self._scope.note_miss(name)
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._scope.names())

    def __len__(self) -> int:
        return len(self._scope.names())

    def own_blobs(self) -> dict[str, Value]:
        """The blobs held at this level (not inherited ones)."""
        return dict(self._scope.blobs)

    def __repr__(self) -> str:
        return f"Workspace(node={self.node!r}, epoch={self.epoch}, blobs={sorted(self._scope.names())})"


def node_state(ws: Workspace) -> NodeState:
    """The runtime state of the node whose workspace ``ws`` is, for daskjobs' own steps (checkpoint
    saves and loads keep what they need between runs there, see ``NodeState.slot``).

    Raises
    ------
    InvalidStateError
        ``ws`` was made outside a node's run (it belongs to no node state).
    """
    if ws._state is None:
        raise InvalidStateError(f"the workspace of node {ws.node!r} belongs to no node run: it has no node state")
    return ws._state
