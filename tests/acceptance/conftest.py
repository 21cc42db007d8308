"""Fixtures of the acceptance layer (see :mod:`acceptance.harness`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from acceptance.harness import (
    JOBFILES,
    ExternalCluster,
    checkpoint_values,
    clean_env,
    finish,
    start_run,
)


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """The job files copied to a folder of their own (on no worker's path), and a driver-only module elsewhere."""
    folder = tmp_path / "userjob"
    shutil.copytree(JOBFILES, folder, ignore=shutil.ignore_patterns("__pycache__", "driver_only"))
    shutil.copytree(JOBFILES / "driver_only", tmp_path / "driver_only")
    return folder


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """The folder ``daskjobs run`` is started from."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


@pytest.fixture
def external_cluster(tmp_path: Path) -> Iterator[ExternalCluster]:
    """A scheduler and one ``daskjobs worker`` per node of the acceptance job (``ps``, ``trainer``)."""
    cluster = ExternalCluster(tmp_path / "cluster", env=clean_env())
    try:
        for node in ("ps", "trainer"):
            cluster.start_worker(node)
        cluster.wait_for_nodes("ps", "trainer")
        yield cluster
    finally:
        cluster.close()


_references: dict[tuple[str, ...], dict] = {}


@pytest.fixture
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """``reference(epochs=8, ballast_mb=0)``: every committed epoch of an uninterrupted ``--local`` run
    of the acceptance job with those settings (computed once per test session)."""

    def made(epochs: int = 8, ballast_mb: int = 0) -> dict:
        key = (str(epochs), str(ballast_mb))
        if key not in _references:
            folder = tmp_path_factory.mktemp("reference")
            jobs = folder / "userjob"
            shutil.copytree(JOBFILES, jobs, ignore=shutil.ignore_patterns("__pycache__", "driver_only"))
            prefix = folder / "ckpt"
            env = clean_env(JOB_EPOCHS=str(epochs), JOB_STEP_SECONDS="0", JOB_BALLAST_MB=str(ballast_mb))
            code, _out, err = finish(
                start_run(jobs, folder, "train.py:job", "--local", "--checkpoint", str(prefix), env=env)
            )
            assert code == 0, err
            _references[key] = checkpoint_values(prefix)
        return _references[key]

    return made
