"""Checkpoints in cluster memory (tier 0, SPEC §3) without a cluster: the options, which epochs are
durable, what a run records, and a LocalSession's tier 0 (a copy in the process)."""

from __future__ import annotations

import numpy as np
import pytest

import daskjobs as dj
from daskjobs.checkpoint._managers.memory import MemoryOptions
from daskjobs.errors import CheckpointWriteError, DefinitionTypeError, JobDefinitionError, JobInterruptedError

EPOCHS = 12


def init_a(ws):
    ws["x"] = np.zeros(4)
    ws["rng"] = np.random.default_rng(3).bit_generator.state
    ws["seen"] = np.zeros(0, dtype=np.int64)


def step_a(ws):
    rng = np.random.default_rng()
    rng.bit_generator.state = ws["rng"]
    ws["x"] = ws["x"] + rng.normal(size=4)
    ws["rng"] = rng.bit_generator.state
    ws.log("loss", float(ws["x"].sum()))


def record(ws, batch):
    ws["seen"] = np.append(ws["seen"], batch)


def define_job(epochs: int = EPOCHS) -> dj.Job:
    """Node a: an RNG-driven array and a reader (its position is part of the snapshot); node b: a counter."""
    with dj.Cluster(), dj.Job(name="tier0") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(init_a)
                reader = dj.ArrayReader(np.arange(100), batch_size=3, name="ids")
            dj.Task(step_a)
            dj.pipe(dj.ReaderWithLimit(reader, num_iter=2), record)
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", 0))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
            dj.epoch_limiter(job, epochs)
    return job


def final_blobs(session: dj.Session) -> dict[str, object]:
    return {
        "x": session.fetch("x", "a"),
        "seen": session.fetch("seen", "a"),
        "n": session.fetch("n", "b"),
        "rng": session.fetch("rng", "a"),
    }


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    """The final blobs of an uninterrupted run without checkpoints."""
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), progress=False).train(session)
        return final_blobs(session)


def assert_equal(actual: dict[str, object], expected: dict[str, object]) -> None:
    for name, value in expected.items():
        if isinstance(value, np.ndarray):
            assert actual[name].tobytes() == value.tobytes(), name
        else:
            assert actual[name] == value, name


@pytest.mark.parametrize(
    ("options", "error", "names"),
    [
        ({"in_memory": "yes"}, DefinitionTypeError, "in_memory"),
        ({"durable_every": 5}, JobDefinitionError, "durable_every"),
        ({"replicas": 2}, JobDefinitionError, "replicas"),
        ({"durable_interval": 30}, JobDefinitionError, "durable_interval"),
        ({"in_memory": True, "durable_every": 0}, JobDefinitionError, "durable_every"),
        ({"in_memory": True, "durable_every": 2.0}, DefinitionTypeError, "durable_every"),
        ({"in_memory": True, "replicas": -1}, JobDefinitionError, "replicas"),
        ({"in_memory": True, "replicas": True}, DefinitionTypeError, "replicas"),
        ({"in_memory": True, "durable_interval": 0}, JobDefinitionError, "durable_interval"),
        ({"in_memory": True, "durable_interval": "1m"}, DefinitionTypeError, "durable_interval"),
        ({"in_memory": True, "async_save": True}, JobDefinitionError, "async_save"),
    ],
)
def test_invalid_options_are_refused_naming_the_option(tmp_path, options, error, names):
    """Each tier-0 option is checked at construction: a TypeError or ValueError subclass of daskjobs'
    naming the option; the options of tier 0 need ``in_memory=True``."""
    with pytest.raises(error, match=names):
        dj.MultiNodeCheckpointManager(str(tmp_path), **options)


@pytest.mark.parametrize("options", [{"durable_every": 5}, {"durable_interval": 10.0}])
def test_without_a_prefix_durable_options_are_refused(options):
    """``db_prefix=None`` writes nothing durable: its schedule options are refused, and without
    ``in_memory`` a manager needs a prefix."""
    with pytest.raises(JobDefinitionError, match=next(iter(options))):
        dj.MultiNodeCheckpointManager(None, in_memory=True, **options)
    with pytest.raises(JobDefinitionError, match="in_memory=True"):
        dj.MultiNodeCheckpointManager(None)


def test_tier0_is_off_by_default_and_its_defaults_when_on(tmp_path):
    """Tier 0 is off unless asked for; on, one replica and a durable commit every 10 epochs."""
    assert dj.MultiNodeCheckpointManager(str(tmp_path)).memory_options is None
    assert dj.MultiNodeCheckpointManager(str(tmp_path), in_memory=True).memory_options == MemoryOptions(1, 10, None)
    assert dj.MultiNodeCheckpointManager(None, in_memory=True).memory_options == MemoryOptions(1, None, None)


