"""The distributed client a DaskSession talks through: connecting, and sending runs at once."""

from __future__ import annotations

import dask.config
from distributed import Client

from ..errors import DefinitionTypeError, SessionLostError
from ._placement import config_timeout

_MESSAGE_LOG_LENGTH = 100
"""Messages a client made here keeps for debugging (Dask's default 1000 holds ~1000 graphs)."""


def send_at_once(client: Client) -> None:
    """Let ``client`` send each message to the scheduler at once.

    A distributed client batches its messages to the scheduler in 10 ms windows: a run's graph,
    submitted a few milliseconds after the previous run released its keys, waited for the next
    window, which made a checkpointed tiny epoch nearly twice as long. The batching exists for
    clients sending thousands of small messages; a session sends a few per run. The client
    makes a new batched stream when it reconnects, so this is applied before every run.
    """
    comm = getattr(client, "scheduler_comm", None)
    if comm is not None and getattr(comm, "interval", 0) != 0:
        comm.interval = 0


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
        address = target if isinstance(target, str) else target.scheduler_address
        timeout = config_timeout("connect-timeout")
        try:
            # The client gives up reconnecting after ``timeout`` too, and closes itself.
            with dask.config.set({"distributed.admin.low-level-log-length": _MESSAGE_LOG_LENGTH}):
                return Client(target, set_as_default=False, timeout=timeout, security=security), True
        except OSError as exc:  # TimeoutError and refused or failed (e.g. TLS) connections
            raise SessionLostError(
                f"cannot connect to the Dask scheduler at {address} within {timeout:g} s "
                f"(daskjobs.connect-timeout): {exc}. Check that the scheduler runs at that address and, "
                "for a tls:// scheduler, pass security= with certificates it accepts."
            ) from None
    raise DefinitionTypeError(
        f"DaskSession needs a distributed.Client, a cluster object or a scheduler address, got {target!r}"
    )


def dashboard_link(client: Client) -> str | None:
    """The scheduler's dashboard URL, or ``None`` when it serves none."""
    try:
        return client.dashboard_link
    except (KeyError, AttributeError, TypeError):
        return None
