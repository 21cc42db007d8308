"""On a cluster, nodes fsync an epoch's checkpoint in the background while the next epoch runs.

A node writes its group at the end of the epoch's task and hands the fsync to a background
thread; the next epoch's hook reports the flush (or a small group asks for it), and only then
is the epoch committed. A flush that fails fails that epoch's save like any save error, and no
later group hard-links chunks of a group whose flush failed.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest

import daskjobs as dj
from daskjobs._execution.node_run import NodeState
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._managers.ledger import SaveLedger
from daskjobs.checkpoint._node.outcomes import FlushOutcome, FlushReport, SaveOutcome
from daskjobs.checkpoint._node.save_steps import FlushFinish, SaveFinish
from daskjobs.checkpoint._node.slots import checkpoint_slots
from daskjobs.checkpoint._storage import durable as _durable
from daskjobs.checkpoint._storage.durable import in_background
from daskjobs.errors import CheckpointWriteError

BLOB = 4096


def hold_flushes(release: str, monkeypatch: pytest.MonkeyPatch | None = None, only: str | None = None) -> None:
    """Keep this process's background write thread and its batches of syncs waiting until ``release``
    exists (on a worker, without ``monkeypatch``, the batches of syncs are held until then).
    ``only``: hold only the batches with a path containing it (an earlier epoch's flush, still
    running on a busy machine, goes through: its node's next hook waits for it); the first batch
    after the release ends the hold, whatever its paths."""

    def wait() -> None:
        deadline = time.monotonic() + 30
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.005)

    for _ in range(_durable._WRITE_THREADS):  # every background write thread
        in_background(wait)
    real = _durable.sync_paths

    def held(paths, many=False):
        if only is None or os.path.exists(release) or any(only in str(path) for path in paths):
            wait()
            if monkeypatch is None:
                _durable.sync_paths = real
        real(paths, many=many)

    if monkeypatch is None:
        _durable.sync_paths = held
    else:
        monkeypatch.setattr(_durable, "sync_paths", held)


# -- the store ---------------------------------------------------------------------------------
def test_an_unsynced_write_returns_the_flush_that_makes_it_durable(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    entry, flush = store.write_node_unsynced("n", 3, {"w": np.arange(5.0)}, save_id="s")
    assert flush is not None
    flush()
    assert store.read_node("n", 3, entry)["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("where", ["memory", "no-fsync"])
def test_a_group_that_is_durable_at_once_has_no_flush(tmp_path, where):
    store = CheckpointStore(
        f"memory://flush-{os.getpid()}" if where == "memory" else tmp_path, fsync=where != "no-fsync"
    )
    entry, flush = store.write_node_unsynced("n", 1, {"w": np.ones(3)}, save_id="s")
    assert flush is None
    assert store.read_node("n", 1, entry)["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_flush_that_fails_names_node_and_epoch(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    _entry, flush = store.write_node_unsynced("trainer", 7, {"w": np.ones(3)}, save_id="s")
    (staging,) = (tmp_path / "ckpt").glob("trainer.7.tmp-*")  # the group is put in place by the flush
    shutil.rmtree(staging)
    with pytest.raises(CheckpointWriteError, match=r"node 'trainer' at epoch 7 durable"):
        flush()


# -- the node's hooks ----------------------------------------------------------------------------
def make_state(blobs: dict) -> NodeState:
    state = NodeState("n")
    state.scope.blobs = dict(blobs)
    return state


@pytest.mark.parametrize("elements", [BLOB, 1 << 18], ids=["written-later", "flushed-later"])
def test_the_next_hook_reports_the_flush_of_the_group_before(tmp_path, elements):
    """A small workspace is copied and written in the background (its report brings the written
    entry); a bigger one is written in the hook and only fsynced there."""
    store = CheckpointStore(tmp_path / "ckpt")
    state = make_state({"w": np.zeros(elements), "v": np.ones(elements)})
    first = SaveFinish(store, "n", 1, "s1", flush_later=True)(state)
    assert first.later
    assert first.flushed is None
    assert checkpoint_slots(state).flush is not None
    state.scope.blobs["w"] = np.full(elements, 2.0)  # after the hook: the copy (or the written group) keeps 0.0
    second = SaveFinish(store, "n", 2, "s2", first.entry, flush_later=True)(state)
    assert second.flushed.save_id == "s1"
    assert second.flushed.error is None
    written = second.flushed.entry
    if elements == BLOB:  # what the hook described, and the manifest the background write wrote
        assert {k: v for k, v in written.items() if k not in ("seconds", "manifest")} == {
            k: v for k, v in first.entry.items() if k not in ("seconds", "manifest")
        }
        assert first.entry["manifest"] is None
        assert written["manifest"] == store.read_node_entry("n", 1)["manifest"]
    else:
        assert written is None
        assert first.entry["manifest"] == store.read_node_entry("n", 1)["manifest"]
    assert second.entry["bytes_reused"] == elements * 8  # v is linked from epoch 1
    last = FlushFinish()(state).flushed
    assert (last.save_id, last.error) == ("s2", None)
    assert FlushFinish()(state) == FlushOutcome(None)
    assert store.read_node("n", 1, store.read_node_entry("n", 1))["w"][0] == 0.0
    assert store.read_node("n", 2, store.read_node_entry("n", 2))["w"][0] == 2.0


@pytest.mark.parametrize("elements", [BLOB, 1 << 18], ids=["written-later", "flushed-later"])
def test_a_failed_flush_is_reported_and_its_chunks_are_never_linked(tmp_path, elements, monkeypatch):
    """Epoch 1's group cannot be made durable (its folder is replaced by a file daskjobs did not
    write before the background thread gets to it): the next hook reports the error and writes
    epoch 2 whole."""
    store = CheckpointStore(tmp_path / "ckpt")
    state = make_state({"w": np.zeros(elements)})
    release = str(tmp_path / "release")
    hold_flushes(release, monkeypatch)
    first = SaveFinish(store, "n", 1, "s1", flush_later=True)(state)
    shutil.rmtree(tmp_path / "ckpt" / "n.1", ignore_errors=True)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    (tmp_path / "ckpt" / "n.1").write_text("not daskjobs'")
    open(release, "w").close()
    second = SaveFinish(store, "n", 2, "s2", first.entry, flush_later=True)(state)
    assert second.flushed.save_id == "s1"
    assert isinstance(second.flushed.error, CheckpointWriteError)
    assert "epoch 1" in str(second.flushed.error)
    assert (second.entry["bytes_written"], second.entry["bytes_reused"]) == (elements * 8, 0)
    FlushFinish()(state)
    assert store.read_node("n", 2, store.read_node_entry("n", 2))["w"].sum() == 0.0
    assert (tmp_path / "ckpt" / "n.1").read_text() == "not daskjobs'"


# -- the driver's bookkeeping ----------------------------------------------------------------------
def written(saves: SaveLedger, epoch: int, nodes: tuple[str, ...] = ("a", "b")) -> str:
    save_id = saves.start(epoch)
    assert saves.take(epoch, {n: SaveOutcome(entry={"save_id": save_id}, later=True) for n in nodes}) == {}
    return save_id


def test_an_epoch_is_flushed_once_every_node_reported_it():
    saves = SaveLedger()
    save_id = written(saves, 4)
    assert not saves.flushed(4)
    assert saves.note_flushes({"a": FlushOutcome(FlushReport(save_id))}) == {}
    assert not saves.flushed(4)
    assert saves.writing_nodes() == {"b"}
    assert saves.note_flushes({"b": FlushOutcome(FlushReport(save_id))}) == {}
    assert saves.flushed(4)
    assert saves.writing_nodes() == set()


@pytest.mark.parametrize("report", ["error", "gone", "other-save"])
def test_an_epoch_whose_flush_failed_or_vanished_stays_unflushed(report):
    """The failed node is named with its error (or why its flush is gone); the epoch is kept, not
    flushed, for the run to write that node's group again (or give the epoch up)."""
    saves = SaveLedger()
    save_id = written(saves, 4)
    outcome = {
        "error": FlushReport(save_id, OSError("disk full")),
        "gone": None,
        "other-save": FlushReport("not-this-one"),
    }[report]
    bad = saves.note_flushes({"a": FlushOutcome(FlushReport(save_id)), "b": FlushOutcome(outcome)})
    assert list(bad) == [4]
    assert list(bad[4]) == ["b"]
    assert ("disk full" if report == "error" else "flush is gone") in str(bad[4]["b"])
    assert 4 in saves.entries
    assert not saves.flushed(4)
    assert saves.writing_nodes() == {"b"}


