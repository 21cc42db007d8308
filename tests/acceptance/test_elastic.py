"""Any Dask cluster, any size, changing under the job (SPEC §1.6a, §4): a notebook's ``Client()`` and
plain ``dask worker`` processes run the job with no set-up; workers killed for good hand their nodes
to the others; workers that join take nodes at an epoch boundary; a worker SIGTERMed and restarted
by its supervisor within half a second is a planned departure; ``timeout`` forwarding the group's
SIGTERM to the driver is one graceful stop; an adaptive ``LocalCluster`` scales down under the job.
Every case with a prefix ends with its checkpoints equal, bit for bit, to an uninterrupted run's.

The default test run keeps the notebook ``Client()``, two of three workers killed (and the same
with tier 0, restored from the memory of the workers left) and the supervised SIGTERM of a pinned
worker (the ``representative`` marks); the fast in-process cases of
``tests/test_elastic.py`` cover joining, retiring and the rest there. ``-m matrix`` runs all of them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from acceptance.harness import (
    ExternalCluster,
    assert_quiet,
    assert_same_checkpoints,
    checkpoint_values,
    clean_env,
    finish,
    start_run,
    wait_until,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

EPOCHS = 8
SAVES = [pytest.param([], id="sync"), pytest.param(["--async-save"], id="async")]


@pytest.fixture
def pool(tmp_path: Path):
    """A ``dask scheduler`` and no worker yet (the tests start plain pool workers)."""
    cluster = ExternalCluster(tmp_path / "cluster", env=clean_env())
    try:
        yield cluster
    finally:
        cluster.close()


def run_job(job_dir: Path, cwd: Path, *options: str, marks: Path | None = None, step: str = "0.3", **env: str):
    """``daskjobs run train.py:job OPTIONS`` with ``EPOCHS`` epochs, leaving marks when given."""
    extra = {"JOB_EPOCHS": str(EPOCHS), "JOB_STEP_SECONDS": step, **env}
    if marks is not None:
        marks.mkdir(exist_ok=True)
        extra["JOB_MARKS"] = str(marks)
    return start_run(job_dir, cwd, "train.py:job", *options, env=clean_env(**extra))


def assert_finished(process: subprocess.Popen, prefix: Path, reference, timeout: float = 240) -> str:
    """The run ends with exit 0, no traceback or ERROR, every epoch committed equal to the reference;
    returns its stderr."""
    code, out, err = finish(process, timeout=timeout)
    assert code == 0, err
    assert_quiet(err)
    assert out.strip().splitlines()[-1].startswith(f"job 'acceptance': last epoch {EPOCHS}, committed under {prefix}")
    assert_same_checkpoints(checkpoint_values(prefix), reference(EPOCHS))
    return err


NOTEBOOK = textwrap.dedent(
    """
    import runpy, sys
    from distributed import Client
    import daskjobs as dj

    job = runpy.run_path("train.py")["job"]          # the cell that defines the job
    client = Client(dashboard_address="127.0.0.1:0")  # a default LocalCluster, its dashboard on loopback
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(sys.argv[1]), progress=False)
    print(runner.train(client), flush=True)
    client.close()
    client.cluster.close()
    """
)


def test_a_notebook_client_runs_the_job_with_no_set_up(job_dir, tmp_path, reference):
    """``Client()`` (a default ``LocalCluster`` of pool workers) and ``JobRunner(job, manager).train(client)``,
    as a notebook in the job's folder runs them: the job runs to its end, equal to an uninterrupted run."""
    prefix = tmp_path / "ckpt"
    process = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, str(prefix)],
        cwd=job_dir,
        env=clean_env(JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS="0"),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == str(EPOCHS)
    assert_quiet(process.stderr)
    assert_same_checkpoints(checkpoint_values(prefix), reference(EPOCHS))


@pytest.mark.matrix
def test_plain_dask_workers_serve_a_job_file_run_from_the_command_line(job_dir, elsewhere, pool, reference):
    """``dask worker ADDRESS`` processes without any resource, and ``daskjobs run --scheduler``: the nodes
    are placed on them (one INFO line with ``-v``), the run equals an uninterrupted one."""
    for _ in range(2):
        pool.start_pool_worker()
    pool.wait_for_workers(2)
    prefix = elsewhere / "ckpt"
    process = run_job(job_dir, elsewhere, "--scheduler", pool.address, "--checkpoint", str(prefix), "-v", step="0")
    err = assert_finished(process, prefix, reference)
    placed = [line for line in err.splitlines() if "placement now" in line]
    assert len(placed) == 1, err
    assert "ps -> tcp://127.0.0.1:" in placed[0]
    assert "trainer -> tcp://127.0.0.1:" in placed[0]


