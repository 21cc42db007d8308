"""Workspaces: value rules, scalar handling and child scopes (pure, no session)."""

from __future__ import annotations

import datetime
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import daskjobs as dj
from daskjobs._model.workspace import Scope, Workspace
from daskjobs.errors import BlobTypeError


def make_ws(node: str = "local") -> Workspace:
    return Workspace(Scope(), node=node, lock=threading.RLock())


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (3, np.dtype(np.int64)),
        (2.5, np.dtype(np.float64)),
        (True, np.dtype(np.bool_)),
        (1 + 2j, np.dtype(np.complex128)),
        (np.float32(1.5), np.dtype(np.float32)),
        (np.uint8(7), np.dtype(np.uint8)),
        (np.bool_(False), np.dtype(np.bool_)),
    ],
)
def test_scalar_becomes_0d_array(value, dtype):
    """Assigning a scalar stores a 0-d array of the scalar's dtype."""
    ws = make_ws()
    ws["x"] = value
    stored = ws["x"]
    assert isinstance(stored, np.ndarray)
    assert stored.shape == ()
    assert stored.dtype == dtype
    assert stored.item() == value


def test_lists_become_json_lists():
    """Assigning a nested list or tuple stores a normalised JSON list, not an array."""
    ws = make_ws()
    ws["m"] = [[1, 2], (3, np.int64(4))]
    assert ws["m"] == [[1, 2], [3, 4]]
    assert type(ws["m"][1]) is list
    assert type(ws["m"][1][1]) is int


@pytest.mark.parametrize(
    "value",
    [
        np.array([1, "a"], dtype=object),
        np.array([{}], dtype=object),
        b"bytes",
        np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        np.datetime64("2024-01-01"),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.timedelta64(5, "s"),
        np.zeros(3, dtype="V4"),
        datetime.date(2024, 1, 1),
        [1, datetime.date(2024, 1, 1)],
    ],
    ids=[
        "object",
        "object-dict",
        "bytes",
        "structured",
        "datetime",
        "datetime-array",
        "timedelta",
        "void",
        "date",
        "list-with-date",
    ],
)
def test_disallowed_values_raise_type_error_naming_blob(value):
    """Object, structured, datetime and void values raise TypeError naming the blob, storing nothing."""
    ws = make_ws()
    with pytest.raises(TypeError, match="'bad_blob'") as info:
        ws["bad_blob"] = value
    assert isinstance(info.value, BlobTypeError)
    assert isinstance(info.value, dj.errors.DaskJobsError)
    assert "bad_blob" not in ws
    assert len(ws) == 0


def test_bad_dtype_does_not_replace_existing_value():
    """A rejected assignment leaves the existing blob unchanged."""
    ws = make_ws()
    ws["x"] = 1
    with pytest.raises(TypeError):
        ws["x"] = {1, 2}
    assert ws["x"] == 1


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "__x", "a b", "zarr.json", ".zattrs"])
def test_bad_blob_name_on_assignment(bad):
    """Assigning to an invalid blob name raises ValueError naming it."""
    ws = make_ws()
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        ws[bad] = 1
    assert len(ws) == 0


def test_mapping_protocol():
    """A workspace behaves as a mutable mapping of names to arrays."""
    ws = make_ws("trainer_0")
    ws["a"] = 1
    ws["b"] = np.arange(3)
    assert sorted(ws) == ["a", "b"]
    assert len(ws) == 2
    assert "a" in ws
    assert 3 not in ws
    del ws["a"]
    assert list(ws) == ["b"]
    with pytest.raises(KeyError, match=r"'a'.*'trainer_0'"):
        ws["a"]
    with pytest.raises(KeyError, match="'a'"):
        del ws["a"]
    assert ws.get("missing") is None
    assert repr(ws) == "Workspace(node='trainer_0', epoch=None, blobs=['b'])"


