"""The "beyond one machine" recipes in ``examples/cluster/``: the workers they start serve the right
nodes. dask-jobqueue's job scripts and the Kubernetes manifests' worker commands are run here as
local processes against a scheduler on 127.0.0.1; ``daskjobs run --scheduler`` then runs a job on them."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from distributed import get_worker
from processes import spawn, stop_group

import daskjobs as dj

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "cluster"
NODES = ["ps", "trainer_0"]

JOB = textwrap.dedent(
    '''
    """A job on nodes ps and trainer_0; each epoch a node checks that it runs on the worker named after it."""

    import numpy as np
    from distributed import get_worker

    import daskjobs as dj


    def make():
        def init(ws):
            ws["epochs"] = np.int64(0)
            ws["placed"] = np.bool_(False)

        def step(ws):
            ws["epochs"] = ws["epochs"] + 1
            ws["placed"] = np.bool_(get_worker().name == ws.node)
            ws["done"] = np.bool_(int(ws["epochs"]) >= 3)

        with dj.Cluster(), dj.Job(name="recipe") as job:
            for node in ("ps", "trainer_0"):
                with job.init_group, dj.Node(node):
                    dj.Task(init)
            with dj.Node("ps"):
                dj.Task(step)
            with dj.Node("trainer_0"):
                done = dj.Task(step, outputs="done").outputs()[0]
            job.add_stop_condition(done)
        return job
    '''
)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(name).stem}", RECIPES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def processes(commands: list[list[str]], logs: Path) -> Iterator[list[subprocess.Popen]]:
    """Start each command in its own session; kill every one afterwards."""
    started = []
    try:
        for index, argv in enumerate(commands):
            started.append(spawn(argv, logs / f"worker-{index}.log", env=env()))
        yield started
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            stop_group(process, signal.SIGTERM, timeout=15)


def check_placement(address: str, logs: Path) -> None:
    """Every node has exactly one worker, named after it; a task of each node runs on that worker."""
    with dj.DaskSession(address) as session:
        deadline = time.monotonic() + 60
        while not set(NODES) <= set(session.nodes()):
            assert time.monotonic() < deadline, "\n".join(p.read_text() for p in logs.glob("*.log"))
            time.sleep(0.2)
        session.check_nodes(NODES)
        group = dj.TaskGroup(dj.WorkspaceType.GLOBAL)
        with group:
            for node in NODES:
                with dj.Node(node):
                    dj.Task(lambda ws: ws.update(placed=np.bool_(get_worker().name == ws.node)))
        session.run(group)
        assert all(bool(session.fetch("placed", node=node)) for node in NODES)


def wait_for_workers(address: str, count: int, logs: Path) -> None:
    """Wait until ``count`` workers are connected to the scheduler at ``address``."""
    from distributed import Client

    with Client(address, timeout=30, set_as_default=False) as client:
        deadline = time.monotonic() + 60
        while len(client.scheduler_info(n_workers=-1)["workers"]) < count:
            assert time.monotonic() < deadline, "\n".join(p.read_text() for p in logs.glob("*.log"))
            time.sleep(0.2)


def run_job_on(address: str, tmp_path: Path, pinned: bool = True) -> None:
    """``daskjobs run --scheduler`` trains the job on those workers and commits its epochs (on pinned
    workers, each node on the worker named after it)."""
    (tmp_path / "recipe_job.py").write_text(JOB)
    prefix = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "daskjobs", "run", "recipe_job.py:make", "--scheduler", address]
    result = subprocess.run(
        [*argv, "--checkpoint", str(prefix)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("dashboard: http://127.0.0.1:")
    assert lines[-1] == f"job 'recipe': last epoch 3, committed under {prefix}; ran epochs 1-3"
    view = dj.open_checkpoint(str(prefix))
    assert view.epoch == 3
    assert all(bool(view[node]["placed"]) == pinned for node in NODES)
    assert all(int(view[node]["epochs"]) == 3 for node in NODES)


@pytest.fixture
def jobqueue_cluster():
    """A dask-jobqueue SLURMCluster whose scheduler listens on 127.0.0.1 (no batch system needed)."""
    jobqueue = pytest.importorskip("dask_jobqueue")
    options = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    with jobqueue.SLURMCluster(cores=2, processes=1, memory="2GB", scheduler_options=options) as cluster:
        yield cluster


@pytest.mark.parametrize("kind", ["SLURMCluster", "PBSCluster"])
def test_jobqueue_job_scripts_serve_one_node_each(kind):
    """add_node_workers gives each node a job script with its --resources, named after the node."""
    jobqueue = pytest.importorskip("dask_jobqueue")
    recipe = load_recipe("jobqueue_nodes.py")
    options = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    with getattr(jobqueue, kind)(cores=4, processes=1, memory="2GB", scheduler_options=options) as cluster:
        recipe.add_node_workers(cluster, NODES, nthreads=4)
        assert list(cluster.worker_spec) == NODES
        for node, spec in cluster.worker_spec.items():
            script = spec["cls"](cluster.scheduler_address, name=node, **spec["options"]).job_script()
            command = shlex.split(script.strip().splitlines()[-1])
            flags = {flag: command[i + 1] for i, flag in enumerate(command) if flag in ("--name", "--resources")}
            assert flags == {"--name": node, "--resources": f"{dj.node_resource(node)}=4"}


def test_jobqueue_workers_run_locally_are_placed_and_run_a_job(jobqueue_cluster, tmp_path):
    """The job scripts' worker commands, run here, serve their nodes; daskjobs run --scheduler uses them."""
    recipe = load_recipe("jobqueue_nodes.py")
    recipe.add_node_workers(jobqueue_cluster, NODES, nthreads=2)
    commands = []
    for node, spec in jobqueue_cluster.worker_spec.items():
        script = spec["cls"](jobqueue_cluster.scheduler_address, name=node, **spec["options"]).job_script()
        argv = shlex.split(script.strip().splitlines()[-1])
        commands.append([*argv, "--host", "127.0.0.1", "--local-directory", str(tmp_path / "workers")])
    with processes(commands, tmp_path):
        check_placement(jobqueue_cluster.scheduler_address, tmp_path)
        run_job_on(jobqueue_cluster.scheduler_address, tmp_path)


