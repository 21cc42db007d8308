"""Checkpoints in cluster memory (tier 0, SPEC §3) on process-based clusters: a lost worker's nodes
come back from the snapshots held in the workers' memory, reading nothing from the prefix (every
read of every process under the test's folder is counted, see ``prefix_reads``); when a snapshot has
no copy left they come back from the newest durable commit; a worker that retires hands its
snapshots to others; every run ends equal to an uninterrupted one."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import dask.config
import numpy as np
import pytest
from distributed import LocalCluster
from prefix_reads import ROOT_VARIABLE, reads_everywhere, watch
from processes import wait_until

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.errors import CheckpointWriteError
from daskjobs.session._pool import pool_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

EPOCHS = 8


def init_a(ws):
    ws["weights"] = np.zeros(8)
    ws["rng"] = np.random.default_rng(5).bit_generator.state
    ws["seen"] = np.zeros(0, dtype=np.int64)


def publish(ws):
    rng = np.random.default_rng()
    rng.bit_generator.state = ws["rng"]
    ws["w"] = ws["weights"] + rng.normal(size=8)
    ws["rng"] = rng.bit_generator.state


def record(ws, batch):
    ws["seen"] = np.append(ws["seen"], batch)


def consumer(kill_mark: str | None, kill_epochs: tuple[int, ...]):
    """Node b's step; it kills its own worker in ``kill_epochs`` (once each, marked by files)."""

    def consume(ws):
        time.sleep(0.1)
        if kill_mark is not None and ws.epoch in kill_epochs:
            mark = Path(f"{kill_mark}-{ws.node}-{ws.epoch}")
            if not mark.exists():
                mark.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        ws["history"] = np.append(ws["history"], ws["w"].sum())
        ws["ack"] = ws["w"].sum()

    return consume


def define_job(epochs: int = EPOCHS, kill_mark: str | None = None, kill_epochs: tuple[int, ...] = ()) -> dj.Job:
    """Node a: an RNG-driven model sent to node b every epoch, and a reader; node b: what it received."""
    with dj.Cluster(), dj.Job(name="tier0") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(init_a)
                reader = dj.ArrayReader(np.arange(60), batch_size=2, name="ids")
            published = dj.Task(publish, outputs="w")
            dj.pipe(dj.ReaderWithLimit(reader, num_iter=1), record)
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("history", np.zeros(0)))
            consume = consumer(kill_mark, kill_epochs)
            consumed = dj.Task(consume, inputs={"w": published.outputs()[0]}, outputs="ack")
        with dj.Node("a"):
            dj.Task(
                lambda ws: ws.__setitem__("weights", ws["weights"] + 1.0),
                name="update",
                inputs={"ack": consumed.outputs()[0]},
            )
            dj.epoch_limiter(job, epochs)
    return job


def blobs(session: dj.Session) -> dict[str, object]:
    names = {"a": ["weights", "rng", "seen"], "b": ["history"]}
    return {f"{node}/{name}": session.fetch(name, node) for node, found in names.items() for name in found}


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    with dj.LocalSession() as session:
        dj.JobRunner(define_job(), progress=False).train(session)
        return blobs(session)


def assert_equal(actual: dict[str, object], expected: dict[str, object]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        if isinstance(value, np.ndarray):
            assert actual[name].tobytes() == value.tobytes(), name
        else:
            assert actual[name] == value, name


def assert_durable_commits_equal(prefix: str, expected_epochs: list[int] | None = None) -> None:
    """Every durable commit verifies and holds what a LocalSession run holds at that epoch."""
    committed = [info.epoch for info in dj.list_checkpoints(prefix)]
    if expected_epochs is not None:
        assert committed == expected_epochs
    for epoch in committed:
        with dj.LocalSession() as session:
            if epoch:
                dj.JobRunner(define_job(), progress=False, max_epochs=epoch).train(session)
            else:
                session.run(define_job().init_group)
            view = dj.open_checkpoint(prefix, epoch=epoch)
            for node in ("a", "b"):
                for name, value in view[node].read().items():
                    expected = session.fetch(name, node)
                    if isinstance(value, np.ndarray):
                        assert value.tobytes() == expected.tobytes(), (epoch, node, name)


@pytest.fixture(scope="module")
def watched_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.getbasetemp())
    watch(root)
    return root


