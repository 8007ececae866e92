"""The "g4ops" attention implementation, registered with transformers' AttentionInterface and
AttentionMaskInterface: which calls run `g4ops.attention` (exact, GEMM-chunked, any head_dim) or FlexAttention's
sliding band, and which keep stock SDPA, with what mask (the comment below). `enable()` registers it;
`enable(model, attention=True)` switches a model's Gemma-4 text attention from "sdpa" to it (`switch_model`).
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from .. import ops

# Attention: "g4ops", registered with transformers' attention interface (the flash-attention contract).
#
# The mask function returns None exactly when the mask would be the plain causal or sliding-window pattern over
# q_len == kv_len positions from 0 (no padding, no cache offset, no packed sequences, image blocks or bidirectional
# layers: transformers forbids the is_causal skip for those), so the attention receives mask None plus its
# `sliding_window`; full layers then run g4ops.attention, sliding layers FlexAttention (compiled CUDA) or stock sdpa
# with the pattern as a dense mask (cuDNN, faster than g4ops.attention there). Everything else gets stock sdpa's
# mask: on a call with queries = keys (padding, packed sequences) g4ops.attention runs with that mask on a full
# layer and FlexAttention on a sliding one (compiled CUDA, `MASKED_SLIDING_VIA_FLEX`; or g4ops.attention,
# `MASKED_SLIDING_VIA_G4OPS`), elsewhere stock sdpa attention. A None mask then always means "causal, queries
# bottom-right aligned". Stock sdpa may also skip its mask for a static-cache prefill (L < S, top-left aligned); we
# never let it for L > 1, because transformers 5.24 slices the queries of KV-shared layers to the last rows when the
# mask is None under any implementation not named "sdpa", and one alignment must be right for both.
#
# Padding and packing (tests/test_packing.py): whatever mask reaches stock sdpa from here has a visible key in every
# query row (`_open_empty_rows`), and those rows' outputs are 0, as CPU sdpa gives them and g4ops.attention does: a
# fully masked row (a left-pad query, or a pad run longer than the window) is reported NaN from CUDA sdpa (unsloth
# PR 9848: B200, torch 2.13), and a NaN there reaches real tokens through 0 * NaN in P @ V in the next layer
# (transformers issue 45201's NaN losses with padding at batch > 1).
# transformers builds the block-diagonal mask of packed sequences (position_ids that restart) only without a cache
# (masking_utils' _preprocess_mask_arguments): with one, e.g. a training forward under the config's use_cache=True,
# it hands over the plain pattern and sequences would see each other. In eager we read position_ids and add the
# sequence boundaries to the mask (`_packed_segments`). Under torch.compile that read is impossible: transformers
# then builds the packed mask whenever there is no cache (it cannot tell packed from plain positions while tracing),
# and a call that got no mask asserts on the device that its positions do not restart, so a compiled packed
# forward with a cache fails loudly (use_cache=False: what Trainer and TRL pass). A given attention_mask is trusted
# there, as transformers does (it detects packing only without one).

ATTENTION = "g4ops"
# Sliding layers of a compiled CUDA model run FlexAttention with a block-sparse band (g4ops.ops.attention's section on
# it); False keeps them on stock SDPA with the dense mask (benchmarks compare the two).
SLIDING_VIA_FLEX = True
# ... and so do those of a padded or packed batch, the band narrowed by its mask. Off: it passes its CPU tests
# (FlexAttention's eager forward, the traced graph), but compiled on CUDA under torch 2.11 it failed
# (attention.MASKED_FLEX_MIN_TORCH says how; there it stays off even when set). Its CUDA tests turn it on.
MASKED_SLIDING_VIA_FLEX = False
# ... or, G4OPS_MASKED_SLIDING=g4ops, on g4ops.attention with the window and the mask (any device, eager or compiled),
# where FlexAttention does not take them: its query blocks multiply only against the keys of their band, about
# L * (block + window) pairs where SDPA with the dense mask computes all L * L. Opt-in because it is slower where
# timed: a packed 2048-token LoRA step ran at 0.81x the default's speed (H100, compiled, 42 layers,
# bench/results/2026-12-06-h100-session41.md), cuDNN's dense-mask kernel beating the chunked one at head_dim 256.
# Not timed at 8192 tokens, where the dense mask computes a larger share of pairs outside the band.
MASKED_SLIDING_VIA_G4OPS = os.environ.get("G4OPS_MASKED_SLIDING") == "g4ops"
_switched_configs: list[weakref.ref] = []  # Gemma-4 text configs enable(model) moved from "sdpa" to "g4ops"


def _interfaces():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface


def _no_padding(attention_mask, kv_length: int) -> bool:
    if attention_mask is None:
        return True
    # Reading a mask's values is a host sync: stock sdpa does the same check in eager; under compile we never do.
    return (
        not torch.compiler.is_compiling()
        and attention_mask.shape[-1] == kv_length
        and bool(attention_mask.all())
    )


def g4ops_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip: bool = True,
    config=None,
    **kwargs,
):
    """AttentionMaskInterface entry: None for the pure causal/sliding pattern, else what stock sdpa builds."""
    from transformers.masking_utils import sdpa_mask

    pure = (
        allow_is_causal_skip
        and q_length == kv_length
        and isinstance(q_offset, int)
        and q_offset == 0
        and isinstance(kv_offset, int)
        and kv_offset == 0
        # a local size that is not this model's sliding window is another pattern (chunked attention)
        and local_size in (None, getattr(config, "sliding_window", None))
        and _no_padding(attention_mask, kv_length)
    )
    if pure:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip and q_length == 1,  # see the section comment
        config=config,
        **kwargs,
    )


def _pattern_mask(q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor:
    """[1, 1, L, S] bool: the causal (sliding) pattern with the queries at the last L positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen = seen & (k_pos > q_pos - window)
    return seen[None, None]