def test_jobqueue_pool_workers_run_locally_run_a_job(jobqueue_cluster, tmp_path):
    """The pool recipe's plain SLURM job scripts (no node resources), their worker commands run here:
    ``daskjobs run --scheduler`` places the nodes on them and trains the job."""
    recipe = load_recipe("jobqueue_pool.py")
    jobqueue = pytest.importorskip("dask_jobqueue")
    options = {**recipe.WORKER_OPTIONS, "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}}
    with jobqueue.SLURMCluster(**options) as cluster:
        script = cluster.job_cls(cluster.scheduler_address, name="pool-0", **cluster.new_spec["options"]).job_script()
        argv = shlex.split(script.strip().splitlines()[-1])
        assert "--resources" not in argv
        worker = [*argv, "--host", "127.0.0.1", "--local-directory", str(tmp_path / "workers")]
        with processes([worker], tmp_path):
            wait_for_workers(cluster.scheduler_address, 1, tmp_path)
            run_job_on(cluster.scheduler_address, tmp_path, pinned=False)


def start_scheduler(tmp_path: Path) -> tuple[list[str], Path]:
    """The command of a ``dask scheduler`` on 127.0.0.1 and the file it writes its address to."""
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0"]
    return [*scheduler, "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)], scheduler_file


def scheduler_address(scheduler_file: Path) -> str:
    deadline = time.monotonic() + 30
    while not (scheduler_file.exists() and scheduler_file.read_text().strip()):
        assert time.monotonic() < deadline, "the scheduler did not start"
        time.sleep(0.05)
    return yaml.safe_load(scheduler_file.read_text())["address"]


def test_kubernetes_pool_worker_commands_run_locally_run_a_job(tmp_path):
    """The pool manifest's worker containers, pointed at a local scheduler (one process per replica),
    are pool workers: ``daskjobs run --scheduler`` places the nodes on them and trains the job."""
    documents = list(yaml.safe_load_all((RECIPES / "kubernetes-pool.yaml").read_text()))
    (pool,) = [doc for doc in documents if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "daskjobs-pool"]
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    argv = [*container["command"], *container["args"]]
    assert argv[:3] == ["daskjobs", "worker", "tcp://daskjobs-scheduler:8786"]
    assert "--node" not in argv
    scheduler, scheduler_file = start_scheduler(tmp_path)
    with processes([scheduler], tmp_path):
        address = scheduler_address(scheduler_file)
        worker = [sys.executable, "-m", "daskjobs", "worker", address, *argv[3:], "--host", "127.0.0.1"]
        with processes([worker] * 2, tmp_path):
            wait_for_workers(address, 2, tmp_path)
            run_job_on(address, tmp_path, pinned=False)


def test_kubernetes_worker_commands_run_locally_are_placed(tmp_path):
    """The manifest's worker containers (command + args), pointed at a local scheduler, serve their nodes."""
    documents = list(yaml.safe_load_all((RECIPES / "kubernetes-workers.yaml").read_text()))
    containers = [
        container
        for doc in documents
        if doc["kind"] == "Deployment" and doc["metadata"]["name"].startswith("daskjobs-worker-")
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]
    assert all(doc["spec"]["replicas"] == 1 for doc in documents if doc["kind"] == "Deployment")
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0"]
    scheduler += ["--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)]
    with processes([scheduler], tmp_path):
        deadline = time.monotonic() + 30
        while not (scheduler_file.exists() and scheduler_file.read_text().strip()):
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.05)
        address = yaml.safe_load(scheduler_file.read_text())["address"]
        commands = []
        for container in containers:
            argv = [*container["command"], *container["args"]]
            assert argv[:3] == ["daskjobs", "worker", "tcp://daskjobs-scheduler:8786"]
            commands.append([sys.executable, "-m", "daskjobs", "worker", address, *argv[3:], "--host", "127.0.0.1"])
        served = sorted(c["args"][c["args"].index("--node") + 1] for c in containers)
        assert served == NODES
        with processes(commands, tmp_path):
            check_placement(address, tmp_path)