@pytest.fixture(scope="module")
def cluster(watched_root):
    """Two pinned workers (a nanny restarts a killed one), each counting its reads under the test folder."""
    os.environ[ROOT_VARIABLE] = watched_root
    with dask.config.set({"distributed.worker.preload": ["prefix_reads"]}), dj.node_cluster(["a", "b"]) as made:
        yield made


@pytest.fixture
def killing(tmp_path):
    """``killing(4, 5)``: the job, node b's step killing its own worker in those epochs (once each)."""
    return lambda *epochs: define_job(kill_mark=str(tmp_path / "killed"), kill_epochs=epochs)


class Reads(dj.RunnerHooks):
    """Counts what every process reads under the prefix from the start of epoch ``start`` to the end of
    epoch ``until`` (the first time it ends: after a recovery, the epoch run again)."""

    def __init__(self, client, start: int, until: int) -> None:
        self.client, self.start, self.until = client, start, until
        self.found: dict[str, list[str]] | None = None
        self.counting = False

    def before_epoch(self, epoch: int) -> None:
        if epoch == self.start and not self.counting and self.found is None:
            reads_everywhere(self.client)
            self.counting = True

    def epoch_saved(self, epoch: int) -> None:
        if epoch == self.until and self.counting and self.found is None:
            self.found = reads_everywhere(self.client)


def _tier0_keys_here(dask_worker) -> list[str]:
    return sorted(str(key) for key in dask_worker.data if "-tier0-" in str(key))


def _tier0_keys_known(dask_scheduler) -> list[str]:
    return sorted(str(key) for key in dask_scheduler.tasks if "-tier0-" in str(key))


def tier0_keys(client) -> tuple[dict[str, list[str]], list[str]]:
    """The tier-0 keys each worker holds (those holding some), and those the scheduler knows."""
    held = {worker: keys for worker, keys in client.run(_tier0_keys_here).items() if keys}
    return held, client.run_on_scheduler(_tier0_keys_known)


def restored_from(runner: dj.JobRunner) -> int:
    """The epoch the (single) recovery restored: the one before the first record made after it."""
    return next(r.epoch for r in runner.history if r.recoveries) - 1


