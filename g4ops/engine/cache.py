"""The decoder's KV cache (`GraphKVCache`): fixed buffers whose writes take the position from a device tensor, so a
step replayed from a CUDA graph writes the right slot.

Full-attention layers keep `max_length` slots (slot = position); sliding layers keep a ring of `sliding_window` slots
(slot = position mod window), which holds exactly the keys a query may see (p - window < key <= p). The masks over
the slots are built on the device from the same position. KV-shared layers read their producer's buffers through
transformers' `shared_kv_states`, as in stock. Positions count cache slots, left padding included, as transformers'
static cache does; padding slots are masked.
"""

from __future__ import annotations

import torch

from ..models import FULL, SLIDING


def text_attentions(model) -> list:
    """The model's Gemma-4 text attention modules (what the cache holds K/V for and the step switches)."""
    return [m for m in model.modules() if hasattr(m, "is_kv_shared_layer") and hasattr(m, "k_proj")]


class GraphKVCache:
    """The KV cache of one decoder: per KV-owning layer, K and V buffers [B, kv_heads, slots, head_dim]."""

    def __init__(self, model, batch: int, max_length: int, position: torch.Tensor):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        param = next(model.parameters())
        self.max_length = max_length
        self.sliding_window = config.sliding_window
        self.window = min(self.sliding_window, max_length)
        self.position = position  # [1] int64, the position of the token being decoded (shared with the decoder)
        self.pad = torch.zeros(batch, 1, dtype=torch.long, device=param.device)  # left-padding slots per row
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._slots: dict[int, int] = {}
        # shapes from the attention modules themselves (per-layer head dims differ between config versions)
        for attn in text_attentions(model):
            if attn.is_kv_shared_layer:
                continue
            i = attn.layer_idx
            slots = max_length if config.layer_types[i] == FULL else self.window
            shape = (batch, attn.k_proj.out_features // attn.head_dim, slots, attn.head_dim)
            self.keys[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self.values[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self._slots[i] = slots
        if not self.keys:
            raise TypeError(f"GraphKVCache: no Gemma-4 attention layers found in {type(model).__name__}")

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks only when no position_ids are given
        raise RuntimeError("GraphKVCache: pass position_ids; the length lives on the device")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the chunk's K/V at its positions; return what the chunk attends over."""
        keys, values, slots = self.keys[layer_idx], self.values[layer_idx], self._slots[layer_idx]
        if tuple(keys.shape[-1:]) != tuple(key_states.shape[-1:]) or keys.shape[1] != key_states.shape[1]:
            raise ValueError(f"GraphKVCache: layer {layer_idx} got K/V {list(key_states.shape)} but holds "
                             f"{list(keys.shape)}; the model's config does not match the cache")  # fmt: skip
        n = key_states.shape[2]
        if n == 1:  # decode: one slot, then attend over the whole buffer under the decode mask
            slot = self.position if slots == self.max_length else torch.remainder(self.position, slots)
            keys.index_copy_(2, slot, key_states)
            values.index_copy_(2, slot, value_states)
            return keys, values
        # prefill from position 0 (not graphed): store the last `slots` tokens, attend over the chunk itself
        keep = min(n, slots)
        positions = torch.arange(n - keep, n, device=keys.device)
        keys.index_copy_(2, torch.remainder(positions, slots), key_states[:, :, n - keep :])
        values.index_copy_(2, torch.remainder(positions, slots), value_states[:, :, n - keep :])
        return key_states, value_states

    def decode_masks(self) -> dict[str, torch.Tensor]:
        """{layer type: bool mask [B, 1, 1, slots]} for the token at `self.position` (already written). Positions
        count cache slots, left padding included, as transformers' static cache does; padding slots are masked."""
        p = self.position
        dev = p.device
        full_pos = torch.arange(self.max_length, device=dev)[None, :]
        ring = torch.arange(self.window, device=dev)
        ring_pos = (p - torch.remainder(p - ring, self.window))[None, :]  # the position each ring slot holds
        return {
            FULL: ((full_pos <= p) & (full_pos >= self.pad))[:, None, None, :],
            SLIDING: (ring_pos >= self.pad)[:, None, None, :],
        }

    def prefill_masks(self, n: int) -> dict[str, torch.Tensor]:
        dev = self.pad.device
        q = torch.arange(n, device=dev)[None, :, None]
        k = torch.arange(n, device=dev)[None, None, :]
        real_key = k >= self.pad[:, :, None]  # [B, 1, n]
        # a padding query sees only itself: its output is never used, but it must stay finite (it becomes K/V)
        causal = ((k <= q) & real_key) | ((k == q) & (q < self.pad[:, :, None]))
        return {FULL: causal[:, None], SLIDING: (causal & (k > q - self.sliding_window))[:, None]}
