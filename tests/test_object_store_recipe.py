"""The object-store how-to as a user follows it (docs/how-to/object-stores.md): its command-line recipe
runs as printed against an S3 emulator (moto) on 127.0.0.1, the credentials only in the environment the
local cluster's workers inherit and the endpoint in ``--storage-option``; its Python recipe is run by
``tests/test_docs.py`` with the page's other examples."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import daskjobs as dj

ROOT = Path(dj.__file__).resolve().parents[1]


def recipe() -> list[str]:
    """The commands of the ``bash`` block under ``## Try it locally with moto``."""
    text = (ROOT / "docs" / "how-to" / "object-stores.md").read_text()
    section = text.split("\n## Try it locally with moto\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_command_line_recipe_runs_as_printed(tmp_path, moto_server):
    """Every command exits 0 (``set -e``); the run commits epochs 0-3 on the workers of a local cluster,
    the listing shows them and every one verifies. The recipe's own ``moto_server`` is the fixture's server
    (its port put in place of the recipe's)."""
    commands = recipe()
    assert commands[0] == "moto_server -H 127.0.0.1 -p 5555 &"
    port = moto_server.rsplit(":", 1)[1]
    shims = tmp_path / "bin"  # `daskjobs` and `python` of this checkout and interpreter
    shims.mkdir()
    for name, line in {
        "daskjobs": f'exec {sys.executable} -m daskjobs "$@"',
        "python": f'exec {sys.executable} "$@"',
    }.items():
        (shims / name).write_text(f"#!/bin/sh\n{line}\n")
        (shims / name).chmod(stat.S_IRWXU)
    work = tmp_path / "examples"
    work.mkdir()
    (work / "train.py").write_text((ROOT / "examples" / "train.py").read_text())
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}  # the recipe exports them
    env.update(
        PATH=f"{shims}{os.pathsep}{env['PATH']}", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    script = "\n".join(["set -e", *(line.replace("5555", port) for line in commands[1:])])
    result = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    finals = [line for line in lines if line.startswith("job 'linear': last epoch")]
    assert finals == ["job 'linear': last epoch 3, committed under s3://ckpt-bucket/linear; ran epochs 1-3"]
    listed = [line for line in lines if re.match(r"\s+\d+  linear  nodes=ps,trainer  ", line)]
    assert [int(line.split()[0]) for line in listed] == [0, 1, 2, 3]
    verified = [line for line in lines if line.startswith("epoch ") and "bytes verified" in line]
    assert [line.split(":")[0] for line in verified] == ["epoch 0", "epoch 1", "epoch 2", "epoch 3"]
    assert all(re.fullmatch(r"epoch \d: OK \(\d+ bytes verified\)", line) for line in verified)