def _packed_segments(position_ids, q_len: int, kv_len: int, mask_given: bool):
    """[B or 1, L] index of the packed sequence each token belongs to when `position_ids` restart inside a row,
    else None, by transformers' rule (`find_packed_sequence_indices`: a new sequence wherever the position does not
    grow by 1). That reads the values, a host sync, so only in eager; under torch.compile a call without a mask
    asserts on the device that the positions do not restart (section comment)."""
    from transformers.masking_utils import find_packed_sequence_indices

    if (q_len != kv_len or q_len == 1 or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[-1] != q_len):  # fmt: skip
        return None
    if torch.compiler.is_compiling():
        if not mask_given:
            torch._assert_async((position_ids.diff(dim=-1) == 1).all(), _PACKED_UNDER_COMPILE)
        return None
    # every layer of a forward gets the same position_ids tensor: read it (a host sync) once, not once per layer.
    # The cache holds the tensor itself, so `is` cannot match a new tensor at a reused address.
    cached, version, segments = _last_segments
    if cached is position_ids and version == position_ids._version:
        return segments
    segments = find_packed_sequence_indices(position_ids)
    _last_segments[:] = [position_ids, position_ids._version, segments]
    return segments


_last_segments: list = [None, None, None]  # [position_ids, its _version, its segments]


_PACKED_UNDER_COMPILE = (
    "g4ops attention: position_ids restart inside a row (packed sequences), but transformers built no packed mask, "
    "which it skips when a cache is passed; under torch.compile g4ops cannot add it. Call the model with "
    "use_cache=False (Trainer and TRL do), or run it eagerly"
)


