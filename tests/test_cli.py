"""``daskjobs checkpoints list|show|verify|prune|unlock`` and ``daskjobs worker``: output, exit codes
(0 success, 1 a check failed, 2 usage error) and that read-only commands create nothing."""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from processes import dead_pid

import daskjobs as dj
from daskjobs.checkpoint._format.records import RECORD_FORMAT_VERSION
from daskjobs.cli import main

pytestmark = pytest.mark.timeout(60)

ACTIONS = ["list", "show", "verify", "prune", "unlock"]


def env() -> dict[str, str]:
    root = str(Path(dj.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def daskjobs(*args: str) -> subprocess.CompletedProcess:
    """The real command, ``python -m daskjobs ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "daskjobs", *args], env=env(), capture_output=True, text=True, timeout=30, check=False
    )


def here(*args: str, capsys) -> subprocess.CompletedProcess:
    """``daskjobs ARGS`` in this process, as a CompletedProcess."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def train(prefix: str, epochs: int = 5, **manager_options) -> None:
    """Commit epochs 0..epochs of a job whose node 'ps' holds ``weights`` (17 float64) and ``step``."""

    def init(ws):
        ws["weights"] = np.zeros(17)
        ws["step"] = np.int64(0)

    def step(ws):
        ws["weights"] = ws["weights"] + 1
        ws["step"] = ws["step"] + 1
        ws.log("loss", 1.0 / int(ws["step"]))

    with dj.Job(name="cli_job") as job:
        with job.init_group, dj.Node("ps"):
            dj.Task(init)
        with dj.Node("ps"):
            dj.Task(step)
    manager = dj.MultiNodeCheckpointManager(prefix, **manager_options)
    dj.JobRunner(job, manager, max_epochs=epochs, progress=False).train(None)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def committed(tmp_path) -> str:
    prefix = str(tmp_path / "ckpt")
    train(prefix)
    return prefix


@pytest.mark.slow
def test_list_show_verify_through_the_real_command(committed):
    """list: one line per epoch; show: the latest by default; verify: OK per epoch; all exit 0."""
    listed = daskjobs("checkpoints", "list", committed)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [int(line.split()[0]) for line in lines] == [0, 1, 2, 3, 4, 5]
    assert "cli_job  nodes=ps  144 bytes" in lines[-1]
    assert lines[-1].endswith("stopped=-  loss=0.2")
    assert "loss" not in lines[0]
    shown = daskjobs("checkpoints", "show", committed)
    assert shown.stdout.splitlines()[0].startswith("job cli_job, epoch 5, created ")
    assert "  ps/weights: <f8 (17,)" in shown.stdout.splitlines()
    assert "  ps/step: <i8 ()" in shown.stdout.splitlines()
    verified = daskjobs("checkpoints", "verify", committed)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.splitlines() == [f"epoch {e}: OK (144 bytes verified)" for e in range(6)]


def test_list_json_has_one_object_per_epoch(committed, capsys):
    """list --json: epoch, job, nodes, bytes, created, stop values, metrics and the record's format
    version of every committed epoch."""
    result = here("checkpoints", "list", committed, "--json", capsys=capsys)
    rows = json.loads(result.stdout)
    assert [row["epoch"] for row in rows] == [0, 1, 2, 3, 4, 5]
    infos = dj.list_checkpoints(committed)
    for row, info in zip(rows, infos, strict=True):
        assert set(row) == {"epoch", "job", "nodes", "bytes", "created", "stop_values", "metrics", "format_version"}
        assert row["format_version"] == RECORD_FORMAT_VERSION
        assert (row["job"], row["nodes"], row["bytes"], row["created"]) == ("cli_job", ["ps"], 144, info.created)
        assert row["stop_values"] == info.stop_values
        assert row["metrics"] == info.record.get("metrics", {})
    assert rows[4]["metrics"] == {"loss": 0.25}


def test_show_epoch_and_json(committed, capsys):
    """show --epoch N shows that epoch; --json prints its commit record."""
    text = here("checkpoints", "show", committed, "--epoch", "2", capsys=capsys).stdout
    assert text.startswith("job cli_job, epoch 2, created ")
    record = json.loads(here("checkpoints", "show", committed, "--epoch", "3", "--json", capsys=capsys).stdout)
    assert record == dj.open_checkpoint(committed, 3).record


@pytest.mark.slow
def test_show_missing_epoch_lists_the_committed_ones(committed):
    """A missing epoch is a usage error (exit 2) that lists what exists."""
    dj.MultiNodeCheckpointManager(committed).store.delete_epoch(1, ["ps"])
    result = daskjobs("checkpoints", "show", committed, "--epoch", "1")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"daskjobs checkpoints show: error: epoch 1 is not committed under {committed}; committed epochs: 0, 2, 3, 4, 5"
    )
    assert result.stdout == ""


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("kind", ["missing", "empty folder", "foreign folder", "file"])
def test_a_prefix_without_checkpoints_is_a_usage_error_and_nothing_is_created(tmp_path, action, kind, capsys):
    """Every action on a mistyped prefix exits 2, names the prefix and creates or changes nothing."""
    prefix = tmp_path / "typo"
    if kind == "empty folder":
        prefix.mkdir()
    elif kind == "foreign folder":
        (prefix / "ps.3").mkdir(parents=True)
        (prefix / "ps.3" / "data").write_bytes(b"not ours")
    elif kind == "file":
        prefix.write_bytes(b"a file")
    before = tree(tmp_path)
    result = here("checkpoints", action, str(prefix), capsys=capsys)
    assert result.returncode == 2
    assert result.stderr.startswith(f"daskjobs checkpoints {action}: error: ")
    assert str(prefix) in result.stderr
    assert tree(tmp_path) == before
    assert prefix.exists() == (kind != "missing")


@pytest.mark.parametrize("action", ["list", "show", "verify", "prune"])
def test_a_daskjobs_prefix_without_a_commit_is_a_usage_error(tmp_path, action, capsys):
    """A prefix whose job never committed (only daskjobs' own folder: its first run failed in the
    init group) holds no checkpoints: exit 2 naming it, nothing created or changed."""
    prefix = tmp_path / "never"
    (prefix / "__daskjobs__" / "commits").mkdir(parents=True)
    before = tree(tmp_path)
    result = here("checkpoints", action, str(prefix), capsys=capsys)
    assert result.returncode == 2
    assert result.stderr.strip() == f"daskjobs checkpoints {action}: error: no committed checkpoint under {prefix}"
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_mistyped_prefix_through_the_real_command(tmp_path):
    """The real command exits 2 and does not create the prefix."""
    result = daskjobs("checkpoints", "list", str(tmp_path / "nothing"))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"daskjobs checkpoints list: error: checkpoint prefix {tmp_path}/nothing does not exist"
    )
    assert not (tmp_path / "nothing").exists()


