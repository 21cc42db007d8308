"""How a DaskSession keeps to its scheduler: its client connected (waited for while it reconnects),
the scheduler's worker table asked for afresh, and the session closed, with
:class:`~daskjobs.errors.SessionLostError`, once the scheduler is lost."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from distributed import Client

from .._config import config_timeout
from ..errors import SessionClosedError, SessionLostError
from ._client import scheduler_rpc
from ._placement import WorkerTable

STOPPING_GRACE = 2.0
"""Seconds a lost scheduler is waited for once a stop of the run was asked for (a signal to the
whole batch job reaches the scheduler too): at most ``daskjobs.connect-timeout``."""


class SchedulerConnection:
    """Mixed into :class:`~daskjobs.DaskSession`: checks of its client's connection, the worker table,
    and the loss of the scheduler.

    Uses the session's attributes below and its ``_check_open()``; sets its ``_open`` to ``False``
    when the scheduler is lost (the session can do nothing without it).
    """

    session_id: str
    _open: bool
    _stopping: bool = False
    _client: Client
    _owns_client: bool
    _address: str

    if TYPE_CHECKING:  # the session's own, which this mixin uses

        def _check_open(self) -> None: ...

    def _check_client(self) -> None:
        """Raise unless the session is open and its client connected (waiting for a reconnect)."""
        self._check_open()
        status = self._client.status
        if status == "running":
            return
        if status in ("closing", "closed") and not self._owns_client:
            raise SessionClosedError(
                f"the Dask client of DaskSession {self.session_id} was closed (by its owner, or after it lost "
                f"the scheduler at {self._address}); open a new session"
            )
        self._await_reconnect()

    def stop_requested(self, requested: bool = True) -> None:
        """Once a stop was asked for, a lost scheduler is waited for :data:`STOPPING_GRACE` seconds at most."""
        self._stopping = requested

    def _await_reconnect(self) -> None:
        """Return once the client is connected again; after ``daskjobs.connect-timeout`` (or
        :data:`STOPPING_GRACE` once a stop was asked for) close the session and raise
        :class:`SessionLostError`."""
        timeout = config_timeout("connect-timeout")
        started = time.monotonic()
        while self._client.status != "running" and time.monotonic() - started < self._patience(timeout):
            if self._client.status in ("closing", "closed"):
                break
            time.sleep(0.05)
        if self._client.status != "running":
            waited = self._patience(timeout)
            why = "while the run stops" if waited < timeout else "(daskjobs.connect-timeout)"
            raise self._lost_scheduler(f"no connection to it for {waited:g} s {why}")

    def _patience(self, timeout: float) -> float:
        """How long a lost scheduler is waited for now (a stop may be asked for while it is)."""
        return min(timeout, STOPPING_GRACE) if self._stopping else timeout

    def _lost_scheduler(self, why: str) -> SessionLostError:
        """Close the session (it can do nothing without its scheduler) and return the error to raise."""
        self._open = False
        if self._owns_client:
            with contextlib.suppress(Exception):
                self._client.close(timeout=2)
        return SessionLostError(
            f"lost the Dask scheduler at {self._address}: {why}. DaskSession {self.session_id} is closed and "
            "its node workspaces are gone"
        )

    def _workers(self) -> WorkerTable:
        """The scheduler's worker table, asked for afresh; the scheduler must answer within
        ``daskjobs.connect-timeout``."""
        timeout = config_timeout("connect-timeout")
        deadline = time.monotonic() + timeout
        while True:
            self._check_client()
            try:
                identity = self._client.sync(
                    scheduler_rpc(self._client).identity,
                    n_workers=-1,
                    callback_timeout=max(deadline - time.monotonic(), 0.1),
                )
                return identity["workers"]
            except OSError as exc:  # TimeoutError, CommClosedError
                if time.monotonic() >= deadline:
                    raise self._lost_scheduler(f"it did not answer for {timeout:g} s ({exc!r})") from None
                time.sleep(0.1)
