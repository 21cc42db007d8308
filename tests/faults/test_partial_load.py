"""Loads — partial (``load_blobs_locally``, ``load_blobs_from_checkpoint(s)``) and whole
(``manager.load``, a resume) — load all nodes or none, and a committed epoch whose node group is
gone is corrupt on every read path.

Every case asserts the exact error, every node's workspace and that nothing committed changed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from prefix_files import files

import daskjobs as dj
from daskjobs.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DefinitionTypeError,
    TaskFailedError,
)

NODES = ["a", "b"]
"""On a DaskSession of the shared cluster, ``a`` and ``b`` live in different worker processes."""


def define() -> dj.Job:
    """Nodes ``a`` and ``b`` each hold ``w`` (grows by one per epoch), ``meta`` (JSON) and ``frozen``;
    only ``b`` holds ``extra``."""
    with dj.Cluster(), dj.Job(name="partial") as job:
        for node in NODES:
            with dj.Node(node):
                with job.init_group:

                    def init(ws, node=node):
                        ws["w"] = np.arange(4096, dtype="f8")
                        ws["meta"] = {"node": node, "count": 0}
                        ws["frozen"] = np.full(7, 3, dtype="i8")
                        if node == "b":
                            ws["extra"] = np.ones(3)

                    dj.Task(init, name="init")

                def step(ws):
                    ws["w"] = ws["w"] + 1
                    ws["meta"] = {**ws["meta"], "count": ws["meta"]["count"] + 1}

                dj.Task(step, name="train")
    return job


@pytest.fixture
def committed(prefix) -> str:
    """A prefix with epochs 0..3 of :func:`define` committed."""
    dj.JobRunner(define(), dj.MultiNodeCheckpointManager(prefix), max_epochs=3, progress=False).train(None)
    return prefix


def fill(session: dj.Session) -> None:
    """Put recognisable values in every node's workspace (what a failed load must leave)."""
    for node in NODES:
        session.feed("w", np.zeros(3), node=node)
        session.feed("meta", "before", node=node)


def untouched(session: dj.Session) -> bool:
    return all(
        np.array_equal(session.fetch("w", node=n), np.zeros(3)) and session.fetch("meta", node=n) == "before"
        for n in NODES
    ) and "extra" not in session.blobs("b")


def staged(session: dj.Session) -> dict[str, bool]:
    """Per node, whether it still keeps blobs a partial load read but did not assign."""
    from daskjobs._model.workspace import node_state
    from daskjobs.checkpoint._node.slots import checkpoint_slots

    def look(ws: dj.Workspace) -> None:
        ws["staged"] = checkpoint_slots(node_state(ws)).staged is not None

    with dj.Cluster(), dj.TaskGroup(dj.WorkspaceType.PRIVATE) as group:
        tasks = {n: dj.Task(look, node=n, outputs="staged") for n in NODES}
    session.run(group)
    return {n: bool(task.outputs()[0].fetch()) for n, task in tasks.items()}


def truncate_a_chunk(prefix: str, node: str, blob: str = "w", epoch: int = 3) -> None:
    chunk = next(p for p in sorted((Path(prefix) / f"{node}.{epoch}" / blob).rglob("*")) if p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-1])


DAMAGE = {
    "a_chunk": (lambda p: truncate_a_chunk(p, "a"), r"epoch 3, node 'a', blob 'w'"),
    "b_chunk": (lambda p: truncate_a_chunk(p, "b"), r"epoch 3, node 'b', blob 'w'"),
    "b_json_chunk": (lambda p: truncate_a_chunk(p, "b", "meta"), r"epoch 3, node 'b', blob 'meta'"),
    "a_group_zarr_json": (lambda p: (Path(p) / "a.3" / "zarr.json").unlink(), r"epoch 3, node 'a'"),
}

WHOLE_LOAD_DAMAGE = {
    **DAMAGE,  # and a group deleted after its commit: a partial load answers False, a whole load cannot
    "b_group_folder": (lambda p: shutil.rmtree(Path(p) / "b.3"), r"epoch 3, node 'b'.*b\.3"),
}


