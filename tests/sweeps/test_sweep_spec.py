"""Sweep specs: every shipped YAML loads; bad keys and values are refused naming file and key;
grid slices expand as the paper's RQ1-RQ3 (shared points once, ff at r = 1); env overrides win."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mtpc.names import CIRCUIT_KINDS
from sweeps.spec import SpecError, grid_key, load_spec, storage_url

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "sweeps").glob("*.yaml"))
NOENV: dict[str, str] = {}


def _write(tmp_path: Path, body: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body))
    return p


def _base() -> dict:
    return {
        "study": "t",
        "space": {"slices": {"a": {"circuit": ["cp"], "rank": [2, 4], "window": [4], "lora_depth": [0]}}},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
    }


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_specs_load(path):
    spec = load_spec(path, env=NOENV)
    assert spec.n_trials == len(spec.grid) > 0
    assert set(spec.eval.modes) == {"greedy", "sample"}  # both decoding modes per trained head
    if path.name == "fidelity_cpu.yaml":  # offline acceptance at the paper's size, two temperatures
        assert spec.eval.acceptance == "offline" and tuple(spec.eval.temperatures) == (1.0, 0.8)
        assert (spec.eval.sets, spec.eval.n_prompts, spec.eval.max_new_tokens) == (3, 225, 256)


def test_shipped_specs_exist():
    assert {"arch_grid.yaml", "smoke.yaml"} <= {p.name for p in SHIPPED}


def test_arch_grid_slices_follow_the_paper():
    spec = load_spec(REPO / "sweeps/arch_grid.yaml", env=NOENV)
    pts = {grid_key(p): p for p in spec.grid}
    rq1 = [p for k, p in pts.items() if "RQ1" in spec.grid_slices[k]]
    assert {(p["circuit"], p["rank"]) for p in rq1 if p["circuit"] == "cp"} >= {
        ("cp", r) for r in (2, 4, 8, 16, 32)
    }
    assert all(p["window"] == 8 and p["lora_depth"] == 0 for p in rq1)
    rq2 = [p for k, p in pts.items() if "RQ2" in spec.grid_slices[k]]
    assert {p["circuit"] for p in rq2} == set(CIRCUIT_KINDS) and {p["window"] for p in rq2} == {8, 16}
    rq3 = [p for k, p in pts.items() if "RQ3" in spec.grid_slices[k]]
    assert {p["lora_depth"] for p in rq3} == {0, 1, 2, 4} and {p["window"] for p in rq3} == {16}
    # a point in two slices runs once and records both
    assert spec.grid_slices["cp-r32-n16-k0"] == ("RQ2", "RQ3")
    assert len(pts) == len(spec.grid)
    assert all(p["rank"] == 1 for p in spec.grid if p["circuit"] == "ff")


def test_full_product_flag(tmp_path):
    raw = yaml.safe_load((REPO / "sweeps/arch_grid.yaml").read_text())
    raw["space"]["full_product"] = True
    spec = load_spec(_write(tmp_path, raw), env=NOENV)
    sliced = load_spec(REPO / "sweeps/arch_grid.yaml", env=NOENV)
    # ranks {2,4,8,16,32,64} x windows {8,16} x k {0,1,2,4} for cp/hmm/btree, plus ff (r = 1)
    assert len(spec.grid) == 3 * 6 * 2 * 4 + 2 * 4
    assert {grid_key(p) for p in sliced.grid} < {grid_key(p) for p in spec.grid}


@pytest.mark.parametrize(
    ("mutate", "key", "what"),
    [
        (lambda d: d.update(colour="red"), "colour", "unknown key"),
        (lambda d: d["space"]["slices"]["a"].update(depth=[1]), "space.slices.a.depth", "unknown key"),
        (lambda d: d["space"]["slices"]["a"].update(rank=[0]), "space.slices.a.rank", "out of range"),
        (lambda d: d["space"]["slices"]["a"].update(window=[1]), "space.slices.a.window", "out of range"),
        (
            lambda d: d["space"]["slices"]["a"].update(circuit=["mlp"]),
            "space.slices.a.circuit",
            "expected one of",
        ),
        (lambda d: d["objectives"][0].update(direction="up"), "objectives[0].direction", "not one of"),
        (lambda d: d["objectives"][0].update(metric="speed"), "objectives[0].metric", "not one of"),
        (lambda d: d.update(eval={"n_prompts": -3}), "eval.n_prompts", "out of range"),
        (lambda d: d.update(eval={"modes": ["beam"]}), "eval.modes", "not one of"),
        (lambda d: d.update(eval={"top_p": 1.5}), "eval.top_p", "out of range"),
        (lambda d: d.update(eval={"acceptance": "teacher"}), "eval.acceptance", "not one of"),
        (lambda d: d.update(eval={"extra_token": "drop"}), "eval.extra_token", "online-only"),
        (lambda d: d.update(slurm={"tasks": 0}), "slurm.tasks", "out of range"),
        (lambda d: d.update(n_trials=7), "n_trials", "grid"),
        (lambda d: d.pop("objectives"), "objectives", "missing"),
    ],
)
def test_bad_spec_names_file_and_key(tmp_path, mutate, key, what):
    raw = _base()
    mutate(raw)
    path = _write(tmp_path, raw, "bad_spec.yaml")
    with pytest.raises(SpecError) as e:
        load_spec(path, env=NOENV)
    msg = str(e.value)
    assert "bad_spec.yaml" in msg and f"'{key}'" in msg and what in msg, msg


def test_objective_mode_must_be_evaluated(tmp_path):
    raw = _base()
    raw["objectives"] = [{"metric": "mu_acc", "direction": "maximize", "mode": "sample"}]
    raw["eval"] = {"modes": ["greedy"]}
    with pytest.raises(SpecError, match="objectives"):
        load_spec(_write(tmp_path, raw), env=NOENV)


def test_known_byte_heads_train_from_the_train_section_and_refuse_drop(tmp_path):
    raw = _base() | {"train": {"config": "debug", "model": {"known_byte": True}}}
    assert load_spec(_write(tmp_path, raw), env=NOENV).train.model.known_byte is True
    raw["eval"] = {"extra_token": "drop", "acceptance": "online"}
    with pytest.raises(
        SpecError, match=r"'eval.extra_token'.*'drop' cannot decode with train.model.known_byte"
    ):
        load_spec(_write(tmp_path, raw), env=NOENV)


def test_env_overrides_and_defaults(tmp_path, monkeypatch):
    """The tracking-URI rule: MLFLOW_TRACKING_URI > mlflow.tracking_uri > sqlite:///<cwd>/mlflow.db
    (the default the analysis and `mlflow ui` read too); a relative sqlite path is made absolute."""
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, {**_base(), "output_dir": str(tmp_path / "o")})
    spec = load_spec(path, env=NOENV)
    assert spec.storage == f"journal:{tmp_path / 'o' / 'optuna.journal'}"
    assert spec.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    configured = _write(tmp_path, {**_base(), "mlflow": {"tracking_uri": "sqlite:///o/m.db"}})
    assert load_spec(configured, env=NOENV).tracking_uri == f"sqlite:///{tmp_path / 'o' / 'm.db'}"
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5999", "MTPC_OPTUNA_STORAGE": "postgresql://u@h/db"}
    spec = load_spec(configured, env=env)
    assert spec.tracking_uri == "http://127.0.0.1:5999" and spec.storage == "postgresql://u@h/db"


def test_storage_url_normalisation(tmp_path):
    assert storage_url("sqlite:///x.db", tmp_path) == "sqlite:///x.db"
    assert storage_url("journal:a/b.log", tmp_path) == f"journal:{tmp_path / 'a/b.log'}"
    assert storage_url("/abs/j.log", tmp_path) == "journal:/abs/j.log"


def test_sampler_space(tmp_path):
    raw = _base()
    raw["space"] = {
        "kind": "tpe",
        "params": {
            "circuit": {"choices": ["cp", "hmm"]},
            "rank": {"low": 2, "high": 32, "log": True},
            "window": {"choices": [4, 8]},
            "lora_depth": {"choices": [0]},
        },
    }
    raw["n_trials"] = 6
    spec = load_spec(_write(tmp_path, raw), env=NOENV)
    assert spec.grid is None and spec.sampler.kind == "tpe" and spec.n_trials == 6
    raw["space"]["params"]["rank"] = {"low": 8, "high": 2}
    with pytest.raises(SpecError, match="space.params.rank"):
        load_spec(_write(tmp_path, raw), env=NOENV)


def test_space_signature_changes_with_the_grid(tmp_path):
    a = load_spec(_write(tmp_path, _base(), "a.yaml"), env=NOENV)
    raw = _base()
    raw["space"]["slices"]["a"]["rank"] = [2, 8]
    b = load_spec(_write(tmp_path, raw, "b.yaml"), env=NOENV)
    assert a.space_signature() != b.space_signature()
    assert a.space_signature() == load_spec(_write(tmp_path, _base(), "c.yaml"), env=NOENV).space_signature()


def test_a_set_replaces_the_whole_value_it_names():
    """`--set space={...}` (and a spec override under a plain key) is the new value, not a merge into the
    old: the SLURM fault test asked for a 3-point space and got the smoke spec's 5 points on top."""
    space = {
        "kind": "grid",
        "slices": {"a": {"circuit": ["cp"], "rank": [2, 4], "window": [4], "lora_depth": [0]}},
    }
    spec = load_spec(
        REPO / "sweeps/smoke.yaml", env=NOENV, overrides={"space": space, "train": {"config": "debug"}}
    )
    assert sorted(grid_key(p) for p in spec.grid) == ["cp-r2-n4-k0", "cp-r4-n4-k0"]
    # smoke's train section (max_epochs 1, lora_start_epoch 0 on top of debug.yaml) is replaced: debug.yaml's values
    assert (spec.train.trainer["max_epochs"], spec.train.model.lora_start_epoch) == (2, 1)