@pytest.mark.parametrize(
    ("epoch", "last", "newest", "since", "due"),
    [
        (0, False, None, None, True),  # epoch 0
        (5, False, 0, 1.0, True),  # a multiple of durable_every
        (6, False, 5, 1.0, False),
        (7, True, 5, 1.0, True),  # the last epoch
        (8, False, 5, 31.0, True),  # durable_interval passed
        (16, False, 5, 1.0, True),  # the durable tier lags: a durable write was given up
        (9, False, None, 1.0, True),  # nothing durable yet
    ],
)
def test_which_epochs_are_durable(epoch, last, newest, since, due):
    """Epoch 0, every multiple of durable_every, the last epoch, one durable_interval seconds after
    the last durable one, and one whenever the durable tier lags more than durable_every behind."""
    options = MemoryOptions(replicas=1, durable_every=5, durable_interval=30.0)
    assert options.durable_due(epoch, last=last, newest_durable=newest, since=since) is due


def test_a_local_session_keeps_every_epoch_in_memory_and_every_nth_durably(tmp_path, reference):
    """On a LocalSession tier 0 is a copy in the process: every epoch is committed in memory, epochs
    0, 5, 10 and the last durably; list_checkpoints sees the durable ones only; the history and
    on_epoch records say which tier holds each epoch; the results equal a run without checkpoints."""
    prefix = str(tmp_path / "ckpt")
    seen = []
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=5)
    runner = dj.JobRunner(define_job(), manager, progress=False, on_epoch=lambda r: seen.append((r.epoch, r.tier)))
    with dj.LocalSession() as session:
        assert runner.train(session) == EPOCHS
        assert_equal(final_blobs(session), reference)
    durable = [5, 10, 12]
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, *durable]
    tiers = [(r.epoch, "durable" if r.epoch in durable else "memory") for r in runner.history]
    assert [(r.epoch, r.tier) for r in runner.history] == tiers
    assert seen == tiers
    assert all(r.tier0_bytes == {"this process": r.tier0_bytes["this process"]} for r in runner.history)
    assert runner.history[-1].bytes_written > 0
    assert runner.history[1].bytes_written == 0
    assert "tier='durable'" in repr(runner)
    assert "tier0_bytes={'this process':" in repr(runner)
    frame = runner.history_frame()
    assert list(frame["tier"])[:5] == ["memory", "memory", "memory", "memory", "durable"]


def test_a_resumed_run_goes_on_from_the_newest_durable_commit(tmp_path, reference):
    """A run that stops (here by max_epochs, between durable epochs) commits its last epoch durably;
    a new run resumes from it and ends equal to an uninterrupted run."""
    prefix = str(tmp_path / "ckpt")

    def run(max_epochs: int | None) -> dj.JobRunner:
        manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=5)
        runner = dj.JobRunner(define_job(), manager, max_epochs=max_epochs, progress=False)
        with dj.LocalSession() as session:
            runner.train(session)
            runner.blobs = final_blobs(session)  # type: ignore[attr-defined]
        return runner

    first = run(7)
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 5, 7]
    second = run(None)
    assert [r.epoch for r in second.history] == list(range(8, EPOCHS + 1))
    assert_equal(second.blobs, reference)  # type: ignore[attr-defined]
    assert first.history[-1].tier == "durable"


def test_a_graceful_stop_commits_the_running_epoch_durably(tmp_path, reference):
    """A stop asked for after a memory-only epoch (what SIGTERM does) commits that epoch under the
    prefix before the run ends; resuming ends equal."""
    prefix = str(tmp_path / "ckpt")

    class StopAt(dj.RunnerHooks):
        runner: dj.JobRunner

        def epoch_saved(self, epoch):
            if epoch == 3:
                self.runner.request_stop()

    hooks = StopAt()
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=5)
    runner = hooks.runner = dj.JobRunner(define_job(), manager, progress=False, hooks=hooks)
    with dj.LocalSession() as session, pytest.raises(JobInterruptedError, match="epoch 3 is committed"):
        runner.train(session)
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 3]
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=5)
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), manager, progress=False).train(session)
        assert_equal(final_blobs(session), reference)


def test_durable_interval_adds_durable_epochs(tmp_path):
    """With ``durable_interval`` an epoch that many seconds after the last durable one is durable too."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=100, durable_interval=1e-9)
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(4), manager, progress=False).train(session)
    assert [info.epoch for info in dj.list_checkpoints(prefix)] == [0, 1, 2, 3, 4]


def test_without_a_prefix_nothing_is_written(tmp_path, reference):
    """``db_prefix=None`` with ``in_memory=True``: every epoch is committed in memory only, nothing is
    written anywhere, and the run ends equal."""
    manager = dj.MultiNodeCheckpointManager(None, in_memory=True)
    runner = dj.JobRunner(define_job(), manager, progress=False)
    with dj.LocalSession() as session:
        assert runner.train(session) == EPOCHS
        assert_equal(final_blobs(session), reference)
    assert {r.tier for r in runner.history} == {"memory"}
    assert "db_prefix=None" in repr(manager)
    assert not list(tmp_path.iterdir())


def test_a_session_without_tier0_is_refused_with_a_clear_error(tmp_path):
    """A session kind that keeps no snapshots in memory fails the run at its first save, naming it."""

    class Bare(dj.LocalSession):
        @property
        def memory(self):
            return None

    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"), in_memory=True)
    with Bare() as session, pytest.raises(CheckpointWriteError, match="Bare keeps no checkpoints in cluster memory"):
        dj.JobRunner(define_job(), manager, progress=False).train(session)