def test_the_next_hooks_report_hands_out_the_epochs_now_durable_in_one_answer():
    """Epoch 4 is flushed in the background; the hooks of epoch 5 report that flush and epoch 5's
    own save: one answer of the ledger hands out both, oldest first, with the entries to commit.
    The ledger keeps them until they are committed; its version stays while it only answers."""
    saves = SaveLedger()
    four = written(saves, 4)
    five = saves.start(5)
    now = {n: SaveOutcome(entry={"save_id": five}, flushed=FlushReport(four)) for n in ("a", "b")}
    received = saves.receive(5, now, ("a", "b"), async_save=False, waiting=[4, 5])
    assert received.failure is None
    assert received.flushes == {}
    assert received.durable == {
        4: {"a": {"save_id": four}, "b": {"save_id": four}},
        5: {"a": {"save_id": five}, "b": {"save_id": five}},
    }
    version = saves.version
    assert list(saves.hand_out([4, 5])[0]) == [4, 5]
    assert saves.version == version


def test_an_epoch_not_durable_yet_holds_back_the_epochs_after_it():
    saves = SaveLedger()
    four = written(saves, 4)
    five = saves.start(5)
    received = saves.receive(
        5, {n: SaveOutcome(entry={"save_id": five}) for n in ("a", "b")}, ("a", "b"), async_save=False, waiting=[4, 5]
    )
    assert received.durable == {}  # epoch 4's flush was not reported: epoch 5 waits behind it
    gone = "its background flush is gone (the worker restarted?)"
    assert received.flushes == {4: {"a": gone, "b": gone}}
    assert saves.ids[4] == four


