"""Fault catalogue, manifests: a node's manifest that does not match its commit record x every read path.

From commit-record format 4 on, a node's blob metadata and chunk digests live in its manifest (the
group's ``zarr.json``), and the record names it by size and XXH3-128 inside its seal. Classes:

* M1 the manifest damaged on disk: edited (one digit of a chunk digest), truncated, extended,
  re-formatted (equal as JSON, not as bytes), deleted;
* M2 swapped: another node's or another epoch's manifest in its place (valid manifests, wrong ones);
* M3 swapped consistently behind the seal: the record re-sealed naming the swapped-in manifest
  (a writer's bug, not an editor): the manifest's own node and epoch still refuse it;
* M4 the record re-sealed naming another node's manifest while every file stays as written.

Each is read through the eager and lazy views, ``verify``, a partial load, ``load``, a resume,
``node_entries``, an upload and ``daskjobs checkpoints verify|show``: ``CheckpointCorruptError``
naming epoch, node and the manifest every time (exit code 1 naming it on the command line), and
nothing committed changes. A save after that epoch (delta) never reuses chunks from a manifest
that does not match: it writes every chunk and warns.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable

import numpy as np
import pytest
from records import manifest_path, raw_record, write_record

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.cli import main
from daskjobs.errors import CheckpointCorruptError

NODES = ("a", "b")
EPOCHS = 2


def build_job() -> dj.Job:
    """Two nodes; node a holds ``frozen`` (never changes) and ``w`` (one more per epoch)."""
    with dj.Cluster(), dj.Job(name="manifests") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.update(frozen=np.arange(4096.0), w=np.zeros(16, "f4")), name="init")
            dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + 1), name="train")
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.update(n=np.int64(0), w=np.ones(16, "f4")), name="init")
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1), name="count")
    return job


@pytest.fixture
def committed(tmp_path) -> str:
    prefix = str(tmp_path / "ckpt")
    runner = dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=EPOCHS, progress=False)
    assert runner.train(dj.LocalSession()) == EPOCHS
    return prefix


def manifest(prefix: str, node: str = "a", epoch: int = EPOCHS) -> str:
    return manifest_path(CheckpointStore(prefix), node, epoch)


def rewrite(path: str, change: Callable[[bytes], bytes]) -> None:
    with open(path, "rb") as file:
        data = file.read()
    os.unlink(path)
    with open(path, "wb") as file:
        file.write(change(data))


def edit_digest(data: bytes) -> bytes:
    """One hex digit of the first chunk digest changed: still a valid manifest, no longer the committed one."""
    at = data.index(b'"hashes":["') + len(b'"hashes":["')
    return data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :]


def copy_from(node: str, epoch: int) -> Callable[[str], None]:
    """``node``'s manifest of ``epoch`` in place of node a's of epoch 2."""

    def apply(prefix: str) -> None:
        shutil.copyfile(manifest(prefix, node, epoch), manifest(prefix) + ".tmp")
        os.replace(manifest(prefix) + ".tmp", manifest(prefix))

    return apply


def named_in_record(node: str, epoch: int) -> Callable[[str], None]:
    """Copy ``node``'s manifest of ``epoch`` in place of a's of epoch 2, and re-seal the record naming it."""

    def apply(prefix: str) -> None:
        store = CheckpointStore(prefix)
        named = raw_record(store, epoch)["manifests"][node]["manifest"]
        copy_from(node, epoch)(prefix)
        record = raw_record(store, EPOCHS)
        record["manifests"]["a"]["manifest"] = named
        write_record(store, EPOCHS, record)

    return apply


def record_names_b(prefix: str) -> None:
    """The record re-sealed naming b's manifest for a; every file stays as written."""
    store = CheckpointStore(prefix)
    record = raw_record(store, EPOCHS)
    record["manifests"]["a"]["manifest"] = record["manifests"]["b"]["manifest"]
    write_record(store, EPOCHS, record)


FAULTS: dict[str, tuple[Callable[[str], None], str]] = {
    "edited": (lambda p: rewrite(manifest(p), edit_digest), "does not match the digest in the commit record"),
    "truncated": (lambda p: rewrite(manifest(p), lambda d: d[:-1]), "bytes, the commit record says"),
    "extended": (lambda p: rewrite(manifest(p), lambda d: d + b" "), "has more than"),
    "reformatted": (
        lambda p: rewrite(manifest(p), lambda d: json.dumps(json.loads(d), indent=1).encode()),
        "bytes, the commit record says",
    ),
    "deleted": (lambda p: os.unlink(manifest(p)), "is missing"),
    "another_node": (copy_from("b", EPOCHS), "does not match|bytes, the commit record says"),
    "another_epoch": (copy_from("a", 1), "does not match|bytes, the commit record says"),
    "another_node_resealed": (named_in_record("b", EPOCHS), "entry is for node 'b' at epoch 2"),
    "another_epoch_resealed": (named_in_record("a", 1), "entry is for node 'a' at epoch 1"),
    "record_names_another_node": (record_names_b, "does not match|bytes, the commit record says"),
}


def run(prefix: str, group_of: Callable[[dj.MultiNodeCheckpointManager], dj.TaskGroup]) -> object:
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(list(NODES))
    with dj.LocalSession() as session:
        return session.run_group(group_of(manager))


