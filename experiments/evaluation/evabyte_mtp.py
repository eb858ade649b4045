"""EvaByte's own multi-byte decoding (`multi_byte_generate`, the paper's "EvaByte-MTP" row) as a baseline.

`evabyte_mtp_runs(model, encoded_sets, max_new_tokens, ...)` runs the backbone's own Medusa-tree
decoding with its 8 heads on every prompt, greedily only: its sampling is lossy ("typical"
acceptance) and it neither bans EOS nor stops exactly at a byte budget, so its output is cut to
`max_new_tokens` (and at the first stop id when EOS is allowed). Each run records bytes per step
(`tokens_per_cycle`), throughput (bytes after the prefill / decode seconds) and `equals_greedy` (its
bytes = plain greedy decoding's, with the same EOS treatment), and, a step standing for a
cycle, `mu_lat` (seconds per step) and `mu_acc` (bytes per step beyond the verified one), so the
analysis places it on the Pareto plot, under the method name `evabyte-mtp` (no rank). Returns [] for a backbone without `multi_byte_generate` (only EvaByte has it).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tracking.schema import EVABYTE_MTP as METHOD

NOTE = "greedy only; EOS not banned by the method itself and output truncated to the budget"


def evabyte_mtp_runs(model: Any, encoded_sets: list[list[torch.Tensor]], max_new_tokens: int, *, set_names=None,
                     eos: tuple[str, ...] = ("banned",), seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """One run dict per (eos treatment, prompt set), shaped like `evaluate_heads`' runs."""
    bb = model.backbone
    own = getattr(bb.model, "multi_byte_generate", None)
    if own is None:
        return []
    stops = list(getattr(bb, "stop_token_ids", ()) or [bb.eos_token_id])
    cfg = bb.model.config
    runs = []
    for eos_mode in eos:
        ban = eos_mode == "banned"
        for set_idx, prompts in zip(set_names or range(len(encoded_sets)), encoded_sets, strict=True):
            steps = produced = equal = 0
            decode_s, hist = 0.0, [0] * (int(cfg.num_pred_heads) + 1)
            for i, p in enumerate(prompts):
                saved = cfg.return_dict
                cfg.return_dict = False  # multi_byte_generate unpacks its forward's output as a tuple
                try:
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        out, acc = own(p[None], max_new_tokens=max_new_tokens, return_acc_lengths=True)
                        decode_s += time.perf_counter() - t0
                finally:
                    cfg.return_dict = saved
                new = out[0, p.shape[0] :].tolist()[:max_new_tokens]
                if not ban:
                    cut = [j for j, t in enumerate(new) if t in stops]
                    new = new[: cut[0] + 1] if cut else new
                greedy = model.generate_plain(p, mode="greedy", seed=seed + i, ban_eos=ban,
                                              max_new_tokens=max_new_tokens).ids.tolist()  # fmt: skip
                equal += new == greedy
                steps += len(acc)
                for n in acc:  # bytes committed per step: the verified byte + accepted head bytes
                    hist[min(int(n) - 1, len(hist) - 1)] += 1
                produced += len(new)
            runs.append({
                "head": METHOD, "backbone": str(bb.name), "circuit": METHOD, "window": int(cfg.num_pred_heads),
                "rank": None, "lora_depth": 0, "mode": "greedy", "extra_token": "keep", "eos": eos_mode,
                "temperature": None, "top_p": None, "prompt_set": set_idx, "seed": seed, "note": NOTE,
                "metrics": {**_step_metrics(produced, steps, decode_s, int(cfg.num_pred_heads)), "cycles": steps,
                            "generated": produced,
                            "equals_greedy": equal / len(prompts) if prompts else float("nan"),
                            "per_position_acceptance": [], "accepted_length_histogram": hist},
            })  # fmt: skip
    return runs


def _step_metrics(produced: int, steps: int, decode_s: float, heads: int) -> dict[str, float]:
    """The Pareto metrics of the suite's heads, a step standing for a cycle: mu_lat = seconds per step,
    mu_acc = bytes per step beyond the one verified byte, the accept-all bound = heads / mu_lat."""
    nan = float("nan")
    tpc = produced / steps if steps else nan
    mu_lat = decode_s / steps if steps else nan
    return {"tokens_per_cycle": tpc, "mu_acc": tpc - 1.0, "mu_lat": mu_lat,
            "throughput": produced / decode_s if decode_s else nan,
            "max_throughput": heads / mu_lat if steps and decode_s else nan}  # fmt: skip
