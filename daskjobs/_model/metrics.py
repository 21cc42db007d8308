"""Metrics that steps log (``ws.log``): summed on each node, merged over nodes, averaged per epoch."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping

MetricSums = dict[str, tuple[float, int]]
"""Metric name -> (sum of the logged values, how many were logged)."""


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
