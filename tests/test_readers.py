"""Readers: ArrayReader batches (numpy and Zarr), ReaderWithLimit, pipe, bad input, the Caffe2 Job example."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import zarr

import daskjobs as dj
from daskjobs.data import epochs_until_finished
from daskjobs.errors import JobDefinitionError, StepTypeError, TaskFailedError


def record(ws, batch):
    """Processor: append the batch's record ids (and the epoch) to checkpointed blobs."""
    ids = batch[0] if isinstance(batch, tuple) else batch
    with ws.lock:
        ws["seen"] = np.append(ws["seen"], ids)
        ws["seen_epoch"] = np.append(ws["seen_epoch"], np.full(len(ids), ws.epoch, dtype=np.int64))


def init_seen(ws):
    ws["seen"] = np.zeros(0, dtype=np.int64)
    ws["seen_epoch"] = np.zeros(0, dtype=np.int64)


def reading_job(*sources, num_iter=None, num_threads=1, node="a", **reader_kwargs):
    """A job whose only work is to record the ids its reader hands out; stops on data_finished."""
    with dj.Cluster(), dj.Job(name="read") as job, dj.Node(node):
        with job.init_group:
            reader = dj.ArrayReader(*sources, name="ids", **reader_kwargs)
            dj.Task(init_seen)
        limited = dj.ReaderWithLimit(reader, num_iter=num_iter)
        dj.pipe(limited, record, num_threads=num_threads)
        job.add_stop_condition(limited.data_finished())
    return job, limited


def run_reading(job, session=None, **runner_kwargs):
    own = session is None
    session = session or dj.LocalSession()
    try:
        runner = dj.JobRunner(job, progress=False, **runner_kwargs)
        last = runner.train(session)
        return last, session.fetch("seen", "a"), session.fetch("seen_epoch", "a")
    finally:
        if own:
            session.close()


def expected_order(n, batch_size, passes, shuffle=False, seed=0, shard=(0, 1), drop_last=False):
    """What ArrayReader promises: per pass, the shard's records, permuted by (seed, pass)."""
    out = []
    for p in range(passes):
        order = np.arange(shard[0], n, shard[1])
        if shuffle:
            order = order[np.random.default_rng([seed, p]).permutation(len(order))]
        if drop_last:
            order = order[: len(order) - len(order) % batch_size]
        out.append(order)
    return np.concatenate(out)


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 4},
        {"batch_size": 4, "shuffle": True, "seed": 3, "num_passes": 3},
        {"batch_size": 3, "shard": (1, 3), "num_passes": 2},
        {"batch_size": 4, "shard": (2, 4), "shuffle": True, "seed": 9, "num_passes": 2, "drop_last": True},
        {"batch_size": 30},
    ],
    ids=["plain", "shuffle", "shard", "shard-shuffle-droplast", "one-batch"],
)
def test_array_reader_visits_every_record_of_every_pass_once(options):
    """Batches follow the promised order: every pass a (seeded) permutation of the shard's records."""
    job, _ = reading_job(np.arange(22), **options)
    _, seen, _ = run_reading(job)
    passes = options.get("num_passes", 1)
    promised = {k: options[k] for k in ("shuffle", "seed", "shard", "drop_last") if k in options}
    assert np.array_equal(seen, expected_order(22, options["batch_size"], passes, **promised))


def test_shuffle_is_fresh_per_pass_and_a_pure_function_of_seed_and_pass():
    """Two passes differ; the same seed gives the same order; another seed another one."""
    first = run_reading(reading_job(np.arange(50), batch_size=10, shuffle=True, seed=1, num_passes=2)[0])[1]
    again = run_reading(reading_job(np.arange(50), batch_size=10, shuffle=True, seed=1, num_passes=2)[0])[1]
    other = run_reading(reading_job(np.arange(50), batch_size=10, shuffle=True, seed=2, num_passes=2)[0])[1]
    assert np.array_equal(first, again)
    assert not np.array_equal(first[:50], first[50:])
    assert sorted(first[:50]) == sorted(first[50:]) == list(range(50))
    assert not np.array_equal(first, other)


