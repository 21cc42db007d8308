"""Workspaces: named numpy arrays per node, with child scopes (pure: no Dask, no I/O)."""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING

import numpy as np

from ._validation import as_blob, validate_name

if TYPE_CHECKING:
    from .history import MetricLog


class Scope:
    """One level of blobs. A child scope reads through to its parent; assigning a name that
    exists in an ancestor writes there; new names stay in the child.

    ``reserved`` names (the outputs of a running group) are created at this level even when
    assigned from a descendant, like Caffe2's pre-created output blobs.
    """

    __slots__ = ("blobs", "parent", "reserved")

    def __init__(self, parent: Scope | None = None) -> None:
        self.blobs: dict[str, np.ndarray] = {}
        self.parent = parent
        self.reserved: frozenset[str] = frozenset()

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


class Workspace(MutableMapping[str, np.ndarray]):
    """A node's blobs as seen by one step: a mutable mapping from name to ``numpy.ndarray``.

    Assigning a scalar stores a 0-d array; only bool and numeric dtypes are accepted.
    Concurrent tasks of one node share the workspace: hold :attr:`lock` around
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
    """

    def __init__(
        self,
        scope: Scope,
        *,
        node: str,
        lock: threading.RLock,
        epoch: int | None = None,
        instance_id: int = 0,
        state: object = None,
        metrics: MetricLog | None = None,
    ) -> None:
        self._scope = scope
        self.node = node
        self.lock = lock
        self.epoch = epoch
        self.instance_id = instance_id
        self._state = state
        self._metrics = metrics

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
        )

    def log(self, name: str, value: float) -> None:
        """Record ``value`` of metric ``name`` (e.g. a loss) for the current run.

        An epoch's value of a metric is the mean of everything logged under that name by all
        steps on all nodes during that epoch; it shows in ``runner.history``, the progress bar
        and the epoch's commit record.

        Raises
        ------
        TypeError
            ``value`` is not a real number (a one-element array is fine).
        ValueError
            ``value`` is NaN or infinite, or ``name`` is not a valid name.
        """
        validate_name(name, "metric")
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(())[()]
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise TypeError(f"metric {name!r} must be a real number, got {type(value).__name__}: {value!r}")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {name!r} must be finite, got {number}")
        if self._metrics is not None:
            self._metrics.add(name, number)

    def __getitem__(self, name: str) -> np.ndarray:
        scope = self._scope.find(name)
        if scope is None:
            raise KeyError(f"blob {name!r} is not in the workspace of node {self.node!r}")
        return scope.blobs[name]

    def __setitem__(self, name: str, value: object) -> None:
        validate_name(name, "blob")
        array = as_blob(value, name)
        scope = self._scope.find(name) or self._scope.owner_for_new(name)
        scope.blobs[name] = array

    def __delitem__(self, name: str) -> None:
        scope = self._scope.find(name)
        if scope is None:
            raise KeyError(f"blob {name!r} is not in the workspace of node {self.node!r}")
        del scope.blobs[name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._scope.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._scope.names())

    def __len__(self) -> int:
        return len(self._scope.names())

    def own_blobs(self) -> dict[str, np.ndarray]:
        """The blobs held at this level (not inherited ones)."""
        return dict(self._scope.blobs)

    def __repr__(self) -> str:
        return f"Workspace(node={self.node!r}, epoch={self.epoch}, blobs={sorted(self._scope.names())})"
