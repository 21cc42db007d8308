"""The helper module of ``job.py``: data for a linear model, and its loss (plain numpy)."""

from __future__ import annotations

import numpy as np


def make_problem(rows: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``x`` and targets ``y = x @ w_true`` for a fixed ``w_true`` (the same for every seed)."""
    x = np.random.default_rng(seed).normal(size=(rows, features))
    return x, x @ np.linspace(-1.0, 1.0, features)


def mean_squared_error(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The mean squared error of the weights ``w``."""
    return float(np.mean((x @ w - y) ** 2))
