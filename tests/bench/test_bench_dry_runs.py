"""Dry runs of the decode benchmarks on the CPU: every part of bench_gpu.py (--tiny) and the engine
section of bench_decode.py finish without an error and record what they promise (~7 s at one thread)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mtpc.names import CIRCUIT_KINDS
from tests.mtpc.test_decode_attention import device  # noqa: F401  (the Triton tests' device fixture)

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def _bench_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


def test_bench_gpu_tiny_runs_every_part(tmp_path):
    import bench_gpu

    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--tiny", "--out", str(out), "--default-model", str(tmp_path / "none")]) == 0
    report = json.loads(out.read_text())
    for part in ("bandwidth", "llama32_3b", "fp32_identity", "graph_vs_eager", "default_model", "bf16"):
        assert part in report and "error" not in report[part], (part, report.get(part))
    assert report["fp32_identity"]["all_identical"] is True
    assert set(report["llama32_3b"]["cycle_ms"]) == {
        f"{k}_{leaf}" for k in CIRCUIT_KINDS for leaf in ("full", "appG")
    }
    assert report["llama32_3b"]["bound_ms"] > 0 and "bars" in report["llama32_3b"]
    assert report["graph_vs_eager"]["skipped"].startswith("no CUDA")
    three_b = report["llama32_3b"]  # plain decoding per byte, every cycle against it too
    assert three_b["ms"]["plain_per_byte"] > 0 and set(three_b["cycle_over_plain_byte"]) == set(
        three_b["cycle_ms"]
    )
    assert "over_plain_byte" in three_b["bars"]["cycle_btree_appG_over_step"]
    fused = three_b["fused_cycle"]  # the keep cycle in one call, beside the loop's, greedy and sampled
    assert (
        set(fused["cycle_ms"])
        == set(fused["loop_cycle_ms"])
        == {f"btree_{leaf}_{mode}" for leaf in ("full", "appG") for mode in ("greedy", "sample")}
    )
    assert all(fused["greedy_equals_plain"].values()) and set(fused["over_step"]) == set(fused["cycle_ms"])
    assert fused["captured"] == {"full": 0, "appG": 0}  # no CUDA: the eager function
    from mtpc.backbones.decode_attention import split_kv_unsupported

    if split_kv_unsupported("cpu", torch.float32) is None:  # Triton's interpreter on the path
        _check_split_kv(three_b["split_kv"])
    else:  # no CUDA and no interpreter: the reason, not a timing
        assert "skipped" in three_b["split_kv"]


def _check_split_kv(split: dict) -> None:
    """bench_gpu's split-KV part ran every variant and call, and split-KV's logits equal SDPA's."""
    assert "skipped" not in split and max(split["max_abs_logit_diff"].values()) < 1e-4, split
    assert set(split["split_kv_over_sdpa"]) >= {"step", "verify_16"}
    assert set(split["split_kv_fused_over_sdpa"]) == set(split["fused_over_sdpa"]) >= {"step", "verify_16"}


def test_bench_gpu_split_kv_part_runs_under_the_triton_interpreter(device):  # noqa: F811 (the fixture)
    """`make test-triton`: bench_gpu's split-KV / fused-op part alone on the tiny model under Triton's
    interpreter (the rest of the dry run is the test above, without triton: its parts run no Triton
    kernel, and under the interpreter the whole dry run takes minutes). A short prompt: the
    interpreter's cost grows with every prefilled byte."""
    import bench_gpu
    import engine_timing as et

    from mtpc.backbones import BackboneAdapter

    dev = torch.device(device)
    model = et.random_llama(et.TINY_SHAPE, dtype=torch.float32, device=dev)
    bb = BackboneAdapter.from_hf(model, name="bench")
    ctx = 24
    prompt = et.random_prompts(1, ctx, seed=0, device=dev)[0]
    g = torch.Generator().manual_seed(1)
    win = {n: torch.randint(0, 256, (n,), generator=g).to(dev) for n in (8, 16)}
    one = torch.tensor([65], device=dev)
    _check_split_kv(bench_gpu.split_kv_part(bb, prompt, ctx, ctx + 32, win, one, 1, 1, dev))


