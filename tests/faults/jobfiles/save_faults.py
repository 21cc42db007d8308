"""The job of the save fault catalogue (``tests/faults/test_worker_save_faults.py``): nodes ``a`` and
``b`` each grow ``w`` every epoch; a step of node ``a`` arms one fault in its worker process, once a
run (and its resumes), before the save of the victim epoch.

Knobs come from the environment of the driver (the module's top level runs there only; the steps
carry the values), so that ``daskjobs run save_faults.py:job`` and a test's own driver run it alike:

``SAVE_FAULT``         a point of a save (:data:`POINTS`) or an injected error (:data:`ERRORS`); unset: none
``SAVE_FAULT_ACTION``  at a point, once it left the file ``at-point`` in ``SAVE_FAULT_FLAGS``: ``kill``
                       (SIGKILL the worker) or ``pause`` (wait there for the file ``go``: the test kills
                       the driver meanwhile)
``SAVE_FAULT_EPOCH``   the epoch whose save by node ``a`` the fault strikes
``SAVE_FAULT_PREFIX``  the checkpoint prefix
``SAVE_FAULT_FLAGS``   a folder: ``armed`` once the fault is armed, ``at-point`` once a paused worker is
                       there, ``go`` when it may go on

A fault strikes node ``a``'s first attempt at the victim group, known by its staging folder
(``a.<epoch>.tmp-<32 hex>``): a retry writes a new staging folder and is left alone.
"""

import errno
import os
import re
import signal
import time

import numpy as np

import daskjobs as dj

FAULT = os.environ.get("SAVE_FAULT", "")
ACTION = os.environ.get("SAVE_FAULT_ACTION", "kill")
EPOCH = int(os.environ.get("SAVE_FAULT_EPOCH", "5"))
PREFIX = os.environ.get("SAVE_FAULT_PREFIX", "")
FLAGS = os.environ.get("SAVE_FAULT_FLAGS", "")
PAUSE_SECONDS = 60
"""Longest a paused worker waits for ``go`` (or for its end, with its driver's)."""


def start(ws):
    ws["w"] = np.arange(6.0)


def grow(ws):
    ws["w"] = ws["w"] * 1.5 + 1


def expected(epoch):
    """``w`` after ``epoch`` epochs."""
    w = np.arange(6.0)
    for _ in range(epoch):
        w = w * 1.5 + 1
    return w


_PATCHED = []
"""``(owner, name, original)`` of what the armed fault replaced in this worker process."""


def _patch(owner, name, replacement):
    _PATCHED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, replacement)


class FirstAttempt:
    """Whether a path is in the staging folder of node ``a``'s first attempt at the victim group; the
    first path of a later attempt (a retry) puts back what the fault replaced."""

    def __init__(self):
        self.pattern = re.compile(rf"{re.escape(PREFIX)}/a\.{EPOCH}\.tmp-[0-9a-f]{{32}}(?=/|$)")
        self.folder = None

    def __call__(self, path):
        match = self.pattern.match(path)
        if match is None:
            return False
        if self.folder is None:
            self.folder = match.group(0)
        if match.group(0) != self.folder:
            while _PATCHED:
                owner, name, original = _PATCHED.pop()
                setattr(owner, name, original)
            return False
        return True

    def holds_manifest(self, path):
        """The group's manifest: ``zarr.json`` of the staging folder, or the one written beside it."""
        return self(path) and os.path.dirname(path) == self.folder and os.path.basename(path).startswith("zarr.json")


def strike(path):
    """What a point does (``SAVE_FAULT_ACTION``), the first time it is reached, at ``path`` (written to
    ``at-point``)."""
    try:
        flag = open(f"{FLAGS}/at-point", "x")  # noqa: SIM115 (closed below)
    except FileExistsError:
        return
    with flag:
        flag.write(path)
    if ACTION == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + PAUSE_SECONDS
    while not os.path.exists(f"{FLAGS}/go") and time.monotonic() < deadline:
        time.sleep(0.01)


def _writes(before=None, after=None):
    """Call ``before(path)`` / ``after(path)`` around each file this worker writes."""
    from daskjobs.checkpoint._storage import files

    real = files.write_file

    def write_file(path, parts, **kwargs):
        if before is not None:
            before(path)
        written = real(path, parts, **kwargs)
        if after is not None:
            after(path)
        return written

    _patch(files, "write_file", write_file)


