"""Every exception daskjobs raises.

The tree::

    DaskJobsError(Exception)
    ├── JobDefinitionError(ValueError)        a bad name, value or cycle in a job definition
    │   ├── DefinitionTypeError(TypeError)    an argument of the wrong kind (e.g. ``num_instances=True``)
    │   │   └── StepTypeError                 a step that is not a plain synchronous callable
    │   └── TargetError                       a TARGET string that names no job (``daskjobs run TARGET``)
    ├── BlobTypeError(TypeError)              a blob value that could not survive a checkpoint
    ├── StopConditionError(TypeError)         a stop condition that is not a boolean
    ├── InvalidStateError(RuntimeError)       a call its object's state forbids (a task changed after its group ran)
    ├── OutputNotReadyError(RuntimeError)     a TaskOutput fetched before its task ran
    ├── SessionClosedError(RuntimeError)      a session used after close()
    ├── TaskFailedError(RuntimeError)         user code raised; the cause is chained
    │   ├── TaskValueError(ValueError)        ... on a daskjobs ValueError (e.g. a reader source invalid on its node)
    │   └── TaskTypeError(TypeError)          ... on a daskjobs TypeError (e.g. a blob value no checkpoint holds)
    ├── NodePlacementError(RuntimeError)      a node has no fitting worker, or several pinned
    ├── NodeLostError(RuntimeError)           a node's worker died and could not be recovered
    ├── SessionLostError(ConnectionError)     the Dask scheduler went away, refused or did not answer
    ├── SchedulerAddressError(ValueError)     a scheduler address that does not parse
    ├── ConfigError(ValueError)               a ``daskjobs.*`` Dask config value its key cannot take
    ├── TargetLoadError(RuntimeError)         importing a TARGET's module, or building its job, raised
    ├── JobInterruptedError(RuntimeError)     a graceful stop on SIGTERM (SIGINT raises KeyboardInterrupt)
    ├── ResumeCheckError(RuntimeError)        a run of daskjobs.testing.check_resume failed or missed its deadline
    ├── ResumeDivergenceError(AssertionError) a job that does not resume exactly (report.raise_for_divergence())
    └── CheckpointError(OSError)
        ├── CheckpointNotFoundError(FileNotFoundError)
        ├── CheckpointCorruptError            data does not match its commit record
        ├── CheckpointFormatError             unknown format, dtype or codec; never decoded
        ├── CheckpointLockedError             another runner writes to the prefix
        ├── CheckpointStorageError            a node's worker does not see the prefix the driver sees
        └── CheckpointWriteError              a save failed after its retries

Every class survives pickling, because errors raised on Dask workers travel to the client.
Each also subclasses the builtin that matches its meaning, so ``except ValueError`` and
friends keep working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BlobTypeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointWriteError",
    "ConfigError",
    "DaskJobsError",
    "DefinitionTypeError",
    "InvalidStateError",
    "JobDefinitionError",
    "JobInterruptedError",
    "NodeLostError",
    "NodePlacementError",
    "OutputNotReadyError",
    "ResumeCheckError",
    "ResumeDivergenceError",
    "SchedulerAddressError",
    "SessionClosedError",
    "SessionLostError",
    "StepTypeError",
    "StopConditionError",
    "TargetError",
    "TargetLoadError",
    "TaskFailedError",
    "TaskTypeError",
    "TaskValueError",
]


class DaskJobsError(Exception):
    """Root of every daskjobs error: ``except dj.errors.DaskJobsError`` catches them all."""


class JobDefinitionError(DaskJobsError, ValueError):
    """A job, task, group or name is invalid; raised while the job is being defined."""


class DefinitionTypeError(JobDefinitionError, TypeError):
    """An argument of a job definition has the wrong kind (a float or bool where an int is
    needed, a number where a name is needed …).

    It is both a :class:`JobDefinitionError` (a ``ValueError``) and a ``TypeError``, so either
    ``except`` clause catches it.
    """


class StepTypeError(DefinitionTypeError):
    """A step is not a plain synchronous callable: not callable at all, an ``async def``
    function, a generator function, or an object whose ``__call__`` is one of those.

    Raised when the :class:`~daskjobs.Task` (or ``SetupNets``, ``report_step``) is built; a step
    that nevertheless returns a coroutine, generator or awaitable fails its task with a
    :class:`TaskFailedError` whose cause is this error.
    """


class ConfigError(DaskJobsError, ValueError):
    """A ``daskjobs.*`` setting of the Dask config has a value its key cannot take (the message names
    the key, the value and what it must be)."""


class TargetError(JobDefinitionError):
    """A ``TARGET`` string (``package.module:name`` or ``path/to/file.py:name``, as ``daskjobs run``,
    ``daskjobs check`` and :func:`daskjobs.testing.check_resume` take it) names no job: it is
    malformed, its file or attribute does not exist, or it names something that is neither a
    :class:`~daskjobs.Job` nor a callable without arguments returning one. The command line
    exits with code 2."""


class TargetLoadError(DaskJobsError, RuntimeError):
    """Importing a ``TARGET``'s module, or calling the callable it names to build the job, raised
    (the exception is the ``__cause__``). The command line exits with code 1."""


class BlobTypeError(DaskJobsError, TypeError):
    """A blob was assigned a value that could not survive a checkpoint round trip.

    Workspaces hold numpy arrays (bool, integer, float, complex, fixed-width strings; numbers
    become 0-d arrays) and JSON values (``None``, ``str``, ``bool``, ``int``, finite ``float``,
    ``list``, ``dict`` with ``str`` keys). The message names the blob and what to store instead.
    """


class StopConditionError(DaskJobsError, TypeError):
    """A stop condition produced something other than a single boolean."""


class InvalidStateError(DaskJobsError, RuntimeError):
    """A call that the current state of its object forbids.

    Raised when a Task or TaskGroup is changed after its group has run, when
    ``Job.current()`` is called outside ``with Job()``, when ``with`` blocks are exited out of
    order, or when a checkpoint manager is asked for its nodes or blob names before it has any.
    The message says what to do instead (e.g. build a new TaskGroup).
    """


class OutputNotReadyError(DaskJobsError, RuntimeError):
    """A :class:`~daskjobs.TaskOutput` was fetched before its task has run in a session."""


class SessionClosedError(DaskJobsError, RuntimeError):
    """A session was used after :meth:`~daskjobs.Session.close`; open a new one."""


class TaskFailedError(DaskJobsError, RuntimeError):
    """User code in a task raised.

    The message names job, group, node, task and epoch; ``__cause__`` is the user's exception
    and ``remote_traceback`` holds its traceback as text (also after crossing processes).
    """

    def __init__(
        self,
        message: str,
        job: str | None = None,
        group: str | None = None,
        node: str | None = None,
        task: str | None = None,
        epoch: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message, job, group, node, task, epoch, remote_traceback)
        self.message = message
        self.job = job
        self.group = group
        self.node = node
        self.task = task
        self.epoch = epoch
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), self.args, {"cause": picklable_cause(self.__cause__)})

    def __setstate__(self, state: dict[str, object] | None) -> None:
        cause = None if state is None else state.get("cause")
        self.__cause__ = cause if isinstance(cause, BaseException) else None


class UnpicklableCause(Exception):
    """Stands in for the cause of a :class:`TaskFailedError` that cannot be pickled, when the error
    travels from a worker to the client: ``str()`` gives the original type's name and message,
    :attr:`type_name` its full name."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.type_name, self.message = type_name, message

    def __str__(self) -> str:
        return f"{self.type_name.rpartition('.')[2]}: {self.message}"