def _with_segments(mask: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """`mask` ([B or 1, 1 or H, L, L], bool or additive) with keys of other packed sequences hidden."""
    same = (segments[:, :, None] == segments[:, None, :])[:, None].to(mask.device)
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


def _open_empty_rows(mask):
    """(mask, rows): a bool mask whose query rows without a visible key see every key instead, so no kernel
    computes a softmax over nothing, and `rows` ([B or 1, H or 1, L] bool, the rows that had a key) to zero the
    others' outputs with. Additive masks and None pass through (rows None)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return mask, None
    rows = mask.any(-1)
    return mask | ~rows[..., None], rows


def g4ops_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """AttentionInterface entry: query [B, Hq, L, D], key/value [B, Hkv, S, D] -> ([B, L, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..ops.attention import attention, flex_sliding_usable, masked_flex_supported, sliding_window_attention

    def stock(mask, every_row_sees_a_key: bool = False):
        mask, rows = (mask, None) if every_row_sees_a_key else _open_empty_rows(mask)
        out, weights = sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
            is_causal=is_causal, **kwargs,
        )
        if rows is not None:  # out [B, L, H, D]; rows [B or 1, H or 1, L]
            out = torch.where(rows.transpose(1, 2)[..., None], out, 0)
        return out, weights

    if torch.is_autocast_enabled(query.device.type):
        # Under autocast (Trainer's bf16=True) RoPE leaves q and k in fp32 beside a bf16 v. SDPA is on autocast's
        # lower-precision list, so stock runs all three in the autocast dtype: cast them so here, for every path below
        # (g4ops.attention needs one dtype; it raised a TypeError on unmasked calls before).
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (ops.to_autocast_dtype(t, dtype) for t in (query, key, value))
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    position_ids = kwargs.get("position_ids") if causal else None
    plain = dropout == 0.0 and not kwargs.get("output_attentions") and all(
        kwargs.get(name) is None for name in ("softcap", "position_bias")
    )
    # A training-shaped call (queries = keys, from position 0) with padding or packed sequences: on a full layer
    # g4ops.attention with the mask, where stock's head_dim-512 SDPA is its slow mem-efficient kernel; on a sliding
    # layer longer than the window (as without a mask, below) FlexAttention with the mask inside the band where it is
    # usable and turned on (MASKED_SLIDING_VIA_FLEX), else g4ops.attention with the window and the mask where that
    # is turned on (MASKED_SLIDING_VIA_G4OPS), where SDPA computes every pair of the dense mask. Only for
    # causal-only masks: transformers' masks narrow the causal (sliding) pattern unless a config asks for
    # bidirectional (vision) blocks, which neither would compute (they see no key past a query).
    # Mixed dtypes (not from autocast, cast above) stay on stock SDPA.
    bidirectional = getattr(getattr(module, "config", None), "use_bidirectional_attention", None) is not None
    training_masked = (plain and causal and q_len == kv_len and query.dtype == key.dtype == value.dtype
                       and not bidirectional)  # fmt: skip

    def masked(mask, every_row_sees_a_key: bool = False):
        if (training_masked and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
                and mask.shape[0] in (1, query.shape[0]) and mask.shape[2:] == (q_len, kv_len)):  # fmt: skip
            if sliding_window is None:
                return attention(query, key, value, scale=scaling, mask=mask).transpose(1, 2).contiguous(), None
            if (SLIDING_VIA_FLEX and MASKED_SLIDING_VIA_FLEX and q_len > sliding_window
                    and flex_sliding_usable(query) and masked_flex_supported()):  # fmt: skip
                out = sliding_window_attention(query, key, value, scaling, sliding_window, mask=mask)
                return out.transpose(1, 2).contiguous(), None
            if MASKED_SLIDING_VIA_G4OPS:
                out = attention(query, key, value, scale=scaling, window=sliding_window, mask=mask)
                return out.transpose(1, 2).contiguous(), None
        return stock(mask, every_row_sees_a_key)

    segments = _packed_segments(position_ids, q_len, kv_len, attention_mask is not None)
    if segments is not None:  # packed sequences, with or without transformers' packed mask (section comment)
        if attention_mask is None:  # each query sees itself: the diagonal is in the pattern and its sequence
            pattern = _pattern_mask(q_len, kv_len, sliding_window, query.device)
            return masked(_with_segments(pattern, segments), every_row_sees_a_key=True)
        return masked(_with_segments(attention_mask, segments))
    if attention_mask is not None:
        return masked(attention_mask)  # stock's mask: padding, packing (compiled), a cache
    if not causal or q_len > kv_len:
        return stock(None)  # stock's meaning of no mask
    if q_len == 1 and (sliding_window is None or kv_len <= sliding_window):
        return stock(None)  # a decode step that sees every key: stock's fast path, same result
    if not plain:
        return stock(_pattern_mask(q_len, kv_len, sliding_window, query.device), every_row_sees_a_key=True)
    if sliding_window is not None:
        if SLIDING_VIA_FLEX and q_len > sliding_window and flex_sliding_usable(query):
            out = sliding_window_attention(query, key, value, scaling, sliding_window)
            return out.transpose(1, 2).contiguous(), None
        # eager, CPU, or shorter than the window: on the H200 cuDNN with the dense window mask beat the chunked path
        # 2x to 5x (2026-11-29)
        return stock(_pattern_mask(q_len, kv_len, sliding_window, query.device), every_row_sees_a_key=True)
    out = attention(query, key, value, scale=scaling, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def register() -> bool:
    """Register "g4ops" with both interfaces; True when this call did it."""
    attn, mask = _interfaces()
    if attn._global_mapping.get(ATTENTION) is g4ops_attention_forward:
        return False
    attn.register(ATTENTION, g4ops_attention_forward)
    mask.register(ATTENTION, g4ops_mask)
    return True


def unregister() -> None:
    attn, mask = _interfaces()
    for interface, fn in ((attn, g4ops_attention_forward), (mask, g4ops_mask)):
        if interface._global_mapping.get(ATTENTION) is fn:
            del interface._global_mapping[ATTENTION]


def switch_model(model: nn.Module, hf) -> list:
    """Move the Gemma-4 text configs of `model` that use "sdpa" to "g4ops" (eager/flash/flex choices are kept)."""
    switched = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(module, hf.Gemma4TextAttention) and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = ATTENTION
            _switched_configs.append(weakref.ref(config))
            switched.append(config)
    return switched


def restore_config(config) -> None:
    for i, ref in enumerate(_switched_configs):  # by identity: weakref == would call the config's __eq__
        if ref() is config:
            config._attn_implementation = "sdpa"
            del _switched_configs[i]
            return


def restore_all() -> None:
    """Every config `switch_model` moved goes back to "sdpa" (disable())."""
    for ref in _switched_configs:
        config = ref()
        if config is not None:
            config._attn_implementation = "sdpa"
    _switched_configs.clear()