@pytest.mark.slow
def test_verify_names_epoch_node_and_blob_of_a_corrupt_chunk(committed):
    """A flipped byte: verify exits 1 naming epoch, node and blob; the other epochs still verify OK."""
    (chunk,) = glob.glob(os.path.join(committed, "ps.4", "weights", "c*"))
    data = bytearray(Path(chunk).read_bytes())
    data[3] ^= 0xFF
    Path(chunk).write_bytes(bytes(data))
    result = daskjobs("checkpoints", "verify", committed)
    assert result.returncode == 1
    assert "epoch 4: CORRUPT" in result.stdout.splitlines()
    assert result.stdout.count(": OK") == 5
    assert "epoch 4, node 'ps', blob 'weights'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": "daskjobs"}', b"[]"])
def test_list_and_verify_mark_a_corrupt_commit_record_by_name(committed, damage, capsys):
    """list shows every other epoch, marks the damaged record and warns naming it, but succeeds
    (SPEC §3: list/show mark it, verify fails); verify exits 1 naming it."""
    record = Path(committed, "__daskjobs__", "commits", "epoch-000000000002.json")
    record.write_bytes(damage)
    listed = here("checkpoints", "list", committed, capsys=capsys)
    assert listed.returncode == 0
    lines = listed.stdout.splitlines()
    assert [int(line.split()[0]) for line in lines] == [0, 1, 2, 3, 4, 5]
    assert lines[2].startswith("       2  CORRUPT commit record: ")
    assert "epoch 2" in listed.stderr
    as_json = json.loads(here("checkpoints", "list", committed, "--json", capsys=capsys).stdout)
    assert set(as_json[2]) == {"epoch", "error"}
    verified = here("checkpoints", "verify", committed, capsys=capsys)
    assert verified.returncode == 1
    assert "epoch 2: CORRUPT" in verified.stdout
    assert "commit record of epoch 2" in verified.stderr


