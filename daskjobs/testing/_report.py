"""What :func:`~daskjobs.testing.check_resume` found: :class:`Divergence`, :class:`CheckedRun` and
:class:`ResumeReport`, with their text, HTML and JSON forms and the likely causes of each kind.

Pure: no Dask, no I/O.
"""

from __future__ import annotations

import html
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..errors import ResumeDivergenceError

Kind = Literal["nondeterministic", "resume", "missing", "extra", "metric"]

KINDS: tuple[Kind, ...] = ("nondeterministic", "resume", "missing", "extra", "metric")

_WIDTH = 100
"""Columns the summary's sentences are wrapped at."""
"""Every kind of divergence; within an epoch, divergences are listed in this order."""

LIKELY_CAUSES: dict[str, tuple[str, ...]] = {
    "nondeterministic": (
        "the global random generator (np.random.*, random.*) used without a fixed seed: draw from a "
        "np.random.default_rng(seed) whose bit_generator.state is kept in the workspace",
        "the wall clock (time.time(), datetime.now(), perf_counter) feeding a value",
        "unordered float reductions across concurrent tasks: instances (num_instances > 1) or pipe threads "
        "(num_threads > 1) adding or averaging into one blob in whatever order they finish; give each its own "
        "blob and combine them in a fixed order in a later task",
        "module state (a counter, a cache) that an earlier run in the same process or worker left behind and "
        "that the init group does not reset (on a cluster each task of a job file has its own copy of the "
        "file's globals, which lives on in its worker from run to run: an init task cannot reset it)",
    ),
    "resume": (
        "the global random generator seeded once in init (np.random.seed, random.seed): a resumed run skips "
        "init and draws from wherever its process's generator is; keep a np.random.Generator's "
        "bit_generator.state in the workspace and draw from a generator restored from it",
        "module globals or attributes of a step object, set in init or carried from epoch to epoch: a new "
        "process starts them afresh; keep them in blobs",
        "the wall clock, when a value depends on the time elapsed since the process started",
        "a reader without state: a custom dj.Reader keeping its position in a Python attribute or iterator "
        "instead of blobs created in setup()",
        "an accumulator in a PRIVATE workspace: its blob vanishes after every run, so the running value lives "
        "elsewhere; create the blob in the init group or use a GLOBAL group",
    ),
    "missing": (
        "a blob created only on a process's first call (a module flag, a cache) or in a PRIVATE workspace, "
        "which is discarded after every run: create it in the init group",
        "a stop condition depending on state outside the workspace: the run ended at another epoch",
    ),
    "extra": (
        "a blob created when state outside the workspace is fresh, as after a restart (`if not CACHE: ws[...]`, "
        "ws.setdefault on a name the init group does not create): create it in the init group",
        "a stop condition depending on state outside the workspace: the run went on past reference A's end",
    ),
    "metric": (
        "a metric computed from state outside the workspace: a step counter, a learning-rate schedule or a "
        "running average kept in a module global or a step object",
        "a metric of time or throughput (seconds per batch, samples per second)",
        "a different number of ws.log calls after a resume (a loop bounded by state outside the workspace)",
        "concurrent tasks logging into one metric in whatever order they finish (the sum's rounding)",
    ),
}
"""For each kind of divergence, what usually causes it and what to do instead."""


@dataclass(frozen=True)
class Divergence:
    """One difference between a run and reference run A.

    Attributes
    ----------
    epoch : int
        The committed epoch that differs.
    node : str or None
        The node whose blob differs; ``None`` for a metric, a stop value or a whole epoch.
    blob : str or None
        The blob (or, for ``kind="metric"``, the metric; for a stop value, the stop condition's
        name) that differs; ``None`` for a whole node or epoch.
    run : str
        The run that differs from A: ``"B"`` (the second reference), ``"stop@k"``, ``"kill@k"``
        or ``"lose-node@k"`` (interrupted after epoch ``k``).
    kind : str
        ``"nondeterministic"`` (B differs from A), ``"resume"`` (an interrupted run's value differs
        while A equals B), ``"missing"`` / ``"extra"`` (a blob, node or epoch of A absent from the
        run, or one of the run absent from A), ``"metric"`` (a logged metric differs).
    detail : str
        What differs, e.g. dtypes, shapes, the largest absolute difference and where.
    """

    epoch: int
    node: str | None
    blob: str | None
    run: str
    kind: Kind
    detail: str

    def where(self) -> str:
        """``epoch 3, node 'ps', blob 'w'`` (the parts that are known)."""
        parts = [f"epoch {self.epoch}"]
        if self.node is not None:
            parts.append(f"node {self.node!r}")
        if self.blob is not None:
            parts.append(f"{'metric' if self.kind == 'metric' else 'blob'} {self.blob!r}")
        return ", ".join(parts)


