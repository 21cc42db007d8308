"""The single-node checkpoint manager: a multi-node manager fixed to one node."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..._model.node import Node
from ..._model.values import validate_name
from ...errors import JobDefinitionError
from .manager import MultiNodeCheckpointManager
from .metadata import MetadataHandler


class CheckpointManager(MultiNodeCheckpointManager):
    """Checkpoints one node's workspace; see :class:`MultiNodeCheckpointManager`.

    Examples
    --------
    >>> import daskjobs as dj, tempfile
    >>> dj.CheckpointManager(tempfile.mkdtemp(), "trainer").nodes()
    ['trainer']
    """

    def __init__(
        self,
        db_prefix: str,
        node_name: str | Node,
        db_type: str = "zarr",
        metadata_handler: MetadataHandler | None = None,
        **options: Any,
    ) -> None:
        super().__init__(db_prefix, db_type, metadata_handler, **options)
        self.node_name = validate_name(str(node_name), "node")
        self._nodes = [self.node_name]

    def _node_names(self, nodes: Iterable[str | Node]) -> list[str]:
        names = super()._node_names(nodes)
        if len(names) > 1 or (names and names[0] != self.node_name):
            raise JobDefinitionError(
                f"CheckpointManager checkpoints only node {self.node_name!r}, got {names}; "
                "use MultiNodeCheckpointManager for several nodes"
            )
        return [self.node_name]

    def set_params(
        self,
        nodes: Sequence[str | Node],
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        job_name: str | None = None,
    ) -> None:
        """As :meth:`MultiNodeCheckpointManager.set_params`; ``nodes`` is ignored (always this node)."""
        super().set_params([self.node_name], path_prefix, path_type, job_name=job_name)

    def blob_list(self) -> list[str]:  # type: ignore[override]  # Caffe2's API: this node's names, not per node
        """Blob names in the last checkpoint saved or loaded."""
        return super().blob_list()[self.node_name]