def test_a_worker_killed_mid_epoch_comes_back_from_memory_reading_nothing(cluster, tmp_path, killing, reference):
    """Node b's worker dies in epoch 4 (epoch 3 committed in memory while it runs): every node is
    restored from epoch 3's snapshots in the workers' memory — no process reads anything under the
    prefix from the kill to the end of the epoch run again — only epoch 4 runs again, and the run
    ends equal, its durable commits (epoch 0 and the last) too."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=10)
    with dj.DaskSession(cluster) as session:
        reads = Reads(session.client, 4, 4)
        runner = dj.JobRunner(killing(4), manager, max_failures=1, progress=False, hooks=reads)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert (tmp_path / "killed-b-4").exists()
    assert restored_from(runner) == 3
    assert reads.found == {}
    assert [r.tier for r in runner.history] == ["memory"] * (EPOCHS - 1) + ["durable"]
    assert all(len(r.tier0_bytes) == 2 for r in runner.history)
    assert_durable_commits_equal(prefix, [0, EPOCHS])


def init_w(ws):
    ws["w"] = np.zeros(4)


def slow_step(ws):
    time.sleep(0.3)
    ws["w"] = ws["w"] + 1.0


def independent_job() -> dj.Job:
    """Nodes a and b, each on its own, a slow step an epoch."""
    with dj.Cluster(), dj.Job(name="tier0-independent") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init_w)
                dj.Task(slow_step)
        with dj.Node("a"):
            dj.epoch_limiter(job, 6)
    return job


class KillB(dj.RunnerHooks):
    """SIGKILLs node b's worker just after epoch ``epoch`` starts (while both nodes' steps run)."""

    def __init__(self, session: dj.DaskSession, epoch: int) -> None:
        self.session, self.epoch, self.killed = session, epoch, False

    def epoch_running(self, epoch: int) -> None:
        if epoch == self.epoch and not self.killed:
            self.killed = True
            worker = self.session.placement["b"]
            pid = self.session.client.run(os.getpid, workers=[worker])[worker]
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()


def test_a_snapshot_that_could_not_reach_its_dead_replica_holder_is_not_left_behind(cluster, tmp_path):
    """Node b's worker dies early in epoch 3 while node a's step runs on: a's snapshot of epoch 3 then
    cannot go to b's worker (Dask retries the connection for its connect timeout). The run comes back
    from epoch 2 in memory and ends, and a's snapshot of epoch 3 — dropped with its epoch — is not
    left in a's worker (once registered late, nothing would release it while the session lives):
    no tier-0 key remains on any worker, nor on the scheduler."""
    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"), in_memory=True, durable_every=10)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(independent_job(), manager, max_failures=1, progress=False, hooks=KillB(session, 3))
        assert runner.train(session) == 6
        assert restored_from(runner) == 2
        assert session.fetch("w", "a").tolist() == session.fetch("w", "b").tolist() == [6.0] * 4
        wait_until(lambda: tier0_keys(session.client) == ({}, []), 10, "no tier-0 snapshot left on the cluster")


async def _register_late(key: str, owner: str, dask_worker) -> None:
    """What a worker whose push outlived its grace does once the push ends: the key into its memory,
    then registered with the scheduler as the driver's data."""
    dask_worker.update_data(data={key: np.arange(4)}, stimulus_id="late-test")
    await dask_worker.scheduler.update_data(who_has={key: [dask_worker.address]}, nbytes={key: 32}, client=owner)


def test_a_snapshot_registered_after_the_run_released_it_is_released_without_another_run(cluster, monkeypatch):
    """A key the driver released while its registration was still on the way (a push to a peer that
    died outlives the run) registers after the run's last release: the driver releases it again by
    itself, with no later run and with the session still open."""
    monkeypatch.setattr("daskjobs.session._memory._RELEASE_AGAIN_AFTER", 4.0)  # none before it is seen registered
    monkeypatch.setattr("daskjobs.session._memory._RELEASE_LATE_EVERY", 0.5)
    with dj.DaskSession(cluster) as session:
        memory, client = session.memory, session.client
        key = f"daskjobs-{session.session_id}-tier0-7-late-0"

        def where(key: str) -> tuple[list[str], bool]:
            """The workers holding ``key``, and whether the scheduler knows it."""
            held, known = tier0_keys(client)
            return sorted(w for w, keys in held.items() if key in keys), key in known

        memory.hold([key])
        released = time.monotonic()
        memory.release([key])  # the run ended: released before it was registered
        time.sleep(0.5)  # the release travels on the client's batched stream (no reply): let it arrive first
        worker = next(iter(client.scheduler_info()["workers"]))
        client.run(_register_late, key, memory.owner, workers=[worker])
        registered = where(key)
        if time.monotonic() - released < 4.0:  # a machine slow enough to take longer proves nothing here
            assert registered == ([worker], True)
        wait_until(lambda: where(key) == ([], False), 15, "the late snapshot released")


