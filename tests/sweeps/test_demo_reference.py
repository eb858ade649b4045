"""The demo's reference point (`sweeps.demo.shipped_reference`): the shipped default head measured by
the sweep trials' own evaluation (evaluate_heads with the spec's eval section, its prompt sets, the
trials' thread count, the backbone named as the trials name it), written where the analysis reads it
and passed to it; measured once per head and evaluation; no shipped head, no reference and no crash.
The model and the evaluation are stubs here: what is checked is what they are called with."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from analysis.reference import read_reference
from sweeps import demo
from sweeps.spec import load_spec
from tests.analysis_helpers import evaluation_result


@pytest.fixture
def spec(tmp_path):
    return load_spec(demo.SMOKE, overrides=demo.demo_overrides(tmp_path, "trial"))


def test_no_shipped_head_means_no_reference_and_no_flag(spec, tmp_path, monkeypatch):
    import mtpc.shipped_heads

    monkeypatch.setattr(mtpc.shipped_heads, "shipped_head_names", lambda heads_dir=None: [])
    assert demo.shipped_reference(spec, tmp_path) is None
    assert not (tmp_path / demo.SHIPPED_REFERENCE).exists()
    args = demo.analysis_args(spec, tmp_path / "analysis", None)
    assert "--reference" not in args and args[args.index("--experiment") + 1] == "mtpc-demo"


def test_the_shipped_head_is_measured_by_the_trials_evaluation(spec, tmp_path, monkeypatch):
    import experiments.evaluation.decoding as decoding
    import experiments.evaluation.prompts as prompts
    import mtpc
    from mtpc.shipped_heads import read_index

    name = read_index()["default"]
    config = types.SimpleNamespace(kind="btree", window=8, rank=16, lora_depth=0, backbone="default@0123abcd")
    model = types.SimpleNamespace(head=types.SimpleNamespace(config=config), window=8, draft_len=4)
    loaded, calls = [], []
    monkeypatch.setattr(mtpc.MtpcModel, "from_pretrained", lambda what, **kw: loaded.append(what) or model)
    monkeypatch.setattr(
        prompts, "eval_prompt_sets", lambda e: calls.append(("prompts", e)) or ([["p"]], ["0"])
    )

    def evaluate(models, sets, evaluation, *, set_names, progress):
        calls.append(
            ("evaluate", models, sets, evaluation, set_names, torch.get_num_threads(), config.backbone)
        )
        return evaluation_result(head=name, backbone=config.backbone, prompt_sets=("0",))

    monkeypatch.setattr(decoding, "evaluate_heads", evaluate)
    threads = torch.get_num_threads()
    path = demo.shipped_reference(spec, tmp_path)
    assert path == tmp_path / demo.SHIPPED_REFERENCE and loaded == ["default"]
    assert calls[0] == ("prompts", spec.eval)  # the sweep's prompt draws
    _, models, sets, evaluation, set_names, during, backbone = calls[1]
    assert models == {name: model} and sets == [["p"]] and set_names == ["0"] and evaluation is spec.eval
    assert during == spec.train.run.cpu_threads == 1 and torch.get_num_threads() == threads  # as the trials
    assert backbone == "default"  # named as the trials' heads name the shipped model
    ref = read_reference(path)
    assert ref.label == f"shipped {name} (m=4)" and set(ref.runs["backbone"]) == {"default"}
    line = demo.reference_line(path)
    assert ref.label in line and "bytes per cycle" in line and "shipped_head.json" in line
    assert demo.analysis_args(spec, tmp_path / "analysis", path)[-2:] == ["--reference", str(path)]
    # a second demo reuses it; another evaluation measures again
    assert demo.shipped_reference(spec, tmp_path) == path and len(calls) == 2
    assert demo.shipped_reference(replace(spec, eval=replace(spec.eval, n_prompts=4)), tmp_path) == path
    assert len(calls) == 4
