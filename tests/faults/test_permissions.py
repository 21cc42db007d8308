"""Fault catalogue, permissions: nothing daskjobs creates is group- or world-writable, whatever the umask.

Class P1: umask ``0`` and ``0o077``, for every way daskjobs creates files and folders (missing parents
of a prefix, node groups raw and compressed, sync and async saves, commit records, the lock,
writability probes, retention and cleanup, the copy uploader): files at most ``0o644 & ~umask``, folders at most
``0o755 & ~umask``. Run in a subprocess so the test process's umask never changes.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

SCRIPT = r"""
import os, sys
import numpy as np
import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.lock import local_holder

os.umask(int(sys.argv[2], 8))
root = sys.argv[1]
with dj.Cluster(), dj.Job(name="perm") as job, dj.Node("trainer_0"):
    with job.init_group:
        dj.Task(lambda ws: ws.update(n=0, w=np.zeros((5, 3), "f4")), name="init")
    dj.Task(lambda ws: ws.update(n=ws["n"] + 1, w=ws["w"] + 1), name="step")
for name, options in {
    "raw": {},
    "zstd": {"compression": "zstd"},
    "async": {"async_save": True, "keep_last": 1},
}.items():
    prefix = os.path.join(root, "missing", "parents", name, "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, **options)
    upload = dj.CopyCheckpointUploader(os.path.join(root, "upload", name)) if name == "raw" else None
    runner = dj.JobRunner(job, manager, upload_task_group_builder=upload, max_epochs=3, progress=False)
    assert runner.train() == 3
store = CheckpointStore(os.path.join(root, "lockonly", "ckpt"))
store.check_writable()
store.acquire_lock(local_holder("perm"))
"""


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077], ids=["umask-000", "umask-022", "umask-077"])
@pytest.mark.slow
def test_created_files_and_folders_are_never_group_or_world_writable(tmp_path, umask):
    """P1: walk everything created under a fresh root; no mode exceeds 0o644/0o755 less the umask."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", SCRIPT, str(root), f"{umask:o}"], check=True, env=env, timeout=100)
    checked = {"file": 0, "dir": 0}
    for folder, dirs, files in os.walk(root):
        for name, kind, limit in [*((d, "dir", 0o755) for d in dirs), *((f, "file", 0o644) for f in files)]:
            mode = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
            assert mode & ~(limit & ~umask) == 0, f"{os.path.join(folder, name)}: {mode:o} (umask {umask:o})"
            checked[kind] += 1
    assert checked["dir"] > 10, checked
    assert checked["file"] > 10, checked
    assert (root / "lockonly" / "ckpt" / "__daskjobs__" / "lock.json").is_file()
    assert (root / "upload" / "raw" / "trainer_0.3" / "zarr.json").is_file()
