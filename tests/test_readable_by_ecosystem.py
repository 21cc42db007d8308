"""Checkpoints the ecosystem reads (SPEC §1.7): every array of a node's group names its dimensions
``<blob>/dim_<i>``, so ``xarray.open_zarr(<prefix>/<node>.<epoch>, consolidated=False)`` (and
``open_datatree``) opens every blob of the node as a variable equal to what ``dj.open_checkpoint``
reads; checkpoints written before (format 4, no dimension names) still read and verify, and
verification accepts exactly the metadata the manifest implies, never less.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from records import as_version, edit_entry, manifest_path, raw_record

import daskjobs as dj
from daskjobs.checkpoint import CheckpointStore
from daskjobs.checkpoint._format import chunks as _chunks
from daskjobs.errors import CheckpointCorruptError

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # the checkpoints read are made by `daskjobs run`

JOB = textwrap.dedent(
    '''
    """One node holding a blob of every kind a checkpoint stores, and a second node."""

    import numpy as np

    import daskjobs as dj


    def init(ws):
        ws["w"] = np.arange(12, dtype=np.float32).reshape(3, 4)
        ws["step"] = np.int64(0)
        ws["mask"] = np.array([True, False, True])
        ws["z"] = np.array([1 + 2j, 3 - 1j], dtype=np.complex64)
        ws["names"] = np.array(["ps", "trainer"])
        ws["tags"] = np.array([b"x", b"yz"])
        ws["empty"] = np.zeros((0, 3))
        ws["config"] = {"lr": 0.5, "layers": [4, 3]}
        ws["reader.data.position"] = np.int64(7)


    def step(ws):
        ws["step"] = ws["step"] + 1
        ws["w"] = ws["w"] * 2
        ws["config"] = {**ws["config"], "step": int(ws["step"])}


    with dj.Cluster(), dj.Job(name="kinds") as job:
        with job.init_group:
            with dj.Node("ps"):
                dj.Task(init)
            with dj.Node("trainer"):
                dj.Task(lambda ws: ws.update(w=np.ones((2, 5))))
        with dj.Node("ps"):
            dj.Task(step)
        with dj.Node("trainer"):
            dj.Task(lambda ws: ws.update(w=ws["w"] + 1))
    '''
)


def env() -> dict[str, str]:
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> Path:
    """Epochs 0..2 of the job, written by ``daskjobs run`` in a fresh folder."""
    folder = tmp_path_factory.mktemp("kinds")
    (folder / "job.py").write_text(JOB)
    result = subprocess.run(
        [sys.executable, "-m", "daskjobs", "run", "job.py:job", "--checkpoint", "ck", "--local", "--max-epochs", "2"],
        cwd=folder, env=env(), capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return folder / "ck"


def same(variable: xr.DataArray, value: object) -> bool:
    """A variable xarray read equals a blob daskjobs read: the same dtype, shape and bytes (a JSON blob: its text)."""
    data = variable.values
    if not isinstance(value, np.ndarray):
        return data.dtype == np.uint8 and json.loads(data.tobytes()) == value
    return data.dtype == value.dtype and data.shape == value.shape and data.tobytes() == value.tobytes()


@pytest.mark.parametrize("epoch", [0, 2])
@pytest.mark.parametrize("node", ["ps", "trainer"])
def test_xarray_opens_every_blob_of_a_node_as_a_variable(prefix, node, epoch):
    view = dj.open_checkpoint(str(prefix), epoch)[node]
    ds = xr.open_zarr(prefix / f"{node}.{epoch}", consolidated=False)
    assert sorted(ds.data_vars) == sorted(view)
    assert not ds.coords
    for name in view:
        variable = ds[name]
        assert variable.dims == tuple(f"{name}/dim_{axis}" for axis in range(variable.ndim)), name
        assert same(variable, view[name]), name


def test_open_datatree_holds_the_same_variables(prefix):
    if not hasattr(xr, "open_datatree"):
        pytest.skip("this xarray has no open_datatree")
    tree = xr.open_datatree(prefix / "ps.2", engine="zarr", consolidated=False)
    view = dj.open_checkpoint(str(prefix), 2)["ps"]
    root = tree.to_dataset()
    assert sorted(root.data_vars) == sorted(view)
    assert all(same(root[name], view[name]) for name in view)


def test_dimension_names_are_in_the_arrays_and_the_manifest(prefix):
    document = json.loads((prefix / "ps.2" / "w" / "zarr.json").read_text())
    assert document["dimension_names"] == ["w/dim_0", "w/dim_1"]
    scalar = json.loads((prefix / "ps.2" / "step" / "zarr.json").read_text())
    assert scalar["dimension_names"] == []
    entry = CheckpointStore(str(prefix)).node_entries(2)["ps"]
    assert entry["blobs"]["reader.data.position"]["dimension_names"] == []
    assert entry["blobs"]["config"]["dimension_names"] == ["config/dim_0"]
    assert raw_record(CheckpointStore(str(prefix)), 2)["format_version"] == 5


def test_compressed_and_multi_chunk_arrays_open_too(tmp_path, monkeypatch):
    """zstd-compressed arrays split into several chunks: xarray and dask read them as daskjobs does."""
    monkeypatch.setattr(_chunks, "CHUNK_BYTES", 4096)
    big = np.arange(3000, dtype=np.float64).reshape(1000, 3)
    with dj.Job(name="big") as job, dj.Node("a"):
        with job.init_group:
            dj.Task(lambda ws: ws.update(big=big.copy(), n=np.int64(1)))
        dj.Task(lambda ws: ws.update(big=ws["big"] + 1))
    manager = dj.MultiNodeCheckpointManager(str(tmp_path / "ck"), compression="zstd")
    dj.JobRunner(job, manager, max_epochs=1, progress=False).train(None)
    ds = xr.open_zarr(tmp_path / "ck" / "a.1", consolidated=False)
    assert ds["big"].data.numblocks[0] > 1
    assert np.array_equal(ds["big"].values, big + 1)
    assert np.array_equal(dj.open_checkpoint(str(tmp_path / "ck"))["a"].lazy("big").compute(), big + 1)


# -- checkpoints of format 4, and verification --------------------------------------------------------
def test_checkpoints_without_dimension_names_still_read_verify_and_resume(prefix, tmp_path):
    """A copy of the prefix rewritten as format 4 wrote it: read, verified and resumed from; xarray
    refuses those groups (no dimension names), and the first new epoch names its dimensions."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(prefix, old, copy_function=shutil.copy)
    store = CheckpointStore(str(old))
    for epoch in (0, 1, 2):
        as_version(store, epoch, 4)
    assert "dimension_names" not in json.loads((old / "ps.2" / "w" / "zarr.json").read_text())
    view = dj.open_checkpoint(str(old))
    assert view.verify() == dj.open_checkpoint(str(prefix)).verify()
    assert np.array_equal(view["ps"]["w"], dj.open_checkpoint(str(prefix))["ps"]["w"])
    with pytest.raises(KeyError, match="dimension_names"):
        xr.open_zarr(old / "ps.2", consolidated=False)
    from daskjobs.runner._targets import load_job

    (tmp_path / "job.py").write_text(JOB)
    job = load_job(f"{tmp_path / 'job.py'}:job")
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(str(old)), max_epochs=3, progress=False)
    assert runner.train(None) == 3
    assert runner.history[0].bytes_reused > 0  # the unchanged chunks of format 4 are reused
    ds = xr.open_zarr(old / "ps.3", consolidated=False)
    assert ds["w"].dims == ("w/dim_0", "w/dim_1")
    assert dj.open_checkpoint(str(old), 3).verify() > 0