def test_a_save_starts_from_the_newest_epoch_written_and_forgets_those_committed():
    """``begin`` reuses the entries of the newest epoch written and awaiting its commit (delta), and
    first forgets the epochs committed with the entries the ledger handed out."""
    saves = SaveLedger()
    written(saves, 3)
    four = saves.start(4)
    entries = {n: {"save_id": four, "node": n, "epoch": 4} for n in ("a", "b")}
    assert saves.take(4, {n: SaveOutcome(entry=e) for n, e in entries.items()}) == {}
    started = saves.begin(5, None, committed=[], last_record=None, done=[3])
    assert started.previous == entries
    assert saves.sources[5] == 4
    assert 3 not in saves.ids
    assert 3 not in saves.entries
    assert saves.begin(6, None, committed=None, last_record=None).previous == {}


# -- whole runs on a cluster -----------------------------------------------------------------------
NODES = ("ps", "trainer_0")


def make_job(hold_at: int | None = None, lose: tuple[str, int] | None = None) -> dj.Job:
    """Blob ``a`` changes every epoch, ``b`` never. ``hold_at``: the nodes' background writes and
    flushes of that epoch wait until the next epoch's step released them; ``lose=(prefix, epoch)``:
    before releasing, that step puts a file of its own where node ``ps``'s group of ``epoch``
    goes (its background write then fails)."""

    def update(ws):
        ws["a"] = ws["a"] + 1.0
        if hold_at is not None and ws.epoch == hold_at:
            hold_flushes(f"{lose[0]}.release-{ws.node}", only=f"{os.sep}{ws.node}.{hold_at}")
        if lose is not None and ws.epoch == lose[1] + 1:
            if ws.node == "ps":
                group = os.path.join(lose[0], f"ps.{lose[1]}")
                shutil.rmtree(group, ignore_errors=True)
                with open(group, "w") as obstacle:
                    obstacle.write("not daskjobs'")
            open(f"{lose[0]}.release-{ws.node}", "w").close()

    with dj.Cluster(), dj.Job(name="flush") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.update(a=np.zeros(BLOB), b=np.ones(BLOB)))
                dj.Task(update, name="update")
    return job


def committed(prefix: str) -> list[int]:
    return [info.epoch for info in dj.list_checkpoints(prefix)]


