"""A writer lock naming this host and a pid that no process can have is foreign (SPEC §3): no run
of this host wrote it, so nothing says its holder is gone. It is refused with
``CheckpointLockedError`` naming the holder — never taken over as stale, never another exception
(such as ``OverflowError`` from ``os.kill``) — on a local disk, ``memory://`` and S3 (moto);
``unlock`` needs ``--force``; ``break_lock=True`` takes it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.lock import _pid_max, describe, holder_alive, unlock
from daskjobs.errors import CheckpointLockedError

HOST = socket.gethostname()
MISSING = object()

PIDS = {
    "0": 0,
    "-1": -1,
    "pid_max+1": _pid_max() + 1,
    "2**31": 2**31,
    "2**64": 2**64,
    "-(2**70)": -(2**70),
    "10**100": 10**100,
    "str-digits": "123",
    "str-abc": "abc",
    "float-whole": 12.0,
    "float-1e300": 1e300,
    "true": True,
    "null": None,
    "list": [1],
    "missing": MISSING,
}


@pytest.fixture(params=["local", "memory", "s3"])
def where(request, tmp_path) -> tuple[str, dict]:
    """``(prefix, storage_options)`` on a local disk, in ``memory://`` or on S3 (moto)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    if request.param == "memory":
        return f"memory://foreign-{uuid.uuid4().hex[:12]}/ckpt", {}
    return request.getfixturevalue("s3_prefix")


def holder(pid: object) -> dict:
    record = {"host": HOST, "job": "old", "started": "2024-01-01T00:00:00+0000", "token": uuid.uuid4().hex}
    if pid is not MISSING:
        record["pid"] = pid
    return record


def lock_path(store: CheckpointStore) -> str:
    return store.fs._strip_protocol(f"{store.url}/__daskjobs__/lock.json")


def put_lock(store: CheckpointStore, data: bytes) -> None:
    store.fs.makedirs(lock_path(store).rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(lock_path(store), data)


def get_lock(store: CheckpointStore) -> bytes:
    store.fs.invalidate_cache()
    return store.fs.cat_file(lock_path(store))


def make_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="foreign") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", 0))
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


def expected_message(url: str, record: dict) -> str:
    named = f"pid {record['pid']!r} cannot be a process of this host" if "pid" in record else "it names no pid"
    return (
        f"checkpoint prefix {url} is locked by another writer ({describe(record)}; {named}: no run here wrote "
        f"this lock); if it is gone, run `daskjobs checkpoints unlock --force {url}` or pass "
        "JobRunner(..., break_lock=True)"
    )


@pytest.mark.parametrize("pid", sorted(PIDS))
def test_a_lock_naming_an_impossible_pid_is_refused_naming_its_holder(where, pid):
    """train() is refused with the exact message; the lock, and everything else, stay as they
    were; unlock without force refuses; break_lock=True takes the lock over and the job runs."""
    url, options = where
    record = holder(PIDS[pid])
    assert holder_alive(record) is None
    data = json.dumps(record).encode()
    store = CheckpointStore(url, options)
    put_lock(store, data)
    manager = dj.MultiNodeCheckpointManager(url, storage_options=options)
    with pytest.raises(CheckpointLockedError) as caught:
        dj.JobRunner(make_job(), manager, max_epochs=2, progress=False).train()
    assert str(caught.value) == expected_message(manager.store.url, record)
    assert get_lock(store) == data
    assert dj.list_checkpoints(url, storage_options=options) == []
    with pytest.raises(CheckpointLockedError, match="pass --force"):
        unlock(CheckpointStore(url, options))
    assert get_lock(store) == data
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(url, storage_options=options), max_epochs=2)
    runner.break_lock = True
    runner.progress = False
    assert runner.train() == 2
    assert [i.epoch for i in dj.list_checkpoints(url, storage_options=options)] == [0, 1, 2]
    assert CheckpointStore(url, options).read_lock() is None


JOB = textwrap.dedent(
    """
    import daskjobs as dj


    def count(ws):
        ws["n"] = ws.get("n", 0) + 1


    with dj.Cluster(), dj.Job(name="foreign") as job, dj.Node("a"):
        dj.Task(count)
    """
)


RUN = [sys.executable, "-m", "daskjobs", "run", "job.py:job", "--local", "--max-epochs", "2"]


@pytest.mark.parametrize("pid", ["0", "2**64", "str-abc"])
@pytest.mark.slow
def test_daskjobs_run_on_a_prefix_with_a_foreign_lock_exits_1_naming_it(tmp_path, pid):
    """``daskjobs run --checkpoint`` on a prefix whose lock names an impossible pid: exit 1, one
    line naming the holder, the lock untouched, nothing committed."""
    (tmp_path / "job.py").write_text(JOB)
    prefix = tmp_path / "ckpt"
    record = holder(PIDS[pid])
    store = CheckpointStore(str(prefix))
    put_lock(store, json.dumps(record).encode())
    before = get_lock(store)
    root = str(Path(dj.__file__).resolve().parents[1])
    result = subprocess.run(
        [*RUN, "--checkpoint", str(prefix), "--no-progress"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    hint = " (run with -v for the traceback)"
    assert result.stderr == f"daskjobs run: error: {expected_message(str(prefix), record)}{hint}\n"
    assert get_lock(store) == before
    assert dj.list_checkpoints(str(prefix)) == []
