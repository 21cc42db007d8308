"""The temporary folders of ``node_cluster`` (``daskjobs-cluster-*``): a run whose driver was SIGKILLed
leaves its folder behind, and the next run removes it; folders whose owner still runs, that name no
owner, or another host's, are never touched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import daskjobs as dj
from daskjobs.session._scratch import FOLDER_PREFIX, OWNER_FILE, remove_orphans

pytestmark = pytest.mark.timeout(120)


def owned_folder(root: Path, name: str, owner: dict | None) -> Path:
    folder = root / f"{FOLDER_PREFIX}{name}"
    (folder / "dask-scratch-space").mkdir(parents=True)
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_only_folders_of_owners_that_are_gone_are_removed(tmp_path):
    me = psutil.Process(os.getpid())
    host = socket.gethostname()
    dead = gone_pid()
    orphan = owned_folder(tmp_path, "orphan", {"pid": dead, "started": time.time() - 60, "host": host})
    reused = owned_folder(tmp_path, "reused", {"pid": os.getpid(), "started": me.create_time() - 3600, "host": host})
    alive = owned_folder(tmp_path, "alive", {"pid": os.getpid(), "started": me.create_time(), "host": host})
    unowned = owned_folder(tmp_path, "unowned", None)
    elsewhere = owned_folder(tmp_path, "elsewhere", {"pid": dead, "started": 1.0, "host": f"not-{host}"})
    garbage = owned_folder(tmp_path, "garbage", None)
    (garbage / OWNER_FILE).write_text("{not json")
    other = tmp_path / "daskjobs-check-1234"
    other.mkdir()
    assert sorted(remove_orphans(str(tmp_path))) == sorted([str(orphan), str(reused)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (alive, unowned, elsewhere, garbage, other)
    )


JOB = textwrap.dedent(
    """
    import time

    import numpy as np

    import daskjobs as dj


    def step(ws):
        time.sleep(0.3)
        ws["n"] = ws["n"] + 1


    with dj.Cluster(), dj.Job(name="slow") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(n=np.int64(0)))
        dj.Task(step)
    """
)


@pytest.mark.cluster
@pytest.mark.slow
def test_the_next_run_removes_the_folder_of_a_killed_run(tmp_path):
    """``daskjobs run`` (a local cluster) SIGKILLed with its process group after its first commit: its
    ``daskjobs-cluster-*`` folder stays; the next ``daskjobs run`` removes it, and its own at its end."""
    (tmp_path / "job.py").write_text(JOB)
    temp = tmp_path / "tmp"
    temp.mkdir()
    root = str(Path(dj.__file__).resolve().parents[1])
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "daskjobs", "run", "job.py:job", "--checkpoint", "ck"]
    killed = subprocess.Popen(
        [*argv, "--max-epochs", "1000"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (tmp_path / "ck" / "__daskjobs__" / "commits" / f"epoch-{1:012d}.json").exists():
        assert killed.poll() is None
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (left,) = temp.glob(f"{FOLDER_PREFIX}*")
    assert json.loads((left / OWNER_FILE).read_text())["pid"] == killed.pid
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    time.sleep(0.5)
    assert left.exists()
    result = subprocess.run(
        [*argv, "--max-epochs", "3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stderr
    assert not left.exists()
    assert list(temp.glob(f"{FOLDER_PREFIX}*")) == []
