"""Property: save then restore of a random workspace gives back exactly the input, with and without delta.

Workspaces mix every stored kind (bool, ints, floats incl. NaN and infinities, complex, fixed-width
``U``/``S`` strings, 0-d and empty arrays, JSON values with big ints) and many blobs; chunks are
tiny so arrays span several chunk files. Each is saved, then saved again as a delta of a partly
changed copy, and read back through ``read_node`` and ``open_checkpoint`` (eager and lazy).
"""

from __future__ import annotations

import json
import tempfile
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.checkpoint._format.records import make_commit_record

NUMERIC = ["?", "i1", "u1", "<i2", ">i4", "<i8", "<u2", ">u4", "<u8", "<f2", ">f4", "<f8", "<c8", ">c16"]
STRINGS = ["<U1", "<U7", ">U3", "S1", "S5"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
arrays = st.sampled_from(NUMERIC + STRINGS).flatmap(
    lambda dtype: hnp.arrays(np.dtype(dtype), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
)
blob_names = st.text("abcdefghij_.-:0123456789", min_size=1, max_size=12).filter(
    lambda n: not n.startswith("__") and ".." not in n and n not in (".", "zarr.json")
)
workspaces = st.dictionaries(
    blob_names, arrays | json_values.filter(lambda v: not isinstance(v, bool | int | float)), min_size=0, max_size=12
)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            stored = value.dtype if value.dtype.kind == "S" else value.dtype.newbyteorder("<")
            assert got[name].dtype == stored, name
            assert got[name].shape == value.shape, name
            assert np.array_equal(got[name], value, equal_nan=value.dtype.kind in "fc"), name
        else:
            assert json.dumps(got[name]) == json.dumps(value), name


def changed(value: object) -> object:
    if isinstance(value, np.ndarray):
        little = value.dtype.newbyteorder("<") if value.dtype.kind != "S" else value.dtype
        out = np.array(value, dtype=little, copy=True, order="C")  # flipping the low byte keeps code points valid
        if out.size:
            out.reshape(-1).view(np.uint8)[0] ^= 1  # a different value of the same dtype
        return out
    return [value]


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workspace=workspaces, compressed=st.booleans())
def test_save_restore_equals_input(workspace, compressed):
    with tempfile.TemporaryDirectory() as root, mock.patch.object(_chunks, "CHUNK_BYTES", 16):
        store = CheckpointStore(f"{root}/ckpt", compression="zstd" if compressed else None, fsync=False)
        first = store.write_node("n", 0, workspace, save_id="e0")
        store.commit(make_commit_record("prop", 0, {"n": first}, {}, {}))
        assert_same(store.read_node("n", 0, first), workspace)
        second_values = {name: changed(value) if i % 2 else value for i, (name, value) in enumerate(workspace.items())}
        second = store.write_node("n", 1, second_values, save_id="e1", previous=first)
        store.commit(make_commit_record("prop", 1, {"n": second}, {}, {}))
        assert second["bytes_written"] + second["bytes_reused"] == second["bytes"]
        store.delete_epoch(0, ["n"])
        view = dj.open_checkpoint(store.url, 1)
        assert_same(dict(view["n"]), second_values)
        for name, value in second_values.items():
            if isinstance(value, np.ndarray):
                lazy = view["n"].lazy(name).compute(scheduler="sync")
                assert np.array_equal(lazy, value, equal_nan=value.dtype.kind in "fc"), name
        assert view.verify() == second["bytes"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workspace=workspaces, async_save=st.booleans(), delta=st.booleans())
def test_manager_round_trip_on_a_local_session(workspace, async_save, delta):
    """The manager's save and load groups (sync or async, delta or not) restore what was fed."""
    with tempfile.TemporaryDirectory() as root, dj.Cluster(), dj.LocalSession() as session:
        manager = dj.MultiNodeCheckpointManager(f"{root}/ckpt", async_save=async_save, delta=delta, fsync=False)
        manager.init(["local"])
        for epoch in (0, 1):
            for name, value in workspace.items():
                session.feed(name, changed(value) if epoch else value, "local")
            session.run(manager.save(epoch))
            manager.write_checkpoint_metadata(epoch)
            manager.flush(session)
        with dj.LocalSession() as fresh:
            fresh.run(manager.load(1))
            got = {name: fresh.fetch(name, "local") for name in workspace}
        assert_same(got, {name: changed(value) for name, value in workspace.items()})
