"""SPEC §3 "Shared storage": the driver and every node's worker must see one checkpoint prefix.

A second machine without the shared filesystem is played by a ``daskjobs worker`` in its own
mount namespace (``unshare --mount``) with a private tmpfs over the folder holding the prefixes:
the same path, another (empty) directory. Real ``dask scheduler`` and ``daskjobs worker``
processes on 127.0.0.1; the driver is this process, or ``daskjobs run --scheduler``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from distributed import Client
from processes import spawn, start_scheduler, stop_group

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._protocol.prefix import Prefix
from daskjobs.errors import CheckpointStorageError, NodePlacementError

NODES = ["a", "b"]
STARTUP_TIMEOUT = 60.0
ADVICE = "use a shared filesystem (NFS, Lustre, ...) mounted at"


def _unshare_problem() -> str | None:
    """Why workers cannot get a private mount namespace here, or ``None``."""
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) on this machine"
    with tempfile.TemporaryDirectory() as folder:
        try:
            done = subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"mount -t tmpfs tmpfs {folder}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`unshare --mount` failed: {exc}"
    if done.returncode != 0:
        return f"`unshare --mount` + `mount -t tmpfs` not permitted here (needs root): {done.stderr.strip()}"
    return None


# -- the job ------------------------------------------------------------------------------
def init(ws: dj.Workspace) -> None:
    ws["x"] = np.zeros(4)


def step(ws: dj.Workspace) -> None:
    ws["x"] = ws["x"] + 1


def make_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="shared") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:
                    dj.Task(init, name="init")
                dj.Task(step, name="step")
    return job


JOB_FILE = """
import numpy as np
import daskjobs as dj


def init(ws):
    ws["x"] = np.zeros(4)


def step(ws):
    ws["x"] = ws["x"] + 1


with dj.Cluster(), dj.Job(name="shared") as job:
    for node in ("a", "b"):
        with dj.Node(node):
            with job.init_group:
                dj.Task(init)
            dj.Task(step)
"""


def tree(prefix: Path) -> dict[str, str]:
    """Every file and folder under ``prefix``: relative path -> digest of its bytes ("dir" for folders)."""
    found = {}
    for path in sorted(prefix.rglob("*")):
        rel = str(path.relative_to(prefix))
        found[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def committed_locally(prefix: Path, epochs: int) -> dict[str, str]:
    """Train the job to ``epochs`` in this process under ``prefix``; return the prefix's tree."""
    with dj.LocalSession() as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=epochs, progress=False)
        assert runner.train(session) == epochs
    return tree(prefix)


# -- the cluster --------------------------------------------------------------------------
MOUNTS = {
    "tmpfs": "mount -t tmpfs tmpfs {shared}",
    "readonly": "mount --bind {shared} {shared} && mount -o remount,ro,bind {shared}",
    "overlay": (
        "mount -t tmpfs tmpfs {upper} && mkdir {upper}/u {upper}/w && "
        "mount -t overlay overlay -o lowerdir={shared},upperdir={upper}/u,workdir={upper}/w {shared}"
    ),
}
"""How a worker's own mount namespace changes the shared folder: ``tmpfs``, another (empty) directory
(a machine without the shared filesystem); ``readonly``, the same files but no writing;
``overlay``, the same files, but what the worker writes goes elsewhere."""


