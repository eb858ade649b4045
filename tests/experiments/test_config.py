"""The one typed config system: every shipped training config and sweep spec goes through the one
parser into dataclasses (the spec's `train` a TrainConfig, its `eval` an EvalConfig whose defaults
are those of experiments.evaluate's --eval.* flags too), a grid point is set by `apply_point`, one override rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from experiments.evaluation.config import EvalConfig
from experiments.plumbing.parsing import Fail, apply_overrides, parse_section, parse_sets
from experiments.training.config import CONFIG_DIR, TrainConfig, apply_point, load_config
from sweeps.spec import FixtureSettings, Objective, SlurmSettings, SweepSpec, load_spec

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("pretrain_"))
SPECS = sorted((REPO / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_training_config_parses_typed(path):
    typed = load_config(path)
    assert isinstance(typed, TrainConfig) and typed.source == str(path)
    raw = yaml.safe_load(path.read_text())
    for section in ("model", "data", "run"):
        for key, value in (raw.get(section) or {}).items():
            got = getattr(getattr(typed, section), key)
            assert got == (tuple(value) if isinstance(got, tuple) else value), (section, key)
    light = load_config(path, trainer_types=False)  # the sweep spec's reading: no Lightning import
    assert light.model == typed.model and light.data == typed.data and light.run == typed.run
    assert light.trainer == raw.get("trainer", {})


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_shipped_spec_parses_into_typed_sections(path, tmp_path):
    spec = load_spec(path, env={}, overrides={"output_dir": str(tmp_path)})
    assert (
        isinstance(spec, SweepSpec)
        and isinstance(spec.train, TrainConfig)
        and isinstance(spec.eval, EvalConfig)
    )
    assert isinstance(spec.slurm, SlurmSettings) and isinstance(spec.fixture, FixtureSettings)
    assert all(isinstance(o, Objective) for o in spec.objectives)
    raw = yaml.safe_load(path.read_text())
    assert spec.train.source == str(CONFIG_DIR / f"{raw['train']['config']}.yaml")
    for section in ("model", "run"):  # the section's overrides land on the base config
        for key, value in raw["train"].get(section, {}).items():
            assert getattr(getattr(spec.train, section), key) == value
    for key, value in raw["train"].get("trainer", {}).items():
        assert spec.train.trainer[key] == value
    given = raw.get("eval", {})
    for f in dataclasses.fields(EvalConfig):  # a key the spec leaves out takes EvalConfig's one default
        want = given.get(f.name, getattr(EvalConfig(), f.name))
        assert getattr(spec.eval, f.name) == (tuple(want) if isinstance(want, list) else want), f.name
    point = spec.grid[-1]
    cfg = apply_point(spec.train, point)
    assert (cfg.model.circuit, cfg.model.rank, cfg.model.window, cfg.model.lora_depth) == (
        point["circuit"],
        point["rank"],
        point["window"],
        point["lora_depth"],
    )
    assert cfg.model.kl_beta == point["kl_beta"] and cfg.seed_everything == point["train_seed"]
    assert cfg.data == spec.train.data and cfg.trainer == spec.train.trainer  # nothing else changes


def test_evaluate_cli_defaults_are_eval_config_defaults():
    """One set of evaluation defaults: the CLI's --eval.* flags are EvalConfig's fields, and the
    importable prompt functions read EvalConfig."""
    import dataclasses
    import inspect

    from experiments.evaluate import build_parser
    from experiments.evaluation.prompts import load_prompt_sets

    d = EvalConfig()
    sig = inspect.signature(load_prompt_sets).parameters
    assert (sig["source"].default, sig["num_prompts"].default, sig["sets"].default, sig["seed"].default) == (
        d.prompts,
        d.n_prompts,
        d.sets,
        d.seed,
    )
    defaults = build_parser().get_defaults().eval.as_dict()
    assert defaults == dataclasses.asdict(d)
    assert (defaults["acceptance"], defaults["latency_prompts"], defaults["continuation_cache"]) == (
        "offline",
        16,
        True,
    )


def test_one_override_rule():
    base = {
        "model": {"rank": 4, "window": 8},
        "space": {"slices": {"a": 1, "b": 2}},
        "trainer": {"max_epochs": 2},
    }
    out = apply_overrides(
        base, {"model.rank": 8, "space.slices": {"c": 3}, "trainer": {"max_steps": 5}, "new.key": 1}
    )
    assert out["model"] == {"rank": 8, "window": 8}  # a dotted key sets one value
    assert out["space"]["slices"] == {"c": 3}  # ... and replaces a mapping it names
    assert out["trainer"] == {"max_epochs": 2, "max_steps": 5}  # a mapping under a plain key merges
    assert (
        out["new"] == {"key": 1} and base["model"]["rank"] == 4
    )  # paths are created; the base is not changed
    assert parse_sets(["a.b=[1, 2]", "c=x=y"]) == {"a.b": [1, 2], "c": "x=y"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_sets(["novalue"])


def test_parse_section_names_the_key():
    fail = Fail("f.yaml")
    assert parse_section(EvalConfig, {"modes": "greedy"}, "eval", fail).modes == (
        "greedy",
    )  # a scalar for a list
    for raw, match in (
        ({"n_prompts": "many"}, r"f\.yaml: eval\.n_prompts: .*int"),
        ({"colour": 1}, r"f\.yaml: eval\.colour: unknown key"),
        ([1], r"f\.yaml: eval: expected a mapping"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_section(EvalConfig, raw, "eval", fail)
    with pytest.raises(ValueError, match=r"objectives\[0\]\.direction: missing"):
        parse_section(Objective, {"metric": "mu_acc"}, "objectives[0]", fail)
    with pytest.raises(ValueError, match=r"eval\.top_p: 1\.5 out of range"):
        EvalConfig(top_p=1.5).check(fail)
    with pytest.raises(
        ValueError,
        match=r"f\.yaml: eval\.extra_token: 'drop' is online-only .* expected keep, or eval\.acceptance: online",
    ):
        EvalConfig(extra_token="drop").check(fail)
    assert EvalConfig(extra_token="drop", acceptance="online").check(fail).acceptance == "online"
    with pytest.raises(ValueError, match=r"eval\.dev_n_prompts: 0 out of range"):
        EvalConfig(dev_n_prompts=0).check(fail)
    assert (
        parse_section(
            EvalConfig, {"dev_n_prompts": 100, "continuation_cache": False}, "eval", fail
        ).dev_n_prompts
        == 100
    )
    assert EvalConfig().continuation_cache and EvalConfig().dev_n_prompts is None


def test_a_bad_trainer_key_in_a_spec_is_found_by_the_check(tmp_path):
    """The spec reads `train.trainer` without Lightning; TrainConfig.check holds it to Trainer's signature."""
    spec = load_spec(
        REPO / "sweeps" / "smoke.yaml",
        env={},
        overrides={"output_dir": str(tmp_path), "train.trainer": {"max_epoch": 1}},
    )
    with pytest.raises(ValueError, match=r"debug\.yaml: trainer: .*max_epoch"):
        apply_point(spec.train, spec.grid[0]).check()


