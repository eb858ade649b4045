"""Tiny tokenkit byte-Llama checkpoints (`model_type: tpu_llama`) written for tests; nothing is downloaded.

`write_tpu_llama` writes what tokenkit's exporter writes: config.json with TPULlamaConfig's fields
and `auto_map` to `modelling_tpu_llama.py`, one model.safetensors with tokenkit's weight names
(random float64 weights; norms away from 1), and, when `code` names tokenkit's folder, its two
modelling files beside them (so `trust_remote_code=True` runs the real code on the same weights).
`expand_dict` builds the expand dictionary from forward id sequences as tokenkit stores it:
reversed ids + 1 joined by commas -> expanded id + 1, plus the list of direct ids (+ 1).
`tokenkit_model` loads the checkpoint with tokenkit's own code (transformers 4.x only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CODE_FILES = ("configuration_tpu_llama.py", "modelling_tpu_llama.py")

#: Llama-3-like "tokens" over bytes (forward order); each a key of the expand dictionary. Some have
#: no shorter suffix in the table ("hello" without "ello"/"llo"), one is longer than maxlen.
BYTE_TOKENS = [b"e", b"h", b"l", b"o", b"t", b" ", b"a", b"n", b"d", b"th", b"he", b"the", b" the", b"in", b"ing",
               b" a", b"an", b"and", b" and", b"lo", b"hello", b"ll", b"or", b"wor", b"world", b" wo", b"\xc3\xa9",
               b"caf", b"the world"]  # fmt: skip


def expand_dict(tokens: list[list[int]], direct: list[int]) -> list:
    """[{"reversed ids + 1": index + 1}, [direct ids + 1]] for tokens given as forward id lists."""
    keys = {",".join(str(i + 1) for i in reversed(t)): n + 1 for n, t in enumerate(tokens)}
    return [keys, [d + 1 for d in direct]]


def byte_expand(specials: list[int]) -> tuple[list, int]:
    """The byte fixture's dictionary (BYTE_TOKENS, then each special id as its own direct entry) and its size."""
    tokens = [list(t) for t in BYTE_TOKENS] + [[s] for s in specials]
    return expand_dict(tokens, specials), len(tokens)


def write_tpu_llama(
    directory: str | Path,
    *,
    vocab: int = 264,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    max_context: int = 256,
    expand: list | None = None,
    expand_size: int = 0,
    maxlen: int = 6,
    tie: bool = False,
    llama3_rope: bool = True,
    bos: int = 256,
    eos: int = 257,
    seed: int = 0,
    code: Path | None = None,
    lm_scale: float = 1.0,
    **extra,
) -> Path:
    """A tiny TPULlamaForCausalLM checkpoint in `directory`; `expand` None writes one without expanded ids."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["TPULlamaForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tpu_llama.TPULlamaConfig",
                     "AutoModelForCausalLM": "modelling_tpu_llama.TPULlamaForCausalLM"},  # fmt: skip
        "model_type": "tpu_llama",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_act": "silu",
        "max_position_embeddings": max_context, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": None, "bos_token_id": bos, "eos_token_id": eos, "pretraining_tp": 1,
        "tie_word_embeddings": tie, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32} if llama3_rope else None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": head_dim,
        "add_qk_norm": False, "skip_out_norm": False,
        "expand_input_ids": expand is not None, "expand_input_ids_maxlen": maxlen if expand is not None else None,
        "expand_input_ids_vocab_size": expand_size if expand is not None else None,
        "expand_input_ids_dict": expand, "torch_dtype": "float64", "transformers_version": "4.48.3",
    }  # fmt: skip
    config.update(extra)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def norm():
        return 1.0 + rnd(hidden, scale=0.1)

    w = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": norm()}
    if expand is not None:
        w["model.expand_embed_tokens.weight"] = rnd(expand_size, hidden)
    q, kv, inter = heads * head_dim, kv_heads * head_dim, 2 * hidden
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(q, hidden), p + "self_attn.k_proj.weight": rnd(kv, hidden),
              p + "self_attn.v_proj.weight": rnd(kv, hidden), p + "self_attn.o_proj.weight": rnd(hidden, q),
              p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
              p + "mlp.down_proj.weight": rnd(hidden, inter), p + "input_layernorm.weight": norm(),
              p + "post_attention_layernorm.weight": norm()}  # fmt: skip
    if not tie:
        w["lm_head.weight"] = rnd(vocab, hidden) * lm_scale
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"), metadata={"format": "pt"}
    )
    if code is not None:
        for f in CODE_FILES:
            shutil.copy(code / f, d / f)
    return d


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def tokenkit_model(directory: Path):
    """The checkpoint through tokenkit's own code (trust_remote_code), float64, sdpa; skips under transformers 5."""
    import pytest

    if transformers_major() >= 5:
        pytest.skip("tokenkit's code imports only under transformers 4.x (make test-compat runs this test)")
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, torch_dtype=torch.float64, attn_implementation="sdpa",
        output_loading_info=True,
    )  # fmt: skip
    assert type(model).__name__ == "TPULlamaForCausalLM"
    assert not any(info.values()), f"tokenkit's code and the fixture disagree on weight names: {info}"
    return model.eval()


#: Llama-3's special tokens in its order (ids 128000..128255 there; 256.. after the 256 bytes here)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", *[f"<|reserved_special_token_{i}|>" for i in range(3, 248)],
]  # fmt: skip
#: Llama-3-Instruct's chat template (the 8B model's; 3.2's adds tool and date blocks around the same turns)
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_byte_tokenizer():
    """A byte-converted Llama-3 tokenizer built with `tokenizers`: the 256 bytes as tokens (ByteLevel
    characters, no merges), then Llama-3's 256 specials (vocab 512), its chat template, eos <|eot_id|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtpc.tokenizer import byte_to_char

    chars = byte_to_char()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>", chat_template=LLAMA3_CHAT_TEMPLATE,
    )  # fmt: skip