@pytest.fixture
def cluster_session(shared_cluster):
    with dj.DaskSession(shared_cluster) as session:
        yield session


@pytest.mark.cluster
def test_a_run_on_a_cluster_commits_every_epoch_after_its_flush(cluster_session, prefix):
    assert cluster_session.background_flushes
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)
    assert runner.train(cluster_session) == 6
    assert committed(prefix) == list(range(7))
    for epoch in range(7):
        view = dj.open_checkpoint(prefix, epoch)
        assert view.verify() > 0
        assert view["ps"]["a"][0] == float(epoch)
    assert all(r.bytes_reused == BLOB * 8 * len(NODES) for r in runner.history)


@pytest.mark.cluster
def test_a_flush_that_fails_on_a_cluster_fails_its_epoch(cluster_session, prefix):
    """Node ps's group of epoch 3 cannot be made durable (a file is where it goes): saving epoch 3
    fails (CheckpointWriteError naming it), the commits before it stay, and a re-run resumes there."""
    job = make_job(hold_at=3, lose=(prefix, 3))
    with pytest.raises(CheckpointWriteError, match="epoch 3"):
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False).train(cluster_session)
    assert committed(prefix) == [0, 1, 2]
    assert dj.open_checkpoint(prefix, 2).verify() > 0
    os.remove(os.path.join(prefix, "ps.3"))
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False)
    assert runner.train(cluster_session) == 6
    assert [r.epoch for r in runner.history] == [3, 4, 5, 6]
    assert dj.open_checkpoint(prefix, 6)["ps"]["a"][0] == 6.0


@pytest.mark.cluster
def test_with_warn_a_failed_flush_skips_its_epoch_and_the_next_epochs_commit(cluster_session, prefix, caplog):
    job = make_job(hold_at=3, lose=(prefix, 3))
    runner = dj.JobRunner(
        job, dj.MultiNodeCheckpointManager(prefix), max_epochs=6, progress=False, on_save_error="warn"
    )
    assert runner.train(cluster_session) == 6
    assert committed(prefix) == [0, 1, 2, 4, 5, 6]
    assert "epoch 3" in caplog.text
    for epoch in (4, 5, 6):  # node ps wrote epoch 4 whole: its epoch 3 was never durable
        view = dj.open_checkpoint(prefix, epoch)
        assert view.verify() > 0
        assert view["ps"]["a"][0] == float(epoch)
        assert view["ps"]["b"][0] == 1.0
    assert runner.history[3].bytes_reused == BLOB * 8  # only trainer_0's b was linked in epoch 4


def test_in_process_sessions_flush_at_once(prefix):
    """A LocalSession's nodes fsync inside the hook: nothing is left to flush after an epoch."""
    session = dj.LocalSession()
    assert not session.background_flushes
    runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
    assert runner.train(session) == 2
    assert committed(prefix) == [0, 1, 2]
    assert all(checkpoint_slots(state).flush is None for state in session._states.states.values())
    session.close()


WORKSPACES = {
    "arrays": {"w": np.arange(12.0).reshape(3, 4), "i": np.arange(5, dtype="<i2"), "zero_d": np.array(1.5)},
    "empty-and-strings": {"e": np.zeros((0, 3)), "u": np.array(["a", "bc"]), "s": np.array([b"x", b"yz"])},
    "json": {"cfg": {"lr": 0.1, "layers": [1, 2]}, "name": "model", "none": None},
}


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("case", list(WORKSPACES))
def test_the_described_entry_is_the_written_one(tmp_path, case, compression):
    """What a hook returns for a background write (``describe_node``) equals what the write
    returns, also for a delta against the epoch before, so a commit never depends on the guess;
    only the write names a manifest (the group's ``zarr.json`` it wrote)."""
    store = CheckpointStore(tmp_path / "ckpt", compression=compression)
    blobs = WORKSPACES[case]
    first = store.write_node("n", 1, blobs, save_id="s1")
    changed = {**blobs, "extra": np.ones(3)}
    for epoch, previous in ((2, None), (3, first)):
        described = store.describe_node("n", epoch, changed, save_id=f"s{epoch}", previous=previous)
        written = store.write_node("n", epoch, changed, save_id=f"s{epoch}", previous=previous)
        assert {k: v for k, v in described.items() if k != "seconds"} == {
            k: v for k, v in written.items() if k not in ("seconds", "manifest")
        }
        assert "manifest" not in described
        assert written["manifest"]["size"] == len((tmp_path / "ckpt" / f"n.{epoch}" / "zarr.json").read_bytes())
    assert written["bytes_reused"] > 0


