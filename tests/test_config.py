"""daskjobs' settings in Dask's config: every key's default, the values it takes, and a clear
``ConfigError`` naming the key for a value it cannot take — raised before a run starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask.config
import pytest

import daskjobs as dj
from daskjobs._config import COUNTS, TIMEOUTS, check_config, config_count, config_timeout
from daskjobs.errors import ConfigError


def test_the_defaults():
    assert {name: config_timeout(name) for name in TIMEOUTS} == {
        "preflight-timeout": 2.0,
        "placement-timeout": 10.0,
        "connect-timeout": 30.0,
        "straggler-timeout": 60.0,
        "recovery-timeout": 60.0,
        "storage-timeout": 600.0,
    }
    assert {name: config_count(name) for name in COUNTS} == {"max-departures": 10}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(5, 5.0), (0, 0.0), (2.5, 2.5), ("10s", 10.0), ("2m", 120.0), ("2 minutes", 120.0), ("1h", 3600.0)],
)
@pytest.mark.parametrize("name", sorted(TIMEOUTS))
def test_a_time_is_seconds_or_a_string_with_a_unit(name, value, seconds):
    with dask.config.set({f"daskjobs.{name}": value}):
        assert config_timeout(name) == seconds


@pytest.mark.parametrize("value", ["soon", "2min", "-1s", -3, float("nan"), float("inf"), True, None, [1]])
@pytest.mark.parametrize("name", sorted(TIMEOUTS))
def test_a_time_it_cannot_take_names_the_key_and_the_value(name, value):
    with dask.config.set({f"daskjobs.{name}": value}), pytest.raises(ConfigError) as caught:
        config_timeout(name)
    assert str(caught.value).startswith(f"daskjobs.{name} is {value!r}: it must be a time of at least 0")
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(("value", "count"), [(0, 0), (3, 3), ("7", 7), (" 12 ", 12)])
def test_a_count_is_an_integer(value, count):
    with dask.config.set({"daskjobs.max-departures": value}):
        assert config_count("max-departures") == count


@pytest.mark.parametrize("value", [-1, "-2", 1.5, "ten", True, None, "3s"])
def test_a_count_it_cannot_take_names_the_key_and_the_value(value):
    with dask.config.set({"daskjobs.max-departures": value}), pytest.raises(ConfigError) as caught:
        config_count("max-departures")
    assert str(caught.value) == (
        f"daskjobs.max-departures is {value!r}: it must be an integer of at least 0 (default 10)"
    )


@pytest.mark.parametrize(
    ("name", "value"), [("recovery-timeout", "later"), ("storage-timeout", "never"), ("max-departures", "many")]
)
def test_a_bad_setting_stops_a_run_before_it_starts(name, value, tmp_path):
    """A setting read only by a recovery is checked when ``train`` starts: nothing runs or is written."""
    ran = tmp_path / "ran"
    with dj.Job(name="config") as job, dj.Node("a"), job.init_group:
        dj.Task(lambda ws: ran.touch())
    prefix = tmp_path / "ckpt"
    runner = dj.JobRunner(job, dj.MultiNodeCheckpointManager(str(prefix)), max_epochs=1, progress=False)
    with dask.config.set({f"daskjobs.{name}": value}), pytest.raises(ConfigError, match=f"daskjobs.{name}"):
        runner.train()
    assert not ran.exists()
    assert not prefix.exists()
    check_config()


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_the_command_line_reports_a_bad_setting_from_the_environment_in_one_line(tmp_path):
    """``DASK_DASKJOBS__RECOVERY_TIMEOUT=later daskjobs demo --local``: exit 2 (bad input), one line."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "DASK_DASKJOBS__RECOVERY_TIMEOUT": "later"}
    done = subprocess.run(
        [sys.executable, "-m", "daskjobs", "demo", "--local", "--checkpoint", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.strip().splitlines() == [
        "daskjobs demo: error: daskjobs.recovery-timeout is 'later': it must be a time of at least 0, a number of "
        "seconds or a string such as '10s' or '2 minutes' (default '60s')"
    ]
    assert not (tmp_path / "c").exists()
