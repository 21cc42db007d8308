"""Flat for days (SPEC §4): no per-epoch growth of Dask bookkeeping, and RSS growth per 1000 epochs.

The short test counts what a leak would leave behind, exactly; the soak test (``-m soak``,
excluded from the default run) measures RSS of the driver and every worker over 2000 epochs.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
import weakref

import dask.config
import numpy as np
import pytest

import daskjobs as dj

SOAK_LIMIT_MB_PER_1000 = 2.0


def define_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="soak") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("w", np.zeros(4)))
            dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1.0), name="step")
            dj.Task(lambda ws: ws.log("loss", 1.0 / (1 + ws.epoch)), name="log")
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", 0))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


def _scheduler_counts(dask_scheduler) -> dict[str, int]:
    spans = dask_scheduler.extensions["spans"]
    return {
        "tasks": len(dask_scheduler.tasks),
        "task_groups": len(dask_scheduler.task_groups),
        "task_prefixes": len(dask_scheduler.task_prefixes),
        "spans": len(spans.spans),
        "span_groups": sum(len(span.groups) for span in spans.spans.values()),
    }


def _worker_counts(dask_worker) -> dict[str, int]:
    return {"tasks": len(dask_worker.state.tasks), "data": len(dask_worker.data)}


def bookkeeping(session: dj.DaskSession) -> dict[str, object]:
    """What the client, scheduler and workers keep, once the last run's releases arrived (only
    the session's anchor task is left, or 5 s passed)."""
    client = session.client
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        on_workers = sum(c["tasks"] for c in client.run(_worker_counts).values())
        if on_workers == 1 and client.run_on_scheduler(_scheduler_counts)["tasks"] == 1:
            break
        time.sleep(0.02)
    return {
        "client_futures": len(client.futures),
        "client_refcount": len(client.refcount),
        "scheduler": client.run_on_scheduler(_scheduler_counts),
        "workers": client.run(_worker_counts),
    }


@pytest.mark.cluster
@pytest.mark.slow
def test_dask_bookkeeping_does_not_grow_per_epoch():
    """After warm-up, 250 more epochs leave exactly as many futures, tasks, task groups, prefixes,
    spans and span groups as before (each run used to add a task group to a span, forever)."""
    counts = {}
    with dj.node_cluster(["a", "b"], processes=False) as cluster, dj.DaskSession(cluster) as session:

        def on_epoch(record: dj.EpochRecord) -> None:
            if record.epoch in (50, 300):
                counts[record.epoch] = bookkeeping(session)

        dj.JobRunner(define_job(), max_epochs=300, on_epoch=on_epoch, progress=False).train(session)
    assert counts[300] == counts[50]
    assert counts[300]["client_futures"] == 1  # the session's anchor
    assert counts[300]["scheduler"]["task_groups"] == 1
    assert counts[300]["scheduler"]["spans"] == 1


@pytest.mark.cluster
def test_a_client_the_user_made_keeps_a_bounded_message_log():
    """``Client(cluster)`` (not made by daskjobs) keeps the last 1000 messages it sent, each run's
    serialized graph among them: megabytes growing for a job's first thousand epochs. A
    DaskSession on it keeps 100, the newest (Dask's own setting is not changed)."""
    from distributed import Client

    with dj.node_cluster(["a", "b"], processes=False) as cluster, Client(cluster) as client:
        assert client.scheduler_comm.recent_message_log.maxlen == 1000
        with dj.DaskSession(client) as session:
            dj.JobRunner(define_job(), max_epochs=150, progress=False).train(session)
            log = client.scheduler_comm.recent_message_log
            assert (log.maxlen, len(log)) == (100, 100)
            assert any("update-graph" in str(message)[:2000] for message in list(log)[-5:])
        assert dask.config.get("distributed.admin.low-level-log-length") == 1000


@pytest.mark.cluster
def test_dask_remembers_a_bounded_number_of_key_prefixes():
    """Dask's ``key_split`` remembers the prefix of its last 100 000 keys, and every epoch makes new
    ones (the tasks', and with tier 0 the snapshots'): half a kilobyte per key, megabytes per
    thousand epochs in the driver and in every worker. The driver and the workers keep it at most
    ``KEY_CACHE_LIMIT`` keys (and an epoch's) long. In-process workers share the driver's cache."""
    from dask.utils import key_split

    from daskjobs.session._growth import KEY_CACHE_LIMIT

    sizes = []
    with dj.node_cluster(["a", "b"], processes=False) as cluster, dj.DaskSession(cluster) as session:
        key_split.cache_clear()
        manager = dj.MultiNodeCheckpointManager(None, in_memory=True)
        runner = dj.JobRunner(
            define_job(), manager, max_epochs=200, progress=False, on_epoch=lambda r: sizes.append(_cached_keys())
        )
        runner.train(session)
    assert len(sizes) == 200
    assert max(sizes) <= KEY_CACHE_LIMIT + 20, max(sizes)
    assert any(later < earlier for earlier, later in itertools.pairwise(sizes))  # it was emptied, and grew again


@pytest.mark.cluster
def test_worker_processes_remember_a_bounded_number_of_key_prefixes(shared_cluster):
    """Workers in processes of their own (``node_cluster``'s) trim their own ``key_split`` cache: with
    tier 0 each sees three new keys per epoch (its node's task, its bundle, its peer's replica)."""
    from daskjobs.session._growth import KEY_CACHE_LIMIT

    epochs = KEY_CACHE_LIMIT // 3 + 50
    with dj.DaskSession(shared_cluster) as session:
        manager = dj.MultiNodeCheckpointManager(None, in_memory=True)
        dj.JobRunner(define_job(), manager, max_epochs=epochs, progress=False).train(session)
        sizes = session.client.run(_cached_keys)
    assert len(sizes) == 2
    assert max(sizes.values()) <= KEY_CACHE_LIMIT + 20, sizes


