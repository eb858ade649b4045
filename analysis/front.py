"""The Pareto front of two objectives, as a pure function (no MLflow, no plotting).

A point is on the front iff no other point is at least as good in both objectives and strictly
better in one. Exact duplicates do not dominate each other (both stay on the front). Points with
a NaN coordinate are never on the front and never dominate. Default objectives: mu_lat down
(lower latency per cycle is better), mu_acc up (more accepted bytes per cycle is better).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

DIRECTIONS = ("min", "max")


def _check_direction(name: str, value: str) -> None:
    if value not in DIRECTIONS:
        raise ValueError(f"{name}={value!r}: expected 'min' or 'max'")


def pareto_mask(
    points: np.ndarray | Sequence[Sequence[float]], directions: Sequence[str] = ("min", "max")
) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``points`` (N, 2) under ``directions``.

    O(N log N): sort by the first objective (best first), sweep groups of equal first value and
    keep a point iff it is the best of its group in the second objective and strictly better
    there than every point with a strictly better first objective."""
    pts = np.asarray(points, dtype=float)  # (N, 2)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise ValueError(f"points: expected shape (N, 2), got {pts.shape}")
    if len(directions) != 2:
        raise ValueError(f"directions: expected two of 'min'/'max', got {list(directions)}")
    for i, d in enumerate(directions):
        _check_direction(f"directions[{i}]", d)
    # turn both objectives into "maximise"
    sign = np.array([1.0 if d == "max" else -1.0 for d in directions])
    z = pts * sign  # (N, 2)
    mask = np.zeros(len(z), dtype=bool)
    valid = np.flatnonzero(np.isfinite(z).all(axis=1))
    if len(valid) == 0:
        return mask
    a, b = z[valid, 0], z[valid, 1]
    order = np.lexsort((-b, -a))  # by a descending, then b descending
    best_b_better_a = -np.inf  # max b over points with strictly greater a
    i = 0
    while i < len(order):
        j = i
        a_i = a[order[i]]
        while j < len(order) and a[order[j]] == a_i:
            j += 1
        group = order[i:j]
        group_best = b[group].max()
        if group_best > best_b_better_a:
            mask[valid[group[b[group] == group_best]]] = True
        best_b_better_a = max(best_b_better_a, group_best)
        i = j
    return mask


def pareto_front(
    df: pd.DataFrame,
    x: str = "mu_acc",
    y: str = "mu_lat",
    x_dir: str = "max",
    y_dir: str = "min",
) -> pd.Series:
    """Boolean Series (index of ``df``): True for rows on the Pareto front of columns x and y."""
    _check_direction("x_dir", x_dir)
    _check_direction("y_dir", y_dir)
    for col in (x, y):
        if col not in df.columns:
            raise ValueError(f"column {col!r} not in the DataFrame; columns: {list(df.columns)}")
    pts = np.column_stack(
        [df[x].to_numpy(dtype=float, na_value=np.nan), df[y].to_numpy(dtype=float, na_value=np.nan)]
    )
    return pd.Series(pareto_mask(pts, (x_dir, y_dir)), index=df.index, name="on_front")
