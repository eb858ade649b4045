"""One evaluation's settings: `EvalConfig`, what a head is evaluated on and how, and the bounds of every field.

The evaluation CLI (`--eval.<field>` flags, a `--config` file's `eval:` section), a sweep spec's `eval`
section and a sweep trial all read this one dataclass; every field's docstring is its `--help` text.
Leaves out: running the evaluation (decoding.py), drawing its prompts (prompts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.plumbing.parsing import Fail
from mtpc import names
from tracking import schema


@dataclass(frozen=True)
class EvalConfig:
    """eval: how a head is evaluated with speculative decoding (the sweep spec's `eval`, a trial, `experiments.evaluate`)."""

    modes: tuple[str, ...] = names.DECODE_MODES
    """decoding modes evaluated: greedy and/or sample"""
    prompts: str = "heldout"
    """`heldout` (the corpus's held-out prompts) or a .jsonl file"""
    sets: int = 1
    """reported prompt sets per mode, disjoint (named 0, 1, ...; one evaluation run each)"""
    dev_sets: int = 0
    """extra disjoint development sets (dev0, ...): for choosing settings, never reported"""
    n_prompts: int = 16
    """prompts per set"""
    dev_n_prompts: int | None = None
    """prompts per development set (default n_prompts); drawn after the reported sets, so resizing them
    leaves the reported prompts as they are"""
    max_new_tokens: int = 128
    """bytes generated per prompt"""
    extra_token: str = "keep"
    """the verifier's extra token: keep (exact, one call per cycle) or drop (the paper's Alg. 2)"""
    temperatures: tuple[float, ...] = (1.0,)
    """sampling temperatures, each its own runs (greedy runs once)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    seed: int = 0
    """the evaluation's sampling seed (prompt i uses seed + i); the training seed is another"""
    eos: tuple[str, ...] = ("banned",)
    """EOS treatments evaluated: banned (probability 0: equal lengths) and/or allowed (EOS stops an answer)"""
    stp: bool = True
    """run the plain model beside every head (speedup_vs_stp); false halves the evaluation"""
    acceptance: str = "offline"
    """offline (acceptance teacher-forced on the plain model's continuations of every prompt; mu_lat
    timed by the online loop on `latency_prompts`) or online (every prompt through the timed loop)"""
    latency_prompts: int = 16
    """offline: the first this many prompts of each set go through the online loop (and STP), timed"""
    continuation_cache: bool = True
    """offline: share the plain model's continuations through the on-disk cache (computed once per
    backbone weights, decode config, prompts and seeds, by whichever trial asks first); false recomputes them"""

    def check(self, fail: Fail) -> EvalConfig:
        """The bounds of every field (`fail(key, msg)` raises); returns self."""
        for m in self.modes:
            fail.choice("eval.modes", m, names.DECODE_MODES)
        fail.text("eval.prompts", self.prompts)
        fail.integer("eval.sets", self.sets, 1, 1000)
        fail.integer("eval.dev_sets", self.dev_sets, 0, 1000)
        fail.integer("eval.n_prompts", self.n_prompts, 1, 100000)
        if self.dev_n_prompts is not None:
            fail.integer("eval.dev_n_prompts", self.dev_n_prompts, 1, 100000)
        fail.integer("eval.max_new_tokens", self.max_new_tokens, 1, 1_000_000)
        fail.choice("eval.extra_token", self.extra_token, names.EXTRA_TOKEN_OPTIONS)
        fail.choice("eval.acceptance", self.acceptance, schema.ACCEPTANCE_METHODS)
        if self.acceptance == "offline" and self.extra_token != "keep":
            fail(
                "eval.extra_token",
                f"{self.extra_token!r} is online-only (offline acceptance mirrors the keep "
                "cycle; drop is not exact): expected keep, or eval.acceptance: online",
            )
        fail.integer("eval.latency_prompts", self.latency_prompts, 1, 100000)
        for t in self.temperatures:
            fail.number("eval.temperatures", t, 1e-6, 100.0)
        fail.number("eval.top_p", self.top_p, 1e-6, 1.0)
        fail.integer("eval.seed", self.seed, 0)
        for e in self.eos:
            fail.choice("eval.eos", e, schema.EOS_MODES)
        for name in ("modes", "temperatures", "eos"):
            values = getattr(self, name)
            if not values:
                fail(f"eval.{name}", "expected a non-empty list")
            if len(set(values)) != len(values):
                fail(f"eval.{name}", f"{list(values)} names a value twice")
        return self
