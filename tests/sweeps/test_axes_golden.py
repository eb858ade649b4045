"""Golden values of the shipped sweeps: for every grid point of sweeps/{smoke,arch_grid,fidelity,
fidelity_cpu}.yaml the grid key, the Optuna params it is enqueued with and the choices a worker
suggests them from, the trial's run name, child-run training params and run-identity hash (the
SHA-256 a pre-empted trial's checkpoint is checked against), and each spec's `space_signature` (a
stored study resumes only under the same one). Generated from the code before the sweep axes were
declared in one table (tracking/axes.py); any change here means stored studies or checkpoints would
no longer be accepted.

Regenerate (only for an intended change): `python -m tests.sweeps.test_axes_golden --write`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("axes_golden.json")
SPECS = ("smoke", "arch_grid", "fidelity", "fidelity_cpu")


class _Recorder:
    """An Optuna trial stand-in: records each suggest_categorical's name and choices, returns the point's value."""

    def __init__(self, point: dict[str, Any]):
        self.point, self.calls = point, []

    def suggest_categorical(self, name, choices):
        self.calls.append([name, list(choices)])
        return self.point[name]


class _SamplerRecorder(_Recorder):
    def suggest_int(self, name, low, high, log=False):
        self.calls.append([name, low, high, log])
        return high


SAMPLER_SPEC = {
    "study": "golden-sampler",
    "objective": "fixture",
    "space": {
        "kind": "tpe",
        "params": {
            "circuit": {"choices": ["ff", "cp"]},
            "rank": {"low": 2, "high": 64, "log": True},
            "window": {"choices": [4, 8]},
            "lora_depth": {"low": 0, "high": 2},
        },
    },
    "n_trials": 4,
    "objectives": [{"metric": "throughput", "direction": "maximize"}],
}


def _sampler_values() -> dict[str, Any]:
    """A sampler space: its signature, what a worker suggests (training axes at their defaults)."""
    from sweeps.spec import parse_spec
    from sweeps.study import suggest
    from tracking.schema import grid_key

    spec = parse_spec(SAMPLER_SPEC, REPO / "golden-sampler.yaml", env={})
    rec = _SamplerRecorder({"circuit": "cp", "window": 8})
    point = suggest(spec, rec)
    return {
        "space_signature": spec.space_signature(),
        "calls": rec.calls,
        "point": point,
        "grid_key": grid_key(point),
    }


def golden_values() -> dict[str, Any]:
    from experiments.plumbing.run_dir import config_hash
    from experiments.training.trial import training_axes, trial_config
    from sweeps.spec import load_spec
    from sweeps.study import grid_attrs, suggest
    from tracking.schema import grid_key

    out: dict[str, Any] = {}
    for name in SPECS:
        spec = load_spec(REPO / "sweeps" / f"{name}.yaml", env={})
        points = []
        for point in spec.grid:
            rec = _Recorder(point)
            suggested = suggest(spec, rec)
            cfg = trial_config(
                spec.train,
                point,
                tracking_uri="sqlite://",
                experiment=spec.experiment,
                run_dir="/tmp/golden-run",
            )
            resolved = cfg.resolved()
            choices = rec.calls  # the same for every point of a grid
            points.append(
                {
                    "grid_key": grid_key(point),
                    "point": point,
                    "suggested": suggested,
                    "user_attrs": grid_attrs(spec, point, attempt=0),
                    "run_name": resolved.run.name,
                    "child_params": training_axes(cfg),
                    "identity_hash": config_hash(resolved.to_dict()),
                }
            )
        out[name] = {"space_signature": spec.space_signature(), "choices": choices, "points": points}
    out["sampler"] = _sampler_values()
    return json.loads(json.dumps(out))  # tuples as lists, as the file holds them


def test_shipped_sweeps_keep_their_keys_signatures_params_and_identities():
    want = json.loads(GOLDEN.read_text())
    got = golden_values()
    assert sorted(got) == sorted(want)
    assert got["sampler"] == want["sampler"]
    for name in SPECS:
        assert got[name]["choices"] == want[name]["choices"], name
        assert got[name]["space_signature"] == want[name]["space_signature"], name
        assert len(got[name]["points"]) == len(want[name]["points"]), name
        for g, w in zip(got[name]["points"], want[name]["points"], strict=True):
            assert g == w, f"{name}: {w['grid_key']}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.sweeps.test_axes_golden --write")
    GOLDEN.write_text(
        json.dumps(golden_values(), sort_keys=True).replace('{"child_params"', '\n{"child_params"') + "\n"
    )
    print(f"wrote {GOLDEN}")