@pytest.mark.cluster
def test_the_scheduler_keeps_one_note_per_kind_of_submission():
    """The scheduler notes in a span the kind of every submission (``{"type": "Future"}`` per
    ``client.submit``, one per node and epoch) and keeps the notes as long as the span lives: the
    session has it drop the repeated ones every ``TRIM_SPANS_EVERY`` tasks submitted."""
    from daskjobs.session._growth import TRIM_SPANS_EVERY

    epochs = TRIM_SPANS_EVERY // 2 + 100  # two submissions per epoch: one trim
    with dj.node_cluster(["a", "b"], processes=False) as cluster, dj.DaskSession(cluster) as session:
        dj.JobRunner(define_job(), max_epochs=epochs, progress=False).train(session)
        notes = session.client.run_on_scheduler(_span_notes)
    assert notes["Future"] <= 2 * epochs + 10 - TRIM_SPANS_EVERY, notes  # 2 per epoch since the trim
    assert notes["Future"] >= 150, notes


def _span_notes(dask_scheduler) -> dict[str, int]:
    import collections

    spans = dask_scheduler.extensions["spans"].spans.values()
    notes = [note for span in spans for note in (span._metadata or {}).get("collections", [])]
    return dict(collections.Counter(note["type"] for note in notes))


@pytest.mark.slow
def test_the_scheduler_needs_no_daskjobs_to_trim_its_notes():
    """The function the scheduler runs is pickled by value: a process in which daskjobs cannot be
    imported (a ``dask scheduler`` without it) loads and runs it."""
    import subprocess
    import sys

    import cloudpickle

    from daskjobs.session._growth import _span_notes_trimmer

    run = (
        "import sys, pickle; sys.modules['daskjobs'] = None; "
        "trim = pickle.loads(sys.stdin.buffer.read()); print(trim(object()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", run], input=cloudpickle.dumps(_span_notes_trimmer()), capture_output=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, b"0", b"")


def _cached_keys() -> int:
    from dask.utils import key_split

    return key_split.cache_info().currsize


def _group_with_edges() -> dj.TaskGroup:
    with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
        made = dj.Task(lambda ws: ws.__setitem__("x", np.arange(3)), node="a", outputs="x")
        dj.Task(lambda ws: ws.__setitem__("y", ws["x"] * 2), node="a", inputs={"x": made.outputs()[0]})
    return group


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_group_with_edges, id="group"),
        pytest.param(lambda: dj.Task(lambda ws: ws.__setitem__("z", 1), node="a"), id="task"),
    ],
)
def test_what_ran_once_is_freed_with_it(session, make):
    """A group (or a task, wrapped in a group) run once and dropped leaves nothing behind: its plan,
    packed steps and wrapping group are cached only as long as it lives. (A recovery runs new
    restore groups; each used to stay forever, with its plans and pickled steps.)"""
    runnable = make()
    session.run(runnable)
    session.run(runnable)  # cached while it lives
    freed = weakref.ref(runnable)
    del runnable
    gc.collect()
    assert freed() is None


def _slope_per_1000(points: list[tuple[int, float]]) -> float:
    epochs, values = zip(*points, strict=True)
    return float(np.polyfit(np.asarray(epochs, float), np.asarray(values, float), 1)[0] * 1000)


@pytest.mark.soak
@pytest.mark.cluster
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("in_memory", [False, True], ids=["plain", "tier0"])
def test_rss_growth_per_1000_epochs_is_bounded(in_memory, tmp_path):
    """Driver and worker RSS grow by at most 2 MB per 1000 epochs after warm-up (2000 epochs);
    open files and threads stay constant. Also with every epoch committed in cluster memory and
    every tenth durably (tier 0)."""
    psutil = pytest.importorskip("psutil")
    epochs, warmup, every = 2000, 500, 100
    with dj.node_cluster(["a", "b"]) as cluster, dj.DaskSession(cluster) as session:
        pids = session.client.run(os.getpid)
        processes = {"driver": psutil.Process(), **{addr: psutil.Process(pid) for addr, pid in pids.items()}}
        rss: dict[str, list[tuple[int, float]]] = {name: [] for name in processes}
        handles: dict[str, list[tuple[int, int]]] = {name: [] for name in processes}

        def on_epoch(record: dj.EpochRecord) -> None:
            if record.epoch >= warmup and record.epoch % every == 0:
                gc.collect()
                for name, process in processes.items():
                    rss[name].append((record.epoch, process.memory_info().rss / 2**20))
                    handles[name].append((len(process.open_files()), process.num_threads()))

        manager = dj.MultiNodeCheckpointManager(str(tmp_path), in_memory=True, durable_every=10) if in_memory else None
        dj.JobRunner(define_job(), manager, max_epochs=epochs, on_epoch=on_epoch, progress=False).train(session)
    growth = {name: _slope_per_1000(points) for name, points in rss.items()}
    assert all(value <= SOAK_LIMIT_MB_PER_1000 for value in growth.values()), growth
    assert all(seen[0] == seen[-1] for seen in handles.values()), handles
