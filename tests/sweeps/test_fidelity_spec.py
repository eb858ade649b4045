"""sweeps/fidelity.yaml holds the study issue 14 asks for: RQ1 (cp at >= 3 ranks, n = 8), RQ2 (every
circuit, n in {8, 16}), RQ3 (ff and btree, k in {0, 1, 2} at n = 16), CE and distilled heads at n = 8
for every circuit at equal steps, two training seeds for every configuration, 3 reported sets of
>= 32 prompts x 128 bytes plus development sets, greedy + sampling at T = 1 and T < 1, validation
often enough for the stopping rule; and every point's training config validates. A slow test
dry-runs it end to end on the debug backbone with a tiny override."""

from __future__ import annotations

from collections import defaultdict

import pytest

from mtpc.names import CIRCUIT_KINDS
from sweeps.spec import load_spec
from tests.sweep_helpers import fresh_tracking_uri, run_cli

SPEC = "sweeps/fidelity.yaml"
CPU_SPEC = "sweeps/fidelity_cpu.yaml"


def test_the_grid_covers_every_question_with_two_seeds():
    spec = load_spec(SPEC, env={})
    pts = spec.grid
    configs = defaultdict(set)
    for p in pts:
        configs[(p["circuit"], p["rank"], p["window"], p["lora_depth"], p["kl_beta"])].add(p["train_seed"])
    assert all(seeds == {0, 1} for seeds in configs.values()), configs
    ce = {c for c in configs if c[4] == 0.0}
    assert {r for c, r, n, k, b in ce if c == "cp" and n == 8 and k == 0} >= {2, 8, 32}  # RQ1 / (a)
    for n in (8, 16):  # RQ2
        assert {c for c, r, w, k, b in ce if w == n and k == 0} == set(CIRCUIT_KINDS)
    for circ in ("ff", "btree"):  # RQ3
        assert {k for c, r, w, k, b in ce if c == circ and w == 16} == {0, 1, 2}
    kl = {c for c in configs if c[4] > 0}
    for circ in CIRCUIT_KINDS:  # H1: CE and distilled twins at n = 8
        twins = {(r, k) for c, r, w, k, b in kl if c == circ and w == 8}
        assert twins and twins <= {(r, k) for c, r, w, k, b in ce if c == circ and w == 8}
    assert len({b for *_, b in kl}) >= 2  # beta is chosen on dev among candidates
    steps = spec.train.trainer["max_steps"]
    every = spec.train.trainer["val_check_interval"]
    assert every <= 0.8 * steps and steps % every == 0  # a validation at the start of the last fifth
    e = spec.eval
    assert e.sets >= 3 and e.n_prompts >= 32 and e.max_new_tokens == 128 and e.dev_sets >= 1
    assert (
        set(e.modes) == {"greedy", "sample"}
        and 1.0 in e.temperatures
        and len([t for t in e.temperatures if t < 1]) >= 2
    )
    assert e.eos == ("banned",)


def test_every_point_validates_as_a_training_config(tmp_path):
    from sweeps.run import validate_trial_configs

    assert validate_trial_configs(load_spec(SPEC, env={}, overrides={"output_dir": str(tmp_path)})) == 44


def test_the_cpu_variant_decides_h1_and_h2_with_two_seeds(tmp_path):
    """sweeps/fidelity_cpu.yaml (the study on the CPU, near the paper's size): CE and distilled twins
    for every circuit at n = 8, every circuit at n = 16, LoRA depths 1 and 2 for ff and btree last, two
    seeds everywhere, the priority order H1 (cp, btree) before H2 before the rest, offline acceptance
    on 3 x 225 prompts x 256 bytes plus a dev set of 100, greedy and sampling at T = 1 and 0.8, EOS
    banned, a study name of its own (never resuming or mixing with the 32-prompt run's), and every
    point validates."""
    from sweeps.run import validate_trial_configs

    spec = load_spec(CPU_SPEC, env={}, overrides={"output_dir": str(tmp_path)})
    configs = defaultdict(set)
    for p in spec.grid:
        configs[(p["circuit"], p["window"], p["kl_beta"])].add(p["train_seed"])
    assert all(seeds == {0, 1} for seeds in configs.values()), configs
    for circ in CIRCUIT_KINDS:
        assert (circ, 8, 0.0) in configs and (circ, 8, 0.5) in configs and (circ, 16, 0.0) in configs
    order = [(p["circuit"], p["window"]) for p in spec.grid]
    assert order.index(("btree", 8)) < order.index(("ff", 16)) < order.index(("ff", 8))
    assert {(p["circuit"], p["lora_depth"]) for p in spec.grid if p["lora_depth"]} == {
        (c, k) for c in ("ff", "btree") for k in (1, 2)}  # fmt: skip
    assert all(p["lora_depth"] == 0 for p in spec.grid[: len(spec.grid) - 8])  # RQ3 runs last
    e = spec.eval
    assert (e.acceptance, e.sets, e.n_prompts, e.max_new_tokens, e.dev_sets, e.dev_n_prompts) == (
        "offline",
        3,
        225,
        256,
        1,
        100,
    )
    assert e.modes == ("greedy", "sample") and e.temperatures == (1.0, 0.8) and e.eos == ("banned",)
    assert e.continuation_cache and e.extra_token == "keep"
    assert spec.study == "mtpc-fidelity-cpu-225" and spec.study != "mtpc-fidelity-cpu"
    steps, every = spec.train.trainer["max_steps"], spec.train.trainer["val_check_interval"]
    assert every <= 0.8 * steps and steps % every == 0
    assert validate_trial_configs(spec) == len(spec.grid)