def serving_a_node(cluster: ExternalCluster, workers: list[subprocess.Popen]) -> subprocess.Popen:
    """The ``dask worker`` command (a nanny, leading its process group) of a worker serving a node now."""
    client = cluster.client()
    table = client.scheduler_info(n_workers=-1)["workers"]
    serving = [a for a, info in table.items() if any(v > 0 for r, v in info["resources"].items() if "node" in r)]
    nannies = client.run(os.getppid, workers=serving)
    return next(w for w in workers if w.pid in nannies.values())


def kill_for_good(
    pool: ExternalCluster, workers: list[subprocess.Popen], process: subprocess.Popen, marks: Path, epochs: list[int]
) -> None:
    """In each of ``epochs`` (once its step left its mark), SIGKILL the process group of a worker
    serving a node, never replaced."""
    for epoch in epochs:
        wait_until(lambda epoch=epoch: (marks / f"epoch-{epoch}").exists(), 120, f"epoch {epoch}'s step", process)
        victim = serving_a_node(pool, workers)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)


@pytest.mark.representative("two-of-three")
@pytest.mark.parametrize("killed", [1, 2], ids=["one-of-three", "two-of-three"])
def test_workers_killed_for_good_leave_the_job_running_on_the_others(
    killed, job_dir, elsewhere, pool, reference, tmp_path
):
    """Three plain pool workers; during the run ``killed`` of them are SIGKILLed with their process groups
    and never replaced: the nodes go to the workers left (down to one serving both nodes), every node
    restores from the last commit, and the run ends equal to an uninterrupted one."""
    workers = [pool.start_pool_worker() for _ in range(3)]
    pool.wait_for_workers(3)
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    options = ["--scheduler", pool.address, "--checkpoint", str(prefix), "--max-failures", str(killed)]
    process = run_job(job_dir, elsewhere, *options, marks=marks)
    kill_for_good(pool, workers, process, marks, [3, 5][:killed])
    code, _out, err = finish(process, timeout=240)
    assert code == 0, err
    assert err.count("lost; restoring all nodes from epoch") == killed, err
    assert "ERROR" not in err, err
    assert_same_checkpoints(checkpoint_values(prefix), reference(EPOCHS))


@pytest.mark.parametrize("durable", [True, False], ids=["durable-every-4", "memory-only"])
def test_workers_killed_for_good_hand_their_nodes_over_from_the_cluster_memory(
    durable, job_dir, elsewhere, pool, reference, tmp_path
):
    """Tier 0 on three plain pool workers (``--in-memory``, with ``--checkpoint`` and
    ``--durable-every 4`` or without a prefix): in epochs 3 and 5 a worker serving a node is
    SIGKILLed with its process group and never replaced. Each time every node comes back from the
    epoch committed in the memory of the workers left (the lost node's replica moves to a worker that
    never served it) and the run ends on the last worker; with a prefix, every durable commit equals
    an uninterrupted run's."""
    workers = [pool.start_pool_worker() for _ in range(3)]
    pool.wait_for_workers(3)
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    options = ["--scheduler", pool.address, "--max-failures", "2", "--in-memory", "-v"]
    if durable:
        options += ["--checkpoint", str(prefix), "--durable-every", "4"]
    process = run_job(job_dir, elsewhere, *options, marks=marks)
    kill_for_good(pool, workers, process, marks, [3, 5])
    code, out, err = finish(process, timeout=240)
    assert code == 0, err
    assert_quiet(err)
    restoring = [line for line in err.splitlines() if "restoring all nodes from epoch" in line]
    assert len(restoring) == 2, err
    assert all("in cluster memory" in line for line in restoring), err
    restored = [int(line.split("from epoch ")[1].split()[0]) for line in restoring]
    assert restored[0] >= 2, err  # only the epoch running (or the one before) ran again
    assert restored[1] >= 4, err
    where = f"committed under {prefix}" if durable else "kept in cluster memory only"
    assert out.strip().splitlines()[-1].startswith(f"job 'acceptance': last epoch {EPOCHS}, {where}"), out
    if durable:
        committed = checkpoint_values(prefix)
        assert {0, EPOCHS} <= set(committed), sorted(committed)
        assert_same_checkpoints(committed, {epoch: reference(EPOCHS)[epoch] for epoch in committed})
    else:
        assert not prefix.exists()


