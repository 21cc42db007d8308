"""The history of a run: one record per epoch, its table (pandas), plot (matplotlib) and HTML."""

from __future__ import annotations

import html
import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ._notebook import show_figures_inline


@dataclass(frozen=True)
class EpochRecord:
    """What happened in one epoch of :meth:`~daskjobs.JobRunner.train`."""

    epoch: int
    seconds: float
    """Wall time of the epoch group run."""
    checkpoint_seconds: float
    """Time the driver spent saving and committing (or, with async saves, waiting for) checkpoints."""
    bytes_written: int
    """Bytes of blob data written by this epoch's checkpoint."""
    bytes_reused: int
    """Bytes of blob data reused from the previous epoch's checkpoint (delta checkpoints)."""
    stop_values: dict[str, bool]
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-epoch mean of each metric logged with ``ws.log(name, value)`` on any node."""
    recoveries: int = 0
    """Node losses recovered from before this epoch completed."""
    tier: str | None = None
    """Where the epoch is committed: ``"durable"`` (under the prefix) or, with tier 0
    (``in_memory=True``), ``"memory"`` (in cluster memory only); ``None`` without checkpoints."""
    tier0_bytes: dict[str, int] | None = None
    """With tier 0: worker address -> bytes of tier-0 snapshots it held once this epoch was committed
    in memory (its own nodes' and its replicas of others'); ``None`` without tier 0."""

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes written and reused: the size of the epoch's checkpoint."""
        return self.bytes_written + self.bytes_reused


_NOTEBOOK_EXTRA = 'pip install "daskjobs[notebook]"'


HISTORY_COLUMNS = ("epoch", "seconds", "checkpoint_seconds", "bytes_written", "bytes_reused", "recoveries")
"""The fixed columns of :func:`history_frame`, in order; stop values and metrics follow."""


def _optional(module: str, purpose: str) -> Any:
    """Import an optional dependency, or say which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{purpose} needs {module.split('.')[0]}, which is not installed: {_NOTEBOOK_EXTRA}") from exc


def history_rows(records: Iterable[EpochRecord]) -> list[dict[str, Any]]:
    """One flat dict per epoch: the fixed fields, with tier 0 ``tier`` and ``tier0_bytes`` (all
    workers together), ``stop:<name>`` per stop condition and one key per metric.

    A metric whose name collides with a fixed field is stored as ``metric:<name>``.

    Examples
    --------
    >>> history_rows([EpochRecord(1, 0.5, 0.1, 10, 0, {"done": False}, {"loss": 0.25})])[0]["loss"]
    0.25
    """
    rows = []
    for record in records:
        row: dict[str, Any] = {name: getattr(record, name) for name in HISTORY_COLUMNS}
        if record.tier0_bytes is not None:
            row["tier"] = record.tier
            row["tier0_bytes"] = sum(record.tier0_bytes.values())
        row.update({f"stop:{name}": value for name, value in record.stop_values.items()})
        for name, value in record.metrics.items():
            row[f"metric:{name}" if name in row or name.startswith("stop:") else name] = value
        rows.append(row)
    return rows


def history_frame(records: Iterable[EpochRecord]) -> Any:
    """A pandas DataFrame with one row per epoch (see :func:`history_rows` for the columns).

    Raises
    ------
    ImportError
        pandas is not installed (it comes with ``daskjobs[notebook]``).

    Examples
    --------
    >>> frame = history_frame([EpochRecord(1, 0.5, 0.1, 10, 0, {}, {"loss": 0.25})])
    >>> list(frame.columns)
    ['epoch', 'seconds', 'checkpoint_seconds', 'bytes_written', 'bytes_reused', 'recoveries', 'loss']
    """
    pandas = _optional("pandas", "history_frame()")
    rows = history_rows(records)
    columns = list(dict.fromkeys([*HISTORY_COLUMNS, *(key for row in rows for key in row)]))
    return pandas.DataFrame(rows, columns=columns)


def plot_history(records: Iterable[EpochRecord], *, title: str | None = None) -> Any:
    """A matplotlib Figure: one panel per metric, and a panel of epoch and checkpoint seconds, over epochs.

    Uses :class:`matplotlib.figure.Figure` directly (no pyplot state), so it works in scripts,
    on servers without a display and in notebooks (where the Figure is shown as the cell's result).

    Raises
    ------
    ImportError
        matplotlib is not installed (it comes with ``daskjobs[notebook]``).

    Examples
    --------
    >>> figure = plot_history([EpochRecord(1, 0.5, 0.1, 10, 0, {}, {"loss": 0.25})])
    >>> [axes.get_title() for axes in figure.axes]
    ['loss', 'time per epoch']
    """
    figure_module = _optional("matplotlib.figure", "plot()")
    show_figures_inline(figure_module.Figure)
    records = list(records)
    epochs = [r.epoch for r in records]
    metrics = list(dict.fromkeys(name for r in records for name in r.metrics))
    panels = len(metrics) + 1
    figure = figure_module.Figure(figsize=(6.4, 2.2 * panels), layout="constrained")
    axes = figure.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, metrics, strict=False):
        points = [(r.epoch, r.metrics[name]) for r in records if name in r.metrics]
        ax.plot([e for e, _ in points], [v for _, v in points], marker="o", markersize=3)
        ax.set_title(name)
        ax.set_ylabel(name)
        values = [v for _, v in points]
        if values and min(values) > 0 and max(values) > 100 * min(values):
            ax.set_yscale("log")
    times = axes[-1]
    times.plot(epochs, [r.seconds for r in records], marker="o", markersize=3, label="epoch")
    times.plot(epochs, [r.checkpoint_seconds for r in records], marker="o", markersize=3, label="checkpoint")
    times.set_title("time per epoch")
    times.set_ylabel("seconds")
    times.set_xlabel("epoch")
    times.legend(loc="best")
    if title:
        figure.suptitle(title)
    return figure


def history_html(records: list[EpochRecord], job: str, where: str, dashboard: str | None) -> str:
    """HTML of a run for notebooks: epochs run, the checkpoint prefix ``where``, a link to the Dask
    ``dashboard`` and a table of the last 20 epochs."""
    rows = history_rows(records[-20:])
    columns = list(dict.fromkeys(key for row in rows for key in row))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(row.get(c, ''))}</td>" for c in columns) + "</tr>" for row in rows)
    link = f' &mdash; <a href="{html.escape(dashboard)}" target="_blank">Dask dashboard</a>' if dashboard else ""
    shown = f", last {len(rows)} shown" if len(records) > len(rows) else ""
    return (
        f"<b>JobRunner</b> for job {html.escape(job)} &mdash; {len(records)} epochs run{shown}, "
        f"checkpoints: <code>{html.escape(where)}</code>{link}"
        f"<table><tr>{head}</tr>{body}</table>"
    )


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))
