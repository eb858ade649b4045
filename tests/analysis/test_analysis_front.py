"""The Pareto front (analysis.front) against a brute-force O(N^2) definition, on random points with
ties, for every direction combination; plus NaN handling and argument errors."""

import itertools

import numpy as np
import pandas as pd
import pytest

from analysis.front import pareto_front, pareto_mask


def brute_force_front(pts: np.ndarray, directions) -> np.ndarray:
    sign = np.array([1.0 if d == "max" else -1.0 for d in directions])
    z = pts * sign
    ok = np.isfinite(z).all(axis=1)
    out = np.zeros(len(z), bool)
    for i in range(len(z)):
        if not ok[i]:
            continue
        dominated = False
        for j in range(len(z)):
            if j != i and ok[j] and (z[j] >= z[i]).all() and (z[j] > z[i]).any():
                dominated = True
                break
        out[i] = not dominated
    return out


@pytest.mark.parametrize("directions", list(itertools.product(("min", "max"), repeat=2)))
def test_front_matches_brute_force(directions):
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 40, 200):
        for rounding in (None, 1):  # rounded coordinates create ties and exact duplicates
            pts = rng.normal(size=(n, 2))
            if rounding is not None:
                pts = np.round(pts, rounding)
            np.testing.assert_array_equal(pareto_mask(pts, directions), brute_force_front(pts, directions))


def test_front_known_example_and_default_directions():
    # (mu_acc, mu_lat): default keeps high mu_acc and low mu_lat
    df = pd.DataFrame(
        {"mu_acc": [1.0, 2.0, 2.0, 3.0, 0.5, 3.0], "mu_lat": [0.020, 0.025, 0.030, 0.040, 0.021, 0.040]},
        index=[10, 11, 12, 13, 14, 15],
    )
    front = pareto_front(df)
    assert front.index.tolist() == df.index.tolist()
    # 12 is dominated by 11 (same mu_acc, slower); 14 by 10; 13 and 15 are duplicates: both kept
    assert front.tolist() == [True, True, False, True, False, True]


def test_front_nan_points_never_on_front_nor_dominating():
    pts = np.array([[np.nan, 0.0], [1.0, 1.0], [0.5, np.nan], [0.9, 0.9]])
    mask = pareto_mask(pts, ("max", "max"))
    assert mask.tolist() == [False, True, False, False]
    assert not pareto_mask(np.full((3, 2), np.nan)).any()
    assert pareto_mask(np.zeros((0, 2))).shape == (0,)


def test_front_errors_name_the_argument():
    with pytest.raises(ValueError, match="x_dir"):
        pareto_front(pd.DataFrame({"mu_acc": [1.0], "mu_lat": [1.0]}), x_dir="up")
    with pytest.raises(ValueError, match="'throughput' not in the DataFrame"):
        pareto_front(pd.DataFrame({"mu_acc": [1.0], "mu_lat": [1.0]}), x="throughput")
    with pytest.raises(ValueError, match=r"shape \(N, 2\)"):
        pareto_mask(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="directions"):
        pareto_mask(np.zeros((3, 2)), ("min",))