@dataclass(frozen=True)
class FirstStep:
    """The step whose output first diverged, where a check can tell: task ``task`` on node ``node``,
    the first task of its group (in the order the job defines them) that assigned a blob that
    differs in epoch ``epoch`` (``blob``; epoch 0: in the init group). See
    :func:`~daskjobs.testing.check_resume`.

    Attributes
    ----------
    task : str
        The task's name.
    node : str
        Its node.
    blob : str
        The blob it assigned, which differs first.
    epoch : int
        The first epoch that differs.
    """

    task: str
    node: str
    blob: str
    epoch: int

    def describe(self) -> str:
        """``task 'update' on node 'center' (it assigned blob 'c' in epoch 3)``."""
        when = "in the init group" if self.epoch == 0 else f"in epoch {self.epoch}"
        return f"task {self.task!r} on node {self.node!r} (it assigned blob {self.blob!r} {when})"


@dataclass(frozen=True)
class CheckedRun:
    """One run of a check: a reference, or a run interrupted once and taken on to the end.

    Attributes
    ----------
    name : str
        ``"A"``, ``"B"``, ``"stop@k"``, ``"kill@k"``, ``"lose-node@k"``, ``"shrink@k"`` or ``"grow@k"``.
    mode : str or None
        ``"stop"``, ``"kill"``, ``"lose-node"``, ``"shrink"`` or ``"grow"``; ``None`` for the references.
    interrupt_at : int or None
        The epoch after whose commit the run was interrupted.
    resumed_from : int or None
        The committed epoch the run went on from after its interruption; ``None`` when it was
        not interrupted (a reference, or a job that ended before ``interrupt_at``).
    epochs : tuple of int
        The epochs the run committed.
    seconds : float
        Wall time of the run (both of its processes or runners).
    divergences : int
        How many divergences from A it has.
    node : str or None
        The node whose worker a ``"lose-node"`` or ``"shrink"`` run killed.
    """

    name: str
    mode: str | None
    interrupt_at: int | None
    resumed_from: int | None
    epochs: tuple[int, ...]
    seconds: float
    divergences: int = 0
    node: str | None = None

    def describe(self) -> str:
        """What happened to the run, e.g. ``killed in epoch 4, resumed from 3``."""
        if self.mode is None or self.interrupt_at is None:  # a reference: never interrupted
            return "reference" if self.name == "A" else "reference, run again"
        if self.resumed_from is None and self.mode in ("lose-node", "shrink"):
            return f"node {self.node!r} killed in epoch {self.interrupt_at + 1}, but the run saw no loss"
        if self.resumed_from is None and self.mode == "grow":
            return f"a worker joined after epoch {self.interrupt_at}, but no node moved onto it"
        if self.resumed_from is None:
            last = self.epochs[-1] if self.epochs else None
            return f"not interrupted: the job ended at epoch {last}, before epoch {self.interrupt_at}"
        if self.mode == "stop":
            return f"stopped after epoch {self.interrupt_at}, resumed from {self.resumed_from}"
        if self.mode == "kill":
            return f"driver killed in epoch {self.interrupt_at + 1}, resumed from {self.resumed_from}"
        if self.mode == "shrink":
            return (
                f"the worker of node {self.node!r} killed for good in epoch {self.interrupt_at + 1}, the other "
                f"worker restored every node from {self.resumed_from}"
            )
        if self.mode == "grow":
            return f"a worker joined after epoch {self.interrupt_at}: nodes moved onto it with their workspaces"
        return f"node {self.node!r} lost in epoch {self.interrupt_at + 1}, restored from {self.resumed_from}"

    def line(self, divergences: list[Divergence]) -> str:
        """One line, as ``daskjobs check`` prints it when the run finishes: its name, what happened to
        it, its epochs, time and how it compares with reference A (``divergences``: its own)."""
        return f"{self.name:<12}  {self.describe():<50}  epochs {epoch_span(self.epochs):<8} {self.seconds:6.1f} s" + (
            _result(self, divergences)
        )


