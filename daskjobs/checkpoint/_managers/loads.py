"""How a manager loads: every node's whole workspace from a committed epoch, or some named blobs,
all or nothing across nodes."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..._model.group import TaskGroup
from ..._model.node import Node
from ..._model.task import Task, WorkspaceType
from ..._model.values import validate_name
from ...errors import CheckpointError, CheckpointNotFoundError, DefinitionTypeError, JobDefinitionError
from .._format.records import committed_entry
from .._node.load_steps import READ_BLOB, AssignStep, DiscardStep, ReadStep
from .._protocol.store import CheckpointStore

if TYPE_CHECKING:
    from ...session import Session
    from .._format.documents import CommitRecord, EntryRef
    from .last import LastCheckpoint

logger = logging.getLogger("daskjobs")


def _name_list(names: Iterable[Any], what: str) -> list[Any]:
    """``names``, a list (or other iterable) of ``what`` names, as a list; the names are not checked.

    Raises
    ------
    DefinitionTypeError
        ``names`` is a ``str`` (it would be taken as one-letter names) or not iterable.
    """
    if isinstance(names, str | bytes):
        raise DefinitionTypeError(
            f"{what} names must be a list of names, not a {type(names).__name__}: pass [{names!r}]"
        )
    try:
        return list(names)
    except TypeError:
        raise DefinitionTypeError(
            f"{what} names must be a list of names, got {type(names).__name__}: {names!r}"
        ) from None


class Loads:
    """Mixed into :class:`~daskjobs.MultiNodeCheckpointManager`: Caffe2's ``load``,
    ``load_blobs_from_checkpoint``, ``load_blobs_locally`` and ``check_db_exists``.

    Uses the manager's attributes below and its ``nodes()``, ``_node_names()``, ``_group()``,
    ``_remember()`` and ``get_ckpt_db_name()``.
    """

    store: CheckpointStore
    _nodes: list[str] | None
    _last: LastCheckpoint
    _job_name: str

    if TYPE_CHECKING:  # the manager's own, which this mixin uses

        def nodes(self) -> list[str]: ...

        def _node_names(self, nodes: Iterable[str | Node]) -> list[str]: ...

        def _group(
            self,
            make_task: Callable[[TaskGroup, str], object],
            workspace_type: WorkspaceType = WorkspaceType.GLOBAL,
            nodes: list[str] | None = None,
        ) -> TaskGroup: ...

        def _remember(
            self, epoch: int, entries: Mapping[str, EntryRef], store: CheckpointStore | None = None
        ) -> None: ...

        def get_ckpt_db_name(self, node_name: str, epoch: int) -> str: ...

    def load(self, epoch: int, path_prefix: str | None = None, path_type: str | None = None) -> TaskGroup:
        """A group restoring every checkpointed node's workspace to committed ``epoch``, verified.

        All or nothing across nodes: every node reads and verifies its whole checkpoint before any
        workspace changes, then each node's GLOBAL workspace holds exactly the epoch's blobs. When
        one node's checkpoint is corrupt, the group fails and no workspace was changed (the blobs the
        other nodes read stay on them until their next load).
        """
        store = self.store if not path_prefix else CheckpointStore(path_prefix, self.store.storage_options)
        return self._whole_load(store, store.read_commit(epoch), uuid.uuid4().hex)

    def restore(self, session: Session, record: CommitRecord, **run_options: Any) -> None:
        """Run :meth:`load` of the commit ``record`` (as the manager's store's ``read_commit``
        returned it: not read again) in ``session``; after a failure, drop what the nodes read.
        A subclass that overrides :meth:`load` has the group it returns run instead (as in Caffe2).

        ``run_options`` go to ``session.run_group``.
        """
        if type(self).load is not Loads.load:
            session.run_group(self.load(record["epoch"]), **run_options)
            return
        load_id = uuid.uuid4().hex
        try:
            session.run_group(self._whole_load(self.store, record, load_id), **run_options)
        except Exception:
            self._discard_staged(session, load_id)
            raise

    def _whole_load(self, store: CheckpointStore, record: CommitRecord, load_id: str) -> TaskGroup:
        epoch = record["epoch"]
        missing = [n for n in self.nodes() if n not in record["nodes"]]
        if missing:
            raise CheckpointError(
                f"epoch {epoch} under {store.url} has no checkpoint for nodes {missing}; it holds {record['nodes']}"
            )
        if store is self.store:
            self._last.record = record
        self._remember(epoch, {n: committed_entry(record, n) for n in self.nodes()}, store)
        return self._two_phase_load(store, record, None, load_id)

    def load_blobs_from_checkpoint(self, blob_names: Sequence[str], epoch: int) -> TaskGroup:
        """A group loading only ``blob_names`` (skipping names a node lacks) from committed ``epoch``.

        Every node reads and verifies its blobs before any workspace changes: when one node's
        checkpoint is corrupt, the group fails and no workspace was changed. The blobs the other
        nodes read then stay on them until their next load; :meth:`load_blobs_locally`
        drops them at once.

        Raises
        ------
        DefinitionTypeError
            ``blob_names`` is a ``str`` (a list of names is needed) or not a list of ``str``.
        CheckpointNotFoundError
            ``epoch`` is not committed, or holds no checkpoint of a checkpointed node.
        """
        names = tuple(validate_name(b, "blob") for b in _name_list(blob_names, "blob"))
        record = self.store.read_commit(epoch)
        missing = [n for n in self.nodes() if n not in record["nodes"]]
        if missing:
            raise CheckpointNotFoundError(
                f"epoch {epoch} under {self.store.url} has no checkpoint for nodes {missing}; "
                f"it holds {record['nodes']}"
            )
        return self._two_phase_load(self.store, record, names, uuid.uuid4().hex)

    def _two_phase_load(
        self, store: CheckpointStore, record: CommitRecord, names: tuple[str, ...] | None, load_id: str
    ) -> TaskGroup:
        """Per node, a task reading and verifying ``names`` (``None``: every blob, replacing the
        workspace) and one putting them into the workspace; every node's second task waits for the
        first of all nodes (dataflow edges)."""
        epoch = record["epoch"]
        group = TaskGroup(WorkspaceType.PRIVATE)
        nodes = self.nodes()
        reads = [
            Task(
                ReadStep(store, node, epoch, committed_entry(record, node), names, load_id),
                group=group,
                node=node,
                name="checkpoint_read",
                outputs=READ_BLOB,
            )
            for node in nodes
        ]
        done = {f"{READ_BLOB}.{node}": read.outputs()[0] for node, read in zip(nodes, reads, strict=True)}
        step_name = "checkpoint_load" if names is None else "checkpoint_partial_load"
        for node in nodes:
            assign = AssignStep(node, epoch, load_id, replace=names is None)
            Task(assign, group=group, node=node, name=step_name, inputs=done)
        return group

    def _complete_commit(self, epoch: int) -> CommitRecord | None:
        """The commit record of ``epoch`` if it holds every checkpointed node and each node's group
        is there (as Caffe2 asked each node's database), else ``None``."""
        try:
            record = self.store.read_commit(epoch)
        except CheckpointNotFoundError:
            return None
        if not all(n in record["nodes"] for n in self.nodes()):
            return None
        gone = [self.store.db_name(n, epoch) for n in self.nodes() if not self.store.has_group(n, epoch)]
        if gone:
            logger.warning("epoch %d is committed under %s but %s no longer exist", epoch, self.store.url, gone)
            return None
        return record

    def check_db_exists(self, epoch: int) -> bool:
        """Whether ``epoch`` is committed, holds every checkpointed node, and each node's group is there."""
        return self._complete_commit(epoch) is not None

    def load_blobs_locally(
        self, nodes: Sequence[str | Node], blob_names: Sequence[str], epoch: int, session: Session
    ) -> bool:
        """Load ``blob_names`` of ``epoch`` into ``nodes``' workspaces in ``session``.

        Returns ``False`` and loads nothing if any node has no committed checkpoint for ``epoch``,
        or its group of ``epoch`` no longer exists (deleted after the commit; a warning names it).
        Otherwise each node loads the named blobs its checkpoint holds (skipping the others), and
        only once every node has read and verified them: when one is corrupt, nothing is loaded.

        Raises
        ------
        DefinitionTypeError
            ``nodes`` or ``blob_names`` is a ``str`` (a list of names is needed) or holds a non-``str``.
        JobDefinitionError
            ``nodes`` differ from the manager's, or a name is invalid.
        CheckpointCorruptError
            A node's group of committed ``epoch`` is there but damaged; no workspace changed.
        """
        names = self._node_names(_name_list(nodes, "node"))
        blobs = tuple(validate_name(b, "blob") for b in _name_list(blob_names, "blob"))
        if self._nodes is not None and sorted(names) != sorted(self._nodes):
            raise JobDefinitionError(f"checkpoint manager is set up for nodes {self._nodes}, not {names}")
        self._nodes = names
        record = self._complete_commit(epoch)
        if record is None:
            return False
        started = time.perf_counter()
        load_id = uuid.uuid4().hex
        try:
            session.run_group(self._two_phase_load(self.store, record, blobs, load_id), job=self._job_name)
        except Exception:
            self._discard_staged(session, load_id)
            raise
        elapsed = int((time.perf_counter() - started) * 1e9)
        self._last.stats = {self.get_ckpt_db_name(n, epoch): elapsed for n in names}
        return True

    def _discard_staged(self, session: Session, load_id: str) -> None:
        """After a failed load, drop what the nodes read for it (best effort)."""
        try:
            session.run_group(
                self._group(lambda g, node: Task(DiscardStep(load_id), group=g, node=node, name="checkpoint_discard")),
                job=self._job_name,
            )
        except Exception as exc:
            logger.debug("could not drop the blobs of a failed load under %s: %s", self.store.url, exc)
