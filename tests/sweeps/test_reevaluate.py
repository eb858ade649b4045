"""sweeps/reevaluate.py: a finished sweep on the debug backbone gets a greedy pass added as more
child runs of each trial (same prompt sets, training axes and `converged` carried), a second run adds
nothing, a partial pass is redone whole, unfinished points are listed, and training keys are refused."""

from __future__ import annotations

import yaml

from sweeps.reevaluate import main
from tests.sweep_helpers import fresh_tracking_uri, run_cli, runs


def _spec(tmp_path, uri):
    spec = {
        "study": "reev",
        "objective": "trial",
        "output_dir": str(tmp_path / "out"),
        "mlflow": {"experiment": "reev", "tracking_uri": uri},
        "train": {
            "config": "debug",
            "trainer": {"max_steps": 2, "val_check_interval": 1, "max_epochs": 1},
            "run": {"checkpoint_every_n_steps": 0},
        },
        "space": {
            "kind": "grid",
            "slices": {
                "a": {"circuit": ["cp"], "rank": [2], "window": [4], "lora_depth": [0], "kl_beta": [0.0, 0.5]}
            },
        },
        "objectives": [{"metric": "mu_acc", "direction": "maximize", "mode": "sample"}],
        "eval": {"modes": ["sample"], "sets": 2, "n_prompts": 1, "max_new_tokens": 6, "stp": False},
    }
    path = tmp_path / "reev.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _by_mode(uri):
    out = {}
    for r in runs(uri, "reev"):
        if "mode" in r.data.params:
            out.setdefault(r.data.params["mode"], []).append(r)
    return out


def test_adds_a_greedy_pass_once_and_redoes_a_partial_one(tmp_path, capsys):
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    spec = _spec(tmp_path, uri)
    r = run_cli([str(spec), "--workers", "1", "--max-trials", "1"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert main([str(spec), "--set", "eval.modes=[greedy]"]) == 0
    out = capsys.readouterr().out
    assert (
        "1 trial head(s) to evaluate for [('greedy', 1.0)]; 1 grid point(s) without a finished trial: cp-r2-n4-k0-kl0.5"
        in out
    )
    modes = _by_mode(uri)
    assert len(modes["sample"]) == 2 and len(modes["greedy"]) == 2
    greedy = modes["greedy"]
    assert {g.data.params["prompt_set"] for g in greedy} == {"0", "1"}
    sample = {s.data.params["prompt_set"]: s for s in modes["sample"]}
    for g in greedy:  # the same prompts, the same parent and training axes as the sweep's own pass
        s = sample[g.data.params["prompt_set"]]
        assert g.data.tags["mlflow.parentRunId"] == s.data.tags["mlflow.parentRunId"]
        for k in ("kl_beta", "train_seed", "converged", "circuit", "window", "rank"):
            assert g.data.params[k] == s.data.params[k], k
    parent = {r.info.run_id: r for r in runs(uri, "reev")}[greedy[0].data.tags["mlflow.parentRunId"]]
    assert (
        "greedy/mu_acc" in parent.data.metrics and "sample/mu_acc" in parent.data.metrics
    )  # the trial's row

    assert main([str(spec), "--set", "eval.modes=[greedy]"]) == 0  # resumable: nothing left to do
    assert "0 trial head(s)" in capsys.readouterr().out
    assert len(_by_mode(uri)["greedy"]) == 2

    from mlflow.tracking import MlflowClient

    MlflowClient(uri).delete_run(greedy[0].info.run_id)  # as if interrupted after one prompt set
    capsys.readouterr()
    assert main([str(spec), "--set", "eval.modes=[greedy]", "--dry-run"]) == 0  # lists, deletes nothing
    assert "1 trial head(s)" in capsys.readouterr().out and len(_by_mode(uri)["greedy"]) == 1
    assert main([str(spec), "--set", "eval.modes=[greedy]"]) == 0
    again = _by_mode(uri)["greedy"]
    assert len(again) == 2 and not {g.info.run_id for g in again} & {g.info.run_id for g in greedy}

    assert main([str(spec), "--set", "train.trainer={max_steps: 9}"]) == 2
    assert "only eval.* keys can change after training" in capsys.readouterr().err
