"""What one checkpointed epoch costs in requests on an object store (S3 on a moto server on
127.0.0.1), counted by ``benchmarks/object_store_requests.py`` run as its users run it.

2 nodes x 3 small blobs (one changing every epoch) save 2 x (3 array metadata + 3 chunks) + 2
manifests + 1 commit record: the format's floor is 15 PUTs (full), or 5 PUTs and 10 server-side
copies (delta). Above it, per node and epoch: the marker PUT, the lock GET before the save, the
HEAD and LIST that make sure nothing is in the group's place; and the driver's lock GET before
the commit. Retention (``keep_last=3``) deletes one epoch per epoch: per node the manifest GET
(what to delete) and the lock GET, one DELETE of the blobs' objects and one of the manifest
(last); then the commit record. A committed group's manifest names every object: no LIST.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "object_store_requests.py"

pytestmark = pytest.mark.timeout(300)

SAVE = {"GET": 3, "LIST": 2, "HEAD": 2, "DELETE": 0, "other": 0}
EXPECTED = {
    "full": {"PUT": 17, "COPY": 0, **SAVE},
    "delta": {"PUT": 7, "COPY": 10, **SAVE},
    "delta+keep_last=3": {"PUT": 7, "COPY": 10, **SAVE, "GET": 7, "DELETE": 5},
}


@pytest.mark.slow
def test_requests_per_epoch_are_the_floor_plus_bookkeeping(tmp_path):
    out = tmp_path / "requests.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(SCRIPT), "--nodes", "2", "--blobs", "3", "--epochs", "6", "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["floor_per_epoch"] == {"full": {"PUT": 15}, "delta": {"PUT": 5, "COPY": 10}}
    assert {name: variant["median_per_epoch"] for name, variant in report["variants"].items()} == EXPECTED
