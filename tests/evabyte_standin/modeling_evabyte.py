"""Stand-in for EvaByte's remote modelling code, with the module layout mtpc's adapter relies on.

What it mirrors (learned from the published layout, no code taken): `EvaByteForCausalLM` with
`.model` (`EvaByteModel`: embed_tokens, layers, norm; forward(input_ids / inputs_embeds,
attention_mask, position_ids, past_key_values, use_cache, multibyte_decoding) -> dict with
`last_hidden_state`) and `.lm_head` (d -> num_pred_heads * vocab; head 0 is the next byte);
`multi_byte_pred_update_cache(cache, retrieve_indices, best_candidate, new_tokens)` that commits
the chosen tokens of a multi-byte step and `_multi_byte_pred_update_cache_when_prefil_len_eq_window_size`;
a static cache (`EvaStaticCacheForTriton`, imported from `.eva_cache` as EvaByte does); and the
attention pattern of EVA: exact attention inside the current window of `window_size` bytes, plus
one summary per `chunk_size` chunk of every earlier window (EVA's RFA chunks; here the chunk means,
so full recompute and cached decoding agree exactly). In a multi-byte step the new keys are
written after the window without moving its position; the mask (True = attend) covers
[chunk summaries | window | new tokens]. Not EVA's maths, no Triton.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .eva_cache import EvaStaticCacheForTriton  # noqa: F401  (the adapter finds it here, as in EvaByte)


class EvaByteConfig(PretrainedConfig):
    model_type = "evabyte"

    def __init__(
        self,
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_pred_heads=8,
        window_size=8,
        chunk_size=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        **kw,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_pred_heads = num_pred_heads
        self.window_size = window_size
        self.chunk_size = chunk_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        kw.setdefault("tie_word_embeddings", False)  # 8 x 320 lm_head rows; transformers 4.x ties by default
        super().__init__(**kw)


def _chunk_means(x, chunk):  # (B, H, S, hd) -> (B, H, S // chunk, hd)
    B, H, S, hd = x.shape
    return x[..., : S // chunk * chunk, :].reshape(B, H, S // chunk, chunk, hd).mean(-2)


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class EvaRMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class EvaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.window_size = config.window_size
        self.chunk_size = config.chunk_size
        d = config.hidden_size
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def _full(self, q, k, v):
        """Whole sequence from position 0: own window exactly + chunk summaries of earlier windows."""
        T, W, C = q.shape[-2], self.window_size, self.chunk_size
        ks, vs = _chunk_means(k, C), _chunk_means(v, C)
        p = torch.arange(T, device=q.device)
        chunk_win = torch.arange(ks.shape[-2], device=q.device) * C // W
        allow = torch.cat([chunk_win[None, :] < (p // W)[:, None], ((p // W)[:, None] == (p // W)[None, :]) & (p[None, :] <= p[:, None])], 1)
        return self._attend(q, torch.cat([ks, k], -2), torch.cat([vs, v], -2), allow[None, None])

    def _attend(self, q, k, v, allow):
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        return scores.masked_fill(~allow, float("-inf")).softmax(-1) @ v

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cos=None, sin=None, multibyte_decoding=False):
        B, T, _ = hidden_states.shape
        shape = (B, T, self.num_heads, self.head_dim)
        q = _rotate(self.q_proj(hidden_states).view(shape).transpose(1, 2), cos, sin)
        k = _rotate(self.k_proj(hidden_states).view(shape).transpose(1, 2), cos, sin)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cache, i, W = past_key_value, self.layer_idx, self.window_size
        if cache is None or not multibyte_decoding:
            if cache is not None and cache.seen[i] != 0:
                raise NotImplementedError("stand-in: incremental calls must use multibyte_decoding=True")
            out = self._full(q, k, v)
            if cache is not None:  # prefill: finished windows -> summaries, the last one stays in the window
                full = max(0, math.ceil(T / W) - 1)
                if full:
                    cache.update_chunk_rfas(_chunk_means(k[..., : full * W, :], self.chunk_size),
                                            _chunk_means(v[..., : full * W, :], self.chunk_size), i)
                rest = T - full * W
                cache.past_window_k[i][..., :rest, :] = k[..., full * W :, :]
                cache.past_window_v[i][..., :rest, :] = v[..., full * W :, :]
                cache.past_window_pos[i] = rest
                cache.update_past_len(T, i)
        else:
            w = cache.past_window_pos[i]
            cache.past_window_k[i][..., w : w + T, :] = k
            cache.past_window_v[i][..., w : w + T, :] = v
            keys = torch.cat([cache.rfa_k[i], cache.past_window_k[i][..., : w + T, :]], -2)
            vals = torch.cat([cache.rfa_v[i], cache.past_window_v[i][..., : w + T, :]], -2)
            if attention_mask.shape[-1] != keys.shape[-2]:
                raise ValueError(f"stand-in: mask covers {attention_mask.shape[-1]} keys, cache has {keys.shape[-2]}")
            out = self._attend(q, keys, vals, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None, cache


class EvaByteDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        d = config.hidden_size
        self.self_attn = EvaAttention(config, layer_idx)
        self.input_layernorm = EvaRMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = EvaRMSNorm(d, config.rms_norm_eps)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)

    def forward(self, hidden_states, **kw):
        a, _, cache = self.self_attn(self.input_layernorm(hidden_states), **kw)
        h = hidden_states + a
        x = self.post_attention_layernorm(h)
        return (h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)),)


class EvaBytePreTrainedModel(PreTrainedModel):
    config_class = EvaByteConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.2)


class EvaByteModel(EvaBytePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(EvaByteDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = EvaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, multibyte_decoding=False, **kw):
        h = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        if position_ids is None:
            start = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(start, start + h.shape[1], device=h.device)[None]
        hd = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, hd, 2, device=h.device, dtype=torch.float64) / hd)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq  # (B, T, hd/2)
        emb = torch.cat([freqs, freqs], -1)[:, None].to(h.dtype)  # (B, 1, T, hd)
        for layer in self.layers:
            (h,) = layer(h, attention_mask=attention_mask, position_ids=position_ids, past_key_value=past_key_values,
                         use_cache=use_cache, cos=emb.cos(), sin=emb.sin(), multibyte_decoding=multibyte_decoding)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=past_key_values)


class EvaByteForCausalLM(EvaBytePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = EvaByteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.num_pred_heads * config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, **kw):
        h = self.model(input_ids=input_ids, **kw)["last_hidden_state"]
        logits = self.lm_head(h).unflatten(-1, (self.config.num_pred_heads, self.config.vocab_size))
        return CausalLMOutputWithPast(logits=logits[..., 0, :])

    def _dump(self, cache, i, k, v):
        chunk = self.model.layers[i].self_attn.chunk_size
        cache.update_chunk_rfas(_chunk_means(k, chunk), _chunk_means(v, chunk), i)

    def multi_byte_pred_update_cache(self, past_key_values, retrieve_indices, best_candidate, new_tokens):
        cache, W = past_key_values, self.config.window_size
        prev = cache.get_past_window_pos(0)
        sel = retrieve_indices[best_candidate, :new_tokens] + prev
        for i in range(self.config.num_hidden_layers):
            cache.update_past_len(new_tokens, i)
            k, v = cache.past_window_k[i], cache.past_window_v[i]
            k[..., prev : prev + new_tokens, :] = k[..., sel, :].clone()
            v[..., prev : prev + new_tokens, :] = v[..., sel, :].clone()
            end = prev + new_tokens
            if end >= W:
                self._dump(cache, i, k[..., :W, :].clone(), v[..., :W, :].clone())
                k[..., : end - W, :] = k[..., W:end, :].clone()
                v[..., : end - W, :] = v[..., W:end, :].clone()
                cache.past_window_pos[i] = end - W
            else:
                cache.past_window_pos[i] = end
        return cache

    def _multi_byte_pred_update_cache_when_prefil_len_eq_window_size(self, past_key_values):
        cache, W = past_key_values, self.config.window_size
        for i in range(self.config.num_hidden_layers):
            if cache.past_window_pos[i] == W:
                self._dump(cache, i, cache.past_window_k[i][..., :W, :].clone(), cache.past_window_v[i][..., :W, :].clone())
                cache.past_window_pos[i] = 0
        return cache