def test_profile_gpu_step_tiny_compares_the_verify_with_the_step_kernel_by_kernel(tmp_path):
    import profile_gpu_step

    out = tmp_path / "profile.json"
    assert profile_gpu_step.main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ms"]) >= {"step_graph", "step_eager", "verify16_graph", "verify16_eager"}
    assert all(r > 0 for r in report["verify16_over_step"].values())
    rows = report["verify16_vs_step"]
    assert rows and all(r["added_us"] == pytest.approx(r["verify_us"] - r["step_us"]) for r in rows)
    assert [r["added_us"] for r in rows] == sorted((r["added_us"] for r in rows), reverse=True)
    for name in ("step_graph", "verify16_graph"):
        assert report[f"profile_{name}"] and report[f"profile_{name}"][0]["count"] > 0


def test_compare_heads_offline_dry_run_scores_each_head_per_draft_length(tmp_path):
    import compare_heads_offline

    out = tmp_path / "cmp.json"
    assert (
        compare_heads_offline.main(
            ["a=x", "known=y", "--dry-run", "--draft-lens", "2,4,8", "--out", str(out)]
        )
        == 0
    )
    got = json.loads(out.read_text())
    res = got["results"]
    assert "machine" in got
    for stats in got["texts"].values():  # the scored texts' degeneracy beside the acceptance
        assert 0.0 <= stats["degenerate_fraction"] <= 1.0
    assert set(got["texts"]) == {"greedy", "sample"}
    assert set(res) == {"greedy", "sample"} and set(res["greedy"]) == {"a", "known"}
    for mode in res.values():
        for by_m in mode.values():
            assert set(by_m) == {"2", "4"}  # m = 8 is beyond the window-4 heads: not scored, no error
            assert all(1.0 <= r["bytes_per_cycle"] <= int(m) for m, r in by_m.items())
            assert all(len(r["per_position_acceptance"]) == int(m) for m, r in by_m.items())
    sys.modules.pop("compare_heads_offline", None)


def test_bench_decode_engine_section(tmp_path):
    import bench_decode

    out = tmp_path / "decode.json"
    argv = ["--sections", "engine", "--model", "random", "--out", str(out), "--rounds", "1", "--reps", "1",
            "--new-tokens", "8", "--identity-prompts", "1", "--context", "32"]  # fmt: skip
    assert bench_decode.main(argv) == 0
    eng = json.loads(out.read_text())["engine"]
    assert set(eng["bars"]) == set(bench_decode.BARS)
    assert eng["identity"]["compact"]["spec_eq_plain"] == 1 and eng["identity"]["compact"]["plain_eq_hf"] == 1
    assert all(v > 0 for v in eng["step_ms"].values())
    parts = eng["cycle_parts"][
        "random_btree_n8_r16_appG16"
    ]  # the loop's cycle in parts beside the plain step
    assert set(parts["ms"]) == {"verify", "head", "draft", "accept", "python", "cycle"}
    assert all(parts["ms"][k] > 0 for k in ("verify", "head", "draft", "accept", "cycle"))
    assert parts["ms"]["cycle"] == pytest.approx(
        sum(parts["ms"][k] for k in ("verify", "head", "draft", "accept", "python"))
    )
    assert parts["cycle_minus_verify_over_step"] > 0 and eng["cycle_parts"]["plain_step_ms"] > 0
    assert set(eng["short_verify_over_step"]) == {"2", "4"}  # the draft length's verify costs
    probe = eng["head_forward_cache_ms"]  # the head and draft hot, after a verify, after a cache sweep
    assert set(probe) == {
        f"{c}_{w}" for c in ("head", "draft") for w in ("hot", "after_verify", "after_sweep")
    }
    assert all(v > 0 for v in probe.values())
    sys.modules.pop("bench_decode", None)


def test_bench_decode_heads_section_reports_degeneracy_beside_acceptance(tmp_path):
    import bench_decode

    out = tmp_path / "decode.json"
    argv = ["--sections", "heads", "--heads-dir", str(tmp_path / "no-heads"), "--windows", "4", "--num-prompts", "1",
            "--sets", "1", "--max-new-tokens", "8", "--out", str(out)]  # fmt: skip
    assert bench_decode.main(argv) == 0
    rows = json.loads(out.read_text())["heads"]["windows"]["4"]["rows"]
    assert {r["circuit"] for r in rows} == set(CIRCUIT_KINDS) and {r["source"] for r in rows} == {"random"}
    for r in rows:
        assert 0.0 <= r["degenerate_fraction"] <= 1.0 and 0.0 < r["distinct_4gram_ratio"] <= 1.0
        assert r["mu_acc"] >= 0 and r["speedup_vs_stp"] > 0
    sys.modules.pop("bench_decode", None)


