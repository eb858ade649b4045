"""Stand-in for EvaByte's `EvaStaticCacheForTriton`: a static window of exact keys/values per layer
plus the chunk summaries of every finished window (EVA's RFA chunks; here: the chunk means).

Same constructor and the methods EvaByte's multi-byte routines call; no Triton.
"""

import torch


class EvaStaticCacheForTriton:
    def __init__(self, batch_size, num_heads, window_size, head_dim, num_layers, dtype, device):
        shape = (batch_size, num_heads, window_size, head_dim)
        self.past_window_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.past_window_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.past_window_pos = [0] * num_layers
        empty = (batch_size, num_heads, 0, head_dim)
        self.rfa_k = [torch.zeros(empty, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rfa_v = [torch.zeros(empty, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seen = [0] * num_layers

    def get_seq_length(self, layer_idx=0):
        return self.seen[layer_idx]

    def get_past_window_pos(self, layer_idx):
        return self.past_window_pos[layer_idx]

    def update_past_len(self, n, layer_idx):
        self.seen[layer_idx] += n

    def update_chunk_rfas(self, rfa_k, rfa_v, layer_idx):
        self.rfa_k[layer_idx] = torch.cat([self.rfa_k[layer_idx], rfa_k], dim=-2)
        self.rfa_v[layer_idx] = torch.cat([self.rfa_v[layer_idx], rfa_v], dim=-2)
        return self.rfa_k[layer_idx], self.rfa_v[layer_idx]