def test_batches_are_tuples_of_rows_of_every_source():
    """Several sources give a tuple of row-aligned arrays; one source gives the array itself."""
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10) * 10
    batches = []
    with dj.Cluster(), dj.Job() as job:
        with job.init_group:
            pair = dj.ArrayReader(x, y, batch_size=4, shuffle=True, name="pair")
            single = dj.ArrayReader(y, batch_size=4, name="single")
        dj.pipe(pair, lambda ws, b: batches.append(("pair", b)))
        dj.pipe(single, lambda ws, b: batches.append(("single", b)))
    dj.JobRunner(job, max_epochs=1, progress=False).train(None)
    pairs = [b for kind, b in batches if kind == "pair"]
    singles = [b for kind, b in batches if kind == "single"]
    assert all(isinstance(b, tuple) and len(b) == 2 for b in pairs)
    assert all(np.array_equal(bx[:, 0] * 5, by) for bx, by in pairs)
    assert [len(b) for b in singles] == [4, 4, 2]
    assert all(isinstance(b, np.ndarray) for b in singles)


def test_limit_counts_per_epoch_and_data_finished_turns_true_with_the_last_batch():
    """num_iter batches per epoch; data_finished is true in the epoch that read the last batch."""
    job, limited = reading_job(np.arange(10), batch_size=2, num_iter=2)
    last, seen, seen_epoch = run_reading(job)
    assert last == 3
    assert np.array_equal(seen, np.arange(10))
    assert np.array_equal(seen_epoch, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    assert int(limited.counter().fetch()) == 1
    assert bool(limited.data_finished().fetch()) is True


def test_limit_hit_is_not_data_finished():
    """An epoch that stops at its limit leaves data_finished false; num_iter=0 reads nothing."""
    job, limited = reading_job(np.arange(10), batch_size=2, num_iter=2)
    runner = dj.JobRunner(job, max_epochs=1, progress=False)
    runner.train(None)
    assert runner.history[-1].stop_values == {limited.data_finished().names[0]: False}
    job, limited = reading_job(np.arange(10), batch_size=2, num_iter=0)
    last, seen, _ = run_reading(job, max_epochs=2)
    assert (last, len(seen), int(limited.counter().fetch())) == (2, 0, 0)


def test_endless_reader_keeps_reading_across_passes():
    """num_passes=None never ends: the job stops on max_epochs."""
    job, _ = reading_job(np.arange(6), batch_size=4, num_iter=3, num_passes=None)
    last, seen, _ = run_reading(job, max_epochs=2)
    assert last == 2
    assert np.array_equal(seen, np.tile(np.arange(6), 3))


def test_hogwild_threads_share_the_batches_exactly_once():
    """num_threads=4: every batch processed once, by any thread."""
    job, _ = reading_job(np.arange(200), batch_size=3, num_iter=20, num_threads=4, shuffle=True)
    _, seen, seen_epoch = run_reading(job)
    assert sorted(seen) == list(range(200))
    assert np.bincount(seen_epoch)[1:].tolist() == [60, 60, 60, 20]


@pytest.mark.parametrize("kind", ["array", "path", "file-url"])
def test_zarr_sources_are_read_on_the_node(tmp_path, kind):
    """A zarr.Array, a path and a file:// URL (with storage_options) read like numpy sources."""
    path = tmp_path / "ids.zarr"
    stored = zarr.create_array(str(path), shape=(30,), chunks=(7,), dtype="i8")
    stored[:] = np.arange(30)
    source = {"array": stored, "path": str(path), "file-url": f"file://{path}"}[kind]
    options = {"storage_options": {"auto_mkdir": False}} if kind == "file-url" else {}
    job, _ = reading_job(source, np.arange(30) * 2, batch_size=4, shuffle=True, num_passes=2, shard=(1, 2), **options)
    _, seen, _ = run_reading(job)
    assert np.array_equal(seen, expected_order(30, 4, 2, shuffle=True, shard=(1, 2)))


def test_zarr_source_on_s3_with_storage_options(s3_prefix):
    """A Zarr URL on (moto) S3 is opened on the node with the reader's storage_options."""
    url, options = s3_prefix
    source = url.rsplit("/", 1)[0] + "/ids.zarr"
    stored = zarr.create_array(source, shape=(25,), chunks=(10,), dtype="i8", storage_options=options)
    stored[:] = np.arange(25)
    job, _ = reading_job(source, batch_size=4, shuffle=True, seed=4, storage_options=options)
    _, seen, _ = run_reading(job)
    assert np.array_equal(seen, expected_order(25, 4, 1, shuffle=True, seed=4))


@pytest.mark.cluster
def test_reading_on_a_cluster_equals_local(session, tmp_path):
    """The same reading job gives the same sequence on every session kind (Zarr read on the worker)."""
    path = tmp_path / "x.zarr"
    stored = zarr.create_array(str(path), shape=(40, 3), chunks=(8, 3), dtype="f4")
    stored[:] = np.arange(120).reshape(40, 3)
    job, _ = reading_job(np.arange(40), str(path), batch_size=6, shuffle=True, num_passes=2, num_iter=5)
    _, seen, seen_epoch = run_reading(job, session)
    assert np.array_equal(seen, expected_order(40, 6, 2, shuffle=True))
    assert seen_epoch.max() == 3


def test_numpy_sources_travel_with_the_init_task_only():
    """The epoch task's payload does not contain the data; the init task's does."""
    import cloudpickle

    data = np.random.default_rng(0).normal(size=(50_000, 4))
    job, _ = reading_job(data[:, 0].copy(), data, batch_size=100)
    epoch_tasks = job.epoch_group.tasks()
    init_tasks = job.init_group.tasks()
    assert max(len(cloudpickle.dumps(t.steps)) for t in epoch_tasks) < 20_000
    assert max(len(cloudpickle.dumps(t.steps)) for t in init_tasks) > data.nbytes
    assert len(pickle.dumps(job.init_group.tasks()[0].steps[0].reader)) < 20_000


def test_reader_state_is_blobs_under_its_name():
    """The position and the numpy sources are blobs reader.<name>.*; the limiter's blobs are per epoch."""
    job, _ = reading_job(np.arange(8), np.ones(8), batch_size=4, num_iter=1)
    with dj.LocalSession() as session:
        dj.JobRunner(job, max_epochs=1, progress=False).train(session)
        blobs = set(session.blobs("a"))
        assert {"reader.ids.position", "reader.ids.source.0", "reader.ids.source.1"} <= blobs
        assert session.fetch("reader.ids.position", "a").tolist() == [0, 4]
        assert not any("limit" in b for b in blobs)


class FileListReader(dj.Reader):
    """A custom reader whose whole state is one JSON value: the files left and the current one's offset."""

    def __init__(self, files, name="files"):
        self.files = files
        super().__init__(name=name)

    def setup(self, ws):
        ws[self.blob("state")] = {"left": list(self.files), "offset": 0}

    def read(self, ws):
        state = ws[self.blob("state")]
        if not state["left"]:
            return None
        current, offset = state["left"][0], state["offset"]
        if offset + 2 >= len(current):
            ws[self.blob("state")] = {"left": state["left"][1:], "offset": 0}
        else:
            ws[self.blob("state")] = {"left": state["left"], "offset": offset + 2}
        return np.array([ord(c) for c in current[offset : offset + 2]])


def custom_job():
    with dj.Cluster(), dj.Job(name="custom") as job, dj.Node("a"):
        with job.init_group:
            reader = FileListReader(["abcde", "fgh", "ijklmnop"])
            dj.Task(init_seen)
        limited = dj.ReaderWithLimit(reader, num_iter=2)
        dj.pipe(limited, record)
        job.add_stop_condition(limited.data_finished())
    return job


def test_custom_reader_with_json_state_continues_where_it_was():
    """A dj.Reader subclass keeping a JSON value as state: a job defined again continues from its blobs."""
    _, expected, expected_epoch = run_reading(custom_job())
    with dj.LocalSession() as session:
        dj.JobRunner(custom_job(), max_epochs=2, progress=False).train(session)
        assert session.fetch("reader.files.state", "a") == {"left": ["fgh", "ijklmnop"], "offset": 2}
        last, seen, seen_epoch = run_reading(custom_job(), session, resume_from_epoch=2)
    assert last == 5
    assert "".join(map(chr, seen)) == "abcdefghijklmnop" == "".join(map(chr, expected))
    assert np.array_equal(seen_epoch, expected_epoch)


def test_custom_reader_with_json_state_resumes_exactly(prefix):
    """A dj.Reader subclass keeping a JSON value as state resumes from a checkpoint where it was."""
    _, expected, expected_epoch = run_reading(custom_job())
    dj.JobRunner(custom_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False).train(None)
    assert dj.open_checkpoint(prefix)["a"]["reader.files.state"] == {"left": ["fgh", "ijklmnop"], "offset": 2}
    last, seen, seen_epoch = run_reading(custom_job(), checkpoint_manager=dj.MultiNodeCheckpointManager(prefix))
    assert last == 5
    assert "".join(map(chr, seen)) == "abcdefghijklmnop" == "".join(map(chr, expected))
    assert np.array_equal(seen_epoch, expected_epoch)


@pytest.mark.parametrize(
    ("source", "options"),
    [
        (np.zeros(0, dtype=np.int64), {"batch_size": 2}),
        (np.arange(3), {"batch_size": 1, "shard": (5, 8), "num_passes": 3}),
        (np.arange(3), {"batch_size": 4, "drop_last": True}),
    ],
    ids=["empty-source", "empty-shard", "no-whole-batch"],
)
def test_a_reader_without_a_batch_is_exhausted_in_the_first_epoch(prefix, source, options):
    """An empty source or shard (finite passes) reads nothing: data_finished is true after epoch 1,
    and epoch 1's checkpoint holds the exhausted position."""
    job, limited = reading_job(source, num_iter=2, **options)
    assert epochs_until_finished(limited.data_finished()) == 1
    last, seen, _ = run_reading(job)
    assert (last, seen.tolist()) == (1, [])
    job, limited = reading_job(source, **options)
    run_reading(job, checkpoint_manager=dj.MultiNodeCheckpointManager(prefix))
    assert list(dj.list_checkpoints(prefix)[-1].stop_values.values()) == [True]
    position = dj.open_checkpoint(prefix)["a"][limited.reader.blob("position")]
    assert position.tolist() == [options.get("num_passes", 1), 0]


# -- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sources", "options", "match"),
    [
        ((np.arange(5), np.arange(6)), {"batch_size": 2}, "different lengths"),
        ((np.arange(5),), {"batch_size": 0}, "batch_size"),
        ((np.arange(5),), {"batch_size": True}, "batch_size"),
        ((np.arange(5),), {"batch_size": 2, "shard": (2, 2)}, "shard"),
        ((np.arange(5),), {"batch_size": 2, "shard": (0, 0)}, "shard"),
        ((np.arange(5),), {"batch_size": 2, "shard": 3}, "shard"),
        ((np.arange(5),), {"batch_size": 2, "num_passes": 0}, "num_passes"),
        ((np.arange(5),), {"batch_size": 2, "num_passes": 1.5}, "num_passes"),
        ((np.arange(5),), {"batch_size": 2, "seed": -1}, "seed"),
        ((np.arange(3),), {"batch_size": 4, "drop_last": True, "num_passes": None}, "not one batch"),
        ((np.arange(3),), {"batch_size": 1, "shard": (5, 8), "num_passes": None}, "read it forever"),
        ((np.zeros(0),), {"batch_size": 1, "num_passes": None}, "not one batch"),
        ((np.array(3),), {"batch_size": 1}, "0-d"),
        ((np.array([object()]),), {"batch_size": 1}, "dtype object"),
        ((np.ma.masked_array([1, 2]),), {"batch_size": 1}, "subclass"),
        (({"a": 1},), {"batch_size": 1}, "not a numpy array"),
        ((), {"batch_size": 1}, "at least one source"),
    ],
)
def test_bad_arguments_raise_at_construction_naming_the_reader(sources, options, match):
    """Each bad argument raises JobDefinitionError (a ValueError) naming the reader, before anything runs."""
    with dj.Cluster(), dj.Job() as job, job.init_group, pytest.raises(JobDefinitionError, match=match) as info:
        dj.ArrayReader(*sources, name="broken", **options)
    assert "'broken'" in str(info.value)
    assert job.init_group.num_registered_tasks() == 0


