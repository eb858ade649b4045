"""Several sequences at once on the compact Llama forward: the verifier alone, for plain decoding.

`LlamaBatchEngine` reuses a verifier-only `LlamaEngine`'s weights and products (its layout, its
`_group`) and keeps its own caches of shape (B, h_kv, C, hd). Prompts of different lengths are
left-aligned to a common length P: each prompt is prefilled alone by the batch-1 forward (the
same products as batch-1 decoding, no padded queries) and its keys and values are copied to its
row's cache slots [pad_b, P); its RoPE positions are slot - pad_b (so every row sees the positions
batch-1 decoding gives it) and an additive mask hides the padding slots from every query. Each
`step` appends one byte per row at the same slot: the batched part. Rows never interact; a
finished row simply keeps decoding (the caller ignores it).

Greedy decoding at batch B equals batch-1 plain decoding in float64 (tests/mtpc/test_llama_batch.py);
in float32 a B-row product rounds differently from a 1-row one, so near-ties may go the other way.
Leaves out: the draft top (speculative decoding stays batch 1), CUDA graphs, torch.compile, EvaByte.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from mtpc.backbones.llama import LlamaEngine, apply_rope, rms_norm, rope_table, signed_sin


class LlamaBatchEngine:
    """B sequences of the verifier on the compact Llama forward (see the module docstring).

    adapter: a `BackboneAdapter` the compact forward implements; weights: the layout as for
    `LlamaEngine` (None: its default)."""

    def __init__(self, adapter: Any, weights: str | None = None):
        self.eng = LlamaEngine(adapter, 0, draft=False, static=False, weights=weights)
        self.args = self.eng.args
        self.device, self.dtype = self.eng.device, self.eng.dtype
        self.rows = 0
        self.length = 0

    @torch.inference_mode()
    def prefill(self, prompts: list[Tensor], new_tokens: int) -> Tensor:
        """Start B sequences (caches for new_tokens more bytes each); -> p logits (B, v) for each
        row's next byte."""
        if not prompts:
            raise ValueError("prompts: need at least one")
        a = self.args
        P = max(p.shape[0] for p in prompts)
        cap = P + new_tokens
        if cap > a.max_context:
            raise ValueError(f"prompt ({P}) + new_tokens ({new_tokens}) exceeds max_context={a.max_context}")
        B = len(prompts)
        kw = {"device": self.device, "dtype": self.dtype}
        self.kv = [
            (torch.zeros(B, a.n_kv_heads, cap, a.head_dim, **kw), torch.zeros(B, a.n_kv_heads, cap, a.head_dim, **kw))
            for _ in range(a.n_layers)
        ]  # fmt: skip
        self.pad = torch.tensor([P - p.shape[0] for p in prompts], device=self.device)  # (B,)
        self.rows, self.length = B, P
        slots = torch.arange(cap, device=self.device)
        self._key_ok = slots[None, :] >= self.pad[:, None]  # (B, C) real (not padding) slots
        self._key_add = torch.where(self._key_ok, self.eng._mask_values[0], self.eng._mask_values[1])  # additive
        self._slots = slots
        self.cos, sin = rope_table(a, P + new_tokens, self.device, self.dtype)  # (C, hd)
        self.sin = signed_sin(sin)
        # Each prompt runs alone through the batch-1 forward (causal, its own length: no padded
        # queries, no (B, T, S) mask) and its keys and values land in its row at slots [pad_b, P).
        logits, hidden = [], []
        for b, p in enumerate(prompts):
            self.eng.reset(p.shape[0])
            out = self.eng.feed(p.to(self.device))
            for (kc, vc), (k1, v1) in zip(self.kv, self.eng.kv, strict=True):
                kc[b, :, P - p.shape[0] : P] = k1[0, :, : p.shape[0]]
                vc[b, :, P - p.shape[0] : P] = v1[0, :, : p.shape[0]]
            logits.append(out.p_logits[-1])
            hidden.append(out.draft_hidden[-1])
        self.hidden = torch.stack(hidden)[:, None]  # (B, 1, d): each row's final state at its last prompt byte
        return torch.stack(logits)

    @torch.inference_mode()
    def step(self, ids: Tensor) -> Tensor:
        """Append one byte per row, ids (B,); -> p logits (B, v) for the next."""
        return self._forward(ids.view(self.rows, 1))[:, -1]

    def _forward(self, ids: Tensor) -> Tensor:  # ids (B, 1) -> logits (B, 1, v)
        e, a = self.eng, self.args
        B = ids.shape[0]
        start, end = self.length, self.length + 1
        pos = (self._slots[start] - self.pad).clamp_min(0)  # (B,) each row's RoPE position
        mask = self._key_add[:, None, None, :end]  # (B, 1, 1, S): the row's real keys, broadcast over its n_rep queries
        cos, sin = self.cos[pos][:, None, None], self.sin[pos][:, None, None]  # (B, 1, 1, hd)
        x = F.embedding(ids, e.embed)  # (B, 1, d)
        for layer, (kc, vc) in zip(e.layers, self.kv, strict=True):
            h = rms_norm(x, layer.ln1, a.norm_eps)
            q, k, v = e._group(h, layer, "qkv")
            # (B, 1, h hd) is the grouped layout (B, h_kv, n_rep, hd) already: a view, no key copies
            q = q.view(B, a.n_kv_heads, e.n_rep, a.head_dim)
            k, v = (t.view(B, a.n_kv_heads, 1, a.head_dim) for t in (k, v))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc[:, :, start:end] = k
            vc[:, :, start:end] = v
            y = F.scaled_dot_product_attention(q, kc[:, :, :end], vc[:, :, :end], attn_mask=mask, scale=e.scale)
            (o,) = e._group(y.reshape(B, 1, a.n_heads * a.head_dim), layer, "o")
            x = x + o
            h = rms_norm(x, layer.ln2, a.norm_eps)
            g, u = e._group(h, layer, "gu")
            (down,) = e._group(F.silu(g) * u, layer, "down")
            x = x + down
        self.length = end
        h = rms_norm(x, e.norm, a.norm_eps)
        self.hidden = h  # (B, 1, d): the final normed state (the draft top's input when k = 0)
        return e._mm(h, e.lm_head_packed) if e.lm_head_packed is not None else F.linear(h, e.lm_head)