def picklable_cause(cause: BaseException | None, depth: int = 8) -> BaseException | None:
    """``cause``, or an :class:`UnpicklableCause` with its type name and message when it cannot be
    pickled; the causes chained to it are made picklable the same way (``depth`` links at most)."""
    if cause is None:
        return None
    import cloudpickle

    try:
        cloudpickle.dumps(cause)
    except Exception:
        kind = type(cause)
        return UnpicklableCause(f"{kind.__module__}.{kind.__qualname__}", str(cause))
    if depth > 0:
        chained = picklable_cause(cause.__cause__, depth - 1)
        if chained is not cause.__cause__:
            cause.__cause__ = chained
        if cause.__context__ is not None and cause.__context__ is not chained:
            cause.__context__ = picklable_cause(cause.__context__, depth - 1)
    return cause


class TaskValueError(TaskFailedError, ValueError):
    """A task failed on a daskjobs ``ValueError`` (its ``__cause__``, e.g. a
    :class:`JobDefinitionError` for an ``ArrayReader`` source that turned out invalid on its node):
    caught by ``except TaskFailedError`` and by ``except ValueError`` alike."""


class TaskTypeError(TaskFailedError, TypeError):
    """A task failed on a daskjobs ``TypeError`` (its ``__cause__``, e.g. a :class:`BlobTypeError`
    for a value assigned to a blob): caught by ``except TaskFailedError`` and by ``except TypeError``."""


class _NodesError(DaskJobsError, RuntimeError):
    """An error about particular nodes: ``nodes`` names them (also after pickling)."""

    def __init__(self, message: str = "", nodes: Sequence[str] = ()) -> None:
        super().__init__(message, list(nodes))
        self.message = message
        self.nodes = list(nodes)

    def __str__(self) -> str:
        return self.message


