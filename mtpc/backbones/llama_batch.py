"""Several sequences at once on the compact Llama forward: the verifier alone, for plain decoding.

`LlamaBatchEngine` reuses a verifier-only `LlamaEngine`'s weights and products (its layout, its
`_group`). Rows come in groups of consecutive rows (`prefill(..., groups=sizes)`; default one
group); each group keeps its own caches of shape (B_g, h_kv, C_g, hd), its prompts left-aligned to
the group's longest, P_g. Each prompt is prefilled alone by the batch-1 forward (the same products
as batch-1 decoding, no padded queries) and its keys and values are copied to its row's slots
[pad_b, P_g); its RoPE positions are slot - pad_b (so every row sees the positions batch-1 decoding
gives it) and an additive mask hides the padding slots from every query. Each `step` appends one
byte per row: the products (q k v, o, the MLP, the unembedding) run over all rows at once, the
attention per group over that group's slots only. So prompts of very different lengths share the
products without attending over each other's padding: on the CPU the products want many rows (each
step reads every weight once), the attention reads every row's keys and values once a byte. Rows
never interact; a finished row simply keeps decoding (the caller ignores it).

tokenkit's byte Llama (`expand_embed_tokens`): each row keeps its own expanded-id state, as the
batch-1 engine does for its one sequence, and every step adds the embedding of each row's
expanded id.

Greedy decoding at batch B equals batch-1 plain decoding in float64 (tests/mtpc/test_llama_batch.py);
in float32 a B-row product rounds differently from a 1-row one, so near-ties may go the other way.
Leaves out: the draft top (speculative decoding stays batch 1), CUDA graphs, torch.compile, EvaByte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from mtpc.backbones.common import Backbone
from mtpc.backbones.llama import LlamaEngine, apply_rope, rms_norm, rope_table, signed_sin


@dataclass
class _Group:
    """Rows [lo, hi) of the batch: their caches, left padding and key mask."""

    lo: int
    hi: int
    kv: list[tuple[Tensor, Tensor]]  # per layer (B_g, h_kv, C_g, hd)
    key_add: Tensor  # (B_g, C_g) additive: 0 on real slots, -inf on padding
    padded: bool  # any row shorter than the group's longest (else no mask is needed)
    length: int  # slots written so far (the same for every row of the group)


class LlamaBatchEngine:
    """B sequences of the verifier on the compact Llama forward (see the module docstring).

    adapter: a `BackboneAdapter` the compact forward implements; weights: the layout as for
    `LlamaEngine` (None: its default)."""

    def __init__(self, adapter: Backbone, weights: str | None = None):
        self.eng = LlamaEngine(adapter, 0, draft=False, static=False, weights=weights)
        self.args = self.eng.args
        self.device, self.dtype = self.eng.device, self.eng.dtype
        self.rows = 0
        self.groups: list[_Group] = []
        self._expand: list[Any] | None = None  # per row: tokenkit's expanded-id state

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of keys and values one cache slot holds over all layers (a batch's memory: rows x slots x this)."""
        a = self.args
        return 2 * a.n_layers * a.n_kv_heads * a.head_dim * self.eng.embed.element_size()

    @torch.inference_mode()
    def prefill(self, prompts: list[Tensor], new_tokens: int, groups: list[int] | None = None) -> Tensor:
        """Start B sequences (caches for new_tokens more bytes each) in groups of consecutive rows
        (sizes summing to B; default one group); -> p logits (B, v) for each row's next byte."""
        if not prompts:
            raise ValueError("prompts: need at least one")
        groups = [len(prompts)] if groups is None else list(groups)
        if any(g < 1 for g in groups) or sum(groups) != len(prompts):
            raise ValueError(f"groups: sizes >= 1 summing to the {len(prompts)} prompts, got {groups}")
        a = self.args
        longest = max(p.shape[0] for p in prompts)
        if longest + new_tokens > a.max_context:
            raise ValueError(
                f"prompt ({longest}) + new_tokens ({new_tokens}) exceeds max_context={a.max_context}"
            )
        kw = {"device": self.device, "dtype": self.dtype}
        self.rows = len(prompts)
        self.groups, lo = [], 0
        for size in groups:
            rows = prompts[lo : lo + size]
            P = max(p.shape[0] for p in rows)
            cap = P + new_tokens
            pad = torch.tensor([P - p.shape[0] for p in rows], device=self.device)
            ok = torch.arange(cap, device=self.device)[None, :] >= pad[:, None]  # (B_g, C_g) real slots
            kv = [(torch.zeros(size, a.n_kv_heads, cap, a.head_dim, **kw), torch.zeros(size, a.n_kv_heads, cap, a.head_dim, **kw))
                  for _ in range(a.n_layers)]  # fmt: skip
            key_add = torch.where(ok, self.eng._mask_values[0], self.eng._mask_values[1])
            self.groups.append(_Group(lo, lo + size, kv, key_add, bool(pad.any()), P))
            lo += size
        self.cos, sin = rope_table(a, longest + new_tokens, self.device, self.dtype)  # (C, hd)
        self.sin = signed_sin(sin)
        self._pos = torch.tensor(
            [p.shape[0] for p in prompts], device=self.device
        )  # each row's next RoPE position
        # Each prompt runs alone through the batch-1 forward (causal, its own length: no padded
        # queries, no (B, T, S) mask) and its keys and values land in its row at slots [pad_b, P_g).
        logits, hidden = [], []
        self._expand = [] if self.eng.expand is not None else None
        for g in self.groups:
            for r, p in enumerate(prompts[g.lo : g.hi]):
                self.eng.reset(p.shape[0])
                out = self.eng.feed(p.to(self.device))
                for (kc, vc), (k1, v1) in zip(g.kv, self.eng.kv, strict=True):
                    kc[r, :, g.length - p.shape[0] : g.length] = k1[0, :, : p.shape[0]]
                    vc[r, :, g.length - p.shape[0] : g.length] = v1[0, :, : p.shape[0]]
                logits.append(out.p_logits[-1])
                hidden.append(out.draft_hidden[-1])
                if self._expand is not None:
                    self._expand.append(self.eng._expand_state)  # reset makes a fresh one per prompt
        self.hidden = torch.stack(hidden)[
            :, None
        ]  # (B, 1, d): each row's final state at its last prompt byte
        return torch.stack(logits)

    @torch.inference_mode()
    def step(self, ids: Tensor) -> Tensor:
        """Append one byte per row, ids (B,); -> p logits (B, v) for the next."""
        return self._forward(ids.view(self.rows, 1))[:, -1]

    def _forward(self, ids: Tensor) -> Tensor:  # ids (B, 1) -> logits (B, 1, v)
        e, a = self.eng, self.args
        B = ids.shape[0]
        cos, sin = self.cos[self._pos][:, None, None], self.sin[self._pos][:, None, None]  # (B, 1, 1, hd)
        x = F.embedding(ids, e.embed)  # (B, 1, d)
        if self._expand is not None:
            eids = [st.feed([t])[0] for st, t in zip(self._expand, ids[:, 0].tolist(), strict=True)]
            x = x + F.embedding(torch.tensor(eids, device=self.device).view(B, 1), e.expand.weight)
        for i, layer in enumerate(e.layers):
            h = rms_norm(x, layer.ln1, a.norm_eps)
            q, k, v = e._group(h, layer, "qkv")
            # (B, 1, h hd) is the grouped layout (B, h_kv, n_rep, hd) already: a view, no key copies
            q = q.view(B, a.n_kv_heads, e.n_rep, a.head_dim)
            k, v = (t.view(B, a.n_kv_heads, 1, a.head_dim) for t in (k, v))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            ys = []
            for g in self.groups:
                kc, vc = g.kv[i]
                end = g.length + 1
                kc[:, :, g.length : end] = k[g.lo : g.hi]
                vc[:, :, g.length : end] = v[g.lo : g.hi]
                mask = (
                    g.key_add[:, None, None, :end] if g.padded else None
                )  # (B_g, 1, 1, S): over the n_rep queries
                ys.append(F.scaled_dot_product_attention(q[g.lo : g.hi], kc[:, :, :end], vc[:, :, :end], attn_mask=mask,
                                                         scale=e.scale))  # fmt: skip
            y = ys[0] if len(ys) == 1 else torch.cat(ys)
            (o,) = e._group(y.reshape(B, 1, a.n_heads * a.head_dim), layer, "o")
            x = x + o
            h = rms_norm(x, layer.ln2, a.norm_eps)
            g_, u = e._group(h, layer, "gu")
            (down,) = e._group(F.silu(g_) * u, layer, "down")
            x = x + down
        for g in self.groups:
            g.length += 1
        self._pos += 1
        h = rms_norm(x, e.norm, a.norm_eps)
        self.hidden = h  # (B, 1, d): the final normed state (the draft top's input when k = 0)
        return e._mm(h, e.lm_head_packed) if e.lm_head_packed is not None else F.linear(h, e.lm_head)
