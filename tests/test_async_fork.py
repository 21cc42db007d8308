"""Asynchronous saves through copy-on-write fork snapshots (``async_snapshot="fork"``).

The checkpoint of an epoch holds the workspace as it was at the snapshot instant, bit for bit,
although the arrays are replaced and changed in place right after it (while the forked child
still writes); runs with real worker processes resume from exactly the expected state; the copy
path keeps working; forking where it is unsafe is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import daskjobs as dj
from daskjobs._execution.node_run import NodeState
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._node.async_saves import AsyncSaveFinish, BackgroundSave
from daskjobs.checkpoint._node.fork import FORK_FROM, ForkedSave, in_snapshot_writer, snapshot_writers
from daskjobs.checkpoint._node.slots import checkpoint_slots
from daskjobs.errors import JobDefinitionError

NUMERIC = ["?", "i1", "u1", "<i2", ">i4", "<i8", "<u8", "<f2", ">f4", "<f8", "<c8", ">c16"]
STRINGS = ["<U1", "<U7", ">U3", "S1", "S5"]


def stored_bytes(value: np.ndarray) -> bytes:
    """The bytes a checkpoint holds for ``value`` (little-endian, C order)."""
    dtype = value.dtype if value.dtype.kind == "S" else value.dtype.newbyteorder("<")
    return np.ascontiguousarray(value.astype(dtype)).tobytes()


def stored_dtype(value: np.ndarray) -> str:
    return value.dtype.str if value.dtype.kind == "S" else value.dtype.newbyteorder("<").str


def expected_of(blobs: dict) -> dict:
    """What the checkpoint must hold: ``(dtype, shape, bytes)`` of arrays, JSON text of values."""
    return {
        name: (stored_dtype(value), value.shape, stored_bytes(value))
        if isinstance(value, np.ndarray)
        else json.dumps(value)
        for name, value in blobs.items()
    }


def disturb(blobs: dict) -> None:
    """Change every array in place (every bit flipped) and replace every value, as a next epoch might."""
    for name, value in list(blobs.items()):
        if isinstance(value, np.ndarray):
            if value.nbytes:
                raw = value.reshape(-1).view(np.uint8) if value.flags.c_contiguous else None
                if raw is not None:
                    np.invert(raw, out=raw)
            blobs[name] = np.zeros(3)
        elif isinstance(value, list):
            value.append("changed")
            blobs[name] = "replaced"
        elif isinstance(value, dict):
            value["changed"] = True
            blobs[name] = None


def snapshot_and_disturb(
    store: CheckpointStore, blobs: dict, epoch: int = 0, mode: str = "fork", previous: dict | None = None
) -> dict:
    """Start an asynchronous save of ``blobs`` as node ``a``'s workspace, disturb them, return the entry."""
    state = NodeState("a")
    state.scope.blobs = blobs
    outcome = AsyncSaveFinish(store, "a", epoch, f"s{epoch}", None, previous, mode)(state)
    assert outcome.error is None
    saver = checkpoint_slots(state).saver
    assert isinstance(saver, ForkedSave if mode == "fork" else BackgroundSave)
    disturb(blobs)
    return saver.result()


def assert_holds(store: CheckpointStore, epoch: int, entry: dict, want: dict) -> None:
    got = store.read_node("a", epoch, entry)
    assert expected_of(got) == want


CASES = {
    "numeric": {f"x{i}": np.arange(24).astype(dtype).reshape(2, 3, 4) for i, dtype in enumerate(NUMERIC)},
    "strings": {
        "u": np.array(["a", "bc", "déf"], dtype="<U3"),
        "ub": np.array(["xyz", ""], dtype=">U3"),
        "s": np.array([b"ab", b"\x00c"], dtype="S2"),
    },
    "zero-d-and-empty": {"scalar": np.array(3.5), "empty": np.zeros((0, 4)), "bool0": np.array(True)},
    "json": {"cfg": {"lr": 0.1, "layers": [1, 2, {"deep": None}]}, "names": ["a", "b"], "text": "hello"},
    "nan-and-inf": {"f": np.array([np.nan, np.inf, -np.inf, -0.0]), "c": np.array([complex(np.nan, 1)])},
    "many-blobs": {f"blob_{i:03d}": np.full(i % 7, i, dtype="<i4") for i in range(200)},
    "big": {"w": np.random.default_rng(1).standard_normal(1 << 20), "m": np.ones((512, 512), dtype="f4")},
    "non-contiguous": {"t": np.arange(64.0).reshape(8, 8).T, "step": np.arange(20)[::3]},
}