@pytest.mark.representative
@pytest.mark.parametrize("saves", SAVES)
def test_workers_that_join_take_nodes_at_an_epoch_boundary(saves, job_dir, elsewhere, pool, reference, tmp_path):
    """One plain pool worker serves both nodes; two more join while epoch 2 runs: a node moves to a new
    worker with its workspace at an epoch boundary (nothing restored, no epoch repeated, no failure
    with ``--max-failures 0``), and the run ends equal to an uninterrupted one."""
    pool.start_pool_worker()
    pool.wait_for_workers(1)
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    options = ["--scheduler", pool.address, "--checkpoint", str(prefix), "--max-failures", "0", "-v", *saves]
    process = run_job(job_dir, elsewhere, *options, marks=marks, step="1")  # time for the workers to start
    wait_until(lambda: (marks / "epoch-1").exists(), 120, "epoch 1's step", process)
    pool.start_pool_worker()
    pool.start_pool_worker()
    err = assert_finished(process, prefix, reference)
    moved = [line for line in err.splitlines() if "moved node(s)" in line]
    assert len(moved) == 1, err
    assert "restoring" not in err, err
    assert "left on purpose" not in err, err


class Supervisor:
    """Restarts a worker command within half a second of its exit, like systemd or a Kubernetes
    kubelet would (each start in a process group of its own)."""

    def __init__(self, cluster: ExternalCluster, start) -> None:
        self.cluster, self.start = cluster, start
        self.process = start()
        self.restarts: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self.process.poll() is not None:
                ended = time.monotonic()
                self.process = self.start()
                self.restarts.append(time.monotonic() - ended)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.representative("pinned")
@pytest.mark.parametrize("kind", ["pinned", "pool"])
def test_a_worker_restarted_within_half_a_second_after_a_group_sigterm_is_a_departure(
    kind, job_dir, elsewhere, pool, reference, tmp_path
):
    """``killpg(SIGTERM)`` on a ``daskjobs worker`` (pinned to the trainer, or a pool worker serving a
    node) while its supervisor restarts it within half a second: the worker's nanny closes it
    gracefully, and the run takes it as a planned departure (one INFO line naming the SIGTERM, with
    ``--max-failures 0``), whichever the driver noticed first: the departure or the new worker's
    emptied workspace. The run ends equal to an uninterrupted one."""
    if kind == "pinned":
        pool.start_worker("ps")
        supervisor = Supervisor(pool, lambda: pool.start_worker("trainer"))
    else:
        pool.start_pool_worker(plain=False)
        supervisor = Supervisor(pool, lambda: pool.start_pool_worker(plain=False))
    try:
        pool.wait_for_workers(2)
        marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
        options = ["--scheduler", pool.address, "--checkpoint", str(prefix), "--max-failures", "0", "-v"]
        process = run_job(job_dir, elsewhere, *options, marks=marks)
        wait_until(lambda: (marks / "epoch-3").exists(), 120, "epoch 3's step", process)
        os.killpg(supervisor.process.pid, signal.SIGTERM)
        err = assert_finished(process, prefix, reference)
    finally:
        supervisor.stop()
    assert supervisor.restarts, "the supervisor never restarted the worker"
    assert max(supervisor.restarts) < 0.5
    departures = [line for line in err.splitlines() if "left on purpose" in line]
    assert departures, err
    assert all("it was sent SIGTERM" in line for line in departures), err
    assert "not counted against max_failures" in departures[0]