def test_an_unnamed_readers_errors_use_its_default_name():
    """A reader without name= is named reader0, reader1, ... in its group; its errors say so."""
    with dj.Cluster(), dj.Job() as job, job.init_group:
        assert dj.ArrayReader(np.arange(3), batch_size=1).name == "reader0"
        with pytest.raises(JobDefinitionError, match="reader 'reader1': batch_size"):
            dj.ArrayReader(np.arange(3), batch_size=0)


@pytest.mark.parametrize("kind", ["missing", "group"])
def test_unreadable_zarr_fails_the_init_group_before_anything_is_committed(tmp_path, prefix, kind):
    """A missing or non-array Zarr path fails in the init group, naming the reader; nothing is committed."""
    path = tmp_path / "source.zarr"
    if kind == "group":
        zarr.open_group(str(path), mode="w")
    job, _ = reading_job(str(path), batch_size=2)
    with pytest.raises(TaskFailedError, match="'ids'") as info:
        dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), progress=False).train(None)
    assert isinstance(info.value.__cause__, JobDefinitionError)
    assert isinstance(info.value, ValueError)  # a TaskValueError: except ValueError catches it too
    assert ("no Zarr array" if kind == "missing" else "group") in str(info.value)
    assert dj.list_checkpoints(prefix) == []