def _result(run: CheckedRun, divergences: list[Divergence]) -> str:
    """How ``run`` compares with reference A: ``""`` for A itself."""
    if run.name == "A":
        return ""
    if divergences:
        return f"  {_count(len(divergences), 'divergence')}, first in epoch {divergences[0].epoch}"
    return "  equal to A"


def epoch_span(epochs: tuple[int, ...]) -> str:
    """``0-17`` for consecutive epochs, else the list (``0-3,5``); ``none`` when empty.

    Examples
    --------
    >>> epoch_span((0, 1, 2, 3)), epoch_span((0, 1, 3)), epoch_span(())
    ('0-3', '0-1,3', 'none')
    """
    if not epochs:
        return "none"
    spans: list[list[int]] = []
    for epoch in epochs:
        if spans and epoch == spans[-1][1] + 1:
            spans[-1][1] = epoch
        else:
            spans.append([epoch, epoch])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


@dataclass
class ResumeReport:
    """What :func:`~daskjobs.testing.check_resume` found.

    ``str(report)`` is a summary as ``daskjobs check`` prints it: one line per run, then the first
    divergence (epoch, node, blob, run), what differs and the likely causes of its kind. In
    Jupyter the report shows as a table.

    Attributes
    ----------
    job : str
        The job's name.
    target : str
        What was checked (the target string, or the Job's repr).
    where : str
        Where the runs ran (``LocalSession``, a scheduler address).
    runs : list of CheckedRun
        Every run: A and B first, then the interrupted ones.
    divergences : list of Divergence
        Every difference from reference A, earliest epoch first (then by kind, run, node, blob).
    step : FirstStep or None
        The step (task and node) whose output first diverged, where the check can tell (see
        :func:`~daskjobs.testing.check_resume`).
    """

    job: str
    target: str
    where: str
    runs: list[CheckedRun]
    divergences: list[Divergence] = field(default_factory=list)
    step: FirstStep | None = None

    @property
    def ok(self) -> bool:
        """Every run equals reference A in every committed epoch."""
        return not self.divergences

    @property
    def deterministic(self) -> bool:
        """The two uninterrupted references A and B are equal."""
        return not any(d.run == "B" for d in self.divergences)

    @property
    def first(self) -> Divergence | None:
        """The first divergence (the earliest), or ``None``."""
        return self.divergences[0] if self.divergences else None

    def raise_for_divergence(self) -> None:
        """Raise :class:`~daskjobs.errors.ResumeDivergenceError` (an ``AssertionError``) with the
        summary if anything diverged; do nothing when :attr:`ok`."""
        if not self.ok:
            raise ResumeDivergenceError(str(self))

    def verdict(self) -> str:
        """Whether the job resumes exactly, in one sentence."""
        if self.ok:
            return (
                f"OK: job {self.job!r} resumes exactly: every run equals reference A in every committed epoch "
                "(every blob of every node, the stop values and the metrics)"
            )
        counts = Counter(d.run for d in self.divergences)
        runs = ", ".join(f"{run} ({n})" for run, n in counts.items())
        what = (
            "is not reproducible: two uninterrupted runs differ"
            if not self.deterministic
            else "does not resume exactly"
        )
        return f"DIVERGES: job {self.job!r} {what}; {_count(len(self.divergences), 'divergence')} in {runs}"

    def run_lines(self) -> list[str]:
        """One line per run: its name, what happened to it, its epochs, time and result."""
        width = max(len(run.name) for run in self.runs) if self.runs else 1
        described = [run.describe() for run in self.runs]
        said = max(map(len, described)) if described else 0
        lines = []
        for run, text in zip(self.runs, described, strict=True):
            result = _result(run, [d for d in self.divergences if d.run == run.name])
            lines.append(
                f"{run.name:<{width}}  {text:<{said}}  epochs {epoch_span(run.epochs):<8} {run.seconds:6.1f} s{result}"
            )
        return lines

    def first_lines(self, width: int = _WIDTH) -> list[str]:
        """The first divergence, what differs, and the likely causes of its kind, wrapped at ``width``
        (nothing when :attr:`ok`)."""
        first = self.first
        if first is None:
            return []
        lines = [
            f"first divergence: {first.where()}, run {first.run} ({first.kind})",
            *textwrap.wrap(first.detail, width, initial_indent="  ", subsequent_indent="  "),
            *(
                textwrap.wrap(f"first diverging step: {self.step.describe()}", width, subsequent_indent="  ")
                if self.step is not None
                else []
            ),
            *textwrap.wrap(f"likely causes ({_kind_meaning(first.kind)}):", width, subsequent_indent="  "),
        ]
        for cause in LIKELY_CAUSES[first.kind]:
            lines += textwrap.wrap(cause, width, initial_indent="  - ", subsequent_indent="    ")
        return lines

    def __str__(self) -> str:
        head = f"daskjobs check of job {self.job!r} ({self.target}) on {self.where}: {len(self.runs)} runs"
        verdict = textwrap.wrap(self.verdict(), _WIDTH, subsequent_indent="  ")
        return "\n".join([head, *(f"  {line}" for line in self.run_lines()), *verdict, *self.first_lines()])

    def __repr__(self) -> str:
        return (
            f"ResumeReport(job={self.job!r}, ok={self.ok}, deterministic={self.deterministic}, "
            f"runs={[run.name for run in self.runs]}, divergences={len(self.divergences)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``daskjobs check --json`` prints)."""
        first = self.first
        return {
            "job": self.job,
            "target": self.target,
            "where": self.where,
            "ok": self.ok,
            "deterministic": self.deterministic,
            "runs": [{**asdict(run), "epochs": list(run.epochs), "description": run.describe()} for run in self.runs],
            "divergences": [asdict(d) for d in self.divergences],
            "first": None if first is None else {**asdict(first), "likely_causes": list(LIKELY_CAUSES[first.kind])},
            "step": None if self.step is None else asdict(self.step),
        }

    def _repr_html_(self) -> str:
        esc = html.escape
        color = "#1a7f37" if self.ok else "#cf222e"
        rows = "".join(
            f"<tr><td>{esc(run.name)}</td><td>{esc(run.describe())}</td><td>{esc(epoch_span(run.epochs))}</td>"
            f"<td>{run.seconds:.1f} s</td><td>{'' if run.name == 'A' else run.divergences}</td></tr>"
            for run in self.runs
        )
        parts = [
            f"<b>ResumeReport</b> of job <code>{esc(self.job)}</code> ({esc(self.target)}) on {esc(self.where)}",
            f'<p style="color:{color}"><b>{esc(self.verdict())}</b></p>',
            "<table><tr><th>run</th><th>what happened</th><th>epochs</th><th>time</th><th>divergences</th></tr>"
            f"{rows}</table>",
        ]
        first = self.first
        if first is not None:
            causes = "".join(f"<li>{esc(cause)}</li>" for cause in LIKELY_CAUSES[first.kind])
            step = "" if self.step is None else f"<p>First diverging step: {esc(self.step.describe())}</p>"
            parts.append(
                f"<p>First divergence: <b>{esc(first.where())}</b>, run <b>{esc(first.run)}</b> "
                f"({esc(first.kind)}): {esc(first.detail)}</p>{step}"
                f"<p>Likely causes ({esc(_kind_meaning(first.kind))}):</p><ul>{causes}</ul>"
            )
        return "\n".join(parts)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _kind_meaning(kind: str) -> str:
    return {
        "nondeterministic": "two uninterrupted runs already differ: the job is not reproducible",
        "resume": "the uninterrupted runs agree, the interrupted run differs: state kept outside the workspaces",
        "missing": "reference A has it, the run does not",
        "extra": "the run has it, reference A does not",
        "metric": "a logged metric differs",
    }[kind]
