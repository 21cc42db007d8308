"""Graceful stop of a run on SIGINT/SIGTERM: the first signal asks to stop after the running
epoch, a second one abandons it at once (SPEC §1.8). The same signal again within
:data:`SAME_REQUEST` seconds is the same request: a wrapper in the process group (GNU ``timeout``,
``srun``) forwards a signal the whole group already got (SPEC §4)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..errors import CheckpointError, JobInterruptedError

logger = logging.getLogger("daskjobs")

SIGNALS: dict[int, str] = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
SAME_REQUEST = 0.5
"""Seconds within which the first signal, arriving again, is one request delivered twice."""


def interruption(
    signum: int,
    job: str,
    last: int | None,
    url: str | None,
    *,
    abandoned: bool,
    list_committed: Callable[[], list[int]] | None = None,
) -> BaseException:
    """The error a run of ``job`` interrupted by ``signum`` raises: ``KeyboardInterrupt`` (SIGINT) or
    :class:`~daskjobs.errors.JobInterruptedError` (SIGTERM), naming the epoch ``last`` committed under
    ``url`` (``None``: nothing committed) and how to resume from it. An ``abandoned`` run names
    the newest commit ``list_committed()`` finds, if newer (see :func:`newest_committed`). The
    error's ``abandoned`` attribute says which kind of interruption it was."""
    if abandoned and list_committed is not None:
        last = newest_committed(list_committed, last)
    if last is None or url is None:
        where = "nothing is committed"
    else:
        where = (
            f"epoch {last} is committed under {url}; run the job again with the same "
            "checkpoint prefix to resume from it"
        )
    what = "abandoned the running epoch" if abandoned else "stopped after the running epoch"
    message = f"job {job!r} interrupted by {SIGNALS[signum]}: {what}; {where}"
    error: BaseException = KeyboardInterrupt(message) if signum == signal.SIGINT else JobInterruptedError(message, last)
    error.abandoned = abandoned  # type: ignore[attr-defined]  # the command line then exits at once
    return error


def newest_committed(list_committed: Callable[[], list[int]], known: int | None) -> int | None:
    """The newest committed epoch ``list_committed()`` gives when it is newer than ``known``: a
    second signal may strike between writing a commit record and the runner noting it, and what a
    new run resumes from is what is on disk. ``known`` when the prefix cannot be listed."""
    try:
        committed = list_committed()
    except (CheckpointError, OSError):
        return known
    newest = committed[-1] if committed else None
    return newest if newest is not None and (known is None or newest > known) else known


class AbandonedRun(KeyboardInterrupt):
    """What a second signal raises, wherever the main thread is: in a step, a save, a commit.

    A ``KeyboardInterrupt`` (whatever the signal), so that nothing on the way takes it for the
    failure of a step or a save (they catch ``Exception``) and everything cleans up as for Ctrl-C;
    the runner then raises the public error of :attr:`signum` (see :func:`interruption`).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"{SIGNALS[signum]} received twice: abandoning the running epoch")
        self.signum = signum

    def __reduce__(self) -> tuple[type[AbandonedRun], tuple[int]]:
        return type(self), (self.signum,)


def signal_of(error: BaseException) -> int:
    """The signal an interruption stands for: its own, SIGINT for ``KeyboardInterrupt``, else SIGTERM."""
    if isinstance(error, AbandonedRun):
        return error.signum
    return signal.SIGINT if isinstance(error, KeyboardInterrupt) else signal.SIGTERM


class GracefulStop:
    """Context manager installing SIGINT/SIGTERM handlers on the main thread (nowhere else).

    The first signal sets :attr:`requested`; the runner checks it after each committed epoch.
    A second one raises :class:`AbandonedRun` at once, wherever the main thread is, unless it is
    the first signal arriving again within :data:`SAME_REQUEST` seconds (one request delivered
    twice). The previous handlers are restored on exit.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self.on_request: Callable[[], None] | None = None
        """Called (from the signal handler, or the requesting thread) when the first request comes."""
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def _requested(self, signum: int) -> None:
        self.requested = signum
        if self.on_request is not None:
            self.on_request()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.requested is not None and signum == self.requested and now - self._at < SAME_REQUEST:
            return
        if self.requested is None:
            self._at = now
            self._requested(signum)
            logger.warning(
                "%s received: the job stops once the running epoch is done (and committed, with checkpoints); "
                "send it again to abandon that epoch",
                SIGNALS[signum],
            )
            return
        raise AbandonedRun(signum)

    def request(self, signum: int) -> None:
        """Ask for the stop ``signum`` gives, from any thread: the first request sets :attr:`requested`;
        a later one abandons the running epoch, as a second signal does, where the handlers are
        installed (the run is on the main thread: the signal is sent to it), else it is ignored."""
        if signum not in SIGNALS:
            raise ValueError(f"a run stops on SIGINT or SIGTERM, not on signal {signum}")
        if self.requested is None:
            self._requested(signum)
            logger.info("%s asked for: the job stops once the running epoch is done", SIGNALS[signum])
            return
        main = threading.main_thread()
        if self._previous and main.ident is not None:
            signal.pthread_kill(main.ident, signum)

    def __enter__(self) -> GracefulStop:
        self.requested = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
            for sig in SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.on_request = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