@pytest.mark.parametrize("mode", ["fork", "copy"])
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_holds_the_snapshot_instant(tmp_path, case, mode):
    """Replaced and in-place-changed arrays after the snapshot: the checkpoint holds the old values exactly."""
    blobs = {
        name: value.copy() if isinstance(value, np.ndarray) else json.loads(json.dumps(value))
        for name, value in CASES[case].items()
    }
    want = expected_of(blobs)
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    entry = snapshot_and_disturb(store, blobs, mode=mode)
    assert_holds(store, 0, entry, want)


arrays = st.sampled_from(NUMERIC + STRINGS).flatmap(
    lambda dtype: hnp.arrays(np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
workspaces = st.dictionaries(
    st.text("abcdefghij_-0123456789", min_size=1, max_size=10).filter(lambda n: not n.startswith("__")),
    arrays | json_values.filter(lambda v: isinstance(v, list | dict | str)),
    max_size=10,
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blobs=workspaces)
def test_random_workspaces_round_trip_through_fork_snapshots(tmp_path_factory, blobs):
    want = expected_of(blobs)
    store = CheckpointStore(tmp_path_factory.mktemp("ckpt"), fsync=False)
    entry = snapshot_and_disturb(store, blobs)
    assert_holds(store, 0, entry, want)


def test_delta_save_from_a_fork_snapshot_reuses_unchanged_chunks(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    frozen = np.arange(1 << 16, dtype="f8")
    first = snapshot_and_disturb(store, {"frozen": frozen.copy(), "w": np.zeros(8)}, epoch=0)
    second = snapshot_and_disturb(store, {"frozen": frozen.copy(), "w": np.ones(8)}, epoch=1, previous=first)
    assert first["bytes_reused"] == 0
    assert second["bytes_reused"] >= frozen.nbytes
    assert_holds(store, 1, second, expected_of({"frozen": frozen, "w": np.ones(8)}))


def define_job(size: int) -> dj.Job:
    """Node a changes ``w`` in place every epoch; node b replaces ``h``; both mirror the epoch in JSON."""
    with dj.Cluster(), dj.Job(name="fork-snapshots") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.update(w=np.zeros(size), log=[]))

            def in_place(ws):
                ws["w"] += 1.0
                ws["w"][ws.epoch % size] = -ws.epoch
                ws["log"].append(ws.epoch)
                ws["log"] = ws["log"]

            dj.Task(in_place)
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.update(h=np.zeros((4, 4), dtype="i8")))
            dj.Task(lambda ws: ws.__setitem__("h", ws["h"] + ws.epoch))
    return job


def state_by_simulation(epoch: int, size: int) -> dict[str, dict]:
    """The same workspaces computed by running the steps' arithmetic plainly."""
    w = np.zeros(size)
    h = np.zeros((4, 4), dtype="i8")
    for e in range(1, epoch + 1):
        w += 1.0
        w[e % size] = -e
        h = h + e
    return {"a": {"w": w, "log": list(range(1, epoch + 1))}, "b": {"h": h}}


@pytest.mark.parametrize("mode", ["fork", "copy"])
def test_runner_resumes_the_exact_state_of_each_epoch(session, tmp_path, mode):
    """Every committed epoch holds that epoch's state; a resumed run ends where a straight one would."""
    size = 1 << 17
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True, async_snapshot=mode)
    assert manager.async_snapshot == mode
    assert dj.JobRunner(define_job(size), manager, max_epochs=4, progress=False).train(session) == 4
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]
    for epoch in range(1, 5):
        view = dj.open_checkpoint(prefix, epoch)
        want = state_by_simulation(epoch, size)
        assert np.array_equal(view["a"]["w"], want["a"]["w"]), epoch
        assert view["a"]["log"] == want["a"]["log"]
        assert np.array_equal(view["b"]["h"], want["b"]["h"])
    resumed = dj.JobRunner(
        define_job(size),
        dj.MultiNodeCheckpointManager(prefix, async_save=True, async_snapshot=mode),
        max_epochs=6,
        progress=False,
    )
    assert resumed.train(session) == 6
    assert [r.epoch for r in resumed.history] == [5, 6]
    want = state_by_simulation(6, size)
    assert np.array_equal(session.fetch("w", "a"), want["a"]["w"])
    assert np.array_equal(session.fetch("h", "b"), want["b"]["h"])
    wait_for(lambda: not snapshot_writers())  # every writer reaped soon after it reported


def test_auto_forks_on_local_disks_and_copies_elsewhere(tmp_path):
    assert dj.MultiNodeCheckpointManager(str(tmp_path), async_save=True).async_snapshot == "auto"
    assert dj.MultiNodeCheckpointManager(f"file://{tmp_path}", async_save=True).async_snapshot == "auto"
    assert dj.MultiNodeCheckpointManager("memory://auto-copy", async_save=True).async_snapshot == "copy"