def dimension_names_of(path: Path, names: list[str] | None) -> None:
    document = json.loads(path.read_text())
    if names is None:
        document.pop("dimension_names")
    else:
        document["dimension_names"] = names
    path.unlink()  # other epochs may hard-link the file: change this epoch's only
    path.write_text(json.dumps(document, separators=(",", ":")))


@pytest.mark.parametrize(
    "names",
    [None, ["w/dim_1", "w/dim_0"], ["row", "column"], ["w/dim_0"]],
    ids=["dropped", "swapped", "renamed", "short"],
)
def test_array_metadata_that_differs_from_the_manifest_is_corrupt(prefix, tmp_path, names):
    """A ``zarr.json`` whose dimension names were dropped or changed is refused on read, naming epoch,
    node and blob: the names are part of what the manifest pins down."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prefix, copy, copy_function=shutil.copy)
    dimension_names_of(copy / "ps.2" / "w" / "zarr.json", names)
    with pytest.raises(CheckpointCorruptError, match=r"epoch 2, node 'ps', blob 'w'.*dimension_names"):
        dj.open_checkpoint(str(copy), 2)["ps"]["w"]
    assert dj.open_checkpoint(str(copy), 1).verify() > 0


def test_a_manifest_naming_other_dimensions_is_corrupt(prefix, tmp_path):
    """A manifest (consistently re-sealed, as a buggy or hostile writer would) whose blob lists other
    dimension names than daskjobs gives is refused before anything is read."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prefix, copy, copy_function=shutil.copy)
    store = CheckpointStore(str(copy))
    edit_entry(store, 2, "ps", lambda entry: entry["blobs"]["w"].update(dimension_names=["a", "b"]))
    assert json.loads(Path(manifest_path(store, "ps", 2)).read_text())["attributes"]["daskjobs"]["blobs"]["w"][
        "dimension_names"
    ] == ["a", "b"]
    with pytest.raises(CheckpointCorruptError, match=r"dimension_names \['a', 'b'\] are not \['w/dim_0', 'w/dim_1'\]"):
        dj.open_checkpoint(str(copy), 2)["ps"]["w"]
