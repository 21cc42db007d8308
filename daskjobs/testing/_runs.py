"""One run of a check, as it happens in a driver process: a job trained against a fresh prefix,
from scratch or resumed, interrupted once if its action says so.

The same code runs in this process (a Job or callable target) and in the child process of a
string target (:mod:`._child`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from .._model.job import Job
from ..checkpoint import MultiNodeCheckpointManager
from ..errors import JobInterruptedError
from ..runner import JobRunner, RunnerHooks
from ..session import Session, node_resource

if TYPE_CHECKING:
    from ..session import DaskSession

logger = logging.getLogger("daskjobs")

ActionKind = Literal["run", "stop", "kill", "lose-node", "shrink", "grow"]

_NOTED = {
    "daskjobs": ("interrupted by SIGTERM: stopped after the running epoch", "lost; restoring all nodes from"),
    "distributed.scheduler": ("marked as failed because", "Couldn't gather keys", "Closed comm <BatchedSend"),
}
"""By logger: the log lines of the interruptions a check makes on purpose (left out while it runs)."""
_KILL_WAIT = 60.0
"""Seconds a driver that is to be killed waits for its kill before it exits on its own."""


@dataclass(frozen=True)
class Action:
    """What one driver process (or in-process runner) does.

    ``"run"`` trains from scratch, or resumes from the prefix's latest commit, to the end.
    ``"stop"`` stops gracefully right after epoch :attr:`at` is committed. ``"kill"`` commits
    epoch :attr:`at`, then SIGKILLs its own process in the middle of epoch ``at + 1``.
    ``"lose-node"`` commits epoch :attr:`at`, then kills :attr:`node`'s worker in the middle of
    epoch ``at + 1`` and recovers (``max_failures >= 1``), to the end. ``"shrink"`` is the same on a
    pool, the worker killed without replacement (the run goes on on the workers left); ``"grow"``
    commits epoch :attr:`at`, then waits for a worker to join the pool (see :mod:`._elastic`), which
    takes nodes at the next epoch boundary.
    """

    kind: ActionKind = "run"
    at: int | None = None
    node: str | None = None


@dataclass(frozen=True)
class Outcome:
    """How a driver's run ended."""

    last: int | None
    """The last epoch :meth:`~daskjobs.JobRunner.train` returned (``None``: interrupted)."""
    interrupted: bool
    """The action's interruption happened (a stop, a node loss)."""
    recovered_from: int | None = None
    """After a node loss: the epoch every node was restored from."""
    seconds: float = 0.0


def perform(
    job: Job,
    prefix: str,
    action: Action,
    session: Session,
    *,
    max_epochs: int | None,
    watch: Callable[[JobRunner], object] | None = None,
    in_memory: bool = False,
) -> Outcome:
    """Run ``job`` against checkpoint ``prefix`` on ``session`` as ``action`` says; ``watch`` is
    given the runner before it starts (to enforce a deadline). ``in_memory``: with tier 0, every
    epoch also durable (so that every epoch is compared), a lost node restored from memory.

    Raises
    ------
    Exception
        Whatever the run raised, except the interruption the action asked for.
    """
    started = time.perf_counter()
    manager = (
        MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=1)
        if in_memory
        else MultiNodeCheckpointManager(prefix)
    )
    failures = 3 if action.kind in ("lose-node", "shrink") else 0
    interruption = Interruption(action, session)
    runner = JobRunner(job, manager, max_epochs=max_epochs, max_failures=failures, progress=False, hooks=interruption)
    interruption.runner = runner
    if watch is not None:
        watch(runner)
    with quiet_interruptions():
        try:
            last = runner.train(session)
        except JobInterruptedError:
            if action.kind != "stop" or not interruption.stopped:
                raise
            return Outcome(None, True, seconds=time.perf_counter() - started)
    recovered = next((r.epoch - 1 for r in runner.history if r.recoveries), None)
    if action.kind == "grow":  # went on from epoch `at`, nothing restored, once nodes spread onto the new worker
        spread = len(set(getattr(session, "placement", {}).values())) > 1
        recovered = action.at if interruption.joined and spread else None
    interrupted = action.kind in ("lose-node", "shrink", "grow") and recovered is not None
    return Outcome(last, interrupted, recovered, time.perf_counter() - started)


