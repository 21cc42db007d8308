"""The temporary folders of ``node_cluster`` (its workers' files), and those a killed run left behind.

A folder ``daskjobs-cluster-*`` under the temporary directory is removed when its cluster object
goes; a driver that is SIGKILLed (or loses its machine) never gets there. So each folder holds an
owner file naming the process that made it (its pid and start time, and the host), and every new
folder's maker first removes the folders whose owner is gone. A folder without that file, another
host's or another user's, or one whose owner still runs, is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import psutil

logger = logging.getLogger("daskjobs")

FOLDER_PREFIX = "daskjobs-cluster-"
"""What the name of every ``node_cluster`` folder under the temporary directory starts with."""
OWNER_FILE = "daskjobs-owner.json"
"""The file in such a folder naming the process that made it."""
_OWNER_BYTES = 4096


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or ``None`` when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def make_cluster_folder() -> str:
    """A new folder for a ``node_cluster``'s worker files, owned by this process; first removes the
    folders of earlier runs whose owner is gone (see :func:`remove_orphans`)."""
    remove_orphans()
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    owner = {"pid": os.getpid(), "started": _started(os.getpid()), "host": socket.gethostname()}
    Path(folder, OWNER_FILE).write_text(json.dumps(owner))
    return folder


def remove_orphans(root: str | None = None) -> list[str]:
    """Remove the ``node_cluster`` folders under ``root`` (default: the temporary directory) whose
    owner process is gone; return them. Failures are logged, never raised."""
    removed: list[str] = []
    base = Path(tempfile.gettempdir() if root is None else root)
    try:
        candidates = sorted(base.glob(f"{FOLDER_PREFIX}*"))
    except OSError:
        return removed
    for folder in candidates:
        if not _orphaned(folder):
            continue
        try:
            shutil.rmtree(folder)
        except OSError as exc:
            logger.debug("could not remove the leftover cluster folder %s: %s", folder, exc)
            continue
        logger.info("removed %s, the cluster folder of a run that is gone", folder)
        removed.append(str(folder))
    return removed


def _orphaned(folder: Path) -> bool:
    """Whether ``folder`` is a real folder of this user whose owner file names a process of this host
    that no longer runs (none with that pid, or one started at another time: the pid was reused)."""
    try:
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        owner_file = folder / OWNER_FILE
        if not stat.S_ISREG(owner_file.lstat().st_mode):
            return False
        with owner_file.open("rb") as handle:
            owner = json.loads(handle.read(_OWNER_BYTES))
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or pid <= 0 or not isinstance(started, int | float):
        return False
    now = _started(pid)
    return now is None or abs(now - started) > 1.0