def test_a_worker_and_its_replica_holder_killed_fall_back_to_the_durable_commit(cluster, tmp_path, reference, caplog):
    """Both workers die in epoch 5 (each holds the other's replicas): no snapshot of epoch 4 is left,
    so every node comes back from the newest durable commit (epoch 3) and the run ends equal."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=3)
    with dj.DaskSession(cluster) as session:
        client = session.client

        class KillBoth(dj.RunnerHooks):
            def epoch_running(self, epoch):
                if epoch == 5 and not (tmp_path / "both").exists():
                    (tmp_path / "both").touch()
                    pids = client.run(os.getpid)
                    threading.Timer(0.05, lambda: [os.kill(p, signal.SIGKILL) for p in pids.values()]).start()

        runner = dj.JobRunner(define_job(), manager, max_failures=1, progress=False, hooks=KillBoth())
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert restored_from(runner) == 3
    restoring = [r.getMessage() for r in caplog.records if "restoring all nodes from" in r.getMessage()]
    assert len(restoring) == 1, restoring
    assert restoring[0].endswith("from epoch 3 (recovery 1 of 1)"), restoring
    assert_durable_commits_equal(prefix, [0, 3, 6, EPOCHS])


def test_without_replicas_a_killed_worker_comes_back_from_the_durable_commit(
    cluster, tmp_path, killing, reference, caplog
):
    """``replicas=0``: node b's snapshots live only in its own worker's memory, so when that worker
    dies in epoch 5 no copy of epoch 4 is left: every node comes back from the newest durable commit
    (epoch 3), the run ends equal, and the commits verify."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=3, replicas=0)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(killing(5), manager, max_failures=1, progress=False)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert restored_from(runner) == 3
    assert any("no copy of node 'b'" in r.getMessage() for r in caplog.records)
    restoring = [r.getMessage() for r in caplog.records if "restoring all nodes from" in r.getMessage()]
    assert len(restoring) == 1, restoring
    assert restoring[0].endswith("from epoch 3 (recovery 1 of 1)"), restoring
    assert_durable_commits_equal(prefix, [0, 3, 6, EPOCHS])


def test_two_workers_killed_one_after_the_other_both_come_back_from_memory(cluster, tmp_path, killing, reference):
    """Node b's worker dies in epoch 3 and, once restored, again in epoch 4: two recoveries from memory
    (epoch 2, then epoch 3), and the run ends equal."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=10)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(killing(3, 4), manager, max_failures=2, progress=False)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert [r.recoveries for r in runner.history] == [0, 0, 1, 2, 2, 2, 2, 2]
    assert_durable_commits_equal(prefix, [0, EPOCHS])


class SlowStore(CheckpointStore):
    """A local store whose background write of one durable epoch of node b takes a while (a slow disk):
    its worker is killed while it writes."""

    def write_node_unsynced(self, node, epoch, blobs, *, save_id, **kwargs):
        if node == "b" and epoch == 3:
            time.sleep(3.0)
        return super().write_node_unsynced(node, epoch, blobs, save_id=save_id, **kwargs)


def test_a_worker_killed_while_it_writes_a_durable_epoch_from_its_snapshot(cluster, tmp_path, killing, reference):
    """Node b's worker dies in epoch 5 while its background thread still writes epoch 3 (durable) from
    the snapshot: the nodes come back from epoch 4 in memory, epoch 3 is never committed, the durable
    tier catches up at once (epoch 5), and every commit verifies and equals an uninterrupted run."""
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=3)
    manager.store = SlowStore(prefix)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(killing(5), manager, max_failures=1, progress=False)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert restored_from(runner) == 4
    assert_durable_commits_equal(prefix, [0, 5, 6, EPOCHS])


def test_without_a_prefix_a_lost_worker_still_comes_back_from_memory(cluster, tmp_path, killing, reference):
    """``db_prefix=None``: fault tolerance without storage; nothing is written."""
    manager = dj.MultiNodeCheckpointManager(None, in_memory=True)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(killing(4), manager, max_failures=1, progress=False)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert restored_from(runner) == 3
    assert {r.tier for r in runner.history} == {"memory"}


def test_without_a_prefix_or_a_replica_a_lost_snapshot_starts_the_run_over(
    cluster, tmp_path, killing, reference, caplog
):
    """``db_prefix=None, replicas=0``: node b's snapshots die with its worker in epoch 4 and nothing
    durable exists, so every node starts again from its init group; the run ends equal."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    manager = dj.MultiNodeCheckpointManager(None, in_memory=True, replicas=0)
    with dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(killing(4), manager, max_failures=1, progress=False)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert any("no copy of node 'b'" in r.getMessage() for r in caplog.records)
    assert [r.getMessage() for r in caplog.records if "restoring all nodes from" in r.getMessage()] == [
        "node(s) ['b'] lost; restoring all nodes from scratch (recovery 1 of 1)"
    ]
    assert [r.epoch for r in runner.history][-EPOCHS:] == list(range(1, EPOCHS + 1))


