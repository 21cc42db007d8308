"""A Hypothesis state machine: random saves, crashes before commit, commits, deletes and clean-ups
against a dict model. Only committed epochs are ever listed or read, always with their exact data."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format.records import make_commit_record
from daskjobs.errors import CheckpointNotFoundError

NODES = ("a", "b")
epochs = st.integers(min_value=0, max_value=6)
values = st.integers(min_value=-1000, max_value=1000)


class CheckpointStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="daskjobs-stateful-")
        self.store = CheckpointStore(f"{self.root}/ckpt")
        self.committed: dict[int, int] = {}
        self.staged: dict[int, tuple[int, dict[str, dict]]] = {}

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _write(self, epoch: int, value: int) -> dict[str, dict]:
        return {
            node: self.store.write_node(
                node,
                epoch,
                {"w": np.full((3, 2), value + i), "n": np.int64(value)},
                save_id=f"s{epoch}_{value}".replace("-", "m"),
            )
            for i, node in enumerate(NODES)
        }

    @rule(epoch=epochs, value=values)
    def save_without_commit(self, epoch: int, value: int) -> None:
        """A crash after the data but before the commit record (uncommitted epochs only)."""
        if epoch in self.committed:
            return
        self.staged[epoch] = (value, self._write(epoch, value))

    @precondition(lambda self: self.staged)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        epoch = data.draw(st.sampled_from(sorted(self.staged)))
        value, entries = self.staged.pop(epoch)
        self.store.commit(make_commit_record("machine", epoch, entries, {"done": False}, {}))
        self.committed[epoch] = value

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        epoch = data.draw(st.sampled_from(sorted(self.committed)))
        self.store.delete_epoch(epoch, NODES)
        del self.committed[epoch]

    @rule()
    def cleanup(self) -> None:
        self.store.cleanup_uncommitted(NODES)
        self.staged.clear()

    @rule()
    def reopen(self) -> None:
        """Another process (a fresh store object) sees exactly the same commits."""
        self.store = CheckpointStore(self.store.url)

    @rule(epoch=epochs)
    def read(self, epoch: int) -> None:
        if epoch not in self.committed:
            try:
                self.store.read_commit(epoch)
            except CheckpointNotFoundError:
                return
            raise AssertionError(f"uncommitted epoch {epoch} has a commit record")
        record = self.store.read_commit(epoch)
        for i, node in enumerate(NODES):
            blobs = self.store.read_node(node, epoch, record["manifests"][node])
            assert np.array_equal(blobs["w"], np.full((3, 2), self.committed[epoch] + i))
            assert int(blobs["n"]) == self.committed[epoch]

    @invariant()
    def only_commits_are_listed(self) -> None:
        assert self.store.committed_epochs() == sorted(self.committed)
        latest = self.store.latest_commit()
        assert (latest["epoch"] if latest else None) == (max(self.committed) if self.committed else None)


CheckpointStoreMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_checkpoint_store_state_machine = CheckpointStoreMachine.TestCase
