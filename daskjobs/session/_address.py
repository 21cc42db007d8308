"""Reaching a scheduler by its address: the address is checked before anything connects, and one
quick attempt (the Dask handshake included) tells a refused connection from a slow one.

A distributed client retries a refused connection until its timeout (30 s by default), and an
address that does not parse, or a ``tls://`` one without TLS settings, can leave a half-made
client whose event-loop thread makes the interpreter wait another minute at exit. A session
checks the address itself, tries once, and only then makes its client.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from distributed import Security
from distributed.comm import registry
from distributed.comm.addressing import parse_address, parse_host_port

from ..errors import DefinitionTypeError, SchedulerAddressError, SessionLostError

_HOST_PORT_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
_SECURE_SCHEMES = ("tls", "wss")
_FORM = "tcp://HOST:PORT, tls://HOST:PORT or HOST:PORT"


def checked_address(address: str) -> str:
    """``address`` if it is a scheduler address a client can connect to.

    Raises
    ------
    SchedulerAddressError
        The address does not parse: an unknown scheme, no host, or a port outside 1-65535.

    Examples
    --------
    >>> checked_address("tcp://127.0.0.1:8786")
    'tcp://127.0.0.1:8786'
    >>> checked_address("http://x")
    Traceback (most recent call last):
    ...
    daskjobs.errors.SchedulerAddressError: 'http://x' is not a Dask scheduler address: unknown scheme 'http' ...
    """
    known = sorted(registry.backends)

    def refuse(why: str) -> SchedulerAddressError:
        return SchedulerAddressError(
            f"{address!r} is not a Dask scheduler address: {why} (expected {_FORM}; schemes: {', '.join(known)})"
        )

    if not address or address != address.strip():
        raise refuse("it is empty or has spaces around it")
    scheme, location = parse_address(address, strict=False)
    if scheme not in known:
        raise refuse(f"unknown scheme {scheme!r}")
    if scheme not in _HOST_PORT_SCHEMES:
        return address
    try:
        host, port = parse_host_port(location)
    except ValueError:
        raise refuse("it has no HOST:PORT") from None
    if not host or any(c.isspace() for c in host):
        raise refuse(f"{host!r} is not a host name or IP address")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise refuse(f"port {port} is outside 1-65535")
    return address


def reach(address: str, security: Any, timeout: float) -> None:
    """Connect to the scheduler at ``address`` once, shake hands and hang up.

    Raises
    ------
    SessionLostError
        At once when the connection is refused or fails (e.g. TLS not accepted), or after
        ``timeout`` seconds without an answer.
    DefinitionTypeError
        A ``tls://`` address without TLS settings (``security=``, or ``distributed.comm.tls``
        in the Dask configuration).
    """
    scheme, _ = parse_address(address, strict=False)
    if security is None:
        security = Security()
    if not isinstance(security, Security) or scheme not in _HOST_PORT_SCHEMES:
        return  # security=True (temporary credentials) or in-process addresses: the client decides
    arguments = security.get_connection_args("client")
    if scheme in _SECURE_SCHEMES and arguments.get("ssl_context") is None:
        raise DefinitionTypeError(
            f"the scheduler at {address} speaks TLS, and no TLS settings were given: pass "
            "security=distributed.Security(tls_ca_file=..., tls_client_cert=..., tls_client_key=..., "
            "require_encryption=True) (or set distributed.comm.tls in the Dask configuration)"
        )
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            asyncio.run(_handshake(address, arguments, timeout))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=attempt, name=f"daskjobs-reach-{address}", daemon=True)
    thread.start()
    thread.join(timeout + 1)
    error = outcome[0] if outcome else TimeoutError()
    if error is None:
        return
    if isinstance(error, TimeoutError):
        raise SessionLostError(
            f"cannot connect to the Dask scheduler at {address}: no answer within {timeout:g} s "
            "(daskjobs.connect-timeout). Check that the scheduler runs at that address."
        ) from None
    if isinstance(error, OSError):
        hint = (
            "pass security= with certificates it accepts"
            if scheme in _SECURE_SCHEMES
            else "if it is a TLS scheduler, use its tls:// address with security="
        )
        raise SessionLostError(
            f"cannot connect to the Dask scheduler at {address}: {_reason(error)}. "
            f"Check that the scheduler runs at that address; {hint}."
        ) from None
    raise error


async def _handshake(address: str, arguments: dict[str, Any], timeout: float) -> None:
    scheme, location = parse_address(address, strict=False)
    connector = registry.get_backend(scheme).get_connector()
    comm = await asyncio.wait_for(connector.connect(location, deserialize=False, **arguments), timeout)
    try:
        # Completing Dask's handshake lets the scheduler see an ordinary connection that ends,
        # not one "closed before the handshake" (which it would log).
        await asyncio.wait_for(comm.write(comm.handshake_info()), timeout)
        await asyncio.wait_for(comm.read(), timeout)
    finally:
        await comm.close()


def _reason(error: BaseException) -> str:
    """What went wrong, from the innermost error Dask and tornado wrapped (e.g. "connection refused")."""
    inner: BaseException = error
    seen = {id(inner)}
    while True:
        following = getattr(inner, "real_error", None) or inner.__cause__
        if following is None or id(following) in seen:
            break
        inner, seen = following, seen | {id(following)}
    if isinstance(inner, ConnectionRefusedError):
        return "the connection was refused (nothing listens on that port)"
    text = f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__
    if "closed" in text.lower() and inner is error:
        return f"the scheduler closed the connection during the handshake ({text})"
    return text
