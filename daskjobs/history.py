"""What happened in each epoch of a run: :class:`EpochRecord`, and epoch metrics (pure: no Dask, no I/O)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MetricSums = dict[str, tuple[float, int]]
"""Metric name -> (sum of the logged values, how many were logged)."""


@dataclass(frozen=True)
class EpochRecord:
    """What happened in one epoch of :meth:`~daskjobs.JobRunner.train`."""

    epoch: int
    seconds: float
    """Wall time of the epoch group run."""
    checkpoint_seconds: float
    """Time the driver spent saving and committing (or, with async saves, waiting for) checkpoints."""
    bytes_written: int
    """Bytes of blob data written by this epoch's checkpoint."""
    bytes_reused: int
    """Bytes of blob data reused from the previous epoch's checkpoint (delta checkpoints)."""
    stop_values: dict[str, bool]
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-epoch mean of each metric logged with ``ws.log(name, value)`` on any node."""
    recoveries: int = 0
    """Node losses recovered from before this epoch completed."""

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes written and reused: the size of the epoch's checkpoint."""
        return self.bytes_written + self.bytes_reused


class MetricLog:
    """Thread-safe sums and counts of the metrics logged during one group run on one node."""

    def __init__(self) -> None:
        self._sums: MetricSums = {}
        self._lock = threading.Lock()

    def add(self, name: str, value: float) -> None:
        """Record one value of ``name``."""
        with self._lock:
            total, count = self._sums.get(name, (0.0, 0))
            self._sums[name] = (total + value, count + 1)

    def sums(self) -> MetricSums:
        """A copy of what was logged."""
        with self._lock:
            return dict(self._sums)


def merge_sums(parts: Iterable[Mapping[str, tuple[float, int]]]) -> MetricSums:
    """Add up metric sums and counts from several nodes or runs."""
    merged: MetricSums = {}
    for part in parts:
        for name, (total, count) in part.items():
            old_total, old_count = merged.get(name, (0.0, 0))
            merged[name] = (old_total + total, old_count + count)
    return merged


def means(sums: Mapping[str, tuple[float, int]]) -> dict[str, float]:
    """The mean of each metric (metrics logged zero times are left out)."""
    return {name: total / count for name, (total, count) in sorted(sums.items()) if count and math.isfinite(total)}
