"""Per-epoch progress: a bar (a widget in Jupyter, text on a terminal) and one log line per epoch."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from ._notebook import in_jupyter

if TYPE_CHECKING:
    from ._history import EpochRecord

logger = logging.getLogger("daskjobs")


def _stderr_is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def shows_bar(enabled: bool | None) -> bool:
    """Whether :class:`EpochProgress` shows a bar for ``enabled`` (``None``: in Jupyter or when stderr
    is a terminal)."""
    return (in_jupyter() or _stderr_is_terminal()) if enabled is None else enabled


_ANNOUNCED: set[str] = set()
"""Dashboard links shown to the user by this process (see :func:`announce_dashboard`)."""


def announce_dashboard(link: str) -> bool:
    """Record that ``link`` (a Dask dashboard) was shown to the user; ``False`` if it had been
    already: a progress bar shows each link once per process, not again after the command line
    printed it, nor on every ``train`` on the same cluster."""
    new = link not in _ANNOUNCED
    _ANNOUNCED.add(link)
    return new


def _bare_terminal_size() -> dict[str, int]:
    """tqdm sizes for a terminal that reports 0 columns or rows (a bare pty, where tqdm would print
    nothing); empty when the terminal's own size can be followed."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        return {}
    fixed = {"ncols": 100} if size.columns == 0 else {}
    return fixed | ({"nrows": 24} if size.lines == 0 else {})


def _widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def known_total(*limits: int | None) -> int | None:
    """The smallest known epoch limit (``max_epochs``, ``epoch_limiter``'s count), or ``None``.

    Examples
    --------
    >>> known_total(10, None, 4), known_total(None)
    (4, None)
    """
    known = [int(limit) for limit in limits if limit is not None]
    return min(known) if known else None


def _text_bar() -> Any:
    from tqdm.std import tqdm

    return tqdm


def _bar_class(jupyter: bool) -> Any:
    """``tqdm.notebook.tqdm`` (a widget) in Jupyter when ipywidgets is installed, else the text bar.

    Choosing here rather than through ``tqdm.auto`` avoids tqdm's "IProgress not found" warning
    when a kernel lacks ipywidgets: the text bar is shown instead.
    """
    if jupyter and _widgets_available():
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm


def describe(record: EpochRecord) -> str:
    """The short text shown beside the bar: epoch and checkpoint time, metrics, stop values.

    Examples
    --------
    >>> from daskjobs.runner import EpochRecord
    >>> describe(EpochRecord(3, 0.25, 0.5, 10, 0, {"done": False}, {"loss": 0.125}))
    'epoch 3 0.25s ckpt 0.50s loss=0.125 done=0'
    >>> describe(EpochRecord(4, 0.25, 0.01, 0, 0, {}, tier="memory", tier0_bytes={}))
    'epoch 4 0.25s ckpt 0.01s memory'
    """
    tier = f" {record.tier}" if record.tier0_bytes is not None and record.tier else ""
    parts = [f"epoch {record.epoch} {record.seconds:.2f}s ckpt {record.checkpoint_seconds:.2f}s{tier}"]
    parts += [f"{name}={value:.4g}" for name, value in record.metrics.items()]
    parts += [f"{name}={int(value)}" for name, value in record.stop_values.items()]
    if record.recoveries:
        parts.append(f"recoveries={record.recoveries}")
    return " ".join(parts)


def epoch_line(record: EpochRecord, *, committed: bool) -> str:
    """One line for a finished epoch where no bar shows (logs, CI): epoch, time, checkpoint
    (``committed``: the epoch was checkpointed), metrics and stop values.

    Examples
    --------
    >>> from daskjobs.runner import EpochRecord
    >>> epoch_line(EpochRecord(3, 0.25, 0.5, 10, 6, {"done": False}, {"loss": 0.125}), committed=True)
    'epoch 3 committed: 0.25 s, checkpoint 0.50 s (10 bytes written, 6 reused), loss=0.125, done=0'
    >>> epoch_line(EpochRecord(3, 0.25, 0.0, 0, 0, {"done": True}), committed=False)
    'epoch 3: 0.25 s, done=1'
    >>> epoch_line(EpochRecord(4, 0.25, 0.0, 0, 0, {}, tier="memory", tier0_bytes={"w1": 8, "w2": 8}), committed=True)
    'epoch 4 committed: 0.25 s, checkpoint in cluster memory (16 bytes on 2 workers)'
    """
    parts = [f"{record.seconds:.2f} s"]
    if committed and record.tier == "memory":
        held = record.tier0_bytes or {}
        parts.append(f"checkpoint in cluster memory ({sum(held.values())} bytes on {len(held)} workers)")
    elif committed:
        durable = "durable checkpoint" if record.tier0_bytes is not None else "checkpoint"
        parts.append(
            f"{durable} {record.checkpoint_seconds:.2f} s ({record.bytes_written} bytes written, "
            f"{record.bytes_reused} reused)"
        )
    parts += [f"{name}={value:.4g}" for name, value in record.metrics.items()]
    parts += [f"{name}={int(value)}" for name, value in record.stop_values.items()]
    if record.recoveries:
        parts.append(f"recoveries={record.recoveries}")
    return f"epoch {record.epoch}{' committed' if committed else ''}: {', '.join(parts)}"


