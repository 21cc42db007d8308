"""Fault catalogue: every value kind of SPEC §1.2, accepted (round trip, exact types) or refused.

Accepted kinds read back equal, with the same types, from the workspace, through
``session.feed``/``fetch`` and as task outputs. Refused kinds raise ``BlobTypeError`` (a
``TypeError``) naming the blob at assignment, from a step (as ``TaskFailedError`` with that
cause) and from ``session.feed``, storing nothing; in a checkpointed job nothing committed changes.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import enum
import os
import threading
import warnings

import numpy as np
import pandas as pd
import pytest

import daskjobs as dj
from daskjobs._model.workspace import Scope, Workspace
from daskjobs.errors import BlobTypeError, TaskFailedError


class Color(enum.IntEnum):
    """An int subclass: would come back as a plain int."""

    RED = 1


class Custom:
    """A user object: not storable."""


Point = collections.namedtuple("Point", "x y")


def _cyclic() -> list:
    value: list = [1]
    value.append(value)
    return value


def _deep(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def _matrix() -> np.matrix:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.matrix([[1, 2]])


def _bit_generator_state() -> dict:
    return np.random.default_rng(12345).bit_generator.state


ACCEPTED = {
    # id: (assigned value, what reads back)
    "int": (3, np.array(3, dtype=np.int64)),
    "negative-int": (-(2**63), np.array(-(2**63), dtype=np.int64)),
    "big-int": (2**100, 2**100),
    "uint64-range-int": (2**63, 2**63),
    "bool": (True, np.array(True)),
    "float": (2.5, np.array(2.5)),
    "nan-float": (float("nan"), np.array(float("nan"))),
    "complex": (1 + 2j, np.array(1 + 2j)),
    "np-float32": (np.float32(1.5), np.array(1.5, dtype=np.float32)),
    "np-uint8": (np.uint8(7), np.array(7, dtype=np.uint8)),
    "np-bool": (np.bool_(False), np.array(False)),
    "np-str": (np.str_("héllo"), np.array("héllo")),
    "np-bytes": (np.bytes_(b"ab"), np.array(b"ab")),
    "array-f4": (np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(6, dtype=np.float32).reshape(2, 3)),
    "array-empty": (np.zeros((0, 3)), np.zeros((0, 3))),
    "array-0d": (np.array(5, dtype=np.int16), np.array(5, dtype=np.int16)),
    "array-bool": (np.array([True, False]), np.array([True, False])),
    "array-c8": (np.array([1 + 1j], dtype=np.complex64), np.array([1 + 1j], dtype=np.complex64)),
    "array-f2": (np.array([0.5], dtype=np.float16), np.array([0.5], dtype=np.float16)),
    "array-big-endian": (np.arange(3, dtype=">i4"), np.arange(3, dtype="<i4")),
    "array-fortran": (np.asfortranarray(np.arange(6.0).reshape(2, 3)), np.arange(6.0).reshape(2, 3)),
    "array-32-dims": (np.zeros((1,) * 32), np.zeros((1,) * 32)),
    "array-U": (np.array(["a", "bcd"]), np.array(["a", "bcd"])),
    "array-S": (np.array([b"a", b"bcd"]), np.array([b"a", b"bcd"])),
    "none": (None, None),
    "str": ("text", "text"),
    "empty-str": ("", ""),
    "unicode-str": ("naïve ✓ 中文", "naïve ✓ 中文"),
    "list": ([1, 2.5, "x", None, True], [1, 2.5, "x", None, True]),
    "tuple": ((1, (2, 3)), [1, [2, 3]]),
    "empty-list": ([], []),
    "empty-dict": ({}, {}),
    "nested-dict": ({"a": {"b": [1, {"c": None}]}}, {"a": {"b": [1, {"c": None}]}}),
    "numpy-scalars-inside": (
        {"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True), "s": np.str_("x")},
        {"i": 3, "f": 0.5, "b": True, "s": "x"},
    ),
    "np-str-key": ({np.str_("k"): 1}, {"k": 1}),
    "big-int-inside": ([2**200, -(2**70)], [2**200, -(2**70)]),
    "rng-state": (_bit_generator_state(), _bit_generator_state()),
    "deep-but-allowed": (_deep(99), _deep(99)),
}

REFUSED = {
    # id: (assigned value, a fragment of the message saying what to store instead)
    "object-array": (np.array([1, "a"], dtype=object), "tolist"),
    "structured-array": (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "field"),
    "datetime-array": (np.array(["2024-01-01"], dtype="datetime64[D]"), "int64"),
    "datetime-scalar": (np.datetime64("2024-01-01"), "int64"),
    "timedelta-scalar": (np.timedelta64(5, "s"), "int64"),
    "void-array": (np.zeros(3, dtype="V4"), "field"),
    "stringdtype-array": (np.array(["a", "bc"], dtype=np.dtypes.StringDType()), "astype(str)"),
    "float128-array": (np.zeros(2, dtype=np.longdouble), "float64"),
    "complex256-array": (np.zeros(2, dtype=np.clongdouble), "complex128"),
    "float128-scalar": (np.longdouble(1.5), "float64"),
    "33-dims": (np.zeros((1,) * 33), "at most 32"),
    "huge-string-items": (np.zeros(1, dtype=f"U{(1 << 20) + 1}"), "JSON value"),
    "masked-array": (np.ma.masked_array([1, 2], mask=[0, 1]), "mask"),
    "matrix": (_matrix(), "np.asarray"),
    "recarray": (np.rec.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]), "np.asarray"),
    "dataframe": (pd.DataFrame({"a": [1, 2]}), "to_numpy"),
    "series": (pd.Series([1, 2]), "to_numpy"),
    "set": ({1, 2}, "sorted"),
    "frozenset": (frozenset({1}), "sorted"),
    "bytes": (b"raw", "decode"),
    "bytearray": (bytearray(b"raw"), "decode"),
    "custom-object": (Custom(), "JSON values"),
    "date": (datetime.date(2024, 1, 1), "JSON values"),
    "decimal": (decimal.Decimal("1.5"), "JSON values"),
    "int-enum": (Color.RED, "int(value)"),
    "ordered-dict": (collections.OrderedDict(a=1), "dict(value)"),
    "defaultdict": (collections.defaultdict(int), "dict(value)"),
    "namedtuple": (Point(1, 2), "tuple(value)"),
    "int-dict-key": ({1: "a"}, "str"),
    "tuple-dict-key": ({("a", "b"): 1}, "str"),
    "nan-in-list": ([1.0, float("nan")], "None"),
    "inf-in-dict": ({"x": float("inf")}, "None"),
    "np-nan-in-dict": ({"x": np.float32("nan")}, "None"),
    "complex-in-list": ([1j], "real"),
    "array-in-list": ([np.zeros(2)], "own blob"),
    "set-in-dict": ({"s": {1}}, "sorted"),
    "object-in-list": ([Custom()], "JSON values"),
    "cycle": (_cyclic(), "itself"),
    "too-deep": (_deep(101), "flatten"),
    "lock": (threading.Lock(), "JSON values"),
    "function": (len, "JSON values"),
}


def _ws() -> Workspace:
    return Workspace(Scope(), node="a", lock=threading.RLock())


def assert_same(got: object, expected: object) -> None:
    """Equal values of exactly the same types (arrays: dtype, shape and bytes; JSON: recursively)."""
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype
        assert got.dtype.isnative
        assert got.shape == expected.shape
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes()
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, list):
        assert len(got) == len(expected)
        for item, want in zip(got, expected, strict=True):
            assert_same(item, want)
    else:
        assert got == expected


# -- accepted kinds ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(ACCEPTED))
def test_accepted_value_reads_back_from_the_workspace(kind):
    """ws[b] = v; ws[b] gives the normalised value, equal and of the same types, also through a child."""
    value, expected = ACCEPTED[kind]
    ws = _ws()
    ws["blob"] = value
    assert_same(ws["blob"], expected)
    ws.child()["blob"] = value
    assert_same(ws["blob"], expected)


@pytest.mark.parametrize("kind", list(ACCEPTED))
def test_accepted_value_round_trips_through_feed_and_fetch(kind):
    """session.feed then fetch gives the normalised value; fetch and feed copy."""
    value, expected = ACCEPTED[kind]
    with dj.LocalSession() as session:
        session.feed("blob", value, node="a")
        got = session.fetch("blob", node="a")
        assert_same(got, expected)
        again = session.fetch("blob", node="a")
        if isinstance(got, np.ndarray):
            assert not np.shares_memory(got, again)
            got[...] = np.zeros((), dtype=got.dtype)
        elif isinstance(got, list | dict):
            assert again is not got
            got.clear()
        assert_same(session.fetch("blob", node="a"), expected)


@pytest.mark.parametrize("kind", list(ACCEPTED))
def test_accepted_value_round_trips_as_task_output(kind):
    """A step assigning the value makes a task output equal to the normalised value, in both workspace types."""
    value, expected = ACCEPTED[kind]

    def produce(ws):
        ws["blob"] = value

    for workspace_type in dj.WorkspaceType:
        with dj.Cluster(), dj.TaskGroup(workspace_type) as group:
            task = dj.Task(produce, outputs="blob", node="a")
        with dj.LocalSession() as session:
            session.run(group)
            assert_same(task.outputs()[0].fetch(), expected)


def test_memmap_is_stored_as_a_plain_array(tmp_path):
    """A numpy.memmap loses nothing as a plain ndarray view, so it is stored as one."""
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4,))
    mm[:] = [1, 2, 3, 4]
    ws = _ws()
    ws["m"] = mm
    assert type(ws["m"]) is np.ndarray
    assert ws["m"].tolist() == [1, 2, 3, 4]


def test_json_values_are_stored_as_copies_and_arrays_as_given():
    """Assigning a dict stores a normalised copy; an array is stored without copying."""
    state = {"pos": [1, 2]}
    array = np.zeros(3)
    ws = _ws()
    ws["state"], ws["array"] = state, array
    state["pos"].append(3)
    assert ws["state"] == {"pos": [1, 2]}
    assert ws["array"] is array


# -- refused kinds -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_value_raises_at_assignment(kind):
    """Assignment raises BlobTypeError (a TypeError) naming the blob and what to store instead; nothing is stored."""
    value, hint = REFUSED[kind]
    ws = _ws()
    ws["bad"] = 1
    with pytest.raises(BlobTypeError, match="'bad'") as info:
        ws["bad"] = value
    assert isinstance(info.value, TypeError)
    assert hint in str(info.value)
    assert_same(ws["bad"], np.array(1))
    with pytest.raises(BlobTypeError, match="'fresh'"):
        ws.child()["fresh"] = value
    assert "fresh" not in ws


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_value_from_a_step_fails_its_task(kind):
    """A step assigning a refused value fails its task with TaskFailedError caused by BlobTypeError."""
    value, _ = REFUSED[kind]

    def assign(ws):
        ws["bad"] = value

    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        dj.Task(assign, node="a", name="assigner")
    with dj.LocalSession() as session:
        with pytest.raises(TaskFailedError, match="'a/assigner'") as info:
            session.run(group)
        assert isinstance(info.value.__cause__, BlobTypeError)
        assert isinstance(info.value, TypeError)  # a TaskTypeError: except TypeError catches it too
        assert "'bad'" in str(info.value)
        assert session.blobs("a") == []


@pytest.mark.parametrize("kind", list(REFUSED))
def test_refused_value_raises_from_feed(kind):
    """session.feed raises BlobTypeError naming the blob and stores nothing."""
    value, hint = REFUSED[kind]
    with dj.LocalSession() as session:
        session.feed("other", 1, node="a")
        with pytest.raises(BlobTypeError, match="'bad'") as info:
            session.feed("bad", value, node="a")
        assert hint in str(info.value)
        assert session.blobs("a") == ["other"]


def test_json_changed_in_place_into_something_unstorable_fails_the_output():
    """A stored list changed in place to hold a refused value fails when it is captured as an output."""

    def corrupt(ws):
        ws["state"] = [1]
        ws["state"].append({1, 2})

    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(corrupt, outputs="state", node="a", name="corrupt")
    with dj.LocalSession() as session, pytest.raises(TaskFailedError, match="'a/corrupt'") as info:
        session.run(group)
    assert isinstance(info.value.__cause__, BlobTypeError)
    assert "'state'" in str(info.value.__cause__)


# -- nothing committed changes -------------------------------------------------------------------


def committed(prefix: str) -> dict[str, bytes]:
    """Every file under ``prefix`` with its bytes, but the writer lock (held only while a runner runs)."""
    files = {}
    for root, _, names in os.walk(prefix):
        for name in names:
            if name == "lock.json":
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, prefix)] = f.read()
    return files


@pytest.mark.parametrize("kind", ["dataframe", "masked-array", "set", "nan-in-list", "object-array"])
def test_refused_value_in_a_checkpointed_epoch_changes_nothing_committed(prefix, kind):
    """A step assigning a refused value in epoch 2 fails the run; epochs 0-1 stay committed byte for byte."""
    value, _ = REFUSED[kind]
    seen: dict[str, object] = {}

    def step(ws):
        ws["n"] = ws["n"] + 1
        if ws.epoch == 2:  # LocalSession: the step runs in this process, after epoch 1 committed
            seen["epochs"] = [info.epoch for info in dj.list_checkpoints(prefix)]
            seen["files"] = committed(prefix)
            ws["bad"] = value

    with dj.Cluster(), dj.Job(name="values") as job:
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("n", 0), node="a")
        dj.Task(step, node="a", name="step")
        dj.epoch_limiter(job, 5, node="a")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False)
    with pytest.raises(TaskFailedError, match="'a/step'") as info:
        runner.train(None)
    assert isinstance(info.value.__cause__, BlobTypeError)
    assert seen["epochs"] == [0, 1]
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 1]
    assert committed(prefix) == seen["files"]