class Machines:
    """A ``dask scheduler`` and one ``daskjobs worker`` per node on 127.0.0.1.

    :meth:`serve` gives a node's worker its own mount namespace in which :attr:`shared` is
    changed as :data:`MOUNTS` says: that node's machine does not share the driver's folder.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.shared = root / "shared"
        self.logs = root / "logs"
        for folder in (self.shared, self.logs, root / "workers", root / "elsewhere"):
            folder.mkdir()
        self.env = {**os.environ, "PYTHONPATH": str(Path(dj.__file__).resolve().parents[1])}
        self.workers: dict[str, tuple[subprocess.Popen, str]] = {}
        self.scheduler, self.address = start_scheduler(self.logs, env=self.env, timeout=STARTUP_TIMEOUT)
        self.client = Client(self.address, timeout=STARTUP_TIMEOUT, set_as_default=False)

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.glob("*")))

    def served(self) -> dict[str, str]:
        """Node -> address of the live worker serving it."""
        found = {}
        for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
            for resource in info["resources"]:
                if resource.startswith("daskjobs-node-"):
                    found[resource.removeprefix("daskjobs-node-")] = address
        return found

    def start(self, node: str, mount: str = "shared") -> None:
        """Start ``node``'s worker (without waiting for it), in its own mount namespace unless ``"shared"``."""
        command = [sys.executable, "-m", "daskjobs", "worker", self.address, "--host", "127.0.0.1", "--node", node]
        command += ["--nthreads", "2", "--local-directory", str(self.root / "workers")]
        if mount != "shared":
            upper = self.root / f"upper-{node}"
            upper.mkdir(exist_ok=True)
            inner = f"{MOUNTS[mount].format(shared=self.shared, upper=upper)} && exec {' '.join(command)}"
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner]
        log = self.logs / f"worker-{node}.log"
        self.workers[node] = (spawn(command, log, env=self.env, cwd=self.root / "elsewhere"), mount)

    def stop(self, node: str) -> None:
        process, _ = self.workers.pop(node)
        stop_group(process)

    def serve(self, private: set[str] = frozenset(), mount: str = "tmpfs") -> None:
        """Give the workers of ``private`` nodes ``mount`` and let the others share :attr:`shared`; wait for them."""
        old = self.served()
        wanted = {node: mount if node in private else "shared" for node in NODES}
        changed = [n for n in NODES if n not in self.workers or self.workers[n][1] != wanted[n]]
        for node in changed:
            if node in self.workers:
                self.stop(node)
            self.start(node, wanted[node])
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            served = self.served()
            if set(served) >= set(NODES) and all(served[n] != old.get(n) for n in changed):
                return
            assert time.monotonic() < deadline, f"workers did not register: {served}\n{self.log()}"
            time.sleep(0.1)

    def seen_by(self, node: str, path: Path) -> bool:
        """Whether ``path`` exists as ``node``'s worker sees it (through its mount namespace)."""
        return Path(f"/proc/{self.workers[node][0].pid}/root{path}").exists()

    def prefix(self) -> Path:
        """A new prefix under :attr:`shared` (its parent folder exists, as the driver sees it)."""
        folder = self.shared / uuid.uuid4().hex[:8]
        folder.mkdir()
        return folder / "ckpt"

    def close(self) -> None:
        self.client.close()
        for node in list(self.workers):
            self.stop(node)
        stop_group(self.scheduler)


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machines]:
    problem = _unshare_problem()
    if problem is not None:
        pytest.skip(problem)
    cluster = Machines(tmp_path_factory.mktemp("machines"))
    try:
        yield cluster
    finally:
        cluster.close()


unshared = pytest.mark.parametrize("private", [pytest.param({"a"}, id="one-node"), pytest.param(set(NODES), id="all")])


def check_error(error: CheckpointStorageError, private: set[str], machines: Machines, prefix: Path) -> None:
    """The error names exactly the private nodes, each with its worker's name and address, and the path."""
    message = str(error)
    assert error.nodes == sorted(private)
    assert "\n" not in message
    served = machines.served()
    for node in NODES:
        named = f"node {node!r} on worker {node!r} ({served[node]}, host "
        assert (named in message) == (node in private), message
    assert f"checkpoint prefix {prefix} is not the same storage for every node" in message
    assert f"{ADVICE} {prefix} on every machine, or an object store prefix (s3://" in message