def test_zarr_length_mismatch_fails_the_init_group(tmp_path):
    """A Zarr URL whose length differs from the other sources fails when the init group runs."""
    stored = zarr.create_array(str(tmp_path / "short.zarr"), shape=(4,), dtype="i8")
    stored[:] = 1
    job, _ = reading_job(np.arange(5), str(tmp_path / "short.zarr"), batch_size=2)
    with pytest.raises(TaskFailedError, match="'ids': sources have different lengths"):
        run_reading(job)


def test_pipe_and_limit_misuse_name_the_reader():
    """Not callable, async, bad num_threads, no group, another node, limit in the init group."""
    with dj.Cluster(), dj.Job() as job:
        with job.init_group, dj.Node("a"):
            reader = dj.ArrayReader(np.arange(4), batch_size=2, name="r")
        with pytest.raises(StepTypeError, match=r"'r'.*callable"):
            dj.pipe(reader, "not a function")

        async def processor(ws, batch):
            return None

        def generator(ws, batch):
            yield batch

        class AsyncCall:
            async def __call__(self, ws, batch):
                return None

        with pytest.raises(StepTypeError, match=r"'r'.*async def"):
            dj.pipe(reader, processor)
        with pytest.raises(StepTypeError, match=r"'r'.*generator function"):
            dj.pipe(reader, generator)
        with pytest.raises(StepTypeError, match=r"'r'.*__call__ is an async def"):
            dj.pipe(reader, AsyncCall())
        with pytest.raises(TypeError, match=r"'r'.*async def"):
            dj.pipe(reader, functools.partial(processor))
        with pytest.raises(JobDefinitionError, match=r"'r'.*num_threads"):
            dj.pipe(reader, record, num_threads=0)
        with dj.Node("b"), pytest.raises(JobDefinitionError, match="reader 'r' was built on node 'a'"):
            dj.pipe(reader, record)
        with dj.Node("b"), pytest.raises(JobDefinitionError, match="reader 'r' was built on node 'a'"):
            dj.ReaderWithLimit(reader)
        with job.init_group, pytest.raises(JobDefinitionError, match=r"'r'.*epoch group"):
            dj.ReaderWithLimit(reader)
        with pytest.raises(JobDefinitionError, match=r"'r'.*num_iter"):
            dj.ReaderWithLimit(reader, num_iter=-1)
        with job.init_group, dj.Node("a"), pytest.raises(JobDefinitionError, match="'r' already exists"):
            dj.ArrayReader(np.arange(4), batch_size=2, name="r")
    with pytest.raises(JobDefinitionError, match=r"'r'.*needs an active TaskGroup"):
        dj.pipe(reader, record)
    with dj.Cluster(), pytest.raises(JobDefinitionError, match="init_group"):
        dj.ArrayReader(np.arange(4), batch_size=2)
    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.PRIVATE), pytest.raises(JobDefinitionError, match="PRIVATE"):
        dj.ArrayReader(np.arange(4), batch_size=2)