def _publishes(before=None, after=None):
    """Call ``before(staged)`` / ``after(staged)`` around each staging folder put in place."""
    from daskjobs.checkpoint._storage import durable

    real = durable.Staged.publish

    def publish(staged):
        if before is not None:
            before(staged)
        folders = real(staged)
        if after is not None:
            after(staged)
        return folders

    _patch(durable.Staged, "publish", publish)


def during_take_over_writes():
    first = FirstAttempt()
    _writes(before=lambda path: first(path) and strike(path))


def after_the_manifest():
    first = FirstAttempt()
    _writes(after=lambda path: first.holds_manifest(path) and strike(path))


def before_the_staged_rename():
    first = FirstAttempt()
    _publishes(before=lambda staged: first(staged.folder) and strike(staged.folder))


def after_the_staged_rename():
    first = FirstAttempt()
    _publishes(after=lambda staged: first(staged.folder) and strike(staged.folder))


def during_the_batched_sync():
    """At the second fsync of the group's files: the first is done."""
    from daskjobs.checkpoint._storage import durable

    first, real, seen = FirstAttempt(), durable.fsync_path, []

    def fsync_path(path):
        if first(path):
            seen.append(path)
            if len(seen) == 2:
                strike(path)
        real(path)

    _patch(durable, "fsync_path", fsync_path)


POINTS = {
    "during-take-over-writes": during_take_over_writes,
    "after-the-manifest": after_the_manifest,
    "before-the-staged-rename": before_the_staged_rename,
    "after-the-staged-rename": after_the_staged_rename,
    "during-the-batched-sync": during_the_batched_sync,
}
"""Moments of node ``a``'s save of the victim epoch (written over its retired group, flushed in the
background) where :func:`strike` strikes."""


def write_enospc():
    """The first file of the attempt finds the disk full."""
    first, fired = FirstAttempt(), []

    def full(path):
        if first(path) and not fired:
            fired.append(path)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    _writes(before=full)


def sync_eio():
    """Every sync of the attempt's files fails (the batch's, and the syncer's retry of its request)."""
    from daskjobs.checkpoint._storage import durable, files

    first, real = FirstAttempt(), durable.sync_paths

    def sync_paths(paths, many=False):
        if any(first(path) for path in paths):
            raise OSError(errno.EIO, "Input/output error (injected)", paths[0])
        real(paths, many=many)

    _patch(durable, "sync_paths", sync_paths)
    _patch(files, "sync_paths", sync_paths)


def sync_eio_stuck():
    """:func:`sync_eio`, and removing the attempt's files fails too: the worker cannot clean up."""
    from daskjobs.checkpoint._storage import cleanup

    sync_eio()
    first, real = FirstAttempt(), cleanup.Tree.unlink

    def unlink(tree, paths):
        if any(first(path) for path in paths):
            raise OSError(errno.EIO, "Input/output error (injected)", paths[0])
        real(tree, paths)

    _patch(cleanup.Tree, "unlink", unlink)


def rename_eio():
    """Renaming the attempt's staging folder into place fails."""
    first = FirstAttempt()

    def failing(staged):
        if first(staged.folder):
            raise OSError(errno.EIO, "Input/output error (injected)", staged.target)

    _publishes(before=failing)


ERRORS = {
    "write-enospc": write_enospc,
    "sync-eio": sync_eio,
    "sync-eio-stuck": sync_eio_stuck,
    "rename-eio": rename_eio,
}
"""Errors injected into node ``a``'s save of the victim epoch, once."""


def arm(ws):
    """Before node ``a``'s save of the victim epoch, once a run and its resumes (an epoch run again
    after a kill must not be struck again)."""
    if ws.epoch != EPOCH or not FAULT:
        return
    try:
        os.close(os.open(f"{FLAGS}/armed", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    {**POINTS, **ERRORS}[FAULT]()


def job():
    with dj.Cluster(), dj.Job(name="save-faults") as made:
        for node in ("a", "b"):
            with dj.Node(node):
                with made.init_group:
                    dj.Task(start, name="start")
                dj.Task(grow, name="grow")
        with dj.Node("a"):
            dj.Task(arm, name="arm")
    return made
