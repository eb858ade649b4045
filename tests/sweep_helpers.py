"""Helpers shared by the sweep, SLURM and MLflow-server tests: write a fixture spec, run the CLI,
read trials back from the Optuna journal and runs from MLflow. No fixtures are defined here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


_TEMPLATE: Path | None = None


def fresh_tracking_uri(directory: Path) -> str:
    """A new MLflow sqlite store in `directory`: a copy of one migrated template (building the
    schema costs ~10 s on the 2-core machine; copying it is instant)."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from sweeps import tracking

        d = Path(tempfile.mkdtemp(prefix="mtpc-mlflow-template-"))
        tracking.ensure_experiment(f"sqlite:///{d / 'mlflow.db'}", "template")
        _TEMPLATE = d / "mlflow.db"
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_TEMPLATE, directory / "mlflow.db")
    return f"sqlite:///{directory / 'mlflow.db'}"


def fixture_spec(tmp: Path, study: str, *, tracking_uri: str | None = None, **over: Any) -> Path:
    """A small grid spec with the fixture objective; `over` replaces top-level keys."""
    spec: dict[str, Any] = {
        "study": study,
        "objective": "fixture",
        "output_dir": str(tmp / "out"),
        "mlflow": {"experiment": study, **({"tracking_uri": tracking_uri} if tracking_uri else {})},
        "space": {"kind": "grid", "slices": {"a": {"circuit": ["cp", "hmm"], "rank": [2, 4], "window": [4], "lora_depth": [0]}}},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
        "eval": {"modes": ["greedy", "sample"], "sets": 1},
        "fixture": {"steps": 1},
    }
    spec.update(over)
    path = tmp / f"{study}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_cli(args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "sweeps.run", *args], capture_output=True, text=True, env=e, cwd=cwd or REPO, timeout=timeout)


def trials(storage: str, study: str) -> list:
    import optuna

    from sweeps.run import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=study, storage=open_storage(storage)).get_trials()


def by_state(ts: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in ts:
        out.setdefault(t.state.name, []).append(t)
    return out


def runs(tracking_uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri)
    exp = c.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment} missing at {tracking_uri}"
    return list(c.search_runs([exp.experiment_id], max_results=1000))


def check_complete_results(storage: str, study: str, tracking_uri: str, experiment: str, n_modes: int = 2) -> list:
    """Every COMPLETE trial: parent run FINISHED, its stored children FINISHED with the metrics;
    no grid point has two COMPLETE trials. Returns the COMPLETE trials."""
    ts = trials(storage, study)
    complete = [t for t in ts if t.state.name == "COMPLETE"]
    keys = [t.user_attrs["grid_key"] for t in complete]
    assert len(keys) == len(set(keys)), f"a grid point completed twice: {sorted(keys)}"
    rs = {r.info.run_id: r for r in runs(tracking_uri, experiment)}
    for t in complete:
        parent = rs[t.user_attrs["mlflow_parent_run_id"]]
        assert parent.info.status == "FINISHED", (t.number, parent.info.status)
        kids = t.user_attrs["mlflow_child_run_ids"]
        assert len(kids) == n_modes
        for k in kids:
            child = rs[k]
            assert child.info.status == "FINISHED"
            assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
            for m in ("mu_lat", "mu_acc", "tokens_per_cycle", "throughput", "max_throughput"):
                assert m in child.data.metrics, (k, m)
            for p in ("backbone", "circuit", "window", "rank", "lora_depth", "mode", "extra_token",
                      "temperature", "prompt_set", "seed", "hardware", "top_p"):
                assert p in child.data.params, (k, p)
            assert child.data.params["circuit"] == t.params["circuit"]
    return complete