def test_setdefault_returns_the_stored_value():
    """setdefault returns the normalised value it stored (what ws[name] then gives), or the existing one."""
    ws = make_ws()
    stored = ws.setdefault("n", 5)
    assert isinstance(stored, np.ndarray)
    assert (stored.shape, stored.dtype, int(stored)) == ((), np.dtype(np.int64), 5)
    assert stored is ws["n"]
    assert ws.setdefault("n", 7) is stored
    assert ws.setdefault("files", ("a", "b")) == ["a", "b"]
    assert ws.setdefault("nothing") is None
    assert "nothing" in ws
    with pytest.raises(BlobTypeError, match="'bad'"):
        ws.setdefault("bad", {1, 2})
    assert "bad" not in ws


def test_workspace_attributes():
    """A workspace carries its node, epoch, instance id and lock, and children inherit them."""
    lock = threading.RLock()
    ws = Workspace(Scope(), node="ps", lock=lock, epoch=4)
    assert (ws.node, ws.epoch, ws.instance_id, ws.lock) == ("ps", 4, 0, lock)
    child = ws.child(instance_id=2)
    assert (child.node, child.epoch, child.instance_id, child.lock) == ("ps", 4, 2, lock)
    assert child.child().instance_id == 2


def test_child_reads_through_to_ancestors():
    """A child sees its parent's and grandparent's blobs, nearest first."""
    root = make_ws()
    root["x"] = 1
    root["y"] = 2
    mid = root.child()
    mid._scope.blobs["y"] = np.array(20)
    leaf = mid.child()
    assert leaf["x"] == 1
    assert leaf["y"] == 20
    assert sorted(leaf) == ["x", "y"]
    assert leaf.own_blobs() == {}


def test_child_writes_through_for_existing_names():
    """Assigning a name that exists in an ancestor replaces it in that ancestor."""
    root = make_ws()
    root["x"] = 1
    leaf = root.child().child()
    leaf["x"] = 5
    assert root["x"] == 5
    assert leaf.own_blobs() == {}
    assert list(root.own_blobs()) == ["x"]


def test_child_new_names_stay_in_child():
    """A new name assigned in a child is visible there but not in its parent, and vanishes with it."""
    root = make_ws()
    child = root.child()
    child["new"] = 3
    assert child["new"] == 3
    assert "new" not in root
    assert list(child.own_blobs()) == ["new"]
    sibling = root.child()
    assert "new" not in sibling


def test_child_delete_removes_from_owner():
    """Deleting an inherited name through a child removes it from the ancestor holding it."""
    root = make_ws()
    root["x"] = 1
    child = root.child()
    del child["x"]
    assert "x" not in root


def test_reserved_names_are_created_at_reserving_level():
    """A new name reserved by a scope is created in that scope even when assigned from a descendant."""
    root = make_ws()
    group = root.child()
    group._scope.reserved = frozenset({"out"})
    task = group.child()
    task["out"] = 7
    task["tmp"] = 1
    assert group.own_blobs().keys() == {"out"}
    assert task.own_blobs().keys() == {"tmp"}
    assert "out" not in root


ALLOWED_DTYPES = st.one_of(
    hnp.boolean_dtypes(),
    hnp.integer_dtypes(endianness="?"),
    hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?"),
    hnp.complex_number_dtypes(endianness="?"),
)


@settings(max_examples=150, deadline=None)
@given(value=hnp.arrays(ALLOWED_DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
def test_allowed_arrays_round_trip(value):
    """Any bool or numeric array of any shape reads back with the same values and shape, in native byte order."""
    native = value.astype(value.dtype.newbyteorder("="))
    ws = make_ws()
    ws["blob"] = value
    got = ws["blob"]
    assert got.dtype == native.dtype
    assert got.dtype.isnative
    assert got.shape == value.shape
    assert got.tobytes() == native.tobytes()
    if value.dtype.isnative:
        assert got is value  # stored as given, not copied
    child = ws.child()
    child["blob"] = value
    assert ws["blob"].tobytes() == native.tobytes()