async def _process_later(ws, batch):
    return None


def test_processor_returning_a_coroutine_fails_its_task():
    """A processor whose call returns a coroutine fails its task with a StepTypeError cause, as a step does."""
    with dj.Cluster(), dj.Job(name="read") as job, dj.Node("a"):
        with job.init_group:
            reader = dj.ArrayReader(np.arange(4), batch_size=2, name="ids")
        limited = dj.ReaderWithLimit(reader)
        dj.pipe(limited, lambda ws, batch: _process_later(ws, batch))
        job.add_stop_condition(limited.data_finished())
    with pytest.raises(TaskFailedError, match=r"reader 'ids\.limit' returned coroutine") as info:
        dj.JobRunner(job, progress=False).train(None)
    assert isinstance(info.value.__cause__, StepTypeError)


def test_reading_on_another_node_fails_naming_the_reader():
    """A step on node b calling a reader of node a fails its task with an error naming the reader."""
    with dj.Cluster(), dj.Job() as job:
        with job.init_group, dj.Node("a"):
            reader = dj.ArrayReader(np.arange(4), batch_size=2, name="r")
        with dj.Node("b"):
            dj.Task(reader.read)
    with pytest.raises(TaskFailedError, match="reader 'r' was built on node 'a' but is read on node 'b'"):
        dj.JobRunner(job, max_epochs=1, progress=False).train(None)


