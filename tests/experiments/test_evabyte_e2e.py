"""End to end on a tiny EvaByte written from its own code (tests/evabyte_real.py): the shipped
`experiments/configs/evabyte.yaml` with the backbone path overridden trains a few steps (LoRA on
the top 2 layers, `init: mtp`), exports, evaluates greedy and sampling (and EvaByte's own multi-byte decoding as a
baseline), and a sweep spec pointed at
it runs 2 trials through `sweeps.run` into MLflow. Everything runs in this process, inside the
test-only `triton_shim` (no triton here), and on the CPU in float32.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.evabyte_real import triton_shim, write_tiny_evabyte

SMALL = {  # the shipped config scaled to the tiny model and the CPU
    "model.backbone_dtype": "float32", "model.chunk_size": "32", "data.source": "debug", "data.seq_len": "64",
    "data.batch_size": "2", "data.max_val_conversations": "4", "trainer.accelerator": "cpu", "trainer.precision": "32",
    "data.global_batch_size": "2", "trainer.limit_train_batches": "2", "trainer.limit_val_batches": "1",
    "trainer.val_check_interval": "1.0", "run.tracking": "false",
}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_evabyte(tmp_path_factory.mktemp("evabyte_e2e") / "tiny")


@pytest.mark.slow  # ~1 min on the shared 2-core CPU
def test_train_export_evaluate_with_the_shipped_config(ckpt, tmp_path):
    from experiments.evaluate import main as evaluate
    from experiments.train import main as train
    from experiments.training.config import CONFIG_DIR
    from mtpc.heads import load_head

    run = tmp_path / "run"
    args = [
        "fit",
        "--config",
        str(CONFIG_DIR / "evabyte.yaml"),
        "--model.backbone",
        str(ckpt),
        "--run.dir",
        str(run),
    ]
    for key, value in SMALL.items():
        args += [f"--{key}", value]
    with triton_shim():
        assert train(args) == 0
    head, _ = load_head(run / "head")
    assert (head.config.kind, head.config.window, head.config.lora_depth) == ("btree", 16, 2)
    assert (run / "head" / "lora.safetensors").exists()  # stage 2 trained the LoRA
    metrics = json.loads((run / "metrics.json").read_text())
    assert (
        metrics["global_step"] == 4 and metrics["val_kl_1"] < 1e-3
    )  # init: mtp: position 1 = the real STP head

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"prompt number {i}") + "\n" for i in range(4)))
    out = tmp_path / "r.json"
    with triton_shim():
        rc = evaluate(["--head", str(run / "head"), "--eval.prompts", str(prompts), "--eval.n_prompts", "2", "--eval.sets", "1",
                       "--eval.max_new_tokens", "24", "--eval.eos", "banned,allowed", "--evabyte-mtp",
                       "--trust-remote-code", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    heads = [r for r in runs if r["head"] == "head"]
    assert {(r["mode"], r["eos"]) for r in heads} == {
        (m, e) for m in ("greedy", "sample") for e in ("banned", "allowed")
    }
    assert all(r["metrics"]["generated"] == 2 * 24 for r in heads if r["eos"] == "banned")  # equal lengths
    # EvaByte's own multi-byte decoding beside them: greedy only, its output = plain greedy decoding's
    own = {r["eos"]: r for r in runs if r["head"] == "evabyte-mtp"}
    assert set(own) == {"banned", "allowed"} and all(r["mode"] == "greedy" for r in own.values())
    assert (
        own["allowed"]["metrics"]["equals_greedy"] == 1.0
        and own["allowed"]["metrics"]["tokens_per_cycle"] >= 1
    )


@pytest.mark.slow  # ~2 min on the shared 2-core CPU
def test_sweep_of_two_trials_into_mlflow(ckpt, tmp_path):
    from sweeps import run
    from sweeps.spec import load_spec
    from tests.sweep_helpers import by_state, fresh_tracking_uri, runs, trials

    uri = fresh_tracking_uri(tmp_path / "mlflow")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"prompt number {i}") + "\n" for i in range(4)))
    overrides: dict = {}
    for dotted, value in SMALL.items():
        section, key = dotted.split(".")
        overrides.setdefault(section, {})[key] = yaml.safe_load(value)
    overrides["model"].update(backbone=str(ckpt), lora_start_epoch=0)
    overrides["trainer"].update(max_epochs=1)
    spec = {
        "study": "evabyte-e2e", "objective": "trial", "output_dir": str(tmp_path / "out"),
        "mlflow": {"experiment": "evabyte-e2e", "tracking_uri": uri},
        "train": {"config": "evabyte", **overrides},
        "space": {"kind": "grid", "slices": {"a": {"circuit": ["cp", "btree"], "rank": [4], "window": [4], "lora_depth": [2]}}},
        "objectives": [{"metric": "throughput", "direction": "maximize"}],
        "eval": {"modes": ["greedy"], "prompts": str(prompts), "sets": 1, "n_prompts": 2, "max_new_tokens": 12},
    }  # fmt: skip
    path = tmp_path / "evabyte.yaml"
    path.write_text(yaml.safe_dump(spec))
    with triton_shim():
        assert run.main([str(path), "--init"]) == 0
        assert run.main([str(path), "--worker"]) == 0
    st = by_state(trials(load_spec(path, env={}).storage, "evabyte-e2e"))
    assert len(st["COMPLETE"]) == 2, {k: len(v) for k, v in st.items()}
    logged = runs(uri, "evabyte-e2e")
    assert len(logged) >= 2