class NodePlacementError(_NodesError):
    """A node cannot be placed: no pinned worker and no pool worker that meets its demands (e.g.
    ``GPU=1``), more than one worker pinned to it, or no worker left on the cluster at all.

    Add a worker without node resources (``dask worker SCHEDULER``, ``daskjobs worker SCHEDULER``:
    daskjobs places nodes on it) with the resources the node needs, or one pinned to the node
    (``daskjobs worker SCHEDULER --node NAME``). ``nodes`` lists the nodes that cannot be placed.
    """


class NodeLostError(_NodesError):
    """A node's worker died or restarted and its workspace could not be restored.

    ``nodes`` lists the nodes whose workspaces are gone. ``departure`` says why the
    worker left when it left on purpose — retired (``client.retire_workers``), its ``--lifetime``
    ran out, or it was sent SIGTERM (a preemption or spot notice): a planned departure, which a
    :class:`~daskjobs.JobRunner` with a checkpoint manager recovers from without counting it
    against ``max_failures``. ``None`` when the worker failed (it died, was killed, or lost its
    connection).
    """

    def __init__(self, message: str = "", nodes: Sequence[str] = (), departure: str | None = None) -> None:
        super().__init__(message, nodes)
        self.args = (message, list(nodes), departure)
        self.departure = departure


class SessionLostError(DaskJobsError, ConnectionError):
    """The Dask scheduler went away, or cannot be reached: at once when it refuses the connection,
    else after ``daskjobs.connect-timeout`` without an answer.

    The message names the scheduler address and the last committed epoch; committed checkpoints
    are intact, and running the job again on a new scheduler resumes from them.
    """


class SchedulerAddressError(DaskJobsError, ValueError):
    """A scheduler address that does not parse (an unknown scheme, no host, a port outside
    1-65535); raised before anything connects. The message names the address and the form
    expected (``tcp://HOST:PORT``, ``tls://HOST:PORT`` or ``HOST:PORT``).

    A well-formed address where no scheduler answers raises :class:`SessionLostError` instead.
    """


class JobInterruptedError(DaskJobsError, RuntimeError):
    """A run was stopped gracefully by SIGTERM after committing its current epoch.

    ``epoch`` is the last committed epoch (``None`` if nothing was committed).
    """

    def __init__(self, message: str = "", epoch: int | None = None) -> None:
        super().__init__(message, epoch)
        self.message = message
        self.epoch = epoch

    def __str__(self) -> str:
        return self.message


class ResumeCheckError(DaskJobsError, RuntimeError):
    """A run of :func:`daskjobs.testing.check_resume` (or ``daskjobs check``) failed: the job
    raised, its process died, or it did not finish within the deadline.

    ``run`` names the run (``"A"``, ``"B"``, ``"stop@3"``, ``"kill@3"``, ``"lose-node@3"``);
    the message says what happened and, for a run in a child process, ends with its last output.
    """

    def __init__(self, message: str = "", run: str | None = None) -> None:
        super().__init__(message, run)
        self.message = message
        self.run = run

    def __str__(self) -> str:
        return self.message


class ResumeDivergenceError(DaskJobsError, AssertionError):
    """A job does not resume exactly: a run of :func:`daskjobs.testing.check_resume` differs from
    its reference. Raised by :meth:`~daskjobs.testing.ResumeReport.raise_for_divergence` and
    :func:`~daskjobs.testing.assert_resumes_exactly`; the message is the report's summary.
    """


class CheckpointError(DaskJobsError, OSError):
    """Base class of checkpoint problems; also raised for job/prefix mismatches."""

    def __str__(self) -> str:  # OSError would format (errno, strerror) pairs; keep the plain message
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested epoch has no committed checkpoint under the prefix."""


class CheckpointCorruptError(CheckpointError):
    """Checkpoint data does not match its commit record (checksum, dtype, shape, missing chunk)."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint uses a format version, dtype or codec daskjobs does not read; nothing was decoded."""


class CheckpointLockedError(CheckpointError):
    """Another runner holds the writer lock of the prefix; the message names the holder."""


class CheckpointStorageError(CheckpointError):
    """A node's worker does not see the checkpoint prefix the driver sees.

    On a cluster of several machines a local path is a different directory on every machine
    unless a shared filesystem is mounted there (and ``memory://`` is private to each process).
    Raised before anything is written or loaded; the message names each node, its worker and the
    path, and says what would work: a shared filesystem mounted at the same path on every
    machine, or an object store prefix. ``nodes`` lists the nodes concerned (also after
    pickling).
    """

    def __init__(self, message: str = "", nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = list(nodes)


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written: the storage failed, or did not finish within
    ``daskjobs.storage-timeout`` (the message names node, epoch and path, and how long was waited).
    The last committed checkpoint is intact."""
