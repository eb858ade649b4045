"""The evaluation CLI and its importable functions on a tiny byte-vocabulary Llama saved to a temp dir."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from experiments.evaluate import main
from experiments.evaluation.config import EvalConfig
from experiments.evaluation.decoding import evaluate_heads, log_evaluation_to_mlflow
from experiments.evaluation.prompts import load_prompt_sets
from mtpc import MtpcModel
from mtpc.heads import save_head
from mtpc.kernels import rowdot_unsupported
from mtpc.tokenizer import ByteTokenizer
from tests.backbone_helpers import tiny_llama

PARAMS = ("backbone", "circuit", "window", "rank", "lora_depth", "mode", "extra_token", "temperature",
          "prompt_set", "seed", "hardware", "top_p", "acceptance_method")  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = tiny_llama(
        vocab=320, hidden=16, layers=2, heads=2, kv_heads=1, dtype=torch.float32, max_context=512
    )
    model.save_pretrained(root / "bb")
    ByteTokenizer().save_pretrained(root / "bb")
    for name, spec in {
        "cp": {"kind": "cp", "window": 4, "rank": 2},
        "ff": {"kind": "ff", "window": 4},
    }.items():
        m = MtpcModel.from_components(model, spec)
        m.head.config.backbone = str(root / "bb")
        save_head(root / name, m.head)
    prompts = root / "prompts.jsonl"
    lines = [json.dumps(f"prompt number {i}") for i in range(4)] + [
        json.dumps({"prompt": "a dict prompt"}),
        json.dumps(
            {"messages": [{"role": "user", "content": "a chat"}, {"role": "assistant", "content": "x"}]}
        ),
    ]
    prompts.write_text("\n".join(lines) + "\n")
    return root


def test_load_prompt_sets_and_errors(exported):
    sets = load_prompt_sets(str(exported / "prompts.jsonl"), num_prompts=3, sets=2, seed=1)
    assert [len(s) for s in sets] == [3, 3] and len(set(sets[0]) | set(sets[1])) == 6
    assert "a chat" in sets[0] + sets[1]
    # each prompt knows its file:line (an error about one names it), through a copy too
    import copy

    lines = {json.loads(x) if x.startswith('"') else None: i for i, x in
             enumerate((exported / "prompts.jsonl").read_text().splitlines(), 1)}  # fmt: skip
    for p in copy.deepcopy(sets[0]):
        assert p.where.startswith(f"{exported / 'prompts.jsonl'}:")
        if p in lines:
            assert p.where.endswith(f":{lines[p]}")
    with pytest.raises(ValueError, match="needed"):
        load_prompt_sets(str(exported / "prompts.jsonl"), num_prompts=4, sets=2)
    with pytest.raises(ValueError, match="eval.prompts"):
        load_prompt_sets(str(exported / "missing.jsonl"))


def test_cli_writes_json_with_every_metric(exported, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main([
        "--head", str(exported / "cp"), "--ff-head", str(exported / "ff"), "--eval.prompts", str(exported / "prompts.jsonl"),
        "--eval.n_prompts", "2", "--eval.sets", "2", "--eval.max_new_tokens", "12", "--eval.modes", "greedy,sample",
        "--eval.extra_token", "drop", "--eval.acceptance", "online", "--out", str(out), "--no-progress",
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert len(res["runs"]) == 2 * 2 * 2  # heads x modes x sets
    for r in res["runs"]:
        m = r["metrics"]
        for k in ("mu_lat", "mu_acc", "tokens_per_cycle", "throughput", "max_throughput", "stp_mu_lat",
                  "stp_throughput", "speedup_vs_stp", "speedup_vs_ff", "peak_mem_bytes"):  # fmt: skip
            assert k in m and m[k] == m[k], k
        assert len(m["per_position_acceptance"]) == 4 and sum(m["accepted_length_histogram"]) == m["cycles"]
        assert m["generated"] == 2 * 12  # EOS banned by default: equal lengths
        assert r["acceptance_method"] == "online" and "derived_throughput" not in m
        if r["head"] == "ff":
            assert m["speedup_vs_ff"] == pytest.approx(1.0)
    assert {(s["head"], s["mode"], s["extra_token"]) for s in res["summary"]} == {
        (h, m, "drop") for h in ("head", "ff") for m in ("greedy", "sample")
    }
    assert set(res["summary"][0]["throughput"]) == {"mean", "std"}


def test_cli_errors_are_clear(exported, tmp_path, capsys):
    assert main(["--head", str(tmp_path), "--out", str(tmp_path / "r.json")]) == 2
    assert "--head" in capsys.readouterr().err
    args = [
        "--head",
        str(exported / "cp"),
        "--eval.prompts",
        str(exported / "prompts.jsonl"),
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert main([*args, "--eval.modes", "beam"]) == 2
    assert "--eval.modes" in capsys.readouterr().err
    assert main([*args, "--ff-head", str(exported / "cp"), "--eval.n_prompts", "1", "--eval.sets", "1"]) == 2
    assert "not ff" in capsys.readouterr().err


def test_mlflow_children_carry_params_and_metrics(exported, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("eval-test")
    parent = client.create_run(exp, run_name="trial").info.run_id
    m = MtpcModel.from_pretrained(exported / "cp")
    res = evaluate_heads(m, [["one", "two"], ["three", "four"]], EvalConfig(modes=("greedy",), max_new_tokens=8,
                         acceptance="online"), progress=False)  # fmt: skip
    ids = log_evaluation_to_mlflow(res, parent, params={"trial": 7}, tracking_uri=uri)
    assert len(ids) == 2
    for rid in ids:
        run = client.get_run(rid)
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert set(PARAMS) <= set(run.data.params) and run.data.params["trial"] == "7"
        assert run.data.params["circuit"] == "cp" and run.data.params["mode"] == "greedy"
        # the engine is part of the setting: a float32 CPU backbone decodes on the row-dot kernel
        # (oneDNN's products where it does not build)
        layout = "onednn" if rowdot_unsupported("cpu", torch.float32) else "rowdot"
        assert run.data.params["hardware"].endswith(f"; engine compact/{layout}"), run.data.params["hardware"]
        assert {"mu_lat", "mu_acc", "throughput", "speedup_vs_stp", "acceptance_pos_2"} <= set(
            run.data.metrics
        )
    assert {client.get_run(r).data.params["prompt_set"] for r in ids} == {"0", "1"}
    # named for what they are (they were all `eval-head-greedy-keep-set<i>`, under every trial alike)
    assert sorted(client.get_run(r).info.run_name for r in ids) == [
        "cp-r2-n4-k0/greedy/set0",
        "cp-r2-n4-k0/greedy/set1",
    ]
    hist = json.loads(
        (Path(client.download_artifacts(ids[0], "accepted_length_histogram.json", str(tmp_path)))).read_text()
    )
    assert sum(hist["accepted_length_histogram"]) == client.get_run(ids[0]).data.metrics["cycles"]


def test_cli_truncated_head_is_one_line_naming_the_file(exported, tmp_path, capsys):
    import shutil

    bad = tmp_path / "cp"
    shutil.copytree(exported / "cp", bad)
    weights = bad / "head.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    rc = main(
        [
            "--head",
            str(bad),
            "--eval.prompts",
            str(exported / "prompts.jsonl"),
            "--eval.n_prompts",
            "1",
            "--eval.sets",
            "1",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(weights) in err, err


def test_cli_missing_head_directory_says_it_does_not_exist(exported, tmp_path, capsys):
    rc = main(
        [
            "--head",
            str(tmp_path / "nowhere"),
            "--eval.prompts",
            str(exported / "prompts.jsonl"),
            "--eval.n_prompts",
            "1",
            "--eval.sets",
            "1",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "nowhere' does not exist or is not a directory" in err, err


def test_an_unusable_out_path_is_refused_before_anything_decodes(exported, tmp_path, capsys, monkeypatch):
    import experiments.evaluation.decoding as ev

    decoded = []
    monkeypatch.setattr(ev, "evaluate_heads", lambda *a, **k: decoded.append(1))
    args = [
        "--head",
        str(exported / "cp"),
        "--eval.prompts",
        str(exported / "prompts.jsonl"),
        "--eval.n_prompts",
        "1",
        "--eval.sets",
        "1",
        "--no-progress",
    ]
    (tmp_path / "existing").mkdir()
    assert main([*args, "--out", str(tmp_path / "existing")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'existing'}: is a directory" in err and err.count("\n") == 1, err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root writes everywhere; the directory case holds for all)
            assert main([*args, "--out", str(locked / "r.json")]) == 2
            assert "not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)
    assert decoded == []


def test_a_prompts_file_with_invalid_utf8_names_file_and_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'"fine"\n"also fine"\n"caf\xe9"\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: not valid UTF-8"):
        load_prompt_sets(str(bad), 1, 1)


def test_offline_cli_derives_throughput_beside_the_timed_subset(exported, tmp_path, capsys):
    """The default (offline): acceptance from every prompt's continuation, mu_lat from the first
    --eval.latency_prompts prompts timed online; derived_throughput = tokens_per_cycle / mu_lat, named so."""
    out = tmp_path / "r.json"
    rc = main(["--head", str(exported / "cp"), "--ff-head", str(exported / "ff"), "--eval.prompts", str(exported / "prompts.jsonl"),
               "--eval.n_prompts", "3", "--eval.sets", "2", "--eval.max_new_tokens", "10", "--eval.latency_prompts", "1",
               "--out", str(out), "--no-progress"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["config"]["acceptance"] == "offline" and res["config"]["latency_prompts"] == 1
    assert len(res["runs"]) == 2 * 2 * 2  # heads x modes x sets
    for r in res["runs"]:
        m = r["metrics"]
        assert r["acceptance_method"] == "offline" and r["latency_prompts"] == 1
        assert m["generated"] == 3 * 10  # every prompt, not only the timed one
        assert m["derived_throughput"] == pytest.approx(m["tokens_per_cycle"] / m["mu_lat"])
        assert m["derived_speedup_vs_stp"] == pytest.approx(m["derived_throughput"] / m["stp_throughput"])
        assert m["throughput"] > 0 and m["speedup_vs_stp"] == pytest.approx(
            m["throughput"] / m["stp_throughput"]
        )
        assert sum(m["accepted_length_histogram"]) == pytest.approx(m["cycles"])
        assert len(r["per_prompt"]) == 3 and len(r["latency_per_prompt"]) == 1
        assert r["latency_per_prompt"][0]["decode_s"] > 0 and r["per_prompt"][0]["decode_s"] is None
        if r["mode"] == "greedy":  # exact cycles: the offline counts are whole numbers
            assert all(float(p["accepted"]).is_integer() for p in r["per_prompt"])
    for rows in res["stp"].values():
        assert all(row["timed_prompts"] == 1 and len(row["per_prompt"]) == 1 for row in rows)
    assert {s["acceptance_method"] for s in res["summary"]} == {"offline"}
    assert "(offline)" in capsys.readouterr().out


def test_offline_greedy_equals_the_online_loop_in_evaluate(exported):
    """Greedy, float32, tiny model: the offline mu_acc and cycles of a set equal the online loop's."""
    m = MtpcModel.from_pretrained(exported / "cp")
    prompts = [["one", "two", "three"]]
    e = EvalConfig(modes=("greedy",), max_new_tokens=12, stp=False)
    on = evaluate_heads(m, prompts, replace(e, acceptance="online"), progress=False)["runs"][0]
    off = evaluate_heads(m, prompts, replace(e, acceptance="offline", latency_prompts=1), progress=False)[
        "runs"
    ][0]
    assert [p["cycles"] for p in off["per_prompt"]] == [p["cycles"] for p in on["per_prompt"]]
    assert [p["accepted"] for p in off["per_prompt"]] == [p["accepted"] for p in on["per_prompt"]]
    assert off["metrics"]["mu_acc"] == pytest.approx(on["metrics"]["mu_acc"])


