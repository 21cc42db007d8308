"""The writer lock of a checkpoint prefix: one writer per prefix, stale locks taken over atomically.

The lock is the file ``__daskjobs__/lock.json`` holding the holder record (host, pid, job,
start time) and a random token. It is created with an exclusive create (``O_EXCL`` on local
disks, a PUT with ``If-None-Match: *`` on S3), so two writers never both get it.

A lock whose holder provably no longer runs (it names this host and a pid that no running
process has) is *stale*. A lock naming another host, or a pid no process can have (``0``, a
negative or non-integer pid, one above ``pid_max``), is *foreign*: it was not written by a run of
this host, so nothing says its holder is gone, and it is refused like a lock of another host
(``break_lock`` takes it). Taking a stale lock over must be atomic too: the taker first claims
``lock.json.break-<token>`` (named after the stale lock's token) with an exclusive create, so of
several processes racing to break the same stale lock exactly one gets the claim; it re-reads
the lock, replaces it only if it is still the stale one, and drops the claim. The others are
refused with :class:`~daskjobs.errors.CheckpointLockedError`.

The holder re-reads the lock before each commit (:func:`check`): if the lock file vanished (the
prefix was deleted) or holds another token, the run stops instead of writing on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from ...errors import CheckpointCorruptError, CheckpointLockedError, CheckpointWriteError
from .._format.entries import dumps, loads

if TYPE_CHECKING:
    from .._storage.base import Files
    from .store import CheckpointStore

logger = logging.getLogger("daskjobs")

LOCK_NAME = "lock.json"
"""File name of the lock inside ``__daskjobs__/``."""
_CLAIM_SUFFIX = ".break-"
_CLAIM_RE = re.compile(re.escape(LOCK_NAME + _CLAIM_SUFFIX) + r"[0-9a-f]{32}")
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
_LOCK_LIMIT = 64 << 10
_ATTEMPTS = 3


def local_holder(job: str) -> dict[str, Any]:
    """The lock holder record of this process running ``job``.

    Examples
    --------
    >>> sorted(local_holder("train"))
    ['host', 'job', 'pid', 'started']
    """
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": job,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@functools.cache
def _pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as file:
            return int(file.read(32))
    except (OSError, ValueError):
        return 2**22


def possible_pid(pid: object) -> TypeGuard[int]:
    """Whether ``pid`` could be the pid of a process of this host: an int from 1 to the system's
    ``pid_max`` (not a bool, float or string).

    Examples
    --------
    >>> [possible_pid(p) for p in (1, 0, -1, 2**64, "12", 12.0, True, None)]
    [True, False, False, False, False, False, False, False]
    """
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _pid_max()


def holder_alive(holder: Mapping[str, Any]) -> bool | None:
    """Whether the process named by a lock holder record still runs.

    ``True``: it runs on this host. ``False``: it provably does not — the record names this host
    and a pid that no running process has. ``None``: unknown — a foreign lock (another host, or a
    pid no process can have: not an int from 1 to the system's ``pid_max``, such as ``0``, ``-1``,
    ``2**40``, ``"abc"`` or none at all, so no run of this host wrote it) or an unreadable record.
    Never raises.

    Examples
    --------
    >>> holder_alive(local_holder("train"))
    True
    >>> holder_alive({"host": socket.gethostname(), "pid": -1}) is None
    True
    >>> holder_alive({"host": "elsewhere", "pid": 1}) is None
    True
    """
    if not isinstance(holder.get("host"), str) or holder["host"] != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not possible_pid(pid):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except OSError:
        return None
    return True


def describe(holder: Mapping[str, Any]) -> str:
    """A short human description of a lock holder record."""
    fields = [f"{key} {holder[key]}" for key in ("host", "pid", "job", "started") if key in holder]
    if "unreadable" in holder:
        fields.append(f"unreadable: {holder['unreadable']}")
    return ", ".join(fields) or "no holder named"


def _read(files: Files, path: str) -> bytes | None:
    """The lock file's bytes, or ``None`` if there is none."""
    data = files.read_small([path], _LOCK_LIMIT)[0]  # never blocks on a FIFO, never follows a symlink
    if isinstance(data, FileNotFoundError):
        return None
    if isinstance(data, OSError):  # stands for the lock file in comparisons and messages
        return dumps({"unreadable": f"cannot read the lock file: {data}"})
    return data


