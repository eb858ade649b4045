"""EvaByte's own code on CUDA with triton: finite logits, adapter = real forward, greedy speculative =
EvaByte's own greedy (bench/device.sh part 3, <= 60 s on an H200).

    python bench/bench_evabyte_gpu.py --out evabyte_gpu.json            # CUDA + triton (the device machine)
    python bench/bench_evabyte_gpu.py --out x.json --dry                # CPU, tiny, through the tests' triton shim

Writes a tiny random-weight EvaByte from its unchanged code (`$MTPC_THIRD_PARTY/evabyte_hf`, default
`../shared/third_party`, else `shared/third_party` in the checkout) with window 2048 / chunks of 16
and head_dim 128 — what EvaByte's triton kernels accept (chunks per window >= the kernel's block) —
loads it with `load_backbone(trust_remote_code=True)` in float32 and bfloat16, and for each dtype
records: the adapter's next-byte logits vs EvaByte's own uncached forward (max-abs), all finite, and
on prompts longer than a window, greedy speculative (an `init: mtp` ff head and a cp head, k = 0
and 2) vs plain vs EvaByte's own greedy decoding (its `generate`, or the same calls where
transformers 5 drops it). bf16 may legitimately differ from the own greedy after a near-tie (the
JSON says where); float32 should not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_CONTEXT = 4096  # positions of the GPU check's model (its prompt crosses a 2048-byte window)
sys.path.insert(0, str(ROOT))


def third_party() -> Path:
    for cand in (
        os.environ.get("MTPC_THIRD_PARTY"),
        ROOT.parent / "shared" / "third_party",
        ROOT / "shared" / "third_party",
    ):
        if cand and (Path(cand) / "evabyte_hf" / "modeling_evabyte.py").is_file():
            return Path(cand)
    raise SystemExit("EvaByte's code not found: set MTPC_THIRD_PARTY to the folder holding evabyte_hf/")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--dry", action="store_true", help="CPU, tiny sizes, the tests' triton shim (checks the script only)"
    )
    ap.add_argument("--new-bytes", type=int, default=64)
    a = ap.parse_args(argv)
    os.environ["MTPC_THIRD_PARTY"] = str(third_party())
    from mtpc import MtpcModel
    from mtpc.heads import HeadConfig, MtpcHead
    from tests.evabyte_real import load_tiny_evabyte, real_greedy, real_logits, write_tiny_evabyte

    t0 = time.time()
    device = "cpu" if a.dry else "cuda"
    if not a.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry for the CPU check of this script)")
    sizes = dict(window_size=16, chunk_size=4) if a.dry else dict(
        window_size=2048, chunk_size=16, hidden_size=256, num_attention_heads=2, intermediate_size=512,
        max_position_embeddings=GPU_CONTEXT)  # fmt: skip
    prompt_len = 40 if a.dry else 2100  # crosses a window
    out_dir = Path("/tmp") / f"mtpc_evabyte_gpu_{os.getpid()}"
    shim = a.dry  # the tests' triton shim on the CPU; on CUDA EvaByte's own triton kernels
    path = write_tiny_evabyte(out_dir / "ckpt", shim=shim, src=third_party() / "evabyte_hf", **sizes)
    result: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "sizes": sizes,
        "runs": [],
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(64, 320, (prompt_len,), generator=g) for _ in range(2)]

    def one_dtype(dtype) -> dict:
        bb0 = load_tiny_evabyte(path, shim=shim, dtype=dtype, device=device)
        x = prompts[0][None].to(device)
        with torch.no_grad():
            want = real_logits(bb0.model, x).float()
            got = bb0.stp_logits(bb0(x).verify_hidden).float()
        entry = {"dtype": str(dtype), "logits_max_abs": float((got - want).abs().max()),
                 "finite": bool(torch.isfinite(got).all()), "triton": bb0.triton, "greedy": []}  # fmt: skip
        own = [real_greedy(bb0.model, p.to(device), a.new_bytes) for p in prompts]
        for k in (0, 2):
            bb = load_tiny_evabyte(path, lora_depth=k, lora_rank=4, shim=shim, dtype=dtype, device=device)
            mtp = MtpcHead(
                HeadConfig(kind="ff", window=4, rank=1, vocab=320, hidden=bb.hidden_size, lora_depth=k)
            )
            mtp.init_from_unembeddings(bb.mtp_unembeddings().float(), noise=0.0)
            for name, head in (
                ("ff-mtp", mtp),
                ("cp", {"kind": "cp", "window": 4, "rank": 2, "lora_depth": k, "seed": 0}),
            ):
                m = MtpcModel.from_components(bb, head)
                for i, p in enumerate(prompts):
                    spec = m.generate(p.to(device), max_new_tokens=a.new_bytes, ban_eos=True).ids.tolist()
                    plain = m.generate_plain(p.to(device), max_new_tokens=a.new_bytes, ban_eos=True)
                    ref = own[i]
                    first_diff = next(
                        (j for j, (u, v) in enumerate(zip(spec, ref, strict=False)) if u != v), None
                    )
                    entry["greedy"].append({"k": k, "head": name, "prompt": i, "spec_eq_plain": spec == plain.ids.tolist(),
                                            "spec_eq_own": spec == ref, "first_diff_vs_own": first_diff})  # fmt: skip
        return entry

    for dtype in (torch.float32, torch.bfloat16):
        try:
            result["runs"].append(one_dtype(dtype))
        except Exception as e:  # noqa: BLE001 - record it, keep the other dtype and what ran before
            where = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(e.__traceback__)[-4:]]
            result["runs"].append(
                {"dtype": str(dtype), "error": f"{type(e).__name__}: {e}", "where": where, "greedy": []}
            )
        Path(a.out).write_text(json.dumps(result, indent=1))  # saved after each dtype
    result["seconds"] = time.time() - t0
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({r["dtype"]: {"error": r["error"]} if "error" in r else {"logits_max_abs": r["logits_max_abs"], "finite": r["finite"],
                                   "spec_eq_own": sum(x["spec_eq_own"] for x in r["greedy"]),
                                   "runs": len(r["greedy"])} for r in result["runs"]}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