# -- train(): fresh run and resume ----------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.representative("one-node")
@unshared
def test_fresh_run_on_workers_without_the_prefix_fails_before_init(machines, private):
    """Nodes whose workers see another directory: CheckpointStorageError naming them, before the init
    group ran; nothing is left under the prefix (no lock, no probe file) or on the nodes' side."""
    machines.serve(private)
    prefix = machines.prefix()
    with dj.DaskSession(machines.address) as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=3, progress=False)
        with pytest.raises(CheckpointStorageError) as caught:
            runner.train(session)
        check_error(caught.value, private, machines, prefix)
        assert [session.blobs(node) for node in NODES] == [[], []]  # the init group never ran
    assert tree(prefix) == {"__daskjobs__": "dir"}
    assert runner.history == []
    for node in private:
        assert not machines.seen_by(node, prefix.parent)  # nothing was created on the node's machine


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mount", "why"),
    [
        ("readonly", "reads it but cannot write next to it (OSError: [Errno 30] Read-only file system"),
        ("overlay", "wrote {prefix}/__daskjobs__/probe.tmp-"),
    ],
)
def test_a_node_whose_writes_the_driver_cannot_read_is_named(machines, mount, why):
    """Node b sees the driver's files but cannot write there (read-only), or writes where the driver
    does not look (an overlay): CheckpointStorageError naming b, before the init group ran."""
    machines.serve({"b"}, mount)
    prefix = machines.prefix()
    before = committed_locally(prefix, 1)
    with dj.DaskSession(machines.address) as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=3, progress=False)
        with pytest.raises(CheckpointStorageError) as caught:
            runner.train(session)
        assert [session.blobs(node) for node in NODES] == [[], []]
    check_error(caught.value, {"b"}, machines, prefix)
    message = str(caught.value)
    assert f"node 'b' on worker 'b' ({machines.served()['b']}, host " in message
    assert why.format(prefix=prefix) in message
    if mount == "overlay":
        assert message.split("which this process does not see (")[1].startswith("no such file)")
    assert tree(prefix) == before


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.representative("all")
@unshared
def test_resume_of_a_checkpoint_only_the_driver_sees_fails_before_loading(machines, private):
    """A checkpoint committed where only the driver sees it: CheckpointStorageError before any load,
    not a "corrupt" checkpoint; the committed epochs are byte for byte as they were."""
    machines.serve(private)
    prefix = machines.prefix()
    before = committed_locally(prefix, 2)
    with dj.DaskSession(machines.address) as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=4, progress=False)
        with pytest.raises(CheckpointStorageError) as caught:
            runner.train(session)
        check_error(caught.value, private, machines, prefix)
        assert [session.blobs(node) for node in NODES] == [[], []]  # nothing was loaded
    assert tree(prefix) == before
    assert [c.epoch for c in dj.list_checkpoints(str(prefix))] == [0, 1, 2]


@pytest.mark.cluster
@pytest.mark.slow
def test_workers_sharing_the_prefix_train_and_resume(machines):
    """Every worker sees the prefix: the run and its resume go through and leave no probe file."""
    machines.serve(set())
    prefix = machines.prefix()
    for epochs in (2, 4):
        with dj.DaskSession(machines.address) as session:
            runner = dj.JobRunner(
                make_job(), dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=epochs, progress=False
            )
            assert runner.train(session) == epochs
            assert [np.asarray(session.fetch("x", node)).tolist() for node in NODES] == [[float(epochs)] * 4] * 2
        own = sorted(p.name for p in (prefix / "__daskjobs__").iterdir())
        assert own == ["commits"]
    assert [c.epoch for c in dj.list_checkpoints(str(prefix))] == [0, 1, 2, 3, 4]
    assert dj.open_checkpoint(str(prefix))["b"]["x"].tolist() == [4.0] * 4


@pytest.mark.cluster
@pytest.mark.slow
def test_daskjobs_run_on_a_worker_without_the_prefix_is_one_paragraph(machines):
    """``daskjobs run --scheduler`` with one node's worker on another "machine": exit 1, one
    paragraph naming that node and its worker, no traceback, nothing written."""
    machines.serve({"b"})
    prefix = machines.prefix()
    jobs = machines.root / "jobs" / uuid.uuid4().hex[:8]
    jobs.mkdir(parents=True)
    (jobs / "myjob.py").write_text(JOB_FILE)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "daskjobs", "run", "myjob.py:job", "--scheduler", machines.address),
            *("--checkpoint", str(prefix), "--max-epochs", "3", "--no-progress"),
        ],
        cwd=jobs,
        env=machines.env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"daskjobs run: error: checkpoint prefix {prefix} is not the same storage")
    assert f"node 'b' on worker 'b' ({machines.served()['b']}, host " in lines[0]
    assert "node 'a'" not in lines[0]
    assert f"{ADVICE} {prefix} on every machine" in lines[0]
    assert tree(prefix) == {"__daskjobs__": "dir"}


