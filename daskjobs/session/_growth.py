"""What Dask remembers of every key and every submission, kept bounded for jobs of many epochs.

* Dask computes a key's prefix (``"daskjobs"`` for ``"daskjobs-…-tier0-12-…"``) with
  :func:`dask.utils.key_split`, which remembers its last 100 000 keys in an LRU cache. A job makes
  new keys every epoch (its tasks' and, with tier 0, its snapshots'), and every one is remembered by
  the driver, the scheduler and the worker that sees it: a few hundred bytes per key, megabytes per
  thousand epochs, up to the cache's 100 000 entries. :func:`trim_key_cache` empties the cache of
  the process it runs in once it holds more than :data:`KEY_CACHE_LIMIT` keys; it is only a memo,
  Dask computes a prefix again when it needs it.
* The scheduler notes, in the span its tasks belong to, the kind of collection of every submission
  (``{"type": "Future"}`` for each ``client.submit``) and never forgets it (dask/distributed#7977:
  spans live forever): a run submits a task per node, so a 64-node job grew the scheduler by about
  20 KB per epoch. :class:`SpanTrim` has the scheduler keep one note per kind, every
  :data:`TRIM_SPANS_EVERY` tasks submitted.
"""

from __future__ import annotations

import logging
from typing import Any

from dask.utils import key_split
from distributed import Client

from .._config import config_timeout

logger = logging.getLogger("daskjobs")

KEY_CACHE_LIMIT = 1000
"""Keys the process's ``key_split`` cache may hold before :func:`trim_key_cache` empties it."""
TRIM_SPANS_EVERY = 1000
"""Tasks a session submits between two trims of the scheduler's span notes."""


def trim_key_cache() -> None:
    """Empty :func:`dask.utils.key_split`'s cache in this process if it holds more than
    :data:`KEY_CACHE_LIMIT` keys (cheap to call every epoch: a look at the cache's size)."""
    if key_split.cache_info().currsize > KEY_CACHE_LIMIT:
        key_split.cache_clear()


def _span_notes_trimmer() -> Any:
    """The function the scheduler runs to keep one note per collection kind in each span.

    Made here, as a nested function, so that it is pickled by value: the scheduler needs neither
    daskjobs nor anything but distributed to run it."""

    def trim_span_notes(dask_scheduler: Any) -> int:
        """Keep one note per kind in every span; return how many were dropped."""
        spans = getattr(dask_scheduler, "extensions", {}).get("spans")
        dropped = 0
        for span in list(getattr(spans, "spans", {}).values()):
            notes = (getattr(span, "_metadata", None) or {}).get("collections")
            if isinstance(notes, list) and len(notes) > 1:
                kinds = {repr(sorted(note.items())) if isinstance(note, dict) else repr(note): note for note in notes}
                dropped += len(notes) - len(kinds)
                notes[:] = list(kinds.values())
        return dropped

    return trim_span_notes


class SpanTrim:
    """Has the scheduler of ``client`` drop repeated collection notes from its spans every
    :data:`TRIM_SPANS_EVERY` tasks submitted (:meth:`submitted`). A scheduler that refuses (it runs
    no functions of clients) or does not answer within the connect timeout is logged once, and
    asked again after as many tasks."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._since = 0
        self._logged = False
        self._trimmer = _span_notes_trimmer()

    def submitted(self, tasks: int) -> None:
        """``tasks`` more tasks were submitted: trim once enough were since the last trim."""
        self._since += tasks
        if self._since < TRIM_SPANS_EVERY:
            return
        self._since = 0
        try:
            self._client.run_on_scheduler(self._trimmer, callback_timeout=config_timeout("connect-timeout"))
        except Exception as exc:
            if not self._logged:
                self._logged = True
                logger.info(
                    "the Dask scheduler did not drop its notes of this session's submissions (%r): it keeps about "
                    "300 bytes per task submitted (dask/distributed#7977) until it restarts; let it run client "
                    "functions (distributed.scheduler.pickle: true) to keep them bounded",
                    exc,
                )
