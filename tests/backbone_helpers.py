"""Tiny in-process backbones for tests (reusable by other test files; nothing is downloaded).

`tiny_llama` builds a stock transformers `LlamaForCausalLM` with a small vocabulary (4 symbols
work), float64 and eager attention by default, for exactness tests. `tiny_backbone` wraps it in a
`BackboneAdapter` (decoding through the compact engine or, with engine="hf", the HF layers);
`randomize_lora` gives the draft top's LoRA non-zero B matrices so that the draft differs from
the verifier; `cache_snapshot` lists an engine's live keys/values for comparisons.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mtpc.backbones import BackboneAdapter


def tiny_llama_config(
    vocab: int = 16,
    hidden: int = 32,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    max_context: int = 128,
    attn: str = "eager",
    tie: bool = False,
) -> LlamaConfig:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_context,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    cfg._attn_implementation = attn
    return cfg


def set_rope(cfg: LlamaConfig, rope: dict) -> None:
    """Give cfg the rotary parameters `rope` (with rope_theta) as the installed transformers reads
    them: 5.x's `rope_parameters`, 4.x's `rope_scaling` + `rope_theta`."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        cfg.rope_parameters = dict(rope)
    else:
        cfg.rope_theta = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg.rope_scaling = (
            None if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1 else scaling
        )


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float64, **cfg_kw) -> LlamaForCausalLM:
    """A random tiny Llama in eval mode; weights scaled up so the layers matter numerically."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**cfg_kw))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def tiny_backbone(
    lora_depth: int = 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    lora_rank: int = 4,
    engine: str = "auto",
    **cfg_kw,
):
    """engine: the decoding path ("compact": mtpc's Llama forward, "hf": the HF layers; auto = compact)."""
    model = tiny_llama(seed, dtype, **cfg_kw)
    return BackboneAdapter.from_hf(model, lora_depth=lora_depth, lora_rank=lora_rank, engine=engine)


ENGINES = ("compact", "hf")  # both decoding paths, for parametrised tests


def cache_snapshot(engine) -> dict[str, torch.Tensor]:
    """Every live key/value of an engine, by name: (rows, h_kv, length, hd) per layer and segment."""
    from mtpc.backbones import LlamaEngine

    out = {}
    if isinstance(engine, LlamaEngine):
        for i, (k, v) in enumerate(engine.kv):
            out[f"k{i}"], out[f"v{i}"] = k[:, :, : engine.length], v[:, :, : engine.length]
        return out
    for seg in ("trunk", "verify", "draft"):
        store = getattr(engine.cache, seg)
        for i in store.keys:
            out[f"{seg}.k{i}"], out[f"{seg}.v{i}"] = store.keys[i], store.values[i]
    return out


def randomize_lora(bb: BackboneAdapter, seed: int = 1, scale: float = 0.3) -> None:
    """Non-zero LoRA A and B everywhere (peft initialises B = 0, i.e. draft == verifier)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bb.lora_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)


def export_tiny_cp_head(root) -> None:
    """A tiny float32 byte Llama saved as `root/bb` (with the byte tokenizer) and a random cp head
    (n = 4, r = 2) for it exported as `root/cp`: what the evaluation CLI's tests load by path."""
    from mtpc import MtpcModel
    from mtpc.heads import save_head
    from mtpc.tokenizer import ByteTokenizer

    model = tiny_llama(
        vocab=320, hidden=16, layers=2, heads=2, kv_heads=1, dtype=torch.float32, max_context=512
    )
    model.save_pretrained(root / "bb")
    ByteTokenizer().save_pretrained(root / "bb")
    m = MtpcModel.from_components(model, {"kind": "cp", "window": 4, "rank": 2})
    m.head.config.backbone = str(root / "bb")
    save_head(root / "cp", m.head)
