"""Speed-up of speculative over plain decoding, timed one way: interleaved in one process, wall clock.

`measure_speedup(model, prompts, mode, ...)`: every round times plain decoding (`generate_plain`) and
speculative decoding (`generate`) prompt by prompt, interleaved (which goes first alternates by prompt
and round), EOS banned; a round's ratio is its total plain time over its total speculative time, the
figure is the median of the rounds' ratios. Beside it the same ratio over the decoding alone (the
generations' own clocks, prefill excluded: both arms prefill the same prompt at the same cost) and
the prefill's share of plain decoding's time, which caps the whole ratio; bytes per cycle (keep cycle: 1 + mu_acc), greedy
outputs compared byte for byte with plain decoding's, and the text's degenerate fraction and
distinct-4-gram ratio (`mtpc.textstats`). The caller holds the timing lock (experiments.plumbing.timing_lock).
Used by bench/bench_shipped_head.py (the reported figures) and the demo's first line.
Leaves out: choosing prompts (held-out sets: experiments.evaluate), the timing lock.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from mtpc.textstats import degeneracy_metrics


def measure_speedup(
    model: Any,
    prompts: list[str],
    mode: str,
    new_bytes: int,
    rounds: int = 3,
    temperature: float = 1.0,
    say: bool = True,
    draft_len: int | None = None,
) -> dict[str, Any]:
    """The module docstring's figures for one decoding mode (`greedy` or `sample`); draft_len: the
    speculative arm's bytes fed per cycle (`MtpcModel.generate`; None: the model's)."""
    kw = dict(max_new_tokens=new_bytes, mode=mode, temperature=temperature, ban_eos=True)
    spec_kw = kw if draft_len is None else dict(kw, draft_len=draft_len)
    model.generate(prompts[0], **spec_kw, seed=0)  # warm both paths (allocations, oneDNN packing)
    model.generate_plain(prompts[0], **kw, seed=0)
    ratios, spec_out, plain_out, emitted, cycles, identical = [], [], [], 0, 0, 0
    decode_ratios, prefill_share = [], []
    for r in range(rounds):
        t_plain = t_spec = d_plain = d_spec = pre_plain = 0.0
        for i, prompt in enumerate(prompts):
            seed = 1000 * r + i
            order = ("plain", "spec") if (i + r) % 2 == 0 else ("spec", "plain")
            for which in order:
                t0 = time.perf_counter()
                if which == "plain":
                    p = model.generate_plain(prompt, **kw, seed=seed)
                    t_plain += time.perf_counter() - t0
                    d_plain, pre_plain = d_plain + p.stats.decode_s, pre_plain + p.stats.prefill_s
                else:
                    s = model.generate(prompt, **spec_kw, seed=seed)
                    t_spec += time.perf_counter() - t0
                    d_spec += s.stats.decode_s
            if r == 0:
                spec_out.append(s.ids.tolist())
                plain_out.append(p.ids.tolist())
                emitted += int(s.stats.decode_generated)
                cycles += int(s.stats.cycles)
                identical += int(s.ids.tolist() == p.ids.tolist())
        ratios.append(t_plain / t_spec)
        decode_ratios.append(d_plain / d_spec)
        prefill_share.append(pre_plain / t_plain)
        if say:
            print(
                f"  {mode}{'' if draft_len is None else f' m={draft_len}'} round {r + 1}/{rounds}: plain {t_plain:.1f} s, speculative {t_spec:.1f} s, "
                f"{ratios[-1]:.3f}x",
                file=sys.stderr,
                flush=True,
            )
    spec_deg = degeneracy_metrics(bytes(b for b in o if b < 256) for o in spec_out)
    out = {
        "speedup_median": statistics.median(ratios),
        "speedup_rounds": ratios,
        "decode_speedup_median": statistics.median(decode_ratios),  # prefill excluded (module docstring)
        "decode_speedup_rounds": decode_ratios,
        "prefill_share_of_plain": statistics.median(prefill_share),
        "bytes_per_cycle": emitted / cycles if cycles else 0.0,
        "draft_len": int(s.stats.window),
        "degenerate_fraction": spec_deg["degenerate_fraction"],
        "distinct_4gram_ratio": spec_deg["distinct_4gram_ratio"],
    }
    if mode == "greedy":
        out["identical"] = f"{identical}/{len(prompts)}"
    else:
        plain_deg = degeneracy_metrics(bytes(b for b in o if b < 256) for o in plain_out)
        out.update(
            plain_degenerate_fraction=plain_deg["degenerate_fraction"],
            plain_distinct_4gram_ratio=plain_deg["distinct_4gram_ratio"],
        )
    return out