def parse(data: bytes) -> dict[str, Any]:
    """The holder record in a lock file's bytes; ``{"unreadable": reason}`` for anything damaged."""
    try:
        holder = loads(data, "lock file")
    except CheckpointCorruptError as exc:
        return {"unreadable": str(exc)}
    return holder if isinstance(holder, dict) else {"unreadable": f"lock file holds {type(holder).__name__}"}


def _identity(data: bytes) -> str:
    """The token of a lock file, or (damaged file) a digest of its bytes: names its break claim."""
    token = parse(data).get("token")
    if isinstance(token, str) and _TOKEN_RE.fullmatch(token):
        return token
    return hashlib.sha256(data).hexdigest()[:32]


def refused(url: str, holder: Mapping[str, Any]) -> CheckpointLockedError:
    """The error refusing a writer of ``url`` because ``holder`` holds its lock, with what to do."""
    alive = holder_alive(holder)
    if alive:
        advice = "stop it first (if that pid is no daskjobs run, `daskjobs checkpoints unlock --force`)"
    else:
        advice = (
            f"if it is gone, run `daskjobs checkpoints unlock --force {url}` or pass JobRunner(..., break_lock=True)"
        )
    state = {True: "still running on this host", None: "not known to be gone"}.get(alive, "gone")
    if alive is None and holder.get("host") == socket.gethostname() and "unreadable" not in holder:
        named = f"pid {holder['pid']!r} cannot be a process of this host" if "pid" in holder else "it names no pid"
        state = f"{named}: no run here wrote this lock"
    return CheckpointLockedError(
        f"checkpoint prefix {url} is locked by another writer ({describe(holder)}; {state}); {advice}"
    )


def acquire(files: Files, path: str, url: str, holder: Mapping[str, Any], *, break_lock: bool = False) -> str:
    """Create the lock at ``path`` for ``holder``, taking over a stale one; return the new token.

    Parameters
    ----------
    files
        The prefix's file backend.
    path
        The lock file's path on ``files``.
    url
        The prefix, for messages.
    holder
        Who is writing (see :func:`local_holder`).
    break_lock
        Also take over a lock whose holder is not known to be gone (another host, a damaged
        lock file). A holder that runs on this host is never broken: that could be a racer
        that just took the lock over.

    Raises
    ------
    CheckpointLockedError
        The lock is held by a holder that runs on this host, or may run elsewhere (without
        ``break_lock``), or another process is taking over the same stale lock right now.
    CheckpointWriteError
        The lock could not be written.
    """
    token = uuid.uuid4().hex
    data = dumps({**holder, "token": token})
    for _ in range(_ATTEMPTS):
        try:  # made durable in the background: exclusion needs no fsync, and a run's first commit comes later
            files.create(path, data, sync_soon=True)
            return token
        except FileExistsError:  # s3fs reports a failed If-None-Match precondition as this too
            pass
        except OSError as exc:
            raise CheckpointWriteError(f"could not lock checkpoint prefix {url}: {exc}") from exc
        current = _read(files, path)
        if current is None:  # released meanwhile: try to create it again
            continue
        held = parse(current)
        alive = holder_alive(held)
        if alive or (alive is None and not break_lock):
            raise refused(url, held)
        _take_over(files, path, url, current, data)
        return token
    raise CheckpointLockedError(f"checkpoint prefix {url}: the lock kept changing hands; try again")


