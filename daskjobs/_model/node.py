"""Cluster and Node: where tasks run, by name."""

from __future__ import annotations

from typing import Any

from ..errors import DefinitionTypeError
from .context import Managed
from .values import check_positive, validate_name


class Cluster(Managed):
    """Records the node names used inside it, in first-use order.

    Each thread has a default cluster; enter a fresh ``Cluster()`` to keep node registrations
    of one job definition separate.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Cluster() as cluster:
    ...     _ = dj.Node("ps"), dj.Node("trainer", GPU=1)
    >>> cluster.nodes()
    ['ps', 'trainer']
    """

    _managed_default = True

    def __init__(self) -> None:
        self._nodes: list[str] = []
        self._node_kwargs: dict[str, dict[str, Any]] = {}

    def add_node(self, node: Node) -> None:
        """Register ``node``; on a repeated name the earlier keyword arguments win."""
        name = str(node)
        if name not in self._node_kwargs:
            self._nodes.append(name)
            self._node_kwargs[name] = {}
        merged = dict(node.kwargs())
        merged.update(self._node_kwargs[name])
        self._node_kwargs[name] = merged

    def nodes(self) -> list[str]:
        """Node names in first-use order."""
        return list(self._nodes)

    def node_kwargs(self) -> dict[str, dict[str, Any]]:
        """Extra resources per node name."""
        return {name: dict(kw) for name, kw in self._node_kwargs.items()}

    def __repr__(self) -> str:
        return f"Cluster(nodes={self._nodes}, node_kwargs={self._node_kwargs})"


class Node(Managed):
    """A named place where tasks run: one Dask worker (or, in-process, one workspace).

    Only the name identifies a node: nodes with the same name are equal (whatever their
    resources), equal to that name as a ``str``, and hash like it, so ``Node("a") in {"a"}``.
    Extra keyword arguments are Dask resources the node's worker must provide, e.g.
    ``Node("trainer", GPU=1)``.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.Node("trainer"):
    ...     print(dj.Node.current())
    trainer
    >>> str(dj.Node.current())
    'local'
    >>> dj.Node("ps") == dj.Node("ps", GPU=1) == "ps"
    True
    >>> dj.Node("ps", GPU=1)
    Node('ps', GPU=1)
    """

    _managed_default = True

    def __init__(self, name: str | Node = "local", **kwargs: float) -> None:
        if not isinstance(name, str | Node):
            raise DefinitionTypeError(f"a node is named by a str (or a Node), got {type(name).__name__}: {name!r}")
        self._name = validate_name(str(name), "node")
        for key, value in kwargs.items():
            validate_name(key, f"node {self._name!r}: resource")
            check_positive(value, f"node {self._name!r}: resource {key}")
        self._kwargs = dict(kwargs)
        Cluster.current().add_node(self)

    @property
    def name(self) -> str:
        """The node's name."""
        return self._name

    def kwargs(self) -> dict[str, Any]:
        """Extra resources the node's worker must provide."""
        return dict(self._kwargs)

    def __str__(self) -> str:
        return self._name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Node):
            return self._name == other._name
        if isinstance(other, str):
            return self._name == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        named = {k: v for k, v in self._kwargs.items() if k.isidentifier()}
        other = {k: v for k, v in self._kwargs.items() if not k.isidentifier()}
        resources = "".join(f", {key}={value!r}" for key, value in named.items())
        return f"Node({self._name!r}{resources}{f', **{other!r}' if other else ''})"


def node_name(node: Node | str | None) -> str:
    """The name of ``node``; a string is validated and registered, ``None`` is the current node.

    Raises
    ------
    DefinitionTypeError
        ``node`` is neither ``None``, a ``str`` nor a :class:`Node`.
    JobDefinitionError
        ``node`` is not a valid node name.
    """
    if node is None:
        return str(Node.current())
    if isinstance(node, Node):
        Cluster.current().add_node(node)
        return str(node)
    return str(Node(node))