# -- outside train(): manual saves and loads ------------------------------------------------
@pytest.mark.cluster
@pytest.mark.slow
def test_checkpoints_saved_and_loaded_outside_train_name_the_node(machines):
    """On a node without the prefix: ``save_checkpoints`` refuses before writing; a load of a commit
    only the driver sees, the manager's init check of it, and a manual save's commit raise
    CheckpointStorageError naming the node, never a "corrupt" checkpoint or a broken commit."""
    machines.serve({"a"})
    prefix = machines.prefix()
    before = committed_locally(prefix, 1)
    with dj.DaskSession(machines.address) as session:
        session.run(make_job().init_group)
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(str(prefix)), progress=False)
        with pytest.raises(CheckpointStorageError) as saving:
            runner.save_checkpoints(5, session)
        check_error(saving.value, {"a"}, machines, prefix)

        with pytest.raises(CheckpointStorageError) as loading:
            runner.load_blobs_from_checkpoints(["x"], 1, session)
        assert loading.value.nodes == ["a"]
        message = str(loading.value)
        assert f"node 'a' on worker 'a' ({machines.served()['a']}, host " in message
        assert f"does not see the commit record of epoch 1 that this process read ({prefix}/__daskjobs__" in message
        assert f"it sees no commit at all: the node's worker sees another directory at {prefix}; " in message
        assert f"{ADVICE} {prefix} on every machine" in message
        assert [np.asarray(session.fetch("x", n)).tolist() for n in NODES] == [[0.0] * 4] * 2  # nothing loaded

        manager = dj.MultiNodeCheckpointManager(str(prefix))
        with pytest.raises(CheckpointStorageError, match="does not see the commit record of epoch 1") as checking:
            session.run(manager.init(NODES, retrieve_from_epoch=1))
        assert checking.value.nodes == ["a"]

        session.run(manager.save(7))  # node a writes its group on its own machine
        with pytest.raises(CheckpointStorageError) as committing:
            manager.write_checkpoint_metadata(7)
        assert committing.value.nodes == ["a"]
        assert str(committing.value).startswith(
            f"not committing epoch 7: node(s) ['a'] wrote their checkpoint, but this process does not see {prefix}/a.7:"
        )
    assert machines.seen_by("a", prefix / "a.7")
    after = tree(prefix)
    assert {k: v for k, v in after.items() if not k.startswith("b.7")} == before  # b's uncommitted group is debris
    assert [c.epoch for c in dj.list_checkpoints(str(prefix))] == [0, 1]


# -- recovery onto another machine ----------------------------------------------------------
@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_recovery_onto_a_worker_without_the_prefix_stops_before_the_restore(machines):
    """A node's worker dies during the run and comes back on a "machine" without the prefix: the
    recovery raises CheckpointStorageError naming it instead of restoring; the commits stay intact."""
    machines.serve(set())
    prefix = machines.prefix()

    def replace_worker(record: dj.EpochRecord) -> None:
        if record.epoch == 2:
            machines.stop("a")
            machines.start("a", "tmpfs")

    with dj.DaskSession(machines.address) as session:
        runner = dj.JobRunner(
            make_job(),
            dj.MultiNodeCheckpointManager(str(prefix)),
            max_epochs=50,
            max_failures=2,
            progress=False,
            on_epoch=replace_worker,
        )
        with pytest.raises(CheckpointStorageError) as caught:
            runner.train(session)
    assert caught.value.nodes == ["a"]
    assert f"node 'a' on worker 'a' ({machines.served()['a']}, host " in str(caught.value)
    committed = [c.epoch for c in dj.list_checkpoints(str(prefix))]
    assert committed[:3] == [0, 1, 2]
    for epoch in committed:
        assert dj.open_checkpoint(str(prefix), epoch)["a"]["x"].tolist() == [float(epoch)] * 4
    assert sorted(p.name for p in (prefix / "__daskjobs__").iterdir()) == ["commits"]


