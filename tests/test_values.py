"""Workspace values (SPEC §1.2): normalisation helpers, steps that do not run, the PRIVATE trap."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import daskjobs as dj
from daskjobs._model.values import MAX_JSON_INT_DIGITS, as_value, copy_value
from daskjobs._model.workspace import Scope, Workspace
from daskjobs.checkpoint import CheckpointStore
from daskjobs.errors import BlobTypeError, CheckpointCorruptError, StepTypeError, TaskFailedError

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=20,
)


def _same_json(got: object, want: object) -> bool:
    if type(got) is not type(want):
        return False
    if isinstance(want, list):
        return len(got) == len(want) and all(_same_json(a, b) for a, b in zip(got, want, strict=True))
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same_json(got[k], want[k]) for k in want)
    return got == want


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES)
def test_json_values_read_back_as_json_would_restore_them(value):
    """ws[x] = v; ws[x] equals what JSON text gives back (tuples as lists), with the same types."""
    ws = Workspace(Scope(), node="a", lock=threading.RLock())
    ws["x"] = value
    got = ws["x"]
    if isinstance(got, np.ndarray):  # a top-level number becomes a 0-d array
        assert got.shape == ()
        assert got.item() == value
        return
    assert _same_json(got, json.loads(json.dumps(value)))
    assert _same_json(copy_value(got), got)


def test_top_level_int_outside_int64_stays_an_exact_int():
    """Ints in int64 range become int64 0-d arrays; larger ones are kept exactly as JSON ints."""
    assert as_value(2**63 - 1, "x").dtype == np.int64
    assert as_value(-(2**63), "x").dtype == np.int64
    assert as_value(2**63, "x") == 2**63
    assert type(as_value(-(2**64), "x")) is int


def test_copy_value_copies_arrays_and_json():
    """copy_value returns independent copies of arrays (keeping layout) and of nested JSON."""
    array = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    copied = copy_value(array)
    assert not np.shares_memory(copied, array)
    assert copied.flags.f_contiguous
    nested = {"a": [1, {"b": [2]}]}
    other = copy_value(nested)
    assert other == nested
    other["a"][1]["b"].append(3)
    assert nested == {"a": [1, {"b": [2]}]}
    assert copy_value(None) is None


def test_copy_value_refuses_json_changed_in_place():
    """A stored list that was given an unstorable item in place is refused when copied, naming the blob."""
    value = as_value([1], "x")
    value.append(object())
    with pytest.raises(BlobTypeError, match=r"'x' at value\[1\]"):
        copy_value(value, "x")


def test_refusal_names_the_path_inside_a_json_value():
    """The message says where inside a nested value the refused item is."""
    with pytest.raises(BlobTypeError, match=r"blob 'cfg' at value\['layers'\]\[2\]: .*float nan"):
        as_value({"layers": [1, 2, float("nan")]}, "cfg")


# -- steps whose call does not run them ----------------------------------------------------------


async def _coroutine_body(ws):
    ws["ran"] = 1


def _returns_coroutine(ws):
    return _coroutine_body(ws)


def _returns_generator(ws):
    return (i for i in range(3))


class _Awaitable:
    def __await__(self):
        yield


def _returns_awaitable(ws):
    return _Awaitable()


async def _agen():
    yield 1


def _returns_async_generator(ws):
    return _agen()


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("step", [_returns_coroutine, _returns_generator, _returns_awaitable, _returns_async_generator])
def test_step_returning_coroutine_generator_or_awaitable_fails_its_task(step, session):
    """Such a step fails its task with TaskFailedError caused by StepTypeError; no 'never awaited' warning."""
    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task(step, node="a", name="lazy")
    with pytest.raises(TaskFailedError, match="'a/lazy'") as info:
        session.run(group)
    assert isinstance(info.value.__cause__, StepTypeError)
    assert "plain synchronous" in str(info.value)
    assert session.blobs("a") == []
    gc.collect()


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("where", ["report_step", "local_init", "task_init", "instance_exit"])
def test_lazy_steps_fail_wherever_they_run(where):
    """Report steps, node-local setups and init/exit hooks returning a coroutine fail their task too."""
    with dj.Cluster(), dj.TaskGroup() as group:
        if where == "report_step":
            dj.Task(lambda ws: None, node="a")
            group.report_step(_returns_coroutine, node="a")
        elif where == "local_init":
            dj.Task(lambda ws: None, node="a")
            group.add_local_setup(dj.SetupNets(init_nets=_returns_coroutine), node="a")
        else:
            dj.Task(lambda ws: None, node="a", num_instances=2, **{where: _returns_coroutine})
    with dj.LocalSession() as session, pytest.raises(TaskFailedError) as info:
        session.run(group)
    assert isinstance(info.value.__cause__, StepTypeError)
    gc.collect()


def test_step_returning_a_value_is_fine(session):
    """Ordinary return values (None, numbers, lists) are ignored as before."""
    with dj.Cluster(), dj.TaskGroup() as group:
        dj.Task([lambda ws: 3, lambda ws: [1, 2], lambda ws: None], node="a")
    session.run(group)


def test_async_steps_also_refused_for_asyncio_futures():
    """An asyncio future returned by a step is an awaitable: refused."""
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        with dj.Cluster(), dj.TaskGroup() as group:
            dj.Task(lambda ws: future, node="a", name="fut")
        with dj.LocalSession() as session, pytest.raises(TaskFailedError, match="Future"):
            session.run(group)
    finally:
        loop.close()


# -- the accumulate-in-PRIVATE trap --------------------------------------------------------------


def _get(ws):
    ws["acc"] = ws.get("acc", 0) + 1


def _contains(ws):
    if "acc" not in ws:
        ws["acc"] = 0
    ws["acc"] = ws["acc"] + 1


def _setdefault(ws):
    ws.setdefault("acc", 0)
    ws["acc"] = ws["acc"] + 1


def _key_error(ws):
    try:
        value = ws["acc"]
    except KeyError:
        value = 0
    ws["acc"] = value + 1


def _trap_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "daskjobs" and "PRIVATE run" in r.getMessage()]


def _run_epochs(session, epoch_step, *, init=None, outputs=None, epoch_type=None, epochs=4) -> None:
    with dj.Cluster(), dj.Job(name="trap", epoch_group=dj.TaskGroup(epoch_type)) as job:
        if init is not None:
            with job.init_group:
                dj.Task(init, node="a")
        dj.Task(epoch_step, node="a", outputs=outputs, name="acc_step")
        dj.epoch_limiter(job, epochs, node="a")
    dj.JobRunner(job, progress=False).train(session)


@pytest.mark.parametrize("step", [_get, _contains, _setdefault, _key_error])
def test_private_accumulate_trap_warns_once_on_the_driver(step, session, caplog):
    """Looking a blob up, finding it missing and creating it in a PRIVATE run warns once over all epochs,
    on the driver, naming node and blob and saying what to do."""
    caplog.set_level(logging.WARNING, logger="daskjobs")
    _run_epochs(session, step)
    records = _trap_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "node 'a'" in message
    assert "blob 'acc'" in message
    assert "job 'trap'" in message
    assert "init group" in message
    assert "GLOBAL" in message


@pytest.mark.parametrize(
    ("step", "kwargs"),
    [
        pytest.param(lambda ws: ws.__setitem__("tmp", 1), {}, id="temporary"),
        pytest.param(lambda ws: ws.update(tmp=np.zeros(2), tmp2=ws.get("other_tmp")), {}, id="unrelated-miss"),
        pytest.param(_get, {"outputs": "acc"}, id="output"),
        pytest.param(_get, {"init": lambda ws: ws.__setitem__("acc", 0)}, id="created-in-init"),
        pytest.param(_get, {"epoch_type": dj.WorkspaceType.GLOBAL}, id="global-group"),
        pytest.param(lambda ws: (ws.pop("tmp", None), ws.__setitem__("tmp", 1)), {}, id="pop-then-create"),
    ],
)
def test_private_trap_stays_quiet_for_temporaries_outputs_and_global(step, kwargs, caplog):
    """Temporary blobs, outputs, blobs the init group created and GLOBAL groups never warn."""
    caplog.set_level(logging.WARNING, logger="daskjobs")
    with dj.LocalSession() as session:
        _run_epochs(session, step, **kwargs)
    assert _trap_records(caplog) == []


def test_private_trap_warns_per_blob_and_node(caplog):
    """Two blobs on two nodes give four warnings, each once."""
    caplog.set_level(logging.WARNING, logger="daskjobs")

    def two(ws):
        ws["x"] = ws.get("x", 0) + 1
        ws["y"] = ws.get("y", 0) + 1

    with dj.Cluster(), dj.Job(name="trap2") as job:
        for node in ("a", "b"):
            dj.Task(two, node=node)
        dj.epoch_limiter(job, 3, node="a")
    with dj.LocalSession() as session:
        dj.JobRunner(job, progress=False).train(session)
    found = sorted((m.split("'")[1], m.split("'")[3]) for m in (r.getMessage() for r in _trap_records(caplog)))
    assert found == [("a", "x"), ("a", "y"), ("b", "x"), ("b", "y")]


def test_private_trap_warns_once_per_job_run(caplog):
    """Each run of a trapping job warns again on the same session; so does each session.run."""
    caplog.set_level(logging.WARNING, logger="daskjobs")
    with dj.LocalSession() as session:
        counts = []
        for _ in range(2):
            _run_epochs(session, _get, epochs=2)
            counts.append(len(_trap_records(caplog)))
        assert counts == [1, 2]
        with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.PRIVATE) as group:
            dj.Task(_get, node="a")
        session.run(group)
        session.run(group)
        assert len(_trap_records(caplog)) == 4


def _report_done(ws):
    ws["report_saw_done"] = "done" in ws


def _finish_after_a_report(ws):
    deadline = time.monotonic() + 30
    while "report_saw_done" not in ws and time.monotonic() < deadline:  # the report step looked "done" up first
        time.sleep(0.001)
    ws["done"] = True


def test_report_step_lookup_does_not_count_for_a_task(caplog):
    """A report step looking a blob up does not make a task's plain assignment of that blob a trap."""
    caplog.set_level(logging.WARNING, logger="daskjobs")
    with dj.Cluster(), dj.Job(name="report") as job:
        dj.Task(_finish_after_a_report, node="a", name="finish")
        job.epoch_group.report_step(_report_done, node="a", interval_ms=1)
        dj.epoch_limiter(job, 3, node="a")
    with dj.LocalSession() as session:
        dj.JobRunner(job, progress=False).train(session)
    assert _trap_records(caplog) == []