@pytest.mark.parametrize("damage", [b"", b"{not json", b"[]"])
def test_show_marks_corrupt_newest_records_and_shows_the_newest_readable(committed, damage, capsys):
    """SPEC §3: show marks a corrupt commit record and still shows the others: by default the
    newest epoch whose record reads, after naming the newer damaged ones (exit 0); the damaged
    epoch asked for by number, or a prefix of damaged records only, fails (exit 1)."""
    commits = Path(committed, "__daskjobs__", "commits")
    for epoch in (4, 5):
        Path(commits, f"epoch-{epoch:012d}.json").write_bytes(damage)
    shown = here("checkpoints", "show", committed, capsys=capsys)
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == [
        "CORRUPT commit record of epoch 5",
        "CORRUPT commit record of epoch 4",
    ]
    assert lines[2].startswith("job cli_job, epoch 3, created ")
    assert "2 newer corrupt commit record(s)" in shown.stderr
    assert "epoch 5" in shown.stderr
    as_json = json.loads(here("checkpoints", "show", committed, "--json", capsys=capsys).stdout)
    assert as_json["epoch"] == 3
    assert here("checkpoints", "show", committed, "--epoch", "5", capsys=capsys).returncode == 1
    for epoch in range(4):
        Path(commits, f"epoch-{epoch:012d}.json").write_bytes(damage)
    failed = here("checkpoints", "show", committed, capsys=capsys)
    assert failed.returncode == 1
    assert "every commit record" in failed.stderr
    assert "epoch 0" in failed.stderr


@pytest.mark.slow
def test_prune_dry_run_keep_last_keep_every(committed, capsys):
    """--dry-run deletes nothing; --keep-last/--keep-every keep those and the newest epoch."""
    before = tree(Path(committed))
    dry = here("checkpoints", "prune", committed, "--keep-last", "1", "--dry-run", capsys=capsys)
    assert dry.returncode == 0
    assert [line for line in dry.stdout.splitlines() if line.startswith("would")] == [
        f"would delete epoch {e}" for e in range(5)
    ]
    assert tree(Path(committed)) == before
    pruned = daskjobs("checkpoints", "prune", committed, "--keep-last", "2", "--keep-every", "2")
    assert pruned.returncode == 0, pruned.stderr
    assert [i.epoch for i in dj.list_checkpoints(committed)] == [0, 2, 4, 5]
    assert not Path(committed, "__daskjobs__", "lock.json").exists()


def test_prune_keeps_at_least_one_epoch_that_verifies(committed, capsys):
    """The kept epochs are verified newest first before anything goes: when none reads back whole,
    nothing is deleted (exit 1); when an older kept one does, the prune goes ahead."""
    (chunk,) = [p for p in Path(committed, "ps.5", "weights").rglob("*") if p.name != "zarr.json"]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    before = tree(Path(committed))
    refused = here("checkpoints", "prune", committed, "--keep-last", "1", capsys=capsys)
    assert refused.returncode == 1
    assert "kept epoch 5: CORRUPT" in refused.stdout
    assert "no epoch it would keep verifies, so nothing was deleted" in refused.stderr
    assert tree(Path(committed)) == before
    pruned = here("checkpoints", "prune", committed, "--keep-last", "2", capsys=capsys)
    assert pruned.returncode == 0, pruned.stderr
    assert "kept epoch 4: OK" in pruned.stdout
    assert [i.epoch for i in dj.list_checkpoints(committed)] == [4, 5]


def test_prune_refuses_a_locked_prefix(committed, capsys):
    """prune takes the writer lock: a running job's prefix is left alone (exit 1)."""
    store = dj.MultiNodeCheckpointManager(committed).store
    store.acquire_lock({"host": "elsewhere", "pid": 12, "job": "running", "started": ""})
    result = here("checkpoints", "prune", committed, "--keep-last", "1", capsys=capsys)
    assert result.returncode == 1
    assert "locked" in result.stderr
    assert [i.epoch for i in dj.list_checkpoints(committed)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("holder", "removed_without_force"),
    [
        ({"pid": os.getpid()}, False),  # alive: this very process
        ({"pid": "dead"}, True),  # a process of this host that has exited
        ({"pid": 2**22 + 5}, False),  # a pid that cannot exist on this host: foreign
        ({"host": "another-host", "pid": 1}, False),  # unknown
    ],
)
def test_unlock_refuses_a_live_or_unknown_holder_without_force(committed, holder, removed_without_force, capsys):
    """unlock removes a dead holder's lock; a live or unknown holder needs --force (exit 1 without it)."""
    import socket

    if holder["pid"] == "dead":
        holder = {"pid": dead_pid()}
    store = dj.MultiNodeCheckpointManager(committed).store
    store.acquire_lock({"host": socket.gethostname(), "job": "j", "started": "", **holder})
    plain = here("checkpoints", "unlock", committed, capsys=capsys)
    if removed_without_force:
        assert plain.returncode == 0
        assert plain.stdout.startswith("removed lock ")
    else:
        assert plain.returncode == 1
        assert "--force" in plain.stderr
        assert store.read_lock() is not None
        forced = here("checkpoints", "unlock", committed, "--force", capsys=capsys)
        assert forced.returncode == 0
        assert forced.stdout.startswith("removed lock ")
    assert store.read_lock() is None
    assert here("checkpoints", "unlock", committed, capsys=capsys).stdout.strip() == f"no lock under {committed}"


