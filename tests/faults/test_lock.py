"""Fault catalogue, writer lock: racing processes, foreign lock files, a lock lost mid-run, unlock.

Classes (SPEC §3 "One writer per prefix"):

* L1 races: N processes race for the same stale lock, locally and on S3 (moto), several rounds
  and kinds of stale lock: exactly one wins, every other gets ``CheckpointLockedError``.
* L2 foreign lock files: each kind of lock file has one exact outcome, never another exception.
* L3 lock lost before a commit: ``CheckpointLockedError``, nothing more committed, nothing changed.
  A writer holding no lock (the manager's own API outside ``train()``) commits and deletes only
  while no other writer may hold the prefix.
* L4 unlock: refused for a holder that may run, ``force`` works.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
from processes import dead_pid

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.lock import holder_alive, local_holder, unlock
from daskjobs.errors import CheckpointLockedError

HOST = socket.gethostname()
RACERS = 5

RACER = r"""
import json, sys, time
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.lock import local_holder
from daskjobs.errors import CheckpointLockedError

url, options = sys.argv[1], json.loads(sys.argv[2])
CheckpointStore(url, options).read_lock()  # warm up connections and imports
print("ready", flush=True)
for line in sys.stdin:
    start, break_lock = line.split()
    store = CheckpointStore(url, options)
    time.sleep(max(0.0, float(start) - time.time()))
    try:
        store.acquire_lock(local_holder("race"), break_lock=break_lock == "1")
        print("won", store._lock_token, flush=True)
    except CheckpointLockedError:
        print("lost CheckpointLockedError", flush=True)
    except BaseException as exc:
        print("error", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
"""


def lock_bytes(holder: dict | None = None, raw: bytes | None = None) -> bytes:
    """A lock file as another writer would have left it."""
    if raw is not None:
        return raw
    return json.dumps({**holder, "token": uuid.uuid4().hex}).encode()


def put_lock(store: CheckpointStore, data: bytes) -> None:
    path = store.fs._strip_protocol(f"{store.url}/__daskjobs__/lock.json")
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def get_lock(store: CheckpointStore) -> bytes | None:
    path = store.fs._strip_protocol(f"{store.url}/__daskjobs__/lock.json")
    store.fs.invalidate_cache()
    return store.fs.cat_file(path) if store.fs.exists(path) else None


# -- L1: races between processes ------------------------------------------------------------------
STALE_KINDS = {
    "dead-pid": (lambda: lock_bytes({"host": HOST, "pid": dead_pid(), "job": "old"}), "0"),
    "impossible-pid-broken": (lambda: lock_bytes({"host": HOST, "pid": -1, "job": "old"}), "1"),
    "other-host-broken": (lambda: lock_bytes({"host": "elsewhere", "pid": 7, "job": "old"}), "1"),
    "garbage-broken": (lambda: lock_bytes(raw=b"\x00{not json"), "1"),
}


def race(url: str, options: dict, rounds: int = 2) -> None:
    store = CheckpointStore(url, options)
    store.check_writable()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, url, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(RACERS)
    ]
    try:
        assert [r.stdout.readline().strip() for r in racers] == ["ready"] * RACERS
        for kind, (make, break_lock) in list(STALE_KINDS.items()) * rounds:
            put_lock(store, make())
            start = time.time() + 0.3
            for racer in racers:
                racer.stdin.write(f"{start} {break_lock}\n")
                racer.stdin.flush()
            results = [r.stdout.readline().split() for r in racers]
            winners = [r[1] for r in results if r[0] == "won"]
            assert len(winners) == 1, (kind, results)
            assert sorted(r[0] for r in results) == ["lost"] * (RACERS - 1) + ["won"], (kind, results)
            assert all(r[1] == "CheckpointLockedError" for r in results if r[0] == "lost"), (kind, results)
            assert store.read_lock()["token"] == winners[0], kind
            own = store._files().listdir(store.fs._strip_protocol(f"{store.url}/__daskjobs__"))
            assert [n for n in own if "break" in n] == [], (kind, own)  # no claim left behind
            store.release_lock()
    finally:
        for racer in racers:
            racer.stdin.close()
        for racer in racers:
            try:
                racer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                racer.kill()
                racer.wait()
            racer.stdout.close()


@pytest.mark.slow
def test_racing_processes_for_a_stale_lock_exactly_one_wins_locally(tmp_path):
    """L1 local: 5 processes, 8 rounds (4 kinds of stale lock, each twice)."""
    race(str(tmp_path / "ckpt"), {})


@pytest.mark.slow
def test_racing_processes_for_a_stale_lock_exactly_one_wins_on_s3(s3_prefix):
    """L1 S3 (moto): the claim and the new lock are conditional PUTs (If-None-Match: *)."""
    race(*s3_prefix, rounds=1)


# -- L2: every kind of lock file has one exact outcome ---------------------------------------------
def make_job(name: str = "lockjob"):
    with dj.Cluster(), dj.Job(name=name) as job, dj.Node("trainer_0"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", 0))
        dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


TAKEN_OVER = {
    "dead-pid": lambda: {"host": HOST, "pid": dead_pid(), "job": "old"},
}
"""Locks naming a pid no process can have are foreign: see tests/test_lock_foreign_pid.py."""
REFUSED = {
    "other-host": (lambda: lock_bytes({"host": "elsewhere", "pid": 4242, "job": "old"}), r"host elsewhere, pid 4242"),
    "other-host-impossible-pid": (lambda: lock_bytes({"host": "elsewhere", "pid": -1, "job": "old"}), "elsewhere"),
    "host-not-a-string": (lambda: lock_bytes({"host": ["x"], "pid": 1}), "not known to be gone"),
    "live-pid-here": (lambda: lock_bytes({"host": HOST, "pid": os.getpid(), "job": "old"}), "still running"),
    "impossible-pid-here": (
        lambda: lock_bytes({"host": HOST, "pid": -1, "job": "old"}),
        "pid -1 cannot be a process of this host: no run here wrote this lock",
    ),
    "garbage": (lambda: b"\x00{not json", "unreadable"),
    "empty": (lambda: b"", "unreadable"),
    "json-list": (lambda: b"[1, 2]", "unreadable: lock file holds list"),
}


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_file_that_is_no_regular_file_is_refused_without_blocking(prefix, tmp_path, kind):
    """L2: a FIFO or symlink in place of lock.json: refused at once as unreadable; break_lock replaces it."""
    store = CheckpointStore(prefix)
    store.check_writable()
    path = os.path.join(prefix, "__daskjobs__", "lock.json")
    target = tmp_path / "elsewhere.json"
    target.write_bytes(lock_bytes({"host": HOST, "pid": -1}))
    os.mkfifo(path) if kind == "fifo" else os.symlink(target, path)
    with pytest.raises(CheckpointLockedError, match="unreadable: cannot read the lock file"):
        store.acquire_lock(local_holder("x"))
    store.acquire_lock(local_holder("x"), break_lock=True)
    assert store.read_lock()["pid"] == os.getpid()
    assert target.read_bytes().startswith(b"{")  # the symlink's target is untouched


@pytest.mark.parametrize("kind", sorted(TAKEN_OVER))
def test_a_lock_whose_holder_provably_is_gone_is_taken_over_with_a_warning(prefix, kind, caplog):
    """L2: this host and a pid no running process has: taken over by train(), warned."""
    holder = TAKEN_OVER[kind]()
    assert holder_alive(holder) is False
    store = CheckpointStore(prefix)
    put_lock(store, lock_bytes(holder))
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
        assert runner.train() == 2
    assert "taking over the checkpoint lock" in caplog.text
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [0, 1, 2]
    assert store.read_lock() is None


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_a_lock_whose_holder_may_run_is_refused_naming_it(prefix, kind):
    """L2: another host, a live pid, or a damaged lock file: refused, nothing written; break_lock takes it."""
    make, message = REFUSED[kind]
    data = make()
    store = CheckpointStore(prefix)
    put_lock(store, data)
    before = sorted(os.listdir(prefix))
    with pytest.raises(CheckpointLockedError, match=message):
        dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train()
    assert get_lock(store) == data
    assert sorted(os.listdir(prefix)) == before
    assert dj.list_checkpoints(prefix) == []
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    runner.break_lock = True
    if kind == "live-pid-here":  # never broken, even with break_lock: it may be a racer that just won
        with pytest.raises(CheckpointLockedError, match="still running on this host"):
            runner.train()
        assert get_lock(store) == data
        return
    assert runner.train() == 2
    assert store.read_lock() is None


def test_holder_alive_never_raises():
    """L2: holder_alive answers True/False/None for anything a lock file may hold."""
    weird = [{}, {"host": HOST, "pid": 2**64}, {"host": HOST, "pid": -(2**70)}, {"host": None, "pid": 1}]
    weird += [{"host": HOST, "pid": p} for p in (None, [], {}, "1", 1e300, float("nan"))]
    for holder in weird:
        assert holder_alive(holder) in (True, False, None)
    assert holder_alive(local_holder("x")) is True


# -- L3: the lock lost before a commit --------------------------------------------------------------
def snapshot(prefix: str) -> dict[str, bytes]:
    """Every committed file's bytes: commit records and the files of committed groups."""
    files = {}
    for info in dj.list_checkpoints(prefix):
        for node in info.nodes:
            root = os.path.join(prefix, f"{node}.{info.epoch}")
            for folder, _, names in os.walk(root):
                for name in names:
                    with open(os.path.join(folder, name), "rb") as file:
                        files[os.path.relpath(os.path.join(folder, name), prefix)] = file.read()
        path = os.path.join(prefix, "__daskjobs__", "commits", f"epoch-{info.epoch:012d}.json")
        with open(path, "rb") as file:
            files[os.path.relpath(path, prefix)] = file.read()
    return files


def _delete_lock(prefix: str) -> bytes | None:
    os.unlink(os.path.join(prefix, "__daskjobs__", "lock.json"))


def _replace_lock(prefix: str) -> bytes | None:
    data = lock_bytes({"host": "elsewhere", "pid": 99, "job": "intruder"})
    with open(os.path.join(prefix, "__daskjobs__", "lock.json"), "wb") as file:
        file.write(data)
    return data


def _delete_prefix(prefix: str) -> bytes | None:
    os.rename(prefix, f"{prefix}.gone")  # atomic, even while a background save writes into it
    shutil.rmtree(f"{prefix}.gone", ignore_errors=True)


LOSSES = {"lock-deleted": _delete_lock, "lock-replaced": _replace_lock, "prefix-deleted": _delete_prefix}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_losing_the_lock_mid_run_stops_before_the_next_commit(prefix, loss, async_save):
    """L3: a step of epoch 3 deletes or rewrites the lock (or the prefix): the run stops with
    CheckpointLockedError, nothing after that moment is committed, committed files are unchanged."""
    seen: dict = {}

    def tamper(ws):
        if ws.epoch == 3 and not seen:
            seen["epochs"] = [i.epoch for i in dj.list_checkpoints(prefix)]
            seen["files"] = snapshot(prefix)
            seen["lock"] = LOSSES[loss](prefix)

    job = make_job()
    with job, dj.Node("trainer_0"):
        dj.Task(tamper, name="tamper")
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1, async_save=async_save)
    with pytest.raises(CheckpointLockedError, match=r"vanished|changed hands"):
        dj.JobRunner(job, manager, max_epochs=6, progress=False).train()
    if loss == "prefix-deleted":
        assert not os.path.exists(prefix)  # no save, retry or clean-up brought it back
        return
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == seen["epochs"]
    assert snapshot(prefix) == seen["files"]
    assert get_lock(CheckpointStore(prefix)) == seen["lock"]  # another holder's lock is left alone


