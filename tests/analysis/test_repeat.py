"""`python -m analysis.repeat`: two runs' summary.csv compared (the demo's repeatability table)."""

import pytest

from analysis import repeat
from analysis.aggregate import aggregate
from tests.analysis_helpers import frame_from_evaluations, synthetic_evaluations


@pytest.fixture(scope="module")
def agg():
    return aggregate(frame_from_evaluations(synthetic_evaluations(ranks=(8,), lora_depths=(0,))))


def test_identical_runs_agree_and_a_shifted_head_shows_its_difference(agg, tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    agg.drop(columns="run_ids").to_csv(a, index=False)
    agg.drop(columns="run_ids").to_csv(b, index=False)
    text, worst = repeat.compare(a, b)
    assert worst == 0 and "same winner: yes; same front: yes" in text
    shifted = agg.drop(columns="run_ids").copy()
    i = shifted["speedup_vs_stp_mean"].idxmin()
    shifted.loc[i, "speedup_vs_stp_mean"] *= 1.08
    shifted.to_csv(b, index=False)
    text, worst = repeat.compare(a, b)
    assert worst == pytest.approx(0.08) and "+8.0%" in text and text.endswith("max |Δ ratio| = 8.0%")


def test_different_configurations_or_missing_file_is_one_line_exit_2(agg, tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    agg.drop(columns="run_ids").to_csv(a, index=False)
    agg.drop(columns="run_ids").iloc[1:].to_csv(b, index=False)
    assert repeat.main([str(a), str(b)]) == 2
    assert "different configurations" in capsys.readouterr().err
    assert repeat.main([str(a), str(tmp_path / "nope.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