def test_storage_options_reach_s3(s3_prefix, capsys):
    """--storage-option KEY=VALUE (JSON values parsed) lets every action read an S3 prefix."""
    url, options = s3_prefix
    train(url, epochs=2, storage_options=options)
    flags = [arg for key, value in options.items() for arg in ("--storage-option", f"{key}={json.dumps(value)}")]
    listed = here("checkpoints", "list", url, *flags, "--json", capsys=capsys)
    assert [row["epoch"] for row in json.loads(listed.stdout)] == [0, 1, 2]
    assert here("checkpoints", "verify", url, *flags, capsys=capsys).returncode == 0
    assert here("checkpoints", "show", url, *flags, capsys=capsys).stdout.startswith("job cli_job, epoch 2")
    missing = here("checkpoints", "list", url + "-typo", *flags, capsys=capsys)
    assert missing.returncode == 2


def test_worker_passes_tls_options_to_dask_worker(tmp_path, capsys):
    """--tls-ca-file/--tls-cert/--tls-key reach dask worker under the same names; a missing file is exit 2."""
    files = {}
    for name in ("ca.pem", "cert.pem", "key.pem"):
        files[name] = tmp_path / name
        files[name].write_text("x")
    args = ["worker", "tls://127.0.0.1:8786", "--node", "ps", "--dry-run"]
    args += ["--tls-ca-file", str(files["ca.pem"]), "--tls-cert", str(files["cert.pem"])]
    result = here(*args, "--tls-key", str(files["key.pem"]), capsys=capsys)
    command = shlex.split(result.stdout)
    options = {option: command[i + 1] for i, option in enumerate(command) if option.startswith("--tls")}
    assert options == {
        "--tls-ca-file": str(files["ca.pem"]),
        "--tls-cert": str(files["cert.pem"]),
        "--tls-key": str(files["key.pem"]),
    }
    missing = here(*args, "--tls-key", str(tmp_path / "nope.pem"), capsys=capsys)
    assert missing.returncode == 2
    assert f"--tls-key {tmp_path}/nope.pem: no such file" in missing.stderr


@pytest.mark.parametrize(
    "args",
    [[], ["checkpoints"], ["checkpoints", "list"], ["checkpoints", "show", "p", "--epoch", "-1"], ["run"], ["nope"]],
)
def test_bad_arguments_exit_2_with_usage(args, capsys):
    """argparse errors: exit 2 with a usage line."""
    result = here(*args, capsys=capsys)
    assert result.returncode == 2
    assert "usage: daskjobs" in result.stderr


def test_list_line_shows_metrics_and_stop_values_of_a_record():
    """A record's metrics (when the commit record has them) and true stop values appear in its list line."""
    from daskjobs.cli._checkpoints import _list_line, summary

    record = {
        "epoch": 7,
        "job": "j",
        "nodes": ["a", "b"],
        "format_version": 4,
        "manifests": {
            "a": {"bytes": 10, "bytes_written": 10, "bytes_reused": 0},
            "b": {"bytes": 5, "bytes_written": 1, "bytes_reused": 4},
        },
        "created": "2026-01-01T00:00:00+00:00",
        "stop_values": {"done": True, "early": False},
        "metrics": {"loss": 0.125, "accuracy": 0.5},
    }
    assert _list_line(summary(record)) == (
        "       7  j  nodes=a,b  15 bytes  2026-01-01T00:00:00+00:00  stopped=done  accuracy=0.5  loss=0.125"
    )
    del record["metrics"]
    assert summary(record)["metrics"] == {}


def subcommand_parsers(parser=None, path=()):
    """``(command path, parser)`` of the ``daskjobs`` parser and of every sub-command, depth first."""
    import argparse

    from daskjobs.cli import build_parser

    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommand_parsers(sub, (*path, name))


@pytest.mark.parametrize(
    ("path", "parser"),
    list(subcommand_parsers()),
    ids=[" ".join(path) or "daskjobs" for path, _ in subcommand_parsers()],
)
def test_every_option_and_command_has_a_help_text(path, parser):
    """`daskjobs ... --help` explains every argument (the demo's included) and every command has a
    description, without reStructuredText markup leaking into the terminal."""
    import argparse

    unexplained = [
        action.option_strings or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]
    assert unexplained == []
    assert (parser.description or "").strip()
    assert "``" not in parser.format_help()