def test_commit_checks_the_lock_only_when_holding_one(tmp_path):
    """L3: a store holding no lock commits as before; check_lock on it says it holds none."""
    store = CheckpointStore(tmp_path / "ckpt")
    with pytest.raises(CheckpointLockedError, match="does not hold"):
        store.check_lock()
    store.acquire_lock(local_holder("x"))
    store.check_lock()
    CheckpointStore(store.url).release_lock()
    with pytest.raises(CheckpointLockedError, match="vanished"):
        store.check_lock()


@pytest.mark.parametrize("kind", [*sorted(k for k in REFUSED if "unreadable" not in REFUSED[k][1]), "dead-pid"])
def test_a_writer_without_the_lock_commits_only_while_nobody_may_hold_it(session, prefix, kind):
    """L3: manager.save + write_checkpoint_metadata (no lock taken) while another writer may hold
    the prefix: CheckpointLockedError naming it, nothing committed or deleted; a provably stale
    lock does not stop it (a damaged lock file is left to the write: only taking the lock refuses it)."""
    stale = kind in TAKEN_OVER
    data = lock_bytes(TAKEN_OVER[kind]()) if stale else REFUSED[kind][0]()
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix, keep_last=1), max_epochs=1, progress=False)
    assert runner.train(session) == 1
    store = CheckpointStore(prefix)
    put_lock(store, data)
    manager = dj.MultiNodeCheckpointManager(prefix, keep_last=1)
    manager.set_params(["trainer_0"], job_name="lockjob")
    session.run(manager.init(["trainer_0"]))
    session.run(manager.save(2))
    if stale:
        manager.write_checkpoint_metadata(2)
        assert [i.epoch for i in dj.list_checkpoints(prefix)] == [2]
        return
    with pytest.raises(CheckpointLockedError, match=REFUSED[kind][1]):
        manager.write_checkpoint_metadata(2)
    assert [i.epoch for i in dj.list_checkpoints(prefix)] == [1]
    assert get_lock(store) == data


