"""What the shipped default model writes: degeneracy on the fixed report set, and sample answers.

`python -m experiments.shipping.default_report [--out bench/results/default_model_report.json]` decodes
the report set — 100 held-out ShareGPT prompts, the first 100 by SHA-256 of their text, fixed
before the model was trained and never used to choose its size or checkpoint — for 160 bytes
with EOS banned, greedily and by sampling (T = 1, seed 0), with Hugging Face `generate` on the
shipped weights (an independent decoder: the report does not depend on mtpc's own engine), and
writes `degenerate_fraction` / `distinct_4gram_ratio` (`mtpc.textstats`) for both, the first five
answers of each, the model label, the command and the machine.

Leaves out: acceptance and speed (experiments.evaluate, bench/), the held-out bits/byte
(experiments.pretrain writes it with the weights).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

from mtpc.atomic import write_json

REPORT_PROMPTS = 100
NEW_BYTES = 160


def report_prompts(n: int = REPORT_PROMPTS) -> list[str]:
    """The fixed report set: held-out prompts ordered by the SHA-256 of their text, first n."""
    from mtpc.data import sharegpt_corpus

    pool = sharegpt_corpus(progress=False).heldout_prompts
    return sorted(pool, key=lambda p: hashlib.sha256(p.encode("utf-8")).hexdigest())[:n]


@torch.inference_mode()
def answers(
    model, tokenizer, prompts: list[str], sample: bool, new_bytes: int = NEW_BYTES, seed: int = 0
) -> list[bytes]:
    from tqdm import tqdm

    out = []
    for i, p in enumerate(tqdm(prompts, desc="sample" if sample else "greedy", unit="prompt")):
        ids = torch.tensor([tokenizer.render_prompt(p)])
        torch.manual_seed(seed + i)
        gen = model.generate(
            ids,
            max_new_tokens=new_bytes,
            min_new_tokens=new_bytes,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            suppress_tokens=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,
        )
        out.append(tokenizer.decode(gen[0, ids.shape[1] :]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.shipping.default_report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", default="bench/results/default_model_report.json")
    ap.add_argument("--prompts", type=int, default=REPORT_PROMPTS)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    from mtpc.backbones.shipped import SHIPPED_DIR, verify_shipped
    from mtpc.names import DECODE_MODES
    from mtpc.textstats import degeneracy_metrics
    from mtpc.tokenizer import ByteTokenizer
    from tracking.runs import machine

    label = verify_shipped()
    model = LlamaForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32).eval()
    tok = ByteTokenizer()
    prompts = report_prompts(args.prompts)
    t0 = time.monotonic()
    report = {
        "model": label,
        "prompts": len(prompts),
        "new_bytes": NEW_BYTES,
        "eos": "banned",
        "decoder": "transformers generate (greedy; sampling T=1, top_k=0, top_p=1, seed 0 + prompt index)",
    }
    for mode in DECODE_MODES:
        texts = answers(model, tok, prompts, sample=mode == "sample")
        report[mode] = {
            **degeneracy_metrics(texts),
            "first_answers": [
                {"prompt": p[:200], "answer": t.decode("utf-8", "replace")}
                for p, t in zip(prompts[:5], texts[:5], strict=True)
            ],
        }
    report.update(
        minutes=(time.monotonic() - t0) / 60,
        hardware=machine(),
        command="python -m experiments.shipping.default_report "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report, indent=1)
    for mode in DECODE_MODES:
        print(
            f"{mode}: " + ", ".join(f"{k}={v:.3f}" for k, v in report[mode].items() if isinstance(v, float))
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
