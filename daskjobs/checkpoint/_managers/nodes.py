"""Which nodes a manager checkpoints, and for which job: recorded by ``set_params`` (or ``init``),
each node's checkpoint named, and every node's worker proven to see the prefix as this process does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..._model.node import Node
from ..._model.values import validate_name
from ...errors import InvalidStateError
from .._format.naming import db_name
from .._node.sharing import prove_shared

if TYPE_CHECKING:
    from ...session import Session
    from .._protocol.store import CheckpointStore
    from .metadata import MetadataHandler


class CheckpointedNodes:
    """Mixed into :class:`~daskjobs.MultiNodeCheckpointManager`: Caffe2's ``set_params`` and
    ``get_ckpt_db_name``, ``nodes`` and ``check_shared``.

    Uses the manager's attributes below.
    """

    db_prefix: str
    db_type: str
    durable: bool
    store: CheckpointStore
    _handler: MetadataHandler
    _nodes: list[str] | None
    _job_name: str
    _job_named: bool

    def _node_names(self, nodes: Iterable[str | Node]) -> list[str]:
        return [validate_name(str(n), "node") for n in nodes]

    def set_params(
        self,
        nodes: Sequence[str | Node],
        path_prefix: str | None = None,
        path_type: str | None = None,
        *,
        job_name: str | None = None,
    ) -> None:
        """Record the checkpointed nodes (and the job's name) and tell the metadata handler."""
        self._nodes = self._node_names(nodes)
        if job_name is not None:
            self._job_name, self._job_named = validate_name(job_name, "job"), True
        self._handler.set_params(
            db_prefix=self.db_prefix,
            db_type=self.db_type,
            node_names=list(self._nodes),
            path_prefix=path_prefix,
            path_type=path_type,
        )

    def nodes(self) -> list[str]:
        """The checkpointed nodes (after :meth:`init` or :meth:`set_params`)."""
        if self._nodes is None:
            raise InvalidStateError("checkpoint manager has no nodes yet: call init() or set_params() first")
        return list(self._nodes)

    def check_shared(self, session: Session) -> None:
        """Prove that every checkpointed node's worker in ``session`` sees this prefix as this process does.

        A local path must be one directory for this process and every node's worker (a shared
        filesystem): on a cluster of several machines without one, each would write where the
        others never look. This process writes a probe file under ``__daskjobs__/``, each node's
        worker reads it and writes its own, this process reads those back, and all of them are
        removed: one round trip to the nodes. A :class:`~daskjobs.JobRunner` does it before a run
        writes or loads anything, and before :meth:`~daskjobs.JobRunner.save_checkpoints`; a
        :class:`~daskjobs.LocalSession` needs no proof.

        Raises
        ------
        CheckpointStorageError
            A node's worker sees another directory (or nothing, or cannot write there); the
            message names the node, its worker and the path, and says what to use instead: a
            shared filesystem mounted at the same path on every machine, or an object store.
        CheckpointWriteError
            This process cannot write to the prefix.

        Examples
        --------
        >>> import daskjobs as dj, tempfile
        >>> manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp())
        >>> manager.set_params(["ps", "trainer"])
        >>> with dj.node_cluster(["ps", "trainer"]) as cluster, dj.DaskSession(cluster) as session:  # doctest: +SKIP
        ...     manager.check_shared(session)
        """
        if self.durable:
            prove_shared(self.store, session, self.nodes(), job=self._job_name)

    def get_ckpt_db_name(self, node_name: str, epoch: int) -> str:
        """The checkpoint name of ``node_name`` at ``epoch``: ``db_name(epoch, node_name, db_prefix)``."""
        return db_name(epoch, str(node_name), self.db_prefix)