def resume(prefix: str) -> object:
    with dj.LocalSession() as session:
        runner = dj.JobRunner(build_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False)
        return runner.train(session)


def partial(prefix: str) -> object:
    with dj.LocalSession() as session:
        return dj.MultiNodeCheckpointManager(prefix).load_blobs_locally(list(NODES), ["w"], EPOCHS, session)


def upload(prefix: str) -> object:
    destination = os.path.join(os.path.dirname(prefix), "copy")
    uploader = dj.CopyCheckpointUploader(destination)
    return run(prefix, lambda manager: uploader.build(EPOCHS, manager))


def cli(action: str) -> Callable[[str], object]:
    """``daskjobs checkpoints ACTION PREFIX --epoch 2`` in this process: raise its error (exit 1) for the catalogue."""

    def call(prefix: str) -> object:
        try:
            code = main(["checkpoints", action, prefix, "--epoch", str(EPOCHS)])
        except SystemExit as exit_:
            code = exit_.code
        if code != 0:
            raise CheckpointCorruptError(f"exit code {code}")
        return code

    return call


READ_PATHS: dict[str, Callable[[str], object]] = {
    "eager": lambda p: dj.open_checkpoint(p, EPOCHS)["a"]["w"],
    "lazy": lambda p: dj.open_checkpoint(p, EPOCHS)["a"].lazy("frozen").compute(scheduler="sync"),
    "verify": lambda p: dj.open_checkpoint(p, EPOCHS).verify(),
    "partial_load": partial,
    "load": lambda p: run(p, lambda manager: manager.load(EPOCHS)),
    "resume": resume,
    "node_entries": lambda p: CheckpointStore(p).node_entries(EPOCHS),
    "upload": upload,
    "cli_verify": cli("verify"),
    "cli_show": cli("show"),
}


def snapshot(prefix: str) -> dict[str, bytes]:
    files = {}
    for root, _dirs, names in os.walk(prefix):
        for name in names:
            if name != "lock.json":
                with open(os.path.join(root, name), "rb") as file:
                    files[os.path.relpath(os.path.join(root, name), prefix)] = file.read()
    return files


@pytest.mark.parametrize("path", sorted(READ_PATHS))
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_manifest_that_does_not_match_its_record_is_refused(committed, fault, path, capsys):
    damage, reason = FAULTS[fault]
    damage(committed)
    before, listed = snapshot(committed), dj.list_checkpoints(committed)
    with pytest.raises(CheckpointCorruptError) as caught:
        READ_PATHS[path](committed)
    message = str(caught.value) + (capsys.readouterr().err if path.startswith("cli") else "")
    assert f"epoch 2, node 'a': the node's manifest {manifest(committed)}" in message
    assert any(part in message for part in reason.split("|")), message
    assert snapshot(committed) == before
    assert dj.list_checkpoints(committed) == listed  # listing reads no manifest: it still lists the epoch


@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_intact_manifests_read_on_every_path(committed, path):
    """The same paths on intact manifests: no error (the catalogue above cannot pass by failing everywhere)."""
    READ_PATHS[path](committed)


def save_epoch_3(prefix: str) -> dict[str, object]:
    """Save epoch 3 in a fresh session whose nodes never wrote nor loaded a manifest (so each reads the
    previous epoch's from storage); return node a's summary in the commit."""
    manager = dj.MultiNodeCheckpointManager(prefix)
    manager.set_params(list(NODES), job_name="manifests")
    with dj.LocalSession() as session:
        session.feed("frozen", np.arange(4096.0), node="a")
        session.feed("w", np.full(16, 3.0, "f4"), node="a")
        session.feed("n", np.int64(3), node="b")
        session.feed("w", np.ones(16, "f4"), node="b")
        session.run_group(manager.save(3))
        manager.write_checkpoint_metadata(3)
    return raw_record(CheckpointStore(prefix), 3)["manifests"]["a"]


def test_delta_reuses_chunks_of_a_manifest_read_from_storage(committed):
    summary = save_epoch_3(committed)
    assert summary["bytes_reused"] == 4096 * 8  # frozen, linked after its manifest was verified
    assert np.array_equal(dj.open_checkpoint(committed, 3)["a"]["frozen"], np.arange(4096.0))


@pytest.mark.parametrize("fault", ["edited", "another_epoch", "deleted", "another_node_resealed"])
def test_delta_never_reuses_chunks_of_a_manifest_that_does_not_match(committed, fault, caplog):
    """The damaged epoch stays as it is (corrupt on read); the new epoch writes every chunk and reads back."""
    FAULTS[fault][0](committed)
    damaged = snapshot(committed)
    with caplog.at_level(logging.WARNING, logger="daskjobs"):
        summary = save_epoch_3(committed)
    assert summary["bytes_reused"] == 0
    assert summary["bytes_written"] == summary["bytes"]
    assert "node 'a' does not reuse chunks of epoch 2 (delta): CheckpointCorruptError" in caplog.text
    view = dj.open_checkpoint(committed, 3)
    assert view.verify() > 0
    assert np.array_equal(view["a"]["w"], np.full(16, 3.0, "f4"))
    assert {k: v for k, v in snapshot(committed).items() if k in damaged} == damaged