def _take_over(files: Files, path: str, url: str, stale: bytes, data: bytes) -> None:
    """Replace the lock file holding ``stale`` by ``data``, or raise if someone else gets there first."""
    claim = f"{path}{_CLAIM_SUFFIX}{_identity(stale)}"
    held = parse(stale)
    try:
        files.create(claim, data)
    except FileExistsError:
        raise CheckpointLockedError(
            f"another process is taking over the stale lock of {url} ({describe(held)}) right now; if none "
            f"is, run `daskjobs checkpoints unlock --force {url}`"
        ) from None
    except OSError as exc:
        raise CheckpointWriteError(f"could not lock checkpoint prefix {url}: {exc}") from exc
    try:
        current = _read(files, path)
        if current != stale:
            raise refused(url, parse(current) if current is not None else {"unreadable": "taken meanwhile"})
        logger.warning("taking over the checkpoint lock of %s from %s", url, describe(held))
        files.remove(path)
        try:
            files.create(path, data)
        except FileExistsError:
            raise refused(url, parse(_read(files, path) or b"{}")) from None
    except CheckpointLockedError:
        raise
    except OSError as exc:
        raise CheckpointWriteError(f"could not lock checkpoint prefix {url}: {exc}") from exc
    finally:
        files.remove(claim)


def check(files: Files, path: str, url: str, token: str) -> None:
    """Raise :class:`CheckpointLockedError` unless the lock at ``path`` still holds ``token`` (one small read)."""
    current = _read(files, path)
    if current is None:
        raise CheckpointLockedError(
            f"the writer lock of {url} vanished (the lock or the whole prefix was deleted); stopping "
            "instead of writing on"
        )
    held = parse(current)
    if held.get("token") != token:
        raise CheckpointLockedError(
            f"the writer lock of {url} changed hands (now {describe(held)}); stopping instead of writing on"
        )


def release(files: Files, path: str, url: str, token: str | None) -> None:
    """Remove the lock holding ``token``; ``token=None`` removes any lock. A lock of another token is left alone."""
    current = _read(files, path)
    if current is None:
        return
    if token is not None and parse(current).get("token") != token:
        logger.warning("not releasing the checkpoint lock of %s: it is now held by %s", url, describe(parse(current)))
        return
    # Not made durable: a lock that a power loss brings back names a process that no longer runs
    # (stale, taken over by the next run), like the lock of a run the power loss itself ended.
    files.remove(path, sync_folder=False)


def read(files: Files, path: str) -> dict[str, Any] | None:
    """The holder record at ``path``, ``None`` if unlocked, ``{"unreadable": reason}`` if damaged."""
    current = _read(files, path)
    return None if current is None else parse(current)


def unlock(store: CheckpointStore, *, force: bool = False) -> dict[str, Any] | None:
    """Remove the writer lock of ``store``'s prefix (``daskjobs checkpoints unlock``); return the holder removed.

    Refuses while the holder may still run — it runs on this host, or its liveness is unknown
    (another host, a damaged lock file) — unless ``force``. ``force`` also removes claims left
    by a process that died while taking over a stale lock.

    Raises
    ------
    CheckpointLockedError
        The holder is not provably gone and ``force`` is false; the message names it.

    Examples
    --------
    >>> import tempfile
    >>> from daskjobs.checkpoint import CheckpointStore
    >>> store = CheckpointStore(tempfile.mkdtemp())
    >>> store.acquire_lock({"host": socket.gethostname(), "pid": -1, "job": "j"})
    >>> unlock(store, force=True)["job"]
    'j'
    """
    held = store.read_lock()
    if held is not None and not force and holder_alive(held) is not False:
        alive = holder_alive(held)
        reason = (
            "still runs"
            if alive
            else "may still run (another host, a pid no process here can have, or an unreadable lock file)"
        )
        raise CheckpointLockedError(
            f"not unlocking {store.url}: its holder ({describe(held)}) {reason}; pass --force "
            "(force=True) if you are sure it is gone"
        )
    files, folder = store._files(), store._own_path()
    if force:
        for name, is_dir in files.listdir(folder).items():
            if not is_dir and _CLAIM_RE.fullmatch(name):
                files.remove(f"{folder}/{name}")
    if held is not None:
        files.remove(f"{folder}/{LOCK_NAME}")
        logger.info("removed the checkpoint lock of %s held by %s", store.url, describe(held))
    return held