class Interruption(RunnerHooks):
    """The hooks through which a run interrupts itself once, as its :class:`Action` says.

    A stop asks for the runner's own graceful stop (what a first SIGTERM does) once epoch ``at``
    was saved: the runner commits it and raises :class:`~daskjobs.errors.JobInterruptedError`. A
    kill or a node loss first commits epoch ``at`` (before epoch ``at + 1`` starts), then strikes
    while epoch ``at + 1`` runs: a kill half an epoch's time after its tasks were handed to the
    cluster, a node loss at once; the run then waits for the strike before that epoch is committed.
    """

    def __init__(self, action: Action, session: Session) -> None:
        self.action, self.session = action, session
        self.runner: JobRunner | None = None
        self.stopped = False
        self.joined = False
        """A grow: the worker joined after epoch ``at`` was committed."""
        self._armed = action.kind in ("kill", "lose-node", "shrink")
        self._timer: threading.Timer | None = None

    def _striking(self, epoch: int) -> bool:
        return self._armed and self.action.at is not None and epoch == self.action.at + 1

    def before_epoch(self, epoch: int) -> None:
        if self._striking(epoch) and self.runner is not None:
            self.runner.commit_saved()  # epoch `at` is committed before epoch `at + 1` starts

    def epoch_running(self, epoch: int) -> None:
        if not self._striking(epoch) or self._timer is not None or self.runner is None:
            return
        if self.action.kind == "kill":  # in this process: steps running in its threads die with it
            strike, delay = _kill_self, 0.5 * statistics.median(r.seconds for r in self.runner.history)
        else:  # on the cluster: the epoch's tasks are running now
            strike, delay = _node_killer(self.session, self.action.node, replace=self.action.kind == "lose-node"), 0.0
        self._timer = threading.Timer(delay, strike)
        self._timer.daemon = True
        self._timer.start()

    def epoch_saved(self, epoch: int) -> None:
        if self.action.kind == "stop" and epoch == self.action.at and self.runner is not None:
            self.stopped = True
            self.runner.request_stop()  # a graceful stop after this epoch, committed
        if self.action.kind == "grow" and epoch == self.action.at and self.runner is not None and not self.joined:
            self.runner.commit_saved()  # epoch `at` is committed: the pool grows now (see ._elastic)
            client = cast("DaskSession", self.session).client  # a grow runs on a pool cluster the check started
            client.wait_for_workers(len(client.scheduler_info(n_workers=-1)["workers"]) + 1, timeout=_KILL_WAIT)
            self.joined = True
        if not self._striking(epoch) or self._timer is None:
            return
        self._armed = False
        self._timer.join(_KILL_WAIT)
        if self.action.kind == "kill":  # the epoch ended before the kill landed: it is not committed yet
            time.sleep(_KILL_WAIT)
            os._exit(70)


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def _kill_worker() -> None:
    """Run on a worker (``client.run``, which does not wait only for coroutines): its process dies."""
    _kill_self()


def _no_restart(dask_worker: Any) -> None:
    """Run on a worker's nanny (``client.run(..., nanny=True)``): it starts no new worker process
    when this one dies."""
    dask_worker.close_gracefully(reason="daskjobs-check-shrink")


def _node_killer(session: Session, node: str | None, *, replace: bool = True) -> Callable[[], None]:
    """What kills ``node``'s worker process at once: a SIGKILL from here when the worker runs on
    this machine (its pid asked for now), else through ``client.run``. Without ``replace`` its
    nanny is told first not to start a new one."""
    client = getattr(session, "client", None)
    if client is None or node is None:
        raise ValueError("a node loss needs a session on a Dask cluster")
    resource = node_resource(node)
    workers = client.scheduler_info(n_workers=-1)["workers"]
    address = next((a for a, w in workers.items() if resource in (w.get("resources") or {})), None)
    if address is None:
        raise ValueError(f"no worker serves node {node!r}")
    pid = client.run(os.getpid, workers=[address])[address]
    local = workers[address].get("host") in ("127.0.0.1", "localhost", "::1", socket.gethostname())

    def strike() -> None:
        if not replace:
            client.run(_no_restart, workers=[address], nanny=True)
        if local:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            with contextlib.suppress(Exception):
                client.run(_kill_worker, workers=[address], wait=False)

    return strike


class _DropNoted(logging.Filter):
    def __init__(self, noted: tuple[str, ...]) -> None:
        super().__init__()
        self.noted = noted

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noted in message for noted in self.noted)


@contextlib.contextmanager
def quiet_interruptions() -> Iterator[None]:
    """Leave the log lines of a check's own interruptions out of the log (of ``daskjobs``, and of a
    Dask scheduler in this process that sees a node's worker die)."""
    filters = [(logging.getLogger(name), _DropNoted(noted)) for name, noted in _NOTED.items()]
    for log, noted in filters:
        log.addFilter(noted)
    try:
        yield
    finally:
        for log, noted in filters:
            log.removeFilter(noted)
