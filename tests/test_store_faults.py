"""A writer process killed mid-save never leaves a half-written epoch that counts (catalogue B1)."""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from daskjobs.checkpoint import CheckpointStore

NODES = ("n0", "n1")
BLOBS = 4
ROWS = 1 << 18  # float32 rows: 1 MiB per blob, 8 MiB per epoch
FILES_PER_EPOCH = len(NODES) * (2 * BLOBS + 1) + 1  # per node: 2 files per blob, the manifest; then the commit

WRITER = """
import json, os, sys
import numpy as np
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._storage import files as _files
from daskjobs.checkpoint._format.records import make_commit_record

prefix, exit_before_write, nodes, rows, count = sys.argv[1], int(sys.argv[2]), *json.loads(sys.argv[3])
if exit_before_write >= 0:
    real, written = _files.write_file, [0]
    def write_file(path, parts):
        written[0] += 1
        if written[0] > exit_before_write:
            os._exit(3)
        return real(path, parts)
    _files.write_file = write_file
store = CheckpointStore(prefix)
for epoch in range(1, 10_000):
    entries = {}
    for n, node in enumerate(nodes):
        blobs = {f"b{i}": np.arange(rows, dtype="f4") + (epoch * 100 + n * 10 + i) for i in range(count)}
        entries[node] = store.write_node(node, epoch, blobs, save_id=f"e{epoch}")
    store.commit(make_commit_record("writer", epoch, entries, {"done": False}, {}))
    print(f"committed {epoch}", flush=True)
"""


def expected(epoch: int, n: int, i: int) -> np.ndarray:
    return np.arange(ROWS, dtype="f4") + (epoch * 100 + n * 10 + i)


def run_writer(prefix: str, exit_before_write: int = -1, kill_after: float | None = None) -> list[int]:
    """Run the writer until it exits or, once it has committed, for ``kill_after`` seconds; then SIGKILL it."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, prefix, str(exit_before_write), json.dumps([NODES, ROWS, BLOBS])],
        stdout=subprocess.PIPE,
        text=True,
    )
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    lines, deadline, kill_at = [], time.monotonic() + 30, None
    try:
        while process.poll() is None and time.monotonic() < (kill_at or deadline):
            if selector.select(timeout=0.01) and (line := process.stdout.readline()):
                lines.append(line)
                if kill_after is not None and kill_at is None:
                    kill_at = time.monotonic() + kill_after
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        lines.extend(process.stdout.readlines())
        process.stdout.close()
        selector.close()
    assert kill_at is not None or kill_after is None, "the writer never committed an epoch"
    return [int(line.split()[1]) for line in lines]


def check_recovery(store: CheckpointStore, committed: list[int]) -> int:
    """The latest commit is a complete, verifying epoch; cleanup removes exactly the debris."""
    latest = store.latest_commit()
    assert latest is not None
    # SIGKILL may land after a commit but before its line was printed
    assert latest["epoch"] in (committed[-1], committed[-1] + 1), (latest["epoch"], committed[-3:])
    assert latest["nodes"] == list(NODES)
    for n, node in enumerate(NODES):
        blobs = store.read_node(node, latest["epoch"], latest["manifests"][node])
        for i in range(BLOBS):
            assert np.array_equal(blobs[f"b{i}"], expected(latest["epoch"], n, i))
    removed = store.cleanup_uncommitted(NODES)
    epochs = store.committed_epochs()
    left = set(os.listdir(store.url)) - {"__daskjobs__", *(f"{node}.{e}" for node in NODES for e in epochs)}
    # a group is written in a staging folder whose name proves it ours from its first moment: none stays
    assert left == set(), (left, removed)
    assert all(
        name.startswith("epoch-") and name.endswith(".json")
        for name in os.listdir(os.path.join(store.url, "__daskjobs__", "commits"))
    )
    return latest["epoch"]


@pytest.mark.representative("0", "1")  # random moments: the other trials, -m matrix
@pytest.mark.parametrize("trial", range(6))
@pytest.mark.slow
def test_sigkill_at_a_random_moment(tmp_path, trial):
    store = CheckpointStore(tmp_path / "ckpt")
    committed = run_writer(store.url, kill_after=random.Random(trial).uniform(0.0, 0.6))
    check_recovery(store, committed)


@pytest.mark.parametrize(
    "writes_into_epoch_2", [0, 1, 2 * BLOBS, 2 * BLOBS + 1, FILES_PER_EPOCH - 2, FILES_PER_EPOCH - 1]
)
@pytest.mark.slow
def test_crash_at_each_step_of_a_save(tmp_path, writes_into_epoch_2):
    """Exit before the k-th file of epoch 2: first array, mid-node, node entry, second node, commit record."""
    store = CheckpointStore(tmp_path / "ckpt")
    committed = run_writer(store.url, exit_before_write=FILES_PER_EPOCH + writes_into_epoch_2)
    assert committed == [1]
    assert check_recovery(store, committed) == 1
    assert store.committed_epochs() == [1]
