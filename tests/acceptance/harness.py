"""The acceptance layer's harness: daskjobs run the way users run it.

Job files of plain top-level functions (``jobfiles/``) are copied to a fresh folder that no worker
has on its path; ``daskjobs run`` runs them as a subprocess in its own process group, from yet
another folder; clusters are real ``dask scheduler`` and ``daskjobs worker`` processes started from
a folder of their own; signals go to the whole process group (``killpg``), as a terminal, SLURM,
Kubernetes or systemd deliver them. Every case checks the exit code, that stderr holds no traceback
and no ERROR, that what is committed verifies, and that the values equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import STEP_SECONDS_WHILE_EXPIRING, ExternalCluster, stop_group, wait_until  # noqa: F401 - the acceptance tests import them here

import daskjobs as dj

ROOT = Path(dj.__file__).resolve().parents[1]
JOBFILES = Path(__file__).parent / "jobfiles"
SESSIONS = ("local", "cluster", "scheduler")
"""How ``daskjobs run`` runs a job: ``--local``, the default node_cluster, ``--scheduler`` of real processes."""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess: this checkout's daskjobs on the path, nothing of the job's folder."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JOB_", "PYTHONPATH"))}
    return {**base, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}


def session_args(kind: str, request: pytest.FixtureRequest) -> list[str]:
    """The ``daskjobs run`` options of a session kind (starting the external cluster it needs)."""
    if kind == "local":
        return ["--local"]
    if kind == "scheduler":
        return ["--scheduler", request.getfixturevalue("external_cluster").address]
    return []


def start_run(
    job_dir: Path, cwd: Path, target: str, *options: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``daskjobs run JOB_DIR/TARGET OPTIONS`` in ``cwd``, in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "daskjobs", "run", str(job_dir / target), "--no-progress", *options],
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    """Wait for ``process``; its exit code, stdout and stderr."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop_group(process)
    return process.returncode, out, err


def assert_quiet(err: str) -> None:
    """No traceback and no ERROR (daskjobs' or Dask's) on stderr."""
    assert "Traceback" not in err, err
    assert "ERROR" not in err, err
    assert "CRITICAL" not in err, err


def checkpoint_values(prefix: Path) -> dict[int, dict[str, dict[str, object]]]:
    """Every committed epoch under ``prefix``: node -> blob -> value (verified reads)."""
    found = {}
    for info in dj.list_checkpoints(str(prefix)):
        view = dj.open_checkpoint(str(prefix), epoch=info.epoch)
        found[info.epoch] = {node: view[node].read() for node in view.nodes}
    return found


def assert_same_checkpoints(actual: dict, expected: dict) -> None:
    """The same epochs, nodes and blobs, bit for bit (JSON values equal)."""
    assert sorted(actual) == sorted(expected)
    for epoch, nodes in expected.items():
        assert sorted(actual[epoch]) == sorted(nodes), epoch
        for node, blobs in nodes.items():
            assert sorted(actual[epoch][node]) == sorted(blobs), (epoch, node)
            for blob, value in blobs.items():
                got = actual[epoch][node][blob]
                if isinstance(value, np.ndarray):
                    assert (got.dtype, got.shape) == (value.dtype, value.shape), (epoch, node, blob)
                    assert got.tobytes() == value.tobytes(), (epoch, node, blob)
                else:
                    assert got == value, (epoch, node, blob)
