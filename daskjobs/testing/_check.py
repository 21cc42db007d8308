"""``check_resume``: run a job uninterrupted twice and interrupted at given epochs, each run against
its own temporary prefix, and compare every committed epoch with the first run."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

from .._model.job import Job
from .._model.values import check_count, check_positive
from ..checkpoint import CheckpointStore
from ..errors import DefinitionTypeError, JobDefinitionError
from ..runner._targets import load_job
from ..session import DaskSession, LocalSession, Session
from ._compare import compare_runs, ordering
from ._elastic import ELASTIC_MODES, elastic_pool
from ._executors import Children, InProcess
from ._report import CheckedRun, Divergence, ResumeReport
from ._runs import Action, ActionKind, Outcome, quiet_interruptions
from ._steps import first_step

logger = logging.getLogger("daskjobs")

MODES = ("stop", "kill", "lose-node", *ELASTIC_MODES)
DEFAULT_TIMEOUT = 600.0
"""Seconds each run (each process of a run) may take when ``timeout`` is not given."""

Target = Job | Callable[[], Job] | str


def check_resume(
    target: Target,
    *,
    max_epochs: int | None = None,
    interrupt_at: int | Iterable[int] | None = None,
    modes: str | Iterable[str] = ("stop",),
    session: Session | Any = None,
    timeout: float | None = None,
    on_run: OnRun | None = None,
) -> ResumeReport:
    """Prove that ``target`` resumes exactly: interrupt it, resume it, compare every epoch.

    The job runs twice from scratch without interruption (references A and B), and once per
    interruption point and mode, each interrupted once and then taken on to its end. Every
    committed epoch of every run is compared with A: every node, every blob (dtype, shape and
    bytes; JSON values by equality; chunk digests first, blobs are read only where they differ),
    the stop values and the metrics logged with ``ws.log``. Each run writes under its own
    temporary prefix, removed afterwards; the job's own checkpoints are never touched.

    Parameters
    ----------
    target : Job, callable or str
        A :class:`~daskjobs.Job`, a callable returning one (called once per run), or
        ``"path/to/file.py:name"`` / ``"package.module:name"`` as ``daskjobs run`` takes it.
        With a string every run, the references included, runs in a fresh process; with a Job
        or a callable every run runs in this process, on a new session each.
    max_epochs : int, optional
        Passed to every :class:`~daskjobs.JobRunner`; the job needs it or a stop condition.
    interrupt_at : int or iterable of int, optional
        The epochs after whose commit runs are interrupted, each before reference A's last
        epoch. Default: epoch 1, the middle epoch and the last but one.
    modes : str or iterable of str
        ``"stop"``: a graceful stop right after epoch ``k`` is committed (what SIGTERM does),
        then a new runner (a new process, for a string target) resumes. ``"kill"``: the driver
        process SIGKILLed in the middle of epoch ``k + 1`` after epoch ``k`` is committed, then
        a new process resumes (string targets only). ``"lose-node"``: a node's worker killed in
        the middle of epoch ``k + 1``; the runner recovers (clusters only). ``"shrink"``: on a
        local pool cluster of two workers that the check starts, the worker of a node SIGKILLed
        without replacement in the middle of epoch ``k + 1``; the run goes on on the other.
        ``"grow"``: on a local pool cluster of one worker, a second joins after epoch ``k``; nodes
        move onto it with their workspaces. (Not with a ``session``: they need pools of their own.)
    session : Session, distributed.Client, cluster or str, optional
        ``None`` or a :class:`~daskjobs.LocalSession`: every run on a new ``LocalSession``. A
        :class:`~daskjobs.DaskSession`, a Client, a cluster or a scheduler address: every run on
        that cluster, in a new ``DaskSession`` (its temporary prefixes must be visible to the
        workers: set ``TMPDIR`` to a shared folder for a cluster of several machines).
    timeout : float, optional
        Seconds each run (each process of it) may take (default 600). A run in a child process
        is killed at its deadline; one in this process is stopped after its running epoch.
    on_run : callable, optional
        Called with each run's :class:`CheckedRun` and its divergences from A as the run finishes
        (``daskjobs check`` prints a line for each): A first, then the node losses, B, and the
        stopped and killed runs once resumed.

    Returns
    -------
    ResumeReport
        ``.ok``, ``.deterministic``, ``.runs``, ``.divergences`` and ``.step``; ``str()`` is a summary.
        ``.step`` names the task and node whose output first diverged, where the check can tell:
        the epoch that first differs is run once more in this process, from reference A's commit
        of the epoch before, recording which task assigns each blob (``ws[name] = value``); of
        the blobs that differ, the one assigned by the task that comes first in its group (as the
        job defines them) names the step. A blob only changed in place (``ws["w"][:] = ...``)
        names none.

    Raises
    ------
    JobDefinitionError, DefinitionTypeError
        Invalid arguments (an unknown mode, ``"kill"`` without a string target, ``"lose-node"``
        without a cluster, ``"shrink"`` or ``"grow"`` with one, an interruption point not before
        A's last epoch).
    ResumeCheckError
        A run failed or missed its deadline; the message names the run.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> def make_job():
    ...     with dj.Cluster(), dj.Job(name="counter") as job:
    ...         with job.init_group:
    ...             _ = dj.Task(lambda ws: ws.__setitem__("rng", np.random.default_rng(0).bit_generator.state))
    ...         def step(ws):
    ...             rng = np.random.default_rng()
    ...             rng.bit_generator.state = ws["rng"]
    ...             ws["x"] = rng.normal(size=3)
    ...             ws["rng"] = rng.bit_generator.state
    ...         _ = dj.Task(step)
    ...         dj.epoch_limiter(job, 4)
    ...     return job
    >>> report = check_resume(make_job)
    >>> report.ok, [run.name for run in report.runs]
    (True, ['A', 'B', 'stop@1', 'stop@2', 'stop@3'])
    """
    chosen = _modes(modes)
    points = _points(interrupt_at)
    if max_epochs is not None:
        max_epochs = check_count(max_epochs, "max_epochs (or None)")
    seconds = DEFAULT_TIMEOUT if timeout is None else check_positive(timeout, "timeout (or None)")
    if "kill" in chosen and not isinstance(target, str):
        raise JobDefinitionError(
            "mode 'kill' needs a string target ('path/to/file.py:name' or 'package.module:name'): it kills the "
            "process the job runs in, and a Job or a callable runs in this one"
        )
    if not isinstance(target, str | Job) and not callable(target):
        raise DefinitionTypeError(
            f"check_resume needs a Job, a callable returning one, or 'path/file.py:name', got {target!r:.80}"
        )
    elastic = [m for m in chosen if m in ELASTIC_MODES]
    if elastic and session is not None and not isinstance(session, LocalSession):
        raise JobDefinitionError(
            f"mode(s) {elastic} run on local pool clusters of their own, which the check starts: leave session= out"
        )
    with _cluster(session) as client, _scratch() as root, quiet_interruptions():
        if "lose-node" in chosen and client is None:
            raise JobDefinitionError(
                "mode 'lose-node' kills a node's worker, so it needs a cluster: pass session= a DaskSession, "
                "a distributed.Client or a scheduler address"
            )
        where = "LocalSession" if client is None else f"the Dask cluster at {client.scheduler.address}"
        if not isinstance(target, str):
            make_job = _job_maker(target, max_epochs)
            executor = InProcess(make_job, client, seconds, max_epochs)
            return _Check(executor, root, target, where, make_job, on_run).run(chosen, points)
        with Children(target, client, root, seconds, max_epochs) as children:
            where = f"{where}, a new process per run"
            return _Check(children, root, target, where, partial(load_job, target), on_run).run(chosen, points)


@dataclass
class _Planned:
    """A run being made: its action, prefix, and what its parts took."""

    name: str
    action: Action
    prefix: str
    outcome: Outcome
    resumed_from: int | None = None
    seconds: float = 0.0


OnRun = Callable[[CheckedRun, list[Divergence]], None]
"""What :func:`check_resume` calls as each run finishes: the run and its divergences from A."""


class _Check:
    """The runs of one check, in an order that disturbs state kept outside the workspaces: A, the
    interrupted runs up to their interruption, B, then the resumes. A resume in this process thus
    starts with module state (and a global random generator) as B left it, not as its own first
    part did, as it would in a new process.

    Each run is compared with A as soon as it finished (``on_run`` is told); a divergence where B
    differs too is then classed as nondeterministic, at the end."""

    def __init__(
        self,
        executor: InProcess | Children,
        root: Path,
        target: Target,
        where: str,
        make_job: Callable[[], Job],
        on_run: OnRun | None = None,
    ) -> None:
        self.executor, self.root, self.where = executor, root, where
        self.make_job, self.on_run = make_job, on_run
        if isinstance(target, str):
            self.target = target
        elif isinstance(target, Job):
            self.target = f"the Job {target.name!r} itself"
        else:
            self.target = f"{getattr(target, '__qualname__', type(target).__name__)}()"
        self.results: dict[str, tuple[CheckedRun, list[Divergence]]] = {}

    def _run(self, name: str, action: Action, folder: str, *, fresh: bool = False) -> _Planned:
        prefix = str(self.root / folder)
        if action.kind in ELASTIC_MODES:
            assert action.at is not None
            with elastic_pool(action.kind, action.at, prefix) as client:
                outcome = self.executor.run(name, prefix, action, client=client)
        else:
            outcome = self.executor.run(name, prefix, action, fresh=fresh)
        logger.info("check: run %s (%s) took %.1f s", name, action.kind, outcome.seconds)
        return _Planned(name, action, prefix, outcome, seconds=outcome.seconds)

    def _finished(self, run: _Planned, reference: CheckpointStore) -> None:
        """Compare ``run`` (all of it done) with reference A and tell ``on_run``."""
        store = CheckpointStore(run.prefix)
        own = [] if run.name == "A" else compare_runs(reference, store, run.name)
        kind = None if run.action.kind == "run" else run.action.kind
        epochs = tuple(store.committed_epochs())
        checked = CheckedRun(
            run.name, kind, run.action.at, run.resumed_from, epochs, run.seconds, len(own), run.action.node
        )
        self.results[run.name] = (checked, own)
        if self.on_run is not None:
            self.on_run(checked, own)

    def run(self, modes: tuple[ActionKind, ...], points: tuple[int, ...] | None) -> ResumeReport:
        a = self._run("A", Action(), "A")
        reference = CheckpointStore(a.prefix)
        committed = reference.committed_epochs()
        record = reference.read_commit(committed[-1])
        last, nodes = committed[-1], list(record["nodes"])
        points = _interruption_points(points, last)
        self._finished(a, reference)
        interrupted: list[_Planned] = []
        for i, at in enumerate(points):
            for mode in modes:
                node = nodes[i % len(nodes)] if mode in ("lose-node", "shrink") else None
                run = self._run(f"{mode}@{at}", Action(mode, at, node), f"{mode}-at-{at}")
                interrupted.append(run)
                if mode in ("lose-node", *ELASTIC_MODES):
                    run.resumed_from = run.outcome.recovered_from
                    self._finished(run, reference)
                elif run.outcome.interrupted or run.outcome.last is None:
                    run.resumed_from = CheckpointStore(run.prefix).committed_epochs()[-1]
        self._finished(self._run("B", Action(), "B", fresh=True), reference)
        for run in interrupted:
            if run.action.kind in ("stop", "kill"):
                if run.resumed_from is not None:
                    run.seconds += self.executor.run(run.name, run.prefix, Action()).seconds
                self._finished(run, reference)
        order = ["A", "B", *(run.name for run in interrupted)]
        unreproducible = {(d.epoch, d.node, d.blob) for d in self.results["B"][1]}
        found = sorted(
            (
                d
                if d.run == "B" or (d.epoch, d.node, d.blob) not in unreproducible
                else replace(d, kind="nondeterministic")
                for name in order
                for d in self.results[name][1]
            ),
            key=ordering(order),
        )
        report = ResumeReport(record["job"], self.target, self.where, [self.results[name][0] for name in order], found)
        if found:
            first = found[0]
            blobs = [
                (d.node, d.blob)
                for d in found
                if d.run == first.run and d.epoch == first.epoch and d.node and d.blob and d.kind != "metric"
            ]
            report.step = first_step(self.make_job, reference, first.epoch, blobs)
        return report


def _interruption_points(points: tuple[int, ...] | None, last: int) -> tuple[int, ...]:
    """The given points (each before ``last``), or epoch 1, the middle one and the last but one."""
    if points is None:
        return tuple(sorted({k for k in (1, (last + 1) // 2, last - 1) if 1 <= k < last}))
    late = [k for k in points if k >= last]
    if late:
        raise JobDefinitionError(
            f"interrupt_at {late}: reference run A ended at epoch {last}, so runs can be interrupted after "
            f"epochs 1 to {last - 1} only"
        )
    return points


def _modes(modes: str | Iterable[str]) -> tuple[ActionKind, ...]:
    chosen = (modes,) if isinstance(modes, str) else tuple(modes)
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise JobDefinitionError(f"modes must be some of {MODES}, got {modes!r}")
    return cast("tuple[ActionKind, ...]", tuple(dict.fromkeys(chosen)))  # each one of MODES


def _points(interrupt_at: int | Iterable[int] | None) -> tuple[int, ...] | None:
    if interrupt_at is None:
        return None
    given = [interrupt_at] if not isinstance(interrupt_at, Iterable) else list(interrupt_at)
    if not given:
        raise JobDefinitionError("interrupt_at must name at least one epoch (or be None for the defaults)")
    return tuple(sorted({check_count(k, "interrupt_at") for k in given}))


def _job_maker(target: Job | Callable[[], Job], max_epochs: int | None) -> Callable[[], Job]:
    """What makes the job of each run: the Job itself, or a call of ``target`` (checked once, here)."""
    job = target if isinstance(target, Job) else target()
    if not isinstance(job, Job):
        raise DefinitionTypeError(f"check_resume: {target!r:.80}() returned {type(job).__name__}, not a Job")
    if not job.stop_conditions and max_epochs is None:
        raise JobDefinitionError(
            f"job {job.name!r} has no stop condition and no max_epochs: it would never stop; pass max_epochs="
        )
    if isinstance(target, Job):
        return lambda: target
    made = [job]
    return lambda: made.pop() if made else target()


@contextlib.contextmanager
def _cluster(session: Session | Any) -> Iterator[Any]:
    """The ``distributed.Client`` the runs use, or ``None`` for LocalSessions."""
    if session is None or isinstance(session, LocalSession):
        yield None
    elif isinstance(session, DaskSession):
        yield session.client
    elif isinstance(session, Session):
        raise DefinitionTypeError(f"check_resume runs on LocalSessions or a Dask cluster, got {session!r}")
    else:
        with DaskSession(session) as anchor:
            yield anchor.client


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A temporary folder for every run's prefix, removed afterwards whatever happens."""
    root = Path(tempfile.mkdtemp(prefix="daskjobs-check-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