def _strip(r):
    return [{k: v for k, v in p.items() if k not in ("decode_s", "prefill_s")} for p in r["per_prompt"]]


@pytest.mark.parametrize("batch", [1, 4])
def test_a_second_head_reuses_the_texts(exported, monkeypatch, batch):
    """Another head's offline evaluation on the same backbone, prompts and decode config computes no
    new texts, and gives the same results as computing them afresh. Batch 1: the continuations come
    from the on-disk cache the first evaluation stored (no new `continuations` call). Batch 4 (k = 0
    on the compact forward): the fused decoding-and-pass the first evaluation kept in the process
    (no new `decode_and_force` call); `$MTPC_PASS_MEMO_MB=0` or the cache off recompute."""
    from mtpc.speculative import offline, pass_cache

    monkeypatch.setattr(pass_cache, "PASSES", type(pass_cache.PASSES)())
    name = "continuations" if batch == 1 else "decode_and_force"
    calls = []
    real = getattr(offline, name)
    monkeypatch.setattr(offline, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = [["one", "two", "three"], ["four", "five"]]
    e = EvalConfig(modes=("greedy", "sample"), max_new_tokens=10, stp=False, acceptance="offline", latency_prompts=1,
                   temperatures=(0.8,))  # fmt: skip
    kw = {"progress": False, "continuation_batch": batch}
    cp = MtpcModel.from_pretrained(exported / "cp")
    evaluate_heads(cp, prompts, e, **kw)
    assert len(calls) == 4  # (mode, set) jobs
    ff = MtpcModel.from_pretrained(exported / "ff")
    cached = evaluate_heads(ff, prompts, e, **kw)
    assert len(calls) == 4  # nothing recomputed
    fresh = evaluate_heads(ff, prompts, replace(e, continuation_cache=False), **kw)
    assert len(calls) == 8
    assert [_strip(r) for r in cached["runs"]] == [_strip(r) for r in fresh["runs"]]
    for a, b in zip(cached["runs"], fresh["runs"], strict=True):
        assert (
            a["metrics"]["mu_acc"] == b["metrics"]["mu_acc"]
            and a["metrics"]["cycles"] == b["metrics"]["cycles"]
        )
    if batch > 1:
        monkeypatch.setenv(pass_cache.PASS_MEMO_ENV, "0")
        evaluate_heads(ff, prompts, e, **kw)
        assert len(calls) == 12
        monkeypatch.setenv(pass_cache.PASS_MEMO_ENV, "lots")
        with pytest.raises(ValueError, match="MTPC_PASS_MEMO_MB"):
            evaluate_heads(ff, prompts, replace(e, modes=("greedy",)), **kw)


def test_cli_no_continuation_cache_stores_nothing(exported, tmp_path, capsys):
    from mtpc.speculative.continuation_cache import cache_root

    args = ["--head", str(exported / "cp"), "--eval.prompts", str(exported / "prompts.jsonl"), "--eval.n_prompts", "2",
            "--eval.max_new_tokens", "6", "--eval.modes", "greedy", "--eval.latency_prompts", "1", "--no-progress"]  # fmt: skip
    assert main([*args, "--eval.continuation_cache", "false", "--out", str(tmp_path / "a.json")]) == 0, (
        capsys.readouterr().err
    )
    assert not list(cache_root().glob("*.json"))
    assert main([*args, "--out", str(tmp_path / "b.json")]) == 0, capsys.readouterr().err
    assert len(list(cache_root().glob("*.json"))) == 1
    runs = [json.loads((tmp_path / f).read_text())["runs"][0]["per_prompt"] for f in ("a.json", "b.json")]
    assert [p["accepted"] for p in runs[0]] == [p["accepted"] for p in runs[1]]


def test_offline_refuses_drop_in_one_line(exported, tmp_path, capsys):
    rc = main(["--head", str(exported / "cp"), "--eval.prompts", str(exported / "prompts.jsonl"), "--eval.extra_token", "drop",
               "--out", str(tmp_path / "r.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--eval.extra_token" in err and "'drop'" in err, err
    assert "eval.acceptance: online" in err
    m = MtpcModel.from_pretrained(exported / "cp")
    with pytest.raises(ValueError, match="keep"):
        evaluate_heads(m, [["one"]], EvalConfig(modes=("greedy",), extra_token="drop"), progress=False)


def test_a_model_with_a_shorter_draft_len_is_evaluated_as_it_decodes(exported):
    """A shipped head decodes with draft_len m < its window n: evaluate_heads feeds m bytes a cycle
    offline as in the timed loop (it used to index n positions of m-long stats and fail), and the
    offline greedy counts equal the online loop's at that m."""
    m = MtpcModel.from_pretrained(exported / "cp", draft_len=2)  # window 4
    prompts = [["one", "two", "three"]]
    e = EvalConfig(modes=("greedy",), max_new_tokens=12, stp=False)
    on = evaluate_heads(m, prompts, replace(e, acceptance="online"), progress=False)["runs"][0]
    off = evaluate_heads(m, prompts, replace(e, acceptance="offline", latency_prompts=1), progress=False)[
        "runs"
    ][0]
    for r in (on, off):
        assert len(r["metrics"]["per_position_acceptance"]) == 2 and r["metrics"]["mu_acc"] <= 1.0
    assert [p["cycles"] for p in off["per_prompt"]] == [p["cycles"] for p in on["per_prompt"]]
    assert off["metrics"]["mu_acc"] == pytest.approx(on["metrics"]["mu_acc"])