@pytest.mark.parametrize("replicas", [1, 0])
def test_a_retired_pool_worker_hands_its_snapshots_over(tmp_path, watched_root, reference, caplog, replicas):
    """A pool worker serving node b is retired in epoch 4: Dask moves its snapshots to the workers left
    (with ``replicas=0`` they are the only copies), node b goes to another worker, every node comes
    back from epoch 3 in memory without a failure counted (``max_failures=0``) and without reading
    the prefix, and the run ends equal."""
    caplog.set_level(logging.INFO, logger="daskjobs")
    prefix = str(tmp_path / "ckpt")
    manager = dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=10, replicas=replicas)
    preload = dask.config.set({"distributed.worker.preload": ["prefix_reads"]})
    with preload, pool_cluster(3) as cluster, dj.DaskSession(cluster) as session:
        client = session.client

        class Retire(Reads):
            def epoch_running(self, epoch):
                if epoch == 4 and not (tmp_path / "retired").exists():
                    (tmp_path / "retired").touch()
                    address = session.placement["b"]
                    threading.Timer(0.05, client.retire_workers, ([address],)).start()

        hooks = Retire(client, 4, 4)
        runner = dj.JobRunner(define_job(), manager, max_failures=0, progress=False, hooks=hooks)
        assert runner.train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    assert restored_from(runner) == 3
    assert hooks.found == {}
    assert any("left on purpose (it was retired)" in r.getMessage() for r in caplog.records)
    assert any("from epoch 3 in cluster memory" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("prefix", "falls_back_to"),
    [
        ("ckpt", "the durable checkpoints under the prefix"),
        (None, "the start of the run (db_prefix=None: nothing durable)"),
    ],
    ids=["prefix", "no-prefix"],
)
def test_a_cluster_too_small_for_the_replicas_says_once_what_a_lost_worker_falls_back_to(
    tmp_path, reference, caplog, prefix, falls_back_to
):
    """On a single pool worker no snapshot can have a replica: one warning says so and what losing
    the worker then falls back to (the prefix, or the start of the run without one); the run ends equal."""
    caplog.set_level(logging.WARNING, logger="daskjobs")
    manager = dj.MultiNodeCheckpointManager(prefix and str(tmp_path / prefix), in_memory=True)
    with pool_cluster(1) as cluster, dj.DaskSession(cluster) as session:
        assert dj.JobRunner(define_job(), manager, progress=False).train(session) == EPOCHS
        assert_equal(blobs(session), reference)
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tier 0:")]
    assert warned == [
        "tier 0: the cluster has too few workers to hold each node's snapshot on 1 + 1 (replicas=1), only on 1: "
        f"losing a worker falls back to {falls_back_to}"
    ]


def test_a_snapshot_that_does_not_fit_is_a_write_error_not_a_dead_worker(tmp_path):
    """A node whose snapshot (and its replica) would take its worker past Dask's memory limits fails
    the save with CheckpointWriteError naming the node and the worker; the worker stays."""

    def big(ws):
        ws["ballast"] = np.ones(160 << 20, dtype=np.uint8)

    with dj.Cluster(), dj.Job(name="big") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(big)
        dj.Task(lambda ws: None)
    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt"), in_memory=True)
    limited = LocalCluster(
        n_workers=2, threads_per_worker=1, memory_limit="400MiB", host="127.0.0.1", dashboard_address=None
    )
    with limited as cluster, dj.DaskSession(cluster) as session:
        workers = set(session.client.scheduler_info(n_workers=-1)["workers"])
        runner = dj.JobRunner(job, manager, max_epochs=2, progress=False)
        with pytest.raises(CheckpointWriteError, match="node 'a', epoch 0: its tier-0 snapshot"):
            runner.train(session)
        assert set(session.client.scheduler_info(n_workers=-1)["workers"]) == workers