class _AboveBar(logging.Handler):
    """While a text bar shows: the console handlers of the ``daskjobs`` and root loggers write through
    the bar, above it (tqdm clears its line, writes, draws it again), never onto its line."""

    def __init__(self, bar: Any) -> None:
        super().__init__()
        self.bar = bar
        self.lines_since_update = 0
        """Log lines written since the bar last advanced."""
        self._swapped: list[tuple[logging.Logger, logging.StreamHandler[Any]]] = []

    def __enter__(self) -> _AboveBar:
        for owner in (logger, logging.root):
            for handler in list(owner.handlers):
                if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
                    owner.removeHandler(handler)
                    owner.addHandler(_Through(self, handler))
                    self._swapped.append((owner, handler))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, handler in self._swapped:
            for through in [h for h in owner.handlers if isinstance(h, _Through) and h.original is handler]:
                owner.removeHandler(through)
            owner.addHandler(handler)
        self._swapped = []


class _Through(logging.Handler):
    """A console handler's records, formatted by it and written above the bar."""

    def __init__(self, above: _AboveBar, original: logging.StreamHandler[Any]) -> None:
        super().__init__(original.level)
        self.above, self.original = above, original
        self.filters = list(original.filters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.original.format(record)
            self.above.bar.write(text, file=self.original.stream)
            self.above.lines_since_update += 1
        except Exception:
            self.handleError(record)


class EpochProgress:
    """Shows each finished epoch: a progress bar, and one INFO line on the ``daskjobs`` logger.

    Parameters
    ----------
    enabled
        ``True``: always show the bar; ``False``: never; ``None``: in Jupyter or when stderr is a
        terminal.
    job_name
        Shown as the bar's label.
    start
        The first epoch this run executes (1 from scratch, ``resume + 1`` when resuming): the bar
        starts at ``start - 1`` epochs done.
    total
        The last epoch if known (then the bar shows a total and an ETA), else ``None``.
    dashboard
        The Dask dashboard link, written above the bar.
    """

    def __init__(
        self, enabled: bool | None, job_name: str, *, start: int, total: int | None, dashboard: str | None = None
    ) -> None:
        self._bar = None
        self._handle: Any = None
        self._redirect: _AboveBar | None = None
        jupyter = in_jupyter()
        if not shows_bar(enabled):
            return
        done = max(start - 1, 0)
        bar = _bar_class(jupyter)
        widget = bar is not _text_bar()
        sizes = {} if jupyter else _bare_terminal_size()
        self._bar = bar(
            total=total if total is None else max(total, done),
            initial=done,
            desc=f"job {job_name}",
            unit="epoch",
            dynamic_ncols=not jupyter and "ncols" not in sizes,
            leave=True,
            **({"display": False} if widget else {}),
            **sizes,
        )
        if widget:
            # Shown under a display id, so that close() can update the text a viewer without
            # widgets shows (tqdm's own display would keep its first state: 0 epochs, forever).
            from IPython.display import display

            self._handle = display(self._bar.container, display_id=True)
        else:
            self._redirect = _AboveBar(self._bar)
            self._redirect.__enter__()
        if dashboard and announce_dashboard(dashboard):
            # The text bar lives on stderr, so the link goes there too (stdout stays the program's own).
            self._bar.write(f"Dask dashboard: {dashboard}", file=None if jupyter else sys.stderr)

    def update(self, record: EpochRecord) -> None:
        """Advance by one finished epoch."""
        logger.info(
            "epoch %d: %.3f s, checkpoint %.3f s%s (%d bytes written, %d reused), metrics %s, stop %s",
            record.epoch,
            record.seconds,
            record.checkpoint_seconds,
            f" ({record.tier})" if record.tier0_bytes is not None and record.tier else "",
            record.bytes_written,
            record.bytes_reused,
            record.metrics,
            record.stop_values,
        )
        if self._redirect is not None:
            self._redirect.lines_since_update = 0
        if self._bar is not None:
            self._bar.set_postfix_str(describe(record), refresh=False)
            # The bar stands at the last finished epoch: an epoch run again after a recovery is not counted twice.
            if record.epoch > self._bar.n:
                self._bar.update(record.epoch - self._bar.n)
            else:
                self._bar.refresh()

    def complete(self) -> None:
        """The run ended normally: a stop condition that came before the known total is not a failure."""
        bar = self._bar
        if bar is not None and bar.total is not None and bar.n < bar.total:
            bar.total = bar.n
            container = getattr(bar, "container", None)  # the Jupyter widget keeps its own maximum
            if container is not None:
                container.children[1].max = bar.n
            bar.refresh()

    def close(self) -> None:
        """Finish the bar: it stays as the last line, unless log lines came after its last epoch (a
        graceful stop's message, an error's): then it goes, and they are the last lines. A widget's
        text form then shows its last state."""
        if self._bar is None:
            return
        try:
            if self._redirect is not None and self._redirect.lines_since_update:
                self._bar.leave = False
            self._bar.close()
            if self._handle is not None:
                self._handle.update(self._bar.container)
        finally:
            if self._redirect is not None:
                self._redirect.__exit__(None, None, None)
                self._redirect = None