# -- the process's batches of syncs ------------------------------------------------------------------
def test_groups_flushed_while_a_sync_runs_share_the_next_one(tmp_path, monkeypatch):
    """Requests made while a batch syncs are synced together (one syncfs for the union of their paths,
    once every path is there); a request whose path vanished fails alone, the others of its batch
    succeed."""
    calls: list[tuple[list[str], bool]] = []
    holding, release = threading.Event(), threading.Event()
    real = _durable.sync_paths

    def recording(paths, many=False):
        calls.append((list(paths), many))
        if paths == [str(tmp_path / "hold")]:
            holding.set()
            assert release.wait(30)
        real(paths, many=many)

    def hold() -> object:
        holding.clear()
        release.clear()
        held = _durable.sync_soon([str(tmp_path / "hold")])
        assert holding.wait(30)
        return held

    monkeypatch.setattr(_durable, "sync_paths", recording)
    monkeypatch.setattr(_durable, "_syncer", None)
    for name in ("hold", "a", "b", "c"):
        (tmp_path / name).write_text(name)
    folder, a, b, c = str(tmp_path), str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")
    hold()
    later = [_durable.sync_soon([folder, path]) for path in (a, b, c)]
    gone = _durable.sync_soon([str(tmp_path / "gone")])  # its filesystem cannot be told: refused alone
    os.unlink(b)  # b vanishes before its batch: the batch is synced request by request, b's fails
    release.set()
    assert isinstance(gone.exception(30), FileNotFoundError)
    assert [f.exception(30) is None for f in later] == [True, False, True]
    assert isinstance(later[1].exception(), FileNotFoundError)
    assert calls[1:] == [([folder, a], False), ([folder, b], False), ([folder, c], False)]
    del calls[:]
    hold()
    later = [_durable.sync_soon([folder, path]) for path in (a, c)]  # both there: one syncfs for both
    release.set()
    assert [f.result(30) for f in later] == [None, None]
    assert calls[1:] == [([folder, a, c], True)]


def test_a_batch_gathers_as_many_requests_as_its_largest_did(tmp_path, monkeypatch):
    """A process serving one node syncs each request at once; once a batch held three (three nodes'
    groups), a lone request waits for two more (at most ``_GATHER``) and the three share one sync."""
    calls: list[tuple[list[str], bool]] = []
    holding, release = threading.Event(), threading.Event()
    real = _durable.sync_paths
    hold = str(tmp_path / "hold")

    def recording(paths, many=False):
        calls.append((list(paths), many))
        if paths == [hold]:
            holding.set()
            assert release.wait(30)
        real(paths, many=many)

    monkeypatch.setattr(_durable, "sync_paths", recording)
    monkeypatch.setattr(_durable, "_GATHER", 5.0)
    monkeypatch.setattr(_durable, "_syncer", None)
    a, b, c = (str(tmp_path / name) for name in "abc")
    for path in (a, b, c, hold):
        open(path, "w").close()
    started = time.monotonic()
    assert _durable.sync_soon([a]).result(30) is None
    assert time.monotonic() - started < 4, "one request alone does not wait to gather"

    held = _durable.sync_soon([hold])
    assert holding.wait(30)
    first = [_durable.sync_soon([path]) for path in (a, b, c)]  # three nodes' groups, while a sync runs
    release.set()
    assert [f.result(30) for f in [held, *first]] == [None] * 4
    assert calls == [([a], False), ([hold], False), ([a, b, c], True)]
    del calls[:]
    lone = _durable.sync_soon([a])
    time.sleep(0.3)
    assert not lone.done(), "it gathers the two that the largest batch had more"
    rest = [_durable.sync_soon([path]) for path in (b, c)]
    assert [f.result(4) for f in [lone, *rest]] == [None, None, None]
    assert calls == [([a, b, c], True)]
