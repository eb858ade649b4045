"""tokenkit's byte Llama end to end through the public CLIs, and the paper's sweep validated against one.

A tiny `tpu_llama` checkpoint (expanded input ids, 4 layers, a byte-converted Llama-3 tokenizer beside
it; tests/tpu_llama_helpers.py) trains a head with LoRA k = 1 for a few steps (`experiments.train`, debug
config: head-only epoch, then head + LoRA) and the exported head is evaluated (`experiments.evaluate`);
no trust_remote_code anywhere. `sweeps/arch_grid.yaml` (llama_byte.yaml's settings) validates every grid
point against the checkpoint's config (layers for k <= 4, the remote-code rule for its auto_map).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.tpu_llama_helpers import byte_expand, llama3_byte_tokenizer, write_tpu_llama


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    exp, n = byte_expand([256, 265])
    d = write_tpu_llama(tmp_path_factory.mktemp("tpu") / "bb", vocab=512, bos=256, eos=[257, 265], expand=exp,
                        expand_size=n, layers=4, max_context=512)  # fmt: skip
    llama3_byte_tokenizer().save_pretrained(d)
    return d


def test_train_with_lora_then_evaluate_through_the_clis(byte_llama, tmp_path, capsys):
    from experiments.evaluate import main as evaluate
    from experiments.train import main as train
    from experiments.training.config import CONFIG_DIR

    run = tmp_path / "run"
    rc = train(["fit", "--config", str(CONFIG_DIR / "debug.yaml"), "--model.backbone", str(byte_llama),
                "--model.lora_depth", "1", "--model.backbone_dtype", "float32", "--run.dir", str(run),
                "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 4 and metrics["val_loss"] == metrics["val_loss"]
    lora = load_file(str(run / "head" / "lora.safetensors"))
    assert lora and any(
        t.abs().max() > 0 for k, t in lora.items() if "lora_B" in k
    )  # stage 2 trained the LoRA
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in ["hello there", "caf\u00e9 and the world"]) + "\n")
    out = tmp_path / "eval.json"
    rc = evaluate(["--head", str(run / "head"), "--eval.prompts", str(prompts), "--eval.n_prompts", "2", "--eval.sets", "1",
                   "--eval.max_new_tokens", "8", "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert len(res["runs"]) == 2 and all(r["metrics"]["generated"] == 2 * 8 for r in res["runs"])


def test_arch_grid_validates_against_a_tpu_llama_checkpoint(byte_llama, tmp_path):
    from sweeps.spec import SpecError, load_spec
    from sweeps.study import validate_trial_configs

    prompts = (
        tmp_path / "prompts.jsonl"
    )  # the tiny checkpoint's 512 positions cannot hold arch_grid's held-out prompts:
    prompts.write_text(
        '"Hello there."\n'
    )  # --check refuses that (eval lengths); evaluate on a short prompt instead
    spec = load_spec(
        "sweeps/arch_grid.yaml",
        overrides={
            "train.model.backbone": str(byte_llama),
            "eval.prompts": str(prompts),
            "eval.n_prompts": 1,
            "eval.sets": 1,
        },
    )
    assert spec.train.source.endswith("llama_byte.yaml") and spec.train.model.backbone == str(byte_llama)
    assert validate_trial_configs(spec) == len(spec.grid) > 0  # k <= 4 layers; its auto_map needs no consent
    three = write_tpu_llama(
        tmp_path / "three", expand=None, layers=3
    )  # the same check can fail: k = 4 > 3 layers
    with pytest.raises(SpecError, match=r"lora_depth.*k = 4 exceeds the 3 layers"):
        validate_trial_configs(
            load_spec("sweeps/arch_grid.yaml", overrides={"train.model.backbone": str(three)})
        )
    other = json.loads((three / "config.json").read_text()) | {"model_type": "llama", "num_hidden_layers": 4}
    (three / "config.json").write_text(json.dumps(other))  # another model with an auto_map: consent needed
    with pytest.raises(SpecError, match="trust_remote_code"):
        validate_trial_configs(
            load_spec("sweeps/arch_grid.yaml", overrides={"train.model.backbone": str(three)})
        )