def test_report_step_accumulating_in_private_still_warns(caplog):
    """A report step that itself looks a blob up and creates it in a PRIVATE run is the trap."""
    caplog.set_level(logging.WARNING, logger="daskjobs")

    def report(ws):
        ws["reports"] = ws.get("reports", 0) + 1

    with dj.Cluster(), dj.Job(name="report") as job:
        dj.Task(lambda ws: None, node="a", name="work")
        job.epoch_group.report_step(report, node="a", interval_ms=60_000)
        dj.epoch_limiter(job, 2, node="a")
    with dj.LocalSession() as session:
        dj.JobRunner(job, progress=False).train(session)
    messages = [r.getMessage() for r in _trap_records(caplog)]
    assert len(messages) == 1
    assert "blob 'reports'" in messages[0]


# -- on every session kind -----------------------------------------------------------------------


def test_json_and_string_values_cross_sessions(session):
    """JSON values and fixed-width string arrays survive feed, steps, outputs and fetch on every session kind."""
    state = {"files": ("a.csv", "b.csv"), "seed": 2**80, "rng": np.random.default_rng(1).bit_generator.state}
    session.feed("state", state, node="a")

    def step(ws):
        ws["state"]["files"].append("c.csv")
        ws["names"] = np.array(["x", "yz"])
        ws["note"] = None

    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        task = dj.Task(step, node="a", outputs=["state", "names"])
    session.run(group)
    want = {"files": ["a.csv", "b.csv", "c.csv"], "seed": 2**80, "rng": state["rng"]}
    assert _same_json(session.fetch("state", node="a"), want)
    assert session.fetch("note", node="a") is None
    names = session.fetch("names", node="a")
    assert names.dtype == np.dtype("<U2")
    assert names.tolist() == ["x", "yz"]
    captured_state, captured_names = task.outputs()[0].fetch(), task.outputs()[1].fetch()
    assert _same_json(captured_state, want)
    assert captured_names.tolist() == ["x", "yz"]
    with pytest.raises(BlobTypeError, match="'bad'"):
        session.feed("bad", {1: 2}, node="a")