@pytest.mark.parametrize(("nbytes", "saver"), [(FORK_FROM, ForkedSave), (FORK_FROM - 8, BackgroundSave)])
def test_auto_forks_for_big_workspaces_only(tmp_path, nbytes, saver):
    """A fork costs a few milliseconds: "auto" copies a workspace smaller than FORK_FROM."""
    state = NodeState("a")
    state.scope.blobs = {"w": np.ones(nbytes // 8), "cfg": {"lr": 1}}
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    assert AsyncSaveFinish(store, "a", 0, "s0", None, None, "auto")(state).error is None
    assert isinstance(checkpoint_slots(state).saver, saver)
    state.scope.blobs["w"] += 1
    assert np.array_equal(store.read_node("a", 0, checkpoint_slots(state).saver.result())["w"], np.ones(nbytes // 8))


@pytest.mark.parametrize("manager", [dj.MultiNodeCheckpointManager, dj.CheckpointManager])
def test_fork_where_unsafe_is_a_value_error(manager):
    args = ("memory://no-fork",) if manager is dj.MultiNodeCheckpointManager else ("memory://no-fork", "a")
    with pytest.raises(ValueError, match=r"async_snapshot='fork' is not possible: memory://no-fork is not on a local"):
        manager(*args, async_save=True, async_snapshot="fork")
    with pytest.raises(
        JobDefinitionError, match=r"async_snapshot must be one of \['auto', 'fork', 'copy'\], not 'cow'"
    ):
        manager(*args, async_save=True, async_snapshot="cow")


def test_memory_store_keeps_the_copy_path(session):
    prefix = "memory://fork-test-copy-path"
    manager = dj.MultiNodeCheckpointManager(prefix, async_save=True)
    if session.__class__.__name__ != "LocalSession":
        pytest.skip("memory:// is per process: only an in-process session can read it back")
    assert dj.JobRunner(define_job(64), manager, max_epochs=3, progress=False).train(session) == 3
    view = dj.open_checkpoint(prefix, 3)
    assert np.array_equal(view["a"]["w"], state_by_simulation(3, 64)["a"]["w"])


class SleepyStore(CheckpointStore):
    """A local store whose writes from a snapshot process first wait ``delay`` seconds (a slow disk)."""

    delay = 30.0

    def write_node(self, node, epoch, blobs, *, save_id, **kwargs):
        if in_snapshot_writer():
            time.sleep(self.delay)
        return super().write_node(node, epoch, blobs, save_id=save_id, **kwargs)


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_child_keeps_no_inherited_descriptor_and_ignores_sigint(tmp_path):
    """Only 0-2 and the pipe stay open in the child (a parent's socket is closed); SIGINT does not stop it."""
    listener = socket.create_server(("127.0.0.1", 0))
    store = SleepyStore(tmp_path / "ckpt", fsync=False)
    store.delay = 1.0
    try:
        saver = ForkedSave(store, "a", 0, "s0", {"w": np.arange(4.0)})
        assert snapshot_writers() == {saver.pid: ("a", 0)}
        wait_for(lambda: len(os.listdir(f"/proc/{saver.pid}/fd")) == 4)
        os.kill(saver.pid, 2)  # SIGINT: a graceful stop waits for the save
        entry = saver.result()
    finally:
        listener.close()
    assert (entry["node"], entry["epoch"]) == ("a", 0)
    assert np.array_equal(store.read_node("a", 0, entry)["w"], np.arange(4.0))
    wait_for(lambda: not snapshot_writers())  # every writer reaped soon after it reported


def test_sigterm_sent_right_after_the_fork_is_ignored_and_the_save_completes(tmp_path):
    """A SIGTERM reaching a writer (``scancel`` and systemd signal every process of the job) is a
    graceful stop, which waits for the save: the child ignores it, also when it arrives before the
    child dropped the parent's handler (here one that would end the child with status 99)."""
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    previous = signal.signal(signal.SIGTERM, lambda *_: os._exit(99))
    delivered = 0
    try:
        for attempt in range(10):
            saver = ForkedSave(store, "a", attempt, f"s{attempt}", {"w": np.arange(4.0) + attempt})
            with contextlib.suppress(ProcessLookupError):  # a writer may finish and be reaped first
                os.kill(saver.pid, signal.SIGTERM)
                delivered += 1
            entry = saver.result()
            assert np.array_equal(store.read_node("a", attempt, entry)["w"], np.arange(4.0) + attempt)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert delivered > 0
    wait_for(lambda: not snapshot_writers())