# -- L4: unlock -------------------------------------------------------------------------------------
UNLOCK = {
    "live-here": ({"host": HOST, "pid": os.getpid(), "job": "j"}, "still runs"),
    "other-host": ({"host": "elsewhere", "pid": 1, "job": "j"}, "may still run"),
    "unreadable": (None, "may still run"),
    "impossible-pid-here": ({"host": HOST, "pid": -1, "job": "j"}, "may still run"),
    "dead-here": ({"host": HOST, "pid": "dead", "job": "j"}, None),
}


@pytest.mark.parametrize("kind", sorted(UNLOCK))
def test_unlock_refuses_a_holder_that_may_run_unless_forced(tmp_path, kind):
    """L4: unlock(store) refuses a live or unknown holder naming it; force=True removes it."""
    holder, refusal = UNLOCK[kind]
    if holder and holder["pid"] == "dead":
        holder = {**holder, "pid": dead_pid()}
    store = CheckpointStore(tmp_path / "ckpt")
    data = lock_bytes(holder) if holder else b"{broken"
    put_lock(store, data)
    if refusal is not None:
        with pytest.raises(CheckpointLockedError, match=f"{refusal}.*--force"):
            unlock(store)
        assert get_lock(store) == data
        assert unlock(store, force=True) is not None
    else:
        assert unlock(store)["pid"] == holder["pid"]
    assert store.read_lock() is None
    assert unlock(store) is None