def test_one_run_name_rule():
    """A training run's default name is the sweep's grid key of the same head, after the backbone."""
    from tracking.schema import grid_key

    cfg = load_config("debug", {"model.kl_beta": 0.5, "seed_everything": 1}).resolved()
    m = cfg.model
    key = grid_key(
        {
            "circuit": m.circuit,
            "rank": m.rank,
            "window": m.window,
            "lora_depth": m.lora_depth,
            "kl_beta": 0.5,
            "train_seed": 1,
        }
    )
    assert cfg.run.name == f"tiny-{key}" == "tiny-cp-r4-n4-k0-kl0.5-s1"
    assert Path(cfg.run.dir).name == cfg.run.name


EVIL = """import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the planted module ran")
from lightning.pytorch.profilers import SimpleProfiler


class P(SimpleProfiler):
    pass
"""


def _plant(tmp_path: Path) -> Path:
    (tmp_path / "evil_marker.py").write_text(EVIL)
    return tmp_path / "IMPORTED"


def _run(tmp_path: Path, module: str, args: list[str]):
    import os
    import subprocess
    import sys

    env = dict(
        os.environ, PYTHONPATH=str(REPO)
    )  # `python -m` from tmp_path: the planted module is importable
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_class_outside_the_allow_list_is_refused_before_any_import(tmp_path, monkeypatch):
    """`class_path` (or a dotted name where Lightning takes an object) names a module; jsonargparse
    imports it to build the object. Outside the allow-list it is refused first: the planted module's
    import (which writes a marker) never runs, in `fit`, in `--check` and in the sweep."""
    import experiments.training.config as config

    marker = _plant(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = {"trainer": {"profiler": {"class_path": "evil_marker.P"}}}
    with pytest.raises(
        ValueError, match=r"trainer\.profiler\.class_path: 'evil_marker\.P' is not a class the suite loads"
    ):
        load_config("debug", bad)
    with pytest.raises(ValueError, match=r"model\.backbone_kwargs\.x\.class_path"):
        load_config("debug", {"model": {"backbone_kwargs": {"x": {"class_path": "evil_marker.P"}}}})
    assert not marker.exists()
    # an allowed class still parses
    assert load_config("debug", {"trainer.profiler": "lightning.pytorch.profilers.SimpleProfiler"}).trainer[
        "profiler"
    ]
    # the check is what stops it: without it the parser imports the planted module
    monkeypatch.setattr(config, "check_class_paths", lambda *a, **k: None)
    load_config("debug", bad)
    assert marker.exists()
    marker.unlink()

    debug = str(CONFIG_DIR / "debug.yaml")
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump({"trainer": {"profiler": {"class_path": "evil_marker.P"}}})
    )
    for args in (
        ["--trainer.profiler.class_path", "evil_marker.P"],
        ["--trainer.profiler", "evil_marker.P"],
        ["--config", str(tmp_path / "bad.yaml")],
        ["--config", '{"trainer": {"profiler": {"class_path": "evil_marker.P"}}}'],
    ):  # inline: read as YAML
        r = _run(
            tmp_path,
            "experiments.train",
            ["fit", "--config", debug, *args, "--run.dir", str(tmp_path / "run")],
        )
        assert r.returncode == 2 and "is not a class the suite loads" in r.stderr, r.stderr[-2000:]
        assert not marker.exists(), args
    spec = {
        "study": "evil",
        "output_dir": str(tmp_path / "out"),
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"},
        "train": {"config": "debug", "trainer": {"profiler": "evil_marker.P"}},
        "space": {"slices": {"a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}}},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    for args in (["--check"], ["--workers", "1"]):
        r = _run(tmp_path, "sweeps.run", [str(tmp_path / "spec.yaml"), *args])
        assert r.returncode == 2 and "key 'train.trainer.profiler'" in r.stderr, r.stderr[-2000:]
        assert not marker.exists(), args


PLANTED = ("torch", "yaml", "pandas", "optuna", "mlflow", "lightning", "jsonargparse")


@pytest.mark.slow
def test_no_cli_imports_a_module_planted_in_the_current_directory(tmp_path):
    """`python -m` puts the current directory first on sys.path: a `torch.py` or `yaml.py` planted
    where a user runs a CLI would be imported instead of the real module. Each CLI package drops the
    directory before importing anything, so none of the planted modules (each writes a marker) runs;
    the suite's own children (sweep workers, the demo's analysis) also run with PYTHONSAFEPATH=1,
    which keeps even a planted package named like the suite's own off their path."""
    import os
    import subprocess
    import sys

    from sweeps.run import python_module

    for name in PLANTED:
        (tmp_path / f"{name}.py").write_text(
            f"import pathlib\npathlib.Path(__file__).with_name('RAN-{name}').write_text('x')\n"
        )
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the suite found after the cwd, as an installed package is
    for cli in (
        ["experiments.train", "fit", "--help"],
        ["experiments.evaluate", "--help"],
        ["sweeps.run", "--help"],
        ["analysis", "--help"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", *cli], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0 and "usage:" in r.stdout, (cli, r.stderr[-2000:])
        assert not sorted(tmp_path.glob("RAN-*")), cli
    # a child of the suite: even a planted `sweeps/` package is not what it runs
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "__init__.py").write_text(
        "import pathlib\npathlib.Path(__file__).parents[1].joinpath('RAN-sweeps').write_text('x')\n"
    )
    cmd, child_env = python_module("sweeps.run", "--help")
    assert child_env["PYTHONSAFEPATH"] == "1" and str(REPO) in child_env["PYTHONPATH"].split(os.pathsep)
    r = subprocess.run(cmd, cwd=tmp_path, env=child_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: python -m sweeps.run" in r.stdout, r.stderr[-2000:]
    assert not sorted(tmp_path.glob("RAN-*"))


def test_check_refuses_an_evaluation_longer_than_the_backbone_context(tmp_path):
    """--check (validate_trial_configs) finds an evaluation that cannot fit the backbone's context:
    the longest drawn prompt + eval.max_new_tokens + window > max_context (tiny: 1024), before training."""
    from mtpc.tokenizer import ByteTokenizer
    from sweeps.spec import SpecError
    from sweeps.study import validate_trial_configs

    smoke = REPO / "sweeps" / "smoke.yaml"
    one = {
        "space.slices": {"a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0]}},
        "output_dir": str(tmp_path),
    }
    with pytest.raises(
        SpecError,
        match=r"key 'eval' \(grid point cp-r2-n4-k0\): eval\.max_new_tokens: .* exceeds the "
        r"context of backbone 'tiny' \(1024\)",
    ):
        validate_trial_configs(load_spec(smoke, env={}, overrides={**one, "eval.max_new_tokens": 100000}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"' + "a" * 500 + '"\n"short"\n')
    ids = len(ByteTokenizer().render_prompt("a" * 500))
    fits = {
        **one,
        "eval.prompts": str(prompts),
        "eval.n_prompts": 2,
        "eval.dev_sets": 0,
        "eval.max_new_tokens": 1024 - ids - 4,
    }
    assert validate_trial_configs(load_spec(smoke, env={}, overrides=fits)) == 1
    with pytest.raises(
        SpecError, match=rf"the longest drawn prompt \({ids} ids\)"
    ):  # the prompt's length counts
        validate_trial_configs(
            load_spec(smoke, env={}, overrides={**fits, "eval.max_new_tokens": 1024 - ids - 3})
        )