# -- ints beyond Python's int <-> str limit, and text UTF-8 cannot hold ---------------------------

BIG = 10**5000
"""5001 digits: more than Python converts between int and str by default (4300)."""


def _save_and_restore(prefix: str, value: object) -> tuple[object, object]:
    """Save ``value`` as blob ``v`` in a real job; return it as ``open_checkpoint`` and a resumed run read it."""
    seen = []
    with dj.Cluster(), dj.Job(name="values") as job, dj.Node("n"):
        with job.init_group:
            dj.Task(lambda ws: ws.__setitem__("v", value), name="init")
        dj.Task(lambda ws: seen.append(ws["v"]), name="look")
    dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=1, progress=False).train(dj.LocalSession())
    seen.clear()
    resumed = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    assert resumed.train(dj.LocalSession()) == 2
    return dj.open_checkpoint(prefix, 1)["n"]["v"], seen[0]


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(BIG, id="int"),
        pytest.param(-BIG, id="negative"),
        pytest.param([BIG, {"k": 10**MAX_JSON_INT_DIGITS - 1, "small": 3}], id="nested"),
    ],
)
def test_ints_beyond_the_str_limit_survive_a_checkpoint(prefix, value):
    """Ints of up to MAX_JSON_INT_DIGITS digits save, load and resume equal, the process's digit limit untouched."""
    limit = sys.get_int_max_str_digits()
    loaded, resumed = _save_and_restore(prefix, value)
    assert _same_json(loaded, value)
    assert _same_json(resumed, value)
    assert sys.get_int_max_str_digits() == limit