# -- Caffe2's Job docstring example, translated line by line ----------------------------------------
class Model:
    """A linear model trained hogwild: ``param_init_net`` creates it, calling it trains on a batch."""

    def param_init_net(self, ws):
        ws["w"] = np.zeros(3)
        ws["saved_w"] = np.zeros(3)
        ws["batches"] = np.int64(0)

    def __call__(self, ws, batch):
        x, y = batch
        with ws.lock:
            ws["w"] = ws["w"] - 0.1 * x.T @ (x @ ws["w"] - y) / len(y)
            ws["batches"] = ws["batches"] + 1

    def save_model_net(self, ws):
        ws["saved_w"] = ws["w"].copy()


def build_model(params):
    return Model()


def make_partitions(records=400):
    x = np.random.default_rng(0).normal(size=(records, 3))
    return x, x @ np.array([1.0, -2.0, 0.5])


def caffe2_example_job():
    partitions, params = make_partitions(), None

    def build_reader(partitions):
        with dj.Job.current().init_group:
            reader = dj.ArrayReader(*partitions, batch_size=10, shuffle=True, num_passes=2)
        with dj.Job.current().epoch_group:
            limited_reader = dj.ReaderWithLimit(reader, num_iter=15)
            dj.Job.current().add_stop_condition(limited_reader.data_finished())
        return limited_reader

    def build_hogwild_trainer(reader, model):
        with dj.Job.current().init_group:
            dj.Task(step=model.param_init_net)
        with dj.Job.current().epoch_group:
            dj.pipe(reader, processor=model, num_threads=8)
        with dj.Job.current().exit_group:
            dj.Task(step=model.save_model_net)

    with dj.Cluster(), dj.Job() as job:
        reader = build_reader(partitions)
        model = build_model(params)
        build_hogwild_trainer(reader, model)
    return job