# -- all or nothing --------------------------------------------------------------------------------------


def test_partial_load_loads_the_named_blobs_a_node_has(session, committed):
    """Both nodes get ``w`` and ``meta`` of epoch 3; ``extra`` only where it was saved; nothing else changes."""
    fill(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    assert manager.load_blobs_locally(NODES, ["w", "meta", "extra"], 3, session) is True
    for node in NODES:
        assert np.array_equal(session.fetch("w", node=node), np.arange(4096) + 3)
        assert session.fetch("meta", node=node) == {"node": node, "count": 3}
        assert "frozen" not in session.blobs(node)
    assert np.array_equal(session.fetch("extra", node="b"), np.ones(3))
    assert "extra" not in session.blobs("a")
    assert not any(b.startswith("daskjobs.") for n in NODES for b in session.blobs(n))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_node_checkpoint_loads_nothing_anywhere(session, committed, kind):
    """CheckpointCorruptError naming epoch, node (and blob); no node's workspace changed; no file changed."""
    damage, message = DAMAGE[kind]
    damage(committed)
    before = files(committed)
    fill(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        manager.load_blobs_locally(NODES, ["w", "meta"], 3, session)
    assert not isinstance(info.value, TaskFailedError)
    assert untouched(session)
    assert staged(session) == {"a": False, "b": False}
    assert files(committed) == before
    assert manager.load_blobs_locally(NODES, ["w", "meta"], 2, session) is True
    assert np.array_equal(session.fetch("w", node="b"), np.arange(4096) + 2)


@pytest.mark.parametrize("kind", ["b_chunk", "a_group_zarr_json"])
def test_runner_and_group_partial_loads_load_nothing_either(session, committed, kind):
    """runner.load_blobs_from_checkpoints and the group of manager.load_blobs_from_checkpoint: the same."""
    damage, message = DAMAGE[kind]
    damage(committed)
    fill(session)
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(committed), max_epochs=5, progress=False)
    with pytest.raises(CheckpointCorruptError, match=message):
        runner.load_blobs_from_checkpoints(["w", "meta"], 3, session)
    assert untouched(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    manager.set_params(NODES)
    with pytest.raises(CheckpointCorruptError, match=message):
        session.run(manager.load_blobs_from_checkpoint(["w", "meta"], 3))
    assert untouched(session)


def test_a_node_group_deleted_after_its_commit_returns_false_and_loads_nothing(session, committed, caplog):
    """SPEC §2.11: a node's checkpoint of that epoch is missing (its group was deleted after the
    commit): the partial loads return False and load nothing, naming it in a warning, and
    check_db_exists says False (as Caffe2 asked each node's database); a whole load, which cannot
    answer False, raises CheckpointCorruptError naming it; nothing on disk changes."""
    shutil.rmtree(Path(committed) / "b.3")
    before = files(committed)
    fill(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    with caplog.at_level("WARNING", logger="daskjobs"):
        assert manager.load_blobs_locally(NODES, ["w", "meta"], 3, session) is False
    assert "b.3" in caplog.text
    assert manager.check_db_exists(3) is False
    assert manager.check_db_exists(2) is True
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(committed), max_epochs=5, progress=False)
    assert runner.load_blobs_from_checkpoints(["w", "meta"], 3, session) is False
    assert untouched(session)
    assert staged(session) == {"a": False, "b": False}
    loader = dj.MultiNodeCheckpointManager(committed)
    loader.set_params(NODES)
    with pytest.raises(CheckpointCorruptError, match=r"epoch 3, node 'b'.*b\.3"):
        session.run(loader.load(3))
    assert untouched(session)
    assert files(committed) == before


def test_an_epoch_missing_for_a_node_returns_false_and_loads_nothing(session, committed):
    """Not committed, or committed without one of the nodes: False, no workspace changed."""
    fill(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    assert manager.load_blobs_locally(NODES, ["w"], 9, session) is False
    other = dj.MultiNodeCheckpointManager(committed)
    assert other.load_blobs_locally([*NODES, "c"], ["w"], 3, session) is False
    assert untouched(session)


@pytest.mark.parametrize("kind", list(WHOLE_LOAD_DAMAGE))
def test_a_whole_load_of_a_damaged_epoch_changes_no_workspace(session, committed, kind):
    """manager.load and a resume: CheckpointCorruptError, every workspace as it was, nothing kept
    staged after the resume; a whole load of a sound epoch then replaces each workspace exactly."""
    damage, message = WHOLE_LOAD_DAMAGE[kind]
    damage(committed)
    before = files(committed)
    fill(session)
    manager = dj.MultiNodeCheckpointManager(committed)
    manager.set_params(NODES, job_name="partial")
    with pytest.raises(CheckpointCorruptError, match=message):
        session.run(manager.load(3))
    assert untouched(session)
    runner = dj.JobRunner(
        define(), dj.MultiNodeCheckpointManager(committed), max_epochs=5, progress=False, resume_from_epoch=3
    )
    with pytest.raises(CheckpointCorruptError, match=message):
        runner.train(session)
    assert untouched(session)
    assert staged(session) == {"a": False, "b": False}
    assert files(committed) == before
    session.run(manager.load(2))
    for node in NODES:
        assert np.array_equal(session.fetch("w", node=node), np.arange(4096) + 2)
        assert session.fetch("meta", node=node) == {"node": node, "count": 2}
    assert sorted(session.blobs("a")) == ["frozen", "meta", "w"]
    assert sorted(session.blobs("b")) == ["extra", "frozen", "meta", "w"]


# -- a list of names, not a str --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "blob_names", "message"),
    [
        (NODES, "frozen", r"blob names must be a list of names, not a str: pass \['frozen'\]"),
        ("a", ["w"], r"node names must be a list of names, not a str: pass \['a'\]"),
        (NODES, 7, r"blob names must be a list of names, got int: 7"),
        (NODES, [b"w"], r"blob name must be a str, got bytes"),
    ],
)
def test_names_that_are_not_a_list_of_str_are_refused(committed, nodes, blob_names, message):
    """A str would be read as one-letter names and load nothing: DefinitionTypeError, nothing loaded."""
    manager = dj.MultiNodeCheckpointManager(committed)
    with dj.LocalSession() as session:
        fill(session)
        with pytest.raises(DefinitionTypeError, match=message) as info:
            manager.load_blobs_locally(nodes, blob_names, 3, session)
        assert isinstance(info.value, TypeError)
        assert untouched(session)
    manager.set_params(NODES)
    with pytest.raises(DefinitionTypeError, match="blob names must be a list"):
        manager.load_blobs_from_checkpoint("frozen", 3)


# -- a committed epoch without a node's group is corrupt -------------------------------------------------


@pytest.mark.parametrize("kind", ["b_group_folder", "a_group_zarr_json"])
def test_load_and_resume_of_a_committed_epoch_without_a_group_raise_corrupt(session, committed, kind):
    """manager.init(retrieve_from_epoch)+load and a resume: CheckpointCorruptError naming epoch and node."""
    damage, message = WHOLE_LOAD_DAMAGE[kind]
    damage(committed)
    before = files(committed)
    manager = dj.MultiNodeCheckpointManager(committed)
    manager.set_params(NODES, job_name="partial")
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        session.run(manager.init(NODES, retrieve_from_epoch=3))
    assert not isinstance(info.value, CheckpointNotFoundError)
    with pytest.raises(CheckpointCorruptError, match=message):
        session.run(manager.load(3))
    runner = dj.JobRunner(define(), dj.MultiNodeCheckpointManager(committed), max_epochs=5, progress=False)
    with pytest.raises(CheckpointCorruptError, match=message):
        runner.train(session)
    assert files(committed) == before
    assert [i.epoch for i in dj.list_checkpoints(committed)] == [0, 1, 2, 3]


def test_an_uncommitted_epoch_is_still_not_found(session, committed):
    manager = dj.MultiNodeCheckpointManager(committed)
    manager.set_params(NODES, job_name="partial")
    with pytest.raises(CheckpointNotFoundError, match="epoch 7"):
        session.run(manager.init(NODES, retrieve_from_epoch=7))
