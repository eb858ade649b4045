"""The training axes of a sweep grid (kl_beta, train_seed) and the evaluation lists (eval.temperatures,
eval.eos): expansion with defaults, grid keys (unchanged for specs that do not use them), validation
naming the key, the mapping into the training config, and a fixture sweep whose child runs carry
them so the analysis keeps CE and distilled heads, seeds, temperatures and EOS treatments apart."""

from __future__ import annotations

import pytest
import yaml

from analysis.aggregate import aggregate, split_settings
from analysis.filters import Filters
from analysis.load import load
from experiments.evaluation.prompts import eval_passes
from experiments.training.config import load_config
from experiments.training.trial import trial_config
from sweeps.spec import SpecError, grid_key, load_spec
from tests.sweep_helpers import fixture_spec, fresh_tracking_uri, run_cli


def write(tmp_path, slices, **over):
    spec = {
        "study": "axes",
        "objective": "fixture",
        "output_dir": str(tmp_path / "out"),
        "space": {"kind": "grid", "slices": slices},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
    }
    spec.update(over)
    path = tmp_path / "axes.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_training_axes_expand_with_defaults_and_keep_old_keys(tmp_path):
    path = write(
        tmp_path,
        {
            "ce": {"circuit": ["cp"], "rank": [4], "window": [8], "lora_depth": [0]},
            "kl": {
                "circuit": ["cp", "ff"],
                "rank": [4],
                "window": [8],
                "lora_depth": [0],
                "kl_beta": [0, 0.5],
                "train_seed": [0, 1],
            },
        },
    )
    spec = load_spec(path, env={})
    keys = [grid_key(p) for p in spec.grid]
    assert keys == [
        "cp-r4-n8-k0",
        "cp-r4-n8-k0-s1",
        "cp-r4-n8-k0-kl0.5",
        "cp-r4-n8-k0-kl0.5-s1",
        "ff-r1-n8-k0",
        "ff-r1-n8-k0-s1",
        "ff-r1-n8-k0-kl0.5",
        "ff-r1-n8-k0-kl0.5-s1",
    ]
    assert spec.grid_slices["cp-r4-n8-k0"] == (
        "ce",
        "kl",
    )  # kl_beta 0 (int) and the default 0.0 are one point
    assert all(isinstance(p["kl_beta"], float) for p in spec.grid)
    assert spec.grid[0] == {
        "circuit": "cp",
        "rank": 4,
        "window": 8,
        "lora_depth": 0,
        "kl_beta": 0.0,
        "train_seed": 0,
    }


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"kl_beta": [1.5]}, "space.slices.s.kl_beta"),
        ({"kl_beta": [True]}, "kl_beta"),
        ({"train_seed": [-1]}, "space.slices.s.train_seed"),
        ({"seed": [1]}, "space.slices.s.seed"),
    ],
)
def test_bad_training_axis_names_the_key(tmp_path, bad, key):
    path = write(tmp_path, {"s": {"circuit": ["cp"], "rank": [4], "window": [8], "lora_depth": [0], **bad}})
    with pytest.raises(SpecError, match=key.replace(".", r"\.")):
        load_spec(path, env={})


def test_eval_temperatures_and_eos_lists(tmp_path):
    sl = {"s": {"circuit": ["cp"], "rank": [4], "window": [8], "lora_depth": [0]}}
    spec = load_spec(
        write(tmp_path, sl, eval={"temperatures": [1.0, 0.7], "eos": ["banned", "allowed"]}), env={}
    )
    assert spec.eval.temperatures == (1.0, 0.7) and spec.eval.eos == ("banned", "allowed")
    assert load_spec(write(tmp_path, sl), env={}).eval.temperatures == (1.0,)
    for ev, match in (
        ({"temperatures": [1.0, 1.0]}, "eval.temperatures.*twice"),
        ({"eos": ["sometimes"]}, "eval.eos"),
        ({"temperature": 0.7}, "eval.temperature.*unknown key"),
        ({"temperatures": [0]}, "eval.temperatures"),
    ):
        with pytest.raises(SpecError, match=match):
            load_spec(write(tmp_path, sl, eval=ev), env={})


def test_axes_reach_the_training_config_and_eval_passes():
    cfg = trial_config(
        load_config("debug"),
        {"circuit": "cp", "rank": 4, "window": 8, "lora_depth": 0, "kl_beta": 0.5, "train_seed": 3},
        tracking_uri="sqlite://",
    )
    assert cfg.source.endswith("debug.yaml") and cfg.model.kl_beta == 0.5 and cfg.seed_everything == 3
    assert (cfg.model.circuit, cfg.model.rank, cfg.model.window) == ("cp", 4, 8)
    assert eval_passes(("greedy", "sample"), (1.0, 0.7)) == [
        ("greedy", 1.0),
        ("sample", 1.0),
        ("sample", 0.7),
    ]
    assert eval_passes(("greedy",), (1.0, 0.7)) == [("greedy", 1.0)]


@pytest.mark.slow
def test_fixture_sweep_children_carry_the_axes_and_analysis_keeps_them_apart(tmp_path):
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    path = fixture_spec(
        tmp_path,
        "axes",
        tracking_uri=uri,
        space={
            "kind": "grid",
            "slices": {
                "a": {
                    "circuit": ["cp"],
                    "rank": [4],
                    "window": [4],
                    "lora_depth": [0],
                    "kl_beta": [0.0, 0.5],
                    "train_seed": [0, 1],
                }
            },
        },
        eval={
            "modes": ["greedy", "sample"],
            "sets": 1,
            "dev_sets": 1,
            "temperatures": [1.0, 0.7],
            "eos": ["banned", "allowed"],
        },
    )
    r = run_cli([str(path), "--workers", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    result, _, _ = load(uri, "axes")
    df = result.runs
    assert len(df) == 4 * 3 * 2  # grid points x (greedy, sample T=1, sample T=0.7) x eos; dev sets left out
    assert set(df.prompt_set) == {"0"}
    dev, _, _ = load(uri, "axes", Filters(prompt_sets="dev"))
    assert len(dev.runs) == 4 * 3 * 2 and set(dev.runs.prompt_set) == {"dev0"}
    assert (
        set(df.kl_beta) == {0.0, 0.5}
        and set(df.train_seed) == {0, 1}
        and set(df.eos) == {"banned", "allowed"}
    )
    parts = split_settings(aggregate(df))
    assert len(parts) == 3 * 2  # (greedy, sample T=1, sample T=0.7) x eos
    assert all(
        len(part) == 4 and (part.n_evals == 1).all() for _, part in parts
    )  # nothing averaged across points