@pytest.mark.parametrize(
    ("value", "where"),
    [
        pytest.param(10**MAX_JSON_INT_DIGITS, "'big'", id="top-level"),
        pytest.param([1, -(10**MAX_JSON_INT_DIGITS)], r"'big' at value\[1\]", id="in-list"),
        pytest.param({"seed": 10**20000}, r"'big' at value\['seed'\]", id="in-dict"),
    ],
)
def test_int_with_too_many_digits_is_refused_at_assignment(value, where):
    """An int of more than MAX_JSON_INT_DIGITS digits raises BlobTypeError (a TypeError) naming the blob and
    saying to store its bytes instead."""
    with pytest.raises(BlobTypeError, match=rf"blob {where}: holds an int of more than {MAX_JSON_INT_DIGITS}") as info:
        as_value(value, "big")
    assert isinstance(info.value, TypeError)
    assert "uint8 array" in str(info.value)


def test_stored_int_with_too_many_digits_is_refused_on_reading(tmp_path):
    """A stored JSON value holding an int of more digits than an assignment accepts is CheckpointCorruptError,
    parsed in bounded time."""
    store = CheckpointStore(tmp_path / "ckpt", fsync=False)
    entry = store.write_node("n", 0, {"v": [10**20000]}, save_id="s")
    with pytest.raises(CheckpointCorruptError, match=r"epoch 0, node 'n', blob 'v': .*an int of 20001 digits"):
        store.read_node("n", 0, entry)


@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        pytest.param("a\ud800b", "'t'", "a str", id="str"),
        pytest.param(["ok", "\udfff"], r"'t' at value\[1\]", "a str", id="in-list"),
        pytest.param({"\udc80": 1}, "'t'", "the dict key", id="dict-key"),
        pytest.param([np.str_("\ud800")], r"'t' at value\[0\]", "a str", id="numpy-str"),
    ],
)
def test_lone_surrogate_is_refused_at_assignment(value, where, what):
    """Text UTF-8 cannot encode raises BlobTypeError at assignment naming the blob, not a failed save later."""
    with pytest.raises(BlobTypeError, match=rf"blob {where}: holds {what} with the lone surrogate") as info:
        as_value(value, "t")
    assert isinstance(info.value, TypeError)
    assert "np.frombuffer(value.encode('utf-8', 'surrogatepass'), np.uint8)" in str(info.value)
    ws = Workspace(Scope(), node="a", lock=threading.RLock())
    with pytest.raises(BlobTypeError, match="lone surrogate"):
        ws["t"] = value
    assert "t" not in ws
