"""The sweep axes are one table (tracking/axes.py): a new axis is one row. An axis the analysis did
not know (`model.lr`), added as a row in a fresh process, reaches the spec's grid and its value
check, the trial's config, run name, grid key and child-run params, the config a multi-rank trial's
child reads back, the Optuna params of a fixture sweep and the analysis's grouping (runs without the
param read as missing); a point naming an unknown axis fails in one line; the table's rows agree
with the TrainConfig fields they set; the library no longer knows the training axes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from experiments.training.config import TrainConfig, apply_point, config_value, load_config, point_of
from sweeps.spec import SpecError, load_spec
from tests.sweep_helpers import REPO, fresh_tracking_uri
from tracking import axes

ARCH = {"circuit": ["cp"], "rank": [4], "window": [4], "lora_depth": [0]}


def write(tmp_path, slices, name="axes", **over):
    spec = {
        "study": name,
        "objective": "fixture",
        "output_dir": str(tmp_path / "out"),
        "space": {"kind": "grid", "slices": slices},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
    }
    spec.update(over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_rows_agree_with_the_config_fields_they_set():
    cfg = TrainConfig()
    for a in axes.axes():
        assert a.role in axes.ROLES and a.name and isinstance(a.tag, str) and a.label
        value = config_value(cfg, a.path)  # the path names a field
        assert a.type in (int, float, str) and isinstance(value, a.type), a.name
        if a.role == axes.TRAINING:
            assert a.default == value, (
                f"{a.name}: the row's default {a.default!r} is not {a.path}'s {value!r}"
            )
    assert len(set(axes.names())) == len(axes.AXES) and len({a.path for a in axes.axes()}) == len(axes.AXES)
    assert axes.names(axes.ARCHITECTURE) == ("circuit", "rank", "window", "lora_depth")


def test_kl_temperature_is_an_axis_named_only_by_the_specs_that_vary_it(tmp_path):
    spec = load_spec(write(tmp_path, {"a": {**ARCH, "kl_temperature": [1, 2.0]}}), env={})
    assert [axes.grid_key(p) for p in spec.grid] == ["cp-r4-n4-k0", "cp-r4-n4-k0-T2"]
    assert spec.grid[1]["kl_temperature"] == 2.0 and isinstance(spec.grid[0]["kl_temperature"], float)
    cfg = apply_point(load_config("debug"), spec.grid[1])
    assert cfg.model.kl_temperature == 2.0 and cfg.resolved().run.name == "tiny-cp-r4-n4-k0-T2"
    plain = load_spec(write(tmp_path, {"a": ARCH}, name="plain"), env={})
    assert (
        "kl_temperature" not in plain.grid[0]
    )  # a spec that does not name it keeps its points and signature
    with pytest.raises(
        SpecError, match=r"space\.slices\.a\.kl_temperature': got 0; expected a finite number > 0"
    ):
        load_spec(write(tmp_path, {"a": {**ARCH, "kl_temperature": [0]}}), env={})


def test_a_point_naming_an_unknown_axis_fails_in_one_line(tmp_path):
    with pytest.raises(SpecError, match=r"space\.slices\.a\.lr': unknown key; expected one of \[") as e:
        load_spec(write(tmp_path, {"a": {**ARCH, "lr": [1e-3]}}), env={})
    assert "\n" not in str(e.value)
    with pytest.raises(axes.UnknownAxis, match=r"unknown sweep axis 'lr'; expected one of \[") as e:
        apply_point(load_config("debug"), {"circuit": "cp", "lr": 1e-3})
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)
    with pytest.raises(SpecError, match=r"fixture\.fail\[0\]\.lr': unknown key"):
        load_spec(write(tmp_path, {"a": ARCH}, fixture={"fail": [{"lr": 1e-3}]}), env={})


def test_the_library_checks_the_architecture_only():
    from mtpc import names

    names.check_axis("rank", 4)
    for name in ("kl_beta", "train_seed"):
        with pytest.raises(ValueError, match="not an architecture axis"):
            names.check_axis(name, 0)
    with pytest.raises(ValueError, match=r"seed_everything: got -1; expected an integer"):
        dataclasses.replace(load_config("debug"), seed_everything=-1).check()


def test_point_of_reads_every_axis_back():
    cfg = apply_point(
        load_config("debug"),
        {
            "circuit": "hmm",
            "rank": 2,
            "window": 4,
            "lora_depth": 0,
            "kl_beta": 0.5,
            "kl_temperature": 2,
            "train_seed": 3,
        },
    )
    assert point_of(cfg) == {
        "circuit": "hmm",
        "rank": 2,
        "window": 4,
        "lora_depth": 0,
        "kl_beta": 0.5,
        "kl_temperature": 2.0,
        "train_seed": 3,
    }
    assert cfg.params()["train_seed"] == 3 and cfg.params()["kl_temperature"] == 2.0


# the whole path of a new axis, in a fresh process where the row is added before anything reads the table
_NEW_AXIS = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    from tracking import axes

    axes.AXES = (*axes.AXES, axes.Axis("lr", "model.lr", axes.TRAINING, "lr", "lr", float, 3e-4))

    import yaml

    from analysis.aggregate import aggregate, split_settings
    from analysis.load import load, run_record
    from experiments.training.config import load_config
    from experiments.training.trial import training_axes, trial_config
    from sweeps import run
    from sweeps.spec import SpecError, load_spec
    from sweeps.study import open_storage
    from tracking.schema import grid_key

    path, bad, uri, tmp = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    out = {}
    spec = load_spec(path, env={})
    out["keys"] = [grid_key(p) for p in spec.grid]
    cfg = trial_config(load_config("debug"), spec.grid[-1], tracking_uri=uri, run_dir=tmp / "run")
    out["lr"], out["run_name"], out["child_params"] = cfg.model.lr, cfg.resolved().run.name, training_axes(cfg)
    out["parent_param"] = cfg.params()["lr"]
    # a multi-rank trial's child: `experiments.train fit --config <run dir>/trial_config.yaml` (experiments/training/launch.py)
    written = tmp / "trial_config.yaml"
    written.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    back = load_config(written)
    out["child_config"] = [back.model.lr, back.resolved().run.name]
    try:
        load_spec(bad, env={})
    except SpecError as e:
        out["bad"] = str(e)
    out["rc"] = run.main([path, "--task"])
    import optuna

    study = optuna.load_study(study_name=spec.study, storage=open_storage(spec.storage))
    out["optuna"] = sorted(t.params.get("lr") for t in study.get_trials())
    df = load(uri, spec.experiment)[0].runs
    out["dtype"], out["values"] = str(df["lr"].dtype), sorted(set(df["lr"]))
    out["groups"] = [[len(part), sorted(set(part["lr"])), list(part["n_evals"])] for _, part in split_settings(aggregate(df))]
    old = run_record("r", "old", "0", {"backbone": "b", "circuit": "cp", "window": "4", "rank": "4", "lora_depth": "0",
                                       "mode": "greedy", "prompt_set": "0"},
                     {"mu_lat": 1.0, "mu_acc": 1.0, "tokens_per_cycle": 2.0, "throughput": 2.0})
    out["old_run_lr"] = old["lr"]
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_a_new_axis_is_one_row(tmp_path):
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    path = write(
        tmp_path,
        {"a": {**ARCH, "lr": [3e-4, 1e-3]}},
        name="axes-lr",
        mlflow={"tracking_uri": uri},
        eval={"modes": ["greedy"], "sets": 2},
    )
    bad = write(tmp_path, {"a": {**ARCH, "lr": [-1.0]}}, name="axes-bad")
    script = tmp_path / "new_axis.py"
    script.write_text(_NEW_AXIS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    r = subprocess.run(
        [sys.executable, str(script), str(path), str(bad), uri, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(
        next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
    )
    assert out["keys"] == [
        "cp-r4-n4-k0",
        "cp-r4-n4-k0-lr0.001",
    ]  # at its default the axis leaves the key as it was
    assert out["lr"] == 1e-3 and out["run_name"] == "tiny-cp-r4-n4-k0-lr0.001" and out["parent_param"] == 1e-3
    assert out["child_params"] == {"kl_beta": 0.0, "kl_temperature": 1.0, "train_seed": 0, "lr": 1e-3}
    assert out["child_config"] == [1e-3, "tiny-cp-r4-n4-k0-lr0.001"]
    assert (
        "space.slices.a.lr" in out["bad"]
        and "expected a positive number" in out["bad"]
        and "\n" not in out["bad"]
    )
    assert out["rc"] == 0 and out["optuna"] == [3e-4, 1e-3]
    assert out["dtype"] == "float64" and out["values"] == [3e-4, 1e-3]
    assert out["groups"] == [[2, [3e-4, 1e-3], [2, 2]]]  # two configurations, each over its two prompt sets
    assert out["old_run_lr"] is None  # a run stored before the axis: missing, not the default