@pytest.mark.matrix
def test_timeout_forwarding_the_group_sigterm_is_one_graceful_stop(job_dir, elsewhere, pool, reference, tmp_path):
    """``timeout -s TERM`` wraps ``daskjobs run`` on plain pool workers and the whole group gets SIGTERM:
    the driver gets it twice (from the group and from ``timeout``), which is one request: the running
    epoch is committed, exit 143, and the same command run again resumes to the uninterrupted result."""
    timeout = shutil.which("timeout")
    if timeout is None:
        pytest.skip("GNU timeout is not installed")
    for _ in range(2):
        pool.start_pool_worker()
    pool.wait_for_workers(2)
    marks, prefix = tmp_path / "marks", elsewhere / "ckpt"
    marks.mkdir()
    options = ["--scheduler", pool.address, "--checkpoint", str(prefix), "--no-progress"]
    argv = [timeout, "-s", "TERM", "600", sys.executable, "-m", "daskjobs", "run", str(job_dir / "train.py:job")]
    env = clean_env(JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS="0.5", JOB_MARKS=str(marks))
    process = subprocess.Popen(
        [*argv, *options],
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_until(lambda: (marks / "epoch-2").exists(), 120, "epoch 2's step", process)
    os.killpg(process.pid, signal.SIGTERM)
    code, _out, err = finish(process, timeout=120)
    assert code == 143, err
    assert_quiet(err)
    assert "abandon" not in err.replace("send it again to abandon", ""), err
    committed = checkpoint_values(prefix)
    assert max(committed) >= 2, err
    again = run_job(job_dir, elsewhere, "--scheduler", pool.address, "--checkpoint", str(prefix), step="0")
    assert_finished(again, prefix, reference)


ADAPTIVE = textwrap.dedent(
    """
    import logging, runpy, sys
    from distributed import Client, LocalCluster
    import daskjobs as dj

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("daskjobs").setLevel(logging.INFO)
    job = runpy.run_path("train.py")["job"]
    cluster = LocalCluster(n_workers=3, threads_per_worker=1, dashboard_address="127.0.0.1:0")

    def adapt_after_epoch_2(record):
        if record.epoch == 2:
            cluster.adapt(minimum=1, maximum=1, interval="200ms", wait_count=1)

    with Client(cluster) as client:
        tier0 = {"in_memory": True, "durable_every": 4} if sys.argv[2:] == ["memory"] else {}
        manager = dj.MultiNodeCheckpointManager(sys.argv[1], **tier0)
        runner = dj.JobRunner(job, manager, max_failures=0, progress=False, on_epoch=adapt_after_epoch_2)
        print(runner.train(client), len(client.scheduler_info()["workers"]), flush=True)
    cluster.close()
    """
)


@pytest.mark.representative("memory")
@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_an_adaptive_local_cluster_scaling_down_under_the_job(job_dir, tmp_path, reference, tier):
    """``cluster.adapt(minimum=1, maximum=1)`` on a LocalCluster of three pool workers, turned on while
    the job runs, scales it down to one worker: the nodes of the workers retired move to the one left,
    a planned departure each (``max_failures=0``), and the run ends equal to an uninterrupted one.
    With tier 0 (``in_memory=True, durable_every=4``) the retired workers' snapshots move with them
    and every node comes back from cluster memory."""
    prefix = tmp_path / "ckpt"
    process = subprocess.run(
        [sys.executable, "-c", ADAPTIVE, str(prefix), tier],
        cwd=job_dir,
        env=clean_env(JOB_EPOCHS=str(EPOCHS), JOB_STEP_SECONDS="0.3"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.split() == [str(EPOCHS), "1"], process.stderr
    # SpecCluster retires the worker, then closes it through its nanny: whichever the worker hears
    # first is the reason it logs, both a planned departure
    assert re.search(r"left on purpose \((it was retired|its nanny closed it)\)", process.stderr), process.stderr
    # Dask's own nannies may log an ERROR closing a retired worker (a CancelledError in their rpc
    # close); nothing of daskjobs may: no ERROR of its logger, no traceback through its code.
    assert "daskjobs ERROR" not in process.stderr, process.stderr
    assert f"{os.sep}daskjobs{os.sep}" not in process.stderr, process.stderr
    expected = reference(EPOCHS)
    if tier == "memory":  # durable commits of epochs 0, 4 and the last only
        restoring = [line for line in process.stderr.splitlines() if "restoring all nodes from epoch" in line]
        assert restoring, process.stderr
        assert all("in cluster memory" in line for line in restoring), process.stderr
        expected = {epoch: expected[epoch] for epoch in (0, 4, EPOCHS)}
    assert_same_checkpoints(checkpoint_values(prefix), expected)