@pytest.mark.slow
def test_bench_ddp_dry_run_runs_both_variants_to_the_same_steps(tmp_path):
    """1 process x 2 threads and 2 DDP processes x 1 thread, the same steps and global batch; a dry
    run reports no times (the measurement is for a quiet machine)."""
    import bench_ddp

    out = tmp_path / "ddp.json"
    assert bench_ddp.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"one", "ddp2"} and report["dry_run"] is True
    one, two = report["variants"]["one"], report["variants"]["ddp2"]
    assert one["global_step"] == two["global_step"] == 2 and one["median_step_s"] is None
    assert one["final_train_loss"][0] == pytest.approx(
        two["final_train_loss"][0], rel=1e-4
    )  # the same global batch


def test_bench_offline_tiny_agrees_with_the_loop(tmp_path):
    """bench_offline's dry run (random tiny Llama, both modes): greedy texts and cycles equal the
    online loop's on every prompt, the sampling comparison is paired, and the JSON names its command."""
    import bench_offline

    out = tmp_path / "offline.json"
    result = bench_offline.main(["--tiny", "--prompts", "3", "--sets", "1", "--max-new-tokens", "12", "--no-two-step",
                                 "--batch", "8", "--slot-budget", "100000", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["command"].startswith("python bench/bench_offline.py --tiny") and result["device"] == "cpu"
    greedy, sample = result["modes"]["greedy"], result["modes"]["sample"]
    assert greedy["greedy_prompts_differing"] == 0 and greedy["greedy_texts_differing_online"] == 0
    assert (
        greedy["paired_cycles"]["mean"] == 0.0 and greedy["online_s"] > 0 and greedy["speedup_one_head"] > 0
    )
    assert sample["paired_accepted"]["n"] == 3 and len(sample["metrics"]) == 1


def test_device_prompt_pool_draws_the_same_sets(tmp_path):
    """The pool device_prep writes for the device (the corpus does not travel) gives the sets that the
    pool itself gives: the GPU's `--prompt-source` file is the held-out draw."""
    from experiments.evaluation.prompts import draw_prompt_sets, load_prompt_sets
    from experiments.shipping.device_prep import write_prompt_pool

    pool = [f'prompt {i}: {"é" * (i % 3)} "quoted"\nline' for i in range(40)]
    path = tmp_path / "pool.jsonl"
    write_prompt_pool(pool, path)
    assert load_prompt_sets(str(path), 5, 3, 0, dev_sets=1, dev_num_prompts=4) == draw_prompt_sets(
        pool, "heldout", 5, 3, 0, dev_sets=1, dev_num_prompts=4
    )


def test_bench_shipped_head_dry_run_reports_speed_text_and_identity(tmp_path, monkeypatch):
    """The shipped head's bench: both modes timed interleaved, greedy outputs equal plain decoding's,
    degeneracy beside every figure, the command and the machine (with its L3) recorded."""
    import bench_shipped_head

    monkeypatch.setenv("MTPC_TIMING_LOCK", str(tmp_path / "timing.lock"))
    monkeypatch.setenv("MTPC_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "shipped.json"
    assert bench_shipped_head.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].endswith("--dry-run --out " + str(out)) and "L3" in report["machine"]
    greedy, sample = report["modes"]["greedy"], report["modes"]["sample"]
    assert greedy["identical"] == "2/2"
    for r in (greedy, sample):
        assert r["speedup_median"] > 0 and r["bytes_per_cycle"] >= 1.0
        # the decoding alone beside the whole generation, and the prefill's share of plain's time
        assert r["decode_speedup_median"] > 0 and len(r["decode_speedup_rounds"]) == len(r["speedup_rounds"])
        assert 0.0 < r["prefill_share_of_plain"] < 1.0
        assert 0.0 <= r["degenerate_fraction"] <= 1.0 and 0.0 < r["distinct_4gram_ratio"] <= 1.0
    assert "plain_degenerate_fraction" in sample
