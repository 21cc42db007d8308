"""How a manager resumes: the epoch a run resumes from, checked against this job's commits under the
prefix, or a fresh start over them; and what the resumed epoch's commit recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..._model.values import check_count
from ...errors import InvalidStateError
from .metadata import check_same_job, stage_fresh_start

if TYPE_CHECKING:
    from .._protocol.staging import Staging
    from .._protocol.store import CheckpointStore
    from .metadata import MetadataHandler


class _Staged(Protocol):
    """What a resume uses of the manager's epoch writer: the staging of the epochs a resume retires."""

    staging: Staging


class Resumes:
    """Mixed into :class:`~daskjobs.MultiNodeCheckpointManager`: Caffe2's ``get_resume_from_epoch_id``,
    and ``start_fresh`` and ``stop_values``.

    Uses the manager's attributes below; adopts the prefix's job name when the manager was given none.
    """

    store: CheckpointStore
    _handler: MetadataHandler
    _writer: _Staged
    _nodes: list[str] | None
    _job_name: str
    _job_named: bool
    _fresh: bool

    def get_resume_from_epoch_id(self, user_epoch: int | None = None) -> int | None:
        """The epoch to resume from (the handler's answer), after checking the prefix holds this job.

        The job's name and nodes are checked against the commit record of ``user_epoch`` when it
        is given (newer records are not read: one of them may be the unreadable commit the user
        skips), else against the latest commit.

        Without a job name given to :meth:`set_params`, only the nodes are checked, and the
        manager takes the job name of the checked commit (for the commits it writes next).

        After :meth:`start_fresh` (and without ``user_epoch``): ``None``, the run starts from scratch.

        Raises
        ------
        DefinitionTypeError, JobDefinitionError
            ``user_epoch`` is not a non-negative int; nothing was read.
        CheckpointError
            The checked commit is another job's or has other nodes.
        CheckpointCorruptError, CheckpointFormatError
            The checked commit record cannot be read.
        """
        if user_epoch is not None:
            user_epoch = check_count(user_epoch, "resume_from_epoch", minimum=0)
            if self._fresh:
                raise InvalidStateError(
                    f"start_fresh() starts from epoch 0 and resume_from_epoch={user_epoch} from epoch {user_epoch}: "
                    "give one of them"
                )
        elif self._fresh:  # see start_fresh
            self._fresh = False
            staging = self._writer.staging
            job = stage_fresh_start(self.store, staging, self._job_name if self._job_named else None, self._nodes)
            if job is not None and not self._job_named:
                self._job_name = job
            return None
        job = check_same_job(self.store, self._job_name if self._job_named else None, self._nodes, user_epoch)
        if job is not None and not self._job_named:  # no name given: this is the prefix's job
            self._job_name = job
        return self._handler.last_epoch(user_epoch=user_epoch)

    def start_fresh(self) -> None:
        """Make the next run start from scratch (init, then epoch 0) although this job's epochs are
        committed under the prefix (what ``daskjobs run --fresh`` does).

        Nothing is deleted now: the committed epochs stay (and a run that fails before its epoch 0
        commits leaves them as they were) until the new epoch 0 is committed. That epoch's groups are
        written to a staging folder; right before its commit record is written the old epochs are
        retired (one warning lists them), as when resuming from an older epoch. The prefix must hold
        this job's commits (its name and nodes, checked against the newest commit record that reads).

        Examples
        --------
        >>> import daskjobs as dj, tempfile
        >>> manager = dj.MultiNodeCheckpointManager(tempfile.mkdtemp())
        >>> manager.start_fresh()  # then JobRunner(job, manager).train(...) starts at epoch 0
        """
        self._fresh = True

    def stop_values(self, epoch: int) -> dict[str, bool]:
        """The stop-condition values recorded when ``epoch`` was committed."""
        return dict(self.store.read_commit(epoch).get("stop_values", {}))