def test_unlock_force_removes_a_claim_left_by_a_crashed_taker(tmp_path):
    """L4: a claim left by a process killed mid-takeover blocks takers until unlock --force."""
    store = CheckpointStore(tmp_path / "ckpt")
    token = uuid.uuid4().hex
    put_lock(store, json.dumps({"host": HOST, "pid": dead_pid(), "token": token}).encode())
    claim = tmp_path / "ckpt" / "__daskjobs__" / f"lock.json.break-{token}"
    claim.write_bytes(b"{}")
    with pytest.raises(CheckpointLockedError, match="taking over the stale lock"):
        CheckpointStore(store.url).acquire_lock(local_holder("x"))
    unlock(store, force=True)
    assert not claim.exists()
    CheckpointStore(store.url).acquire_lock(local_holder("x"))


def test_cli_unlock_needs_force_for_a_holder_that_may_run(tmp_path, capsys):
    """L4 through the command line entry point: exit 1 naming --force, then 0 with --force."""
    from daskjobs.cli import main

    store = CheckpointStore(tmp_path / "ckpt")
    put_lock(store, lock_bytes({"host": "elsewhere", "pid": 1, "job": "j"}))
    assert main(["checkpoints", "unlock", store.url]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["checkpoints", "unlock", "--force", store.url]) == 0
    assert store.read_lock() is None
