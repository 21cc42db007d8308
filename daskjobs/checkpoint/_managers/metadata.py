"""The metadata-handler protocol and the built-in handler that answers from commit records."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..._model.values import check_count
from ...errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError, CheckpointNotFoundError

if TYPE_CHECKING:
    from .._protocol.staging import Staging
    from .._protocol.store import CheckpointStore

logger = logging.getLogger("daskjobs")


def check_same_job(
    store: CheckpointStore, job: str | None, nodes: list[str] | None, epoch: int | None = None
) -> str | None:
    """Refuse to resume ``job`` (with ``nodes``; ``None``: not known yet) from a prefix holding
    another job's checkpoints, or checkpoints of other nodes; return the name of the job whose
    record was checked (``None``: none was). ``job=None``: the name is not checked.

    Parameters
    ----------
    epoch
        The epoch the user asked to resume from: its commit record is checked (an epoch that is
        not committed passes; the metadata handler reports it). ``None``: the latest commit.

    Raises
    ------
    CheckpointError
        Naming both jobs, their nodes and the epoch checked.
    CheckpointCorruptError, CheckpointFormatError
        The record to check cannot be read; for the latest, the message names the
        ``resume_from_epoch`` that skips it.
    """
    if nodes is None:
        return None
    if epoch is None:
        record = store.latest_commit()
    else:
        try:
            record = store.read_commit(epoch)
        except CheckpointNotFoundError:
            return None
    if record is None:
        return None
    if record["job"] != (job or record["job"]) or sorted(record["nodes"]) != sorted(nodes):
        which = "latest epoch" if epoch is None else "epoch"
        this = f"this job is {job!r} with nodes {nodes}" if job else f"this manager checkpoints nodes {nodes}"
        raise CheckpointError(
            f"{store.url} holds checkpoints of job {record['job']!r} with nodes {record['nodes']} "
            f"({which} {record['epoch']}), but {this}; use another db_prefix or delete the old checkpoints"
        )
    return record["job"]


def stage_fresh_start(store: CheckpointStore, staging: Staging, job: str | None, nodes: list[str] | None) -> str | None:
    """Prepare a run from scratch on a prefix holding commits (``daskjobs run --fresh``): check that
    they are ``job``'s (against the newest commit record that reads, see :func:`check_same_job`),
    and have ``staging`` retire every one of them right before the new epoch 0 commits, not sooner.
    Returns the name of the job whose record was checked (``None``: none was).

    Raises
    ------
    CheckpointError
        The prefix holds another job's checkpoints, or checkpoints of other nodes: nothing is retired.
    """
    checked = None
    for epoch in reversed(store.committed_epochs()):
        try:
            checked = check_same_job(store, job, nodes, epoch)
        except (CheckpointCorruptError, CheckpointFormatError):
            continue  # an unreadable record is retired with the others
        break
    older = staging.resume_older(store, -1)
    if older:
        logger.info(
            "starting afresh under %s: the committed epochs %s stay until the new epoch 0 commits", store.url, older
        )
    return checked


@runtime_checkable
class MetadataHandler(Protocol):
    """What a checkpoint manager asks about the checkpoints it writes (Caffe2's protocol)."""

    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None = None,
        path_type: str | None = None,
    ) -> None:
        """Where the checkpoints live and for which nodes."""

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        """The epoch to resume from, or ``None`` to start from scratch."""

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Whether checkpoint storage can be reached; ``False`` skips a save with a warning."""

    def write(self, epoch: int) -> None:
        """Called after the checkpoint of ``epoch`` has been committed."""

    def report(self, action_name: str, stats: dict[str, Any]) -> None:
        """Timing statistics of a save or load, by checkpoint name."""


class CommitRecordHandler:
    """The built-in handler: resume from the latest *committed* epoch.

    ``last_epoch(user_epoch=k)`` returns ``k`` if epoch ``k`` is committed and raises
    :class:`~daskjobs.errors.CheckpointNotFoundError` otherwise.
    """

    def __init__(self, store: CheckpointStore) -> None:
        self._store = store
        self.last_report: tuple[str, dict[str, Any]] | None = None

    def set_params(
        self,
        db_prefix: str,
        db_type: str,
        node_names: list[str],
        path_prefix: str | None = None,
        path_type: str | None = None,
    ) -> None:
        """Nothing to remember: the manager's store knows the prefix."""

    def last_epoch(self, user_epoch: int | None = None) -> int | None:
        """The user's epoch if committed, else the latest committed epoch (or ``None``).

        Raises
        ------
        DefinitionTypeError
            ``user_epoch`` is not an int (``True`` and ``1.0`` are refused, not taken as 1).
        JobDefinitionError
            ``user_epoch`` is negative.
        CheckpointNotFoundError
            ``user_epoch`` is not committed.
        """
        if user_epoch is not None:
            user_epoch = check_count(user_epoch, "resume_from_epoch", minimum=0)
        epochs = self._store.committed_epochs()
        if user_epoch is not None:
            if user_epoch not in epochs:
                raise CheckpointNotFoundError(
                    f"epoch {user_epoch} is not committed under {self._store.url}; committed epochs: {epochs}"
                )
            return user_epoch
        if epochs:
            logger.info("resuming from epoch %d, the latest committed under %s", epochs[-1], self._store.url)
            return epochs[-1]
        return None

    def cp_accessible(self, epoch: int | None = None) -> bool:
        """Always true: storage problems surface as errors of the save itself."""
        return True

    def write(self, epoch: int) -> None:
        """The commit record is the metadata; nothing more to write."""
        logger.debug("epoch %d committed under %s", epoch, self._store.url)

    def report(self, action_name: str, stats: dict[str, Any]) -> None:
        """Log the statistics at debug level and keep the last ones."""
        self.last_report = (action_name, stats)
        logger.debug("%s: %s", action_name, stats)