def test_the_cpu_variant_draws_disjoint_sets_from_the_heldout_pool():
    """783 held-out prompts hold 3 x 225 reported + 100 dev, disjoint; the reported sets are the draw
    of 3 x 225 alone (resizing dev leaves them as they are), dev0 comes after them. A stand-in pool of
    783 distinct prompts; the real held-out pool too when the corpus is built."""
    from experiments.evaluation.prompts import draw_prompt_sets, prompt_set_names

    e = load_spec(CPU_SPEC, env={}).eval
    assert prompt_set_names(e.sets, e.dev_sets) == ["0", "1", "2", "dev0"]
    pools = [[f"prompt {i}" for i in range(783)]]
    try:
        from mtpc.data import CORPUS_VERSION
        from mtpc.paths import cache_dir

        built = cache_dir() / "data" / CORPUS_VERSION / "heldout_prompts.json"
        if built.is_file():
            import json

            pools.append(json.loads(built.read_text(encoding="utf-8")))
    except ImportError:
        pass
    for pool in pools:
        assert len(pool) == 783
        sets = draw_prompt_sets(pool, "heldout", e.n_prompts, e.sets, e.seed, dev_sets=e.dev_sets,
                                dev_num_prompts=e.dev_n_prompts)  # fmt: skip
        assert [len(x) for x in sets] == [225, 225, 225, 100]
        assert len({p for x in sets for p in x}) == 775
        assert sets[:3] == draw_prompt_sets(pool, "heldout", e.n_prompts, e.sets, e.seed)
        equal = draw_prompt_sets(pool, "heldout", 100, 4, e.seed)  # dev of the reported size: the old draw
        assert draw_prompt_sets(pool, "heldout", 100, 3, e.seed, dev_sets=1, dev_num_prompts=100) == equal
    with pytest.raises(ValueError, match="dev_sets x dev_num_prompts = 809"):
        draw_prompt_sets(pools[0], "heldout", 225, 3, 0, dev_sets=1, dev_num_prompts=134)


@pytest.mark.slow
def test_dry_run_on_the_debug_backbone(tmp_path):
    """The whole pipeline on the tiny backbone: one point per slice kind, both seeds, the decision CLI."""
    uri = fresh_tracking_uri(tmp_path / "mlflow")
    sets = [
        f"output_dir={tmp_path / 'out'}",
        f"mlflow.tracking_uri={uri}",
        "train.config=debug",
        "train.trainer={max_steps: 5, val_check_interval: 1, max_epochs: 1}",
        "train.run={checkpoint_every_n_steps: 0}",
        "space.slices={ce: {circuit: [ff, cp], rank: [4], window: [8], lora_depth: [0], train_seed: [0, 1]},"
        " kl: {circuit: [ff, cp], rank: [4], window: [8], lora_depth: [0], kl_beta: [0.5], train_seed: [0, 1]}}",
        "eval.n_prompts=2",
        "eval.max_new_tokens=8",
        "eval.temperatures=[1.0, 0.5]",
    ]
    r = run_cli([SPEC, "--workers", "2", *[x for s in sets for x in ("--set", s)]], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    from analysis.fidelity import main

    out = tmp_path / "fidelity.md"
    assert (
        main(
            ["--tracking-uri", uri, "--experiment", "mtpc-fidelity", "--out", str(out), "--resamples", "200"]
        )
        == 0
    )
    text = out.read_text()
    assert "## H1" in text and "beta = 0.5: the only candidate, fixed in advance" in text
    assert (
        "| ff n=8: β=0.5 vs CE |" in text and "| cp n=8 r=4: β=0.5 vs CE |" in text
    )  # decided on both seeds' prompts
    assert "## Training" in text
