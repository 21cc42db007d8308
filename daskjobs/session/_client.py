"""The distributed client a DaskSession talks through: connecting, sending runs at once, and
waiting for a run's futures."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import dask.config
from distributed import Client, Future

from .._config import config_timeout
from ..errors import DefinitionTypeError, SchedulerAddressError, SessionLostError
from ._address import checked_address, reach

_MESSAGE_LOG_LENGTH = 100
"""Messages a client made here keeps for debugging (Dask's default 1000 holds ~1000 graphs)."""


def send_at_once(client: Client) -> None:
    """Let ``client`` send each message to the scheduler at once, keeping at most
    :data:`_MESSAGE_LOG_LENGTH` of them for debugging.

    A distributed client batches its messages to the scheduler in 10 ms windows: a run's graph,
    submitted a few milliseconds after the previous run released its keys, waited for the next
    window, which made a checkpointed tiny epoch nearly twice as long. The batching exists for
    clients sending thousands of small messages; a session sends a few per run. The stream also
    keeps its last ``distributed.admin.low-level-log-length`` messages, read when it was made: a
    client the user made (``Client(cluster)``) keeps 1000 runs' graphs, megabytes that grow for
    the job's first thousand epochs. The client makes a new batched stream when it reconnects,
    so this is applied before every run.
    """
    comm = getattr(client, "scheduler_comm", None)
    if comm is None:
        return
    if getattr(comm, "interval", 0) != 0:
        comm.interval = 0
    log = getattr(comm, "recent_message_log", None)
    if isinstance(log, collections.deque) and (log.maxlen is None or log.maxlen > _MESSAGE_LOG_LENGTH):
        comm.recent_message_log = collections.deque(log, maxlen=_MESSAGE_LOG_LENGTH)


def connect(target: object, security: object) -> tuple[Client, bool]:
    """A synchronous client for ``target`` and whether the session owns (and later closes) it."""
    if isinstance(target, Client):
        if target.asynchronous:
            raise DefinitionTypeError("DaskSession needs a synchronous distributed.Client, got an asynchronous one")
        if security is not None:
            raise DefinitionTypeError(
                "security= applies to a scheduler address or a cluster; a Client has its own security"
            )
        return target, False
    if isinstance(target, str) or hasattr(target, "scheduler_address"):
        address = checked_address(target) if isinstance(target, str) else target.scheduler_address
        timeout = config_timeout("connect-timeout")
        if isinstance(target, str):
            reach(address, security, timeout)
        client = Client.__new__(Client)
        try:
            # The client gives up reconnecting after ``timeout`` too, and closes itself.
            with dask.config.set({"distributed.admin.low-level-log-length": _MESSAGE_LOG_LENGTH}):
                Client.__init__(client, target, set_as_default=False, timeout=timeout, security=security)
        except BaseException as exc:
            _discard(client)
            if isinstance(exc, ValueError) and isinstance(target, str):  # e.g. an inproc:// address of another process
                raise SchedulerAddressError(f"{address!r} is not a Dask scheduler address here: {exc}") from None
            if not isinstance(exc, OSError):
                raise
            # TimeoutError and refused or failed (e.g. TLS) connections
            raise SessionLostError(
                f"cannot connect to the Dask scheduler at {address} within {timeout:g} s "
                f"(daskjobs.connect-timeout): {exc}. Check that the scheduler runs at that address and, "
                "for a tls:// scheduler, pass security= with certificates it accepts."
            ) from None
        return client, True
    raise DefinitionTypeError(
        f"DaskSession needs a distributed.Client, a cluster object or a scheduler address, got {target!r}"
    )


def scheduler_rpc(client: Client) -> Any:
    """The connection of ``client`` to its scheduler, whose handlers ``client.sync`` calls (``None``
    only before the client connected: :class:`SessionLostError` then)."""
    rpc = client.scheduler
    if rpc is None:
        raise SessionLostError("the Dask client is not connected to a scheduler")
    return rpc


def _discard(client: Client) -> None:
    """Close a client whose construction failed, and stop its event-loop thread.

    Left alone, such a client keeps its loop thread, and its ``__del__`` at interpreter exit
    waits twice the connect timeout for that thread (a minute by default) before giving up.
    The client was made with ``Client.__new__`` first so that this reference exists.
    """
    if getattr(client, "status", "newly-created") not in ("closed", "newly-created"):
        with contextlib.suppress(Exception):
            client.close(timeout=5)
    runner = getattr(client, "_loop_runner", None)
    if runner is not None:
        runner.stop()


def dashboard_link(client: Client) -> str | None:
    """The scheduler's dashboard URL, or ``None`` when it serves none."""
    try:
        return client.dashboard_link
    except (KeyError, AttributeError, TypeError):
        return None


def when_all_done(futures: Sequence[Future]) -> threading.Event:
    """An event set once every future has finished, erred or been cancelled."""
    event = threading.Event()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                event.set()

    for future in futures:
        future.add_done_callback(one_done)
    if not futures:
        event.set()
    return event


async def gather_within(
    client: Client, futures: list[Future], timeout: float, pending: asyncio.Future | None = None
) -> tuple[list[Any] | None, asyncio.Future | None]:
    """On the client's loop: ``(results of the successful futures, None)`` once all are done, or
    ``(None, the gather still in flight)`` after ``timeout`` seconds. The gather itself is never
    interrupted (a cancelled gather could leave the client's shared transfer state broken)."""
    if pending is None:
        pending = asyncio.ensure_future(client.gather(futures, errors="skip", asynchronous=True))
        # An interrupted run drops its gather: its error (e.g. the client closed meanwhile) is
        # taken here, never logged by asyncio as "Task exception was never retrieved".
        pending.add_done_callback(lambda done: done.cancelled() or done.exception())
    gathering = pending
    try:
        return await asyncio.wait_for(asyncio.shield(gathering), timeout), None
    except TimeoutError:
        return None, gathering
