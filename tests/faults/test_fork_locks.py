"""A snapshot writer is forked while other threads of the process hold daskjobs' locks.

A forked child has only the forking thread; a lock another thread held at the fork stays held
forever in the child. daskjobs resets its own module locks in the child, so the write finishes.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._node.fork import ForkedSave, fork_unsafe_reason
from daskjobs.checkpoint._storage import durable as _durable
from daskjobs.checkpoint._storage import zarr_groups as _zarr

LOCKS = {
    "fsync-pool": lambda: _durable._pool_lock,
    "zarr-warnings": lambda: _zarr._ZARR_LOCK,
}


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("held", sorted(LOCKS))
def test_a_lock_held_by_another_thread_at_the_fork_does_not_block_the_writer(tmp_path, held, compression):
    store = CheckpointStore(tmp_path / "ckpt", compression=compression)
    if fork_unsafe_reason(store) is not None:
        pytest.skip(fork_unsafe_reason(store))
    blobs = {"w": np.arange(1000.0), "step": np.int64(3)}
    lock = LOCKS[held]()
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10)
    try:
        saver = ForkedSave(store, "a", 0, "s0", blobs)
        finished = threading.Event()
        outcome: dict = {}

        def wait() -> None:
            outcome["entry"] = saver.result()
            finished.set()

        threading.Thread(target=wait, daemon=True).start()
        assert finished.wait(30), f"the forked writer blocked on the {held} lock held at the fork"
    finally:
        release.set()
        holder.join(10)
    restored = store.read_node("a", 0, outcome["entry"])
    assert np.array_equal(restored["w"], blobs["w"])
    assert restored["step"] == 3