# -- memory:// is private to each process -----------------------------------------------------
@pytest.mark.cluster
def test_memory_prefix_on_worker_processes_is_refused(shared_cluster):
    """memory:// on a cluster of worker processes: each process has its own; refused before init."""
    prefix = f"memory://dj-shared-{uuid.uuid4().hex[:8]}/ckpt"
    with dj.DaskSession(shared_cluster) as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
        with pytest.raises(CheckpointStorageError) as caught:
            runner.train(session)
        assert [session.blobs(node) for node in NODES] == [[], []]
    assert caught.value.nodes == NODES
    message = str(caught.value)
    assert "memory:// is private to each process: use it only with a LocalSession or node_cluster(" in message
    assert "node 'a' on worker " in message
    assert "node 'b' on worker " in message
    assert dj.list_checkpoints(prefix) == []
    assert CheckpointStore(prefix).fs.find(prefix) == []


@pytest.mark.cluster
def test_memory_prefix_on_worker_threads_trains(tmp_path):
    """memory:// on a cluster whose workers are threads of this process: one storage, the run goes on."""
    prefix = f"memory://dj-shared-{uuid.uuid4().hex[:8]}/ckpt"
    with dj.node_cluster(NODES, processes=False) as cluster, dj.DaskSession(cluster) as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
        assert runner.train(session) == 2
    assert [c.epoch for c in dj.list_checkpoints(prefix)] == [0, 1, 2]


# -- probe files --------------------------------------------------------------------------------
@pytest.mark.cluster
def test_probe_files_go_when_the_proof_cannot_run(shared_cluster, prefix):
    """The nodes cannot be reached (a node without a worker): the error is the placement's, and the
    driver's probe file is gone."""
    import dask

    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(["a", "no_such_node"])
    with (
        dask.config.set({"daskjobs.preflight-timeout": "0.2s"}),
        dj.DaskSession(shared_cluster) as session,
        pytest.raises(NodePlacementError),
    ):
        manager.check_shared(session)
    assert os.listdir(Path(prefix) / "__daskjobs__") == []


def test_cleanup_removes_probe_files_a_crash_left(prefix):
    """Probe files are daskjobs temp files: the cleanup before a run removes them, and nothing else."""
    store = CheckpointStore(prefix)
    store.check_writable()
    left = store.new_probe()
    store.write_probe(left, b"0" * 32)
    own = Path(prefix) / "__daskjobs__"
    (own / "probe.txt").write_text("a user's file")
    assert store.cleanup_uncommitted(["a"]) == [f"{prefix}/__daskjobs__/{Path(left).name}"]
    assert sorted(os.listdir(own)) == ["probe.txt"]


def test_local_session_needs_no_proof(prefix, monkeypatch):
    """A LocalSession's nodes live in this process: train() writes no probe file."""

    def refuse(self: Prefix) -> str:
        raise AssertionError("a probe file was asked for")

    monkeypatch.setattr(Prefix, "new_probe", refuse)
    with dj.LocalSession() as session:
        runner = dj.JobRunner(make_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=2, progress=False)
        assert runner.train(session) == 2


@pytest.mark.cluster
def test_s3_prefix_is_proven_and_left_clean(shared_cluster, s3_prefix):
    """An object store prefix is proven too (worker processes reach the same server): the run goes on
    and leaves no probe object."""
    url, options = s3_prefix
    with dj.DaskSession(shared_cluster) as session:
        manager = dj.MultiNodeCheckpointManager(url, storage_options=options)
        assert dj.JobRunner(make_job(), manager, max_epochs=2, progress=False).train(session) == 2
    assert [c.epoch for c in dj.list_checkpoints(url, storage_options=options)] == [0, 1, 2]
    own = CheckpointStore(url, options).fs.find(f"{url}/__daskjobs__")
    assert [path.rsplit("/", 2)[-2] for path in own] == ["commits"] * 3
