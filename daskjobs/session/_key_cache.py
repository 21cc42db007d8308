"""Dask's memory of task-key prefixes, kept small.

Dask computes a key's prefix (``"daskjobs"`` for ``"daskjobs-…-tier0-12-…"``) with
:func:`dask.utils.key_split`, which remembers its last 100 000 keys in an LRU cache. A job makes
new keys every epoch (its tasks' and, with tier 0, its snapshots'), and every one is remembered by
the driver, the scheduler and the worker that sees it: a few hundred bytes per key, megabytes per
thousand epochs, up to the cache's 100 000 entries. :func:`trim_key_cache` empties the cache of the
process it runs in once it holds more than :data:`KEY_CACHE_LIMIT` keys; it is only a memo, Dask
computes a prefix again when it needs it.
"""

from __future__ import annotations

from dask.utils import key_split

KEY_CACHE_LIMIT = 1000
"""Keys the process's ``key_split`` cache may hold before :func:`trim_key_cache` empties it."""


def trim_key_cache() -> None:
    """Empty :func:`dask.utils.key_split`'s cache in this process if it holds more than
    :data:`KEY_CACHE_LIMIT` keys (cheap to call every epoch: a look at the cache's size)."""
    if key_split.cache_info().currsize > KEY_CACHE_LIMIT:
        key_split.cache_clear()