@pytest.mark.cluster
def test_caffe2_job_example_stops_exactly_when_the_data_runs_out(session, prefix):
    """80 batches (2 passes of 40) at 15 per epoch: 6 epochs, the last one reading 5, every batch once."""
    runner = dj.JobRunner(caffe2_example_job(), dj.MultiNodeCheckpointManager(prefix), progress=False)
    assert runner.train(session) == 6
    assert [list(r.stop_values.values()) for r in runner.history] == [[False]] * 5 + [[True]]
    assert int(session.fetch("batches", "local")) == 80
    assert np.allclose(session.fetch("saved_w", "local"), [1.0, -2.0, 0.5], atol=0.05)
    assert dj.open_checkpoint(prefix)["local"]["reader.reader0.position"].tolist() == [2, 0]


def test_epochs_until_finished_predicts_the_last_epoch(tmp_path):
    """The epoch a data_finished stop condition fires in is known up front when the client knows the data."""
    from daskjobs.data import epochs_until_finished

    job = caffe2_example_job()
    assert epochs_until_finished(job.stop_conditions[0]) == 6
    assert dj.JobRunner(job, progress=False).train(None) == 6
    _, limited = reading_job(str(tmp_path / "elsewhere.zarr"), batch_size=2)
    assert epochs_until_finished(limited.data_finished()) is None
    _, limited = reading_job(np.arange(9), batch_size=2, num_passes=None)
    assert epochs_until_finished(limited.data_finished()) is None
    assert epochs_until_finished(limited.counter()) is None


def test_limiter_blob_names_are_per_node():
    """Same-named readers on two nodes get the same limiter blobs; two limiters of one reader do not."""
    with dj.Cluster(), dj.Job() as job:
        limits = []
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    reader = dj.ArrayReader(np.arange(4), batch_size=2, name="shard")
                limits.append(dj.ReaderWithLimit(reader))
        with dj.Node("b"):
            limits.append(dj.ReaderWithLimit(reader, num_iter=1))
    names = [limit.data_finished().names[0] for limit in limits]
    assert names == ["reader.shard.limit.data_finished"] * 2 + ["reader.shard.limit1.data_finished"]


def test_readers_have_readable_reprs():
    """repr and _repr_html_ name the reader, its node and its settings."""
    with dj.Cluster(), dj.Job() as job, dj.Node("a"):
        with job.init_group:
            reader = dj.ArrayReader(np.arange(4), batch_size=2, shuffle=True, name="ids")
        limited = dj.ReaderWithLimit(reader, num_iter=3)
    assert repr(reader).startswith("ArrayReader(name='ids', node='a', sources=1, batch_size=2, shuffle=True")
    assert repr(limited) == f"ReaderWithLimit(reader={reader!r}, num_iter=3)"
    assert "ReaderWithLimit(reader=ArrayReader(name=&#x27;ids&#x27;" in limited._repr_html_()
