"""daskjobs' settings in Dask's configuration (the ``daskjobs`` section): defaults and readers.

Every wait of daskjobs has a deadline; the ones a user can change are read here, from
``dask.config`` (``dask.config.set``, a YAML file of Dask's config folders, or environment variables
``DASK_DASKJOBS__<KEY>``). A value that is not what its key needs raises
:class:`~daskjobs.errors.ConfigError` naming the key and the value, when the setting is read.

Imports only :mod:`daskjobs.errors` and :mod:`dask.config` (not ``distributed``): sessions, the
runner and the checkpoints' waits for storage read their settings from here.
"""

from __future__ import annotations

import contextlib
import math
from datetime import timedelta

import dask.config
from dask.utils import parse_timedelta

from .errors import ConfigError

TIMEOUTS = {
    "preflight-timeout": "2s",
    "placement-timeout": "10s",
    "connect-timeout": "30s",
    "straggler-timeout": "60s",
    "recovery-timeout": "60s",
    "storage-timeout": "10 minutes",
}
"""Waits: key -> default (a number of seconds, or a string such as ``"10s"`` or ``"2 minutes"``)."""
COUNTS = {"max-departures": 10}
"""Counts: key -> default (an integer, at least 0)."""
CHOICES = {"rebalance": ("on-join", "never")}
"""Choices: key -> the values it takes, its default first."""
dask.config.update_defaults(
    {"daskjobs": {**TIMEOUTS, **COUNTS, **{name: values[0] for name, values in CHOICES.items()}}}
)


def config_timeout(name: str) -> float:
    """The ``daskjobs.<name>`` wait from the Dask config, in seconds (its default when unset: a
    ``dask.config.set`` block that first created the ``daskjobs`` section removes it on exit).

    Examples
    --------
    >>> import dask.config
    >>> from daskjobs._config import config_timeout
    >>> with dask.config.set({"daskjobs.recovery-timeout": "2 minutes"}):
    ...     config_timeout("recovery-timeout")
    120.0
    """
    value = dask.config.get(f"daskjobs.{name}", default=TIMEOUTS[name])
    seconds = None
    if isinstance(value, int | float | str | timedelta) and not isinstance(value, bool):
        with contextlib.suppress(KeyError, ValueError, TypeError):
            seconds = parse_timedelta(value, default="s")
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(
            f"daskjobs.{name} is {value!r}: it must be a time of at least 0, a number of seconds "
            f"or a string such as '10s' or '2 minutes' (default {TIMEOUTS[name]!r})"
        )
    return float(seconds)


def config_count(name: str) -> int:
    """The ``daskjobs.<name>`` count from the Dask config (an integer of at least 0).

    Examples
    --------
    >>> import dask.config
    >>> from daskjobs._config import config_count
    >>> with dask.config.set({"daskjobs.max-departures": "3"}):
    ...     config_count("max-departures")
    3
    """
    value = dask.config.get(f"daskjobs.{name}", default=COUNTS[name])
    try:
        count = int(str(value).strip()) if not isinstance(value, bool | float) else None
    except ValueError:
        count = None
    if count is None or count < 0:
        raise ConfigError(f"daskjobs.{name} is {value!r}: it must be an integer of at least 0 (default {COUNTS[name]})")
    return count


def config_choice(name: str) -> str:
    """The ``daskjobs.<name>`` setting from the Dask config, one of the values :data:`CHOICES` lists.

    Examples
    --------
    >>> import dask.config
    >>> from daskjobs._config import config_choice
    >>> config_choice("rebalance")
    'on-join'
    >>> with dask.config.set({"daskjobs.rebalance": "never"}):
    ...     config_choice("rebalance")
    'never'
    """
    values = CHOICES[name]
    value = dask.config.get(f"daskjobs.{name}", default=values[0])
    if value not in values:
        allowed = " or ".join(repr(v) for v in values)
        raise ConfigError(f"daskjobs.{name} is {value!r}: it must be {allowed} (default {values[0]!r})")
    return str(value)


def check_config() -> None:
    """Read every ``daskjobs.*`` setting once: a bad value raises :class:`~daskjobs.errors.ConfigError`
    before a run starts, not when a recovery first needs it."""
    for name in TIMEOUTS:
        config_timeout(name)
    for name in COUNTS:
        config_count(name)
    for name in CHOICES:
        config_choice(name)
