"""Exact causal (optionally sliding-window) attention for training and prefill, as batched GEMMs over query chunks.

Why: Gemma-4's full-attention layers have head_dim 512, which PyTorch's flash and cuDNN SDPA kernels do not take, so
SDPA falls back to the mem-efficient kernel, whose backward is slow (H200, 2048 tokens: ~8 ms per full layer against
~0.45 ms for a head_dim-256 sliding layer on cuDNN). And the sliding layers get a dense [L, L] mask from
transformers, so they cost O(L^2) although only a 512-token window is visible. Here each query chunk multiplies only
against the keys it can see (causal: up to the chunk's last row; sliding: the window), so sliding layers cost
O(L * window), and the GEMMs run on cuBLAS at any head_dim.

Measured on the H200 (bench/results/2026-11-29-h200-attention.md, -session3-decode.md), fwd+bwd at 2048 tokens,
bf16: on a full layer under torch.compile 2.30 vs 7.20 ms for stock, with a smaller error vs fp64 than stock's
(dq 1.66e-3 vs 6.33e-3: stock's MATH backend rounds its fp32 result, P included, before the backward GEMMs); in
eager 0.80x stock (8.42 vs 6.72 ms). Sliding layers: this path is slower than cuDNN there, so
`g4ops.enable(model, attention=True)` runs those on FlexAttention when compiled on CUDA (`sliding_window_attention`
below: 0.91 vs cuDNN's 1.02 ms, bench/results/2026-11-29-h200-session4-train42.md), else on stock. A first version
rounded P and dS to bf16 for their GEMMs and took the backward's rowsum(dO * O) from the bf16 output, and was up to
1.25x stock's error; both are fixed below.

Semantics (what `attention` returns is softmax(scale * q k^T + mask) v, per query head):
- query [B, Hq, L, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv], L <= S; query head h reads kv head h // (Hq / Hkv)
  (transformers' `repeat_kv` order), and the kv gradients are summed over the heads that share them.
- Queries are the last L positions (bottom-right aligned: query i sits at position S - L + i; L == S in training).
  Query position p sees key position k when k <= p, and with a sliding window also k > p - window (transformers'
  `sliding_window_overlay`: `kv_idx > q_idx - sliding_window`).
- `mask` (optional, bool, [B or 1, 1, L, S]: transformers' padding or packed-sequence mask): a key is visible only
  where the mask is also True. It narrows the pattern above and never widens it (keys past a query's position are
  not computed). A query row that sees no key (a left-pad query) gets output 0 and passes no gradient, as
  `g4ops.hf.attention_interface` makes stock SDPA give such rows.
- Numerics: scores, the softmax and its statistics in fp32 (fp64 for fp64 inputs); every GEMM accumulates in fp32
  and the outputs and gradients are rounded once to the input dtype. bf16/fp16: the GEMMs take bf16/fp16 operands
  (tensor cores on CUDA; elsewhere the same exact products and fp32 sums on upcast operands), and the fp32 P and dS
  enter their GEMMs as a hi + lo pair of that dtype (`_parts`), not rounded to it as flash and the mem-efficient
  kernel do. The backward's rowsum(dO * O) is taken as rowsum(P * dP) in fp32, not from the rounded output.
- Memory: forward saves only q, k, v and the fp32 row logsumexp; backward recomputes P chunk by chunk. The
  transient per chunk is a [B, Hq, chunk, visible keys] fp32 score block.

Forward and backward are plain ATen ops in a Python loop over chunks that depends only on shapes. With a gradient
to compute, `attention` calls the registered op `g4ops::attention`, whose Autograd kernel is a
`torch.autograd.Function` of them: torch.compile sees one op (an autograd.Function in the graph would make PyTorch's
AOTAutograd cache refuse to store the compiled step), and AOTAutograd traces both loops into ATen ops, which Inductor
fuses around the GEMMs. Without a gradient the forward loop is traced directly.
"""

from __future__ import annotations

import warnings

import torch

from . import _torch_version
from .core import _BELOW_AUTOGRAD, _lib
from .reference import truncated_to

CHUNK = 512  # least query rows per GEMM block: big enough for full-speed GEMMs
MAX_CHUNKS = 4  # most blocks per call: torch.compile unrolls the loop, and at 8192 tokens 16 blocks per layer made a
# 42-layer training step compile for over 390 s (H200, 2026-11-29); 4 blocks there is a 0.5 GiB fp32 score block


def default_chunk(q_len: int) -> int:
    """Query rows per block: CHUNK, or more (a multiple of 128) so a call has at most MAX_CHUNKS blocks."""
    rows = -(-q_len // MAX_CHUNKS)
    return max(CHUNK, -(-rows // 128) * 128)

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _operand_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype GEMM operands are in: bf16/fp16 as given (tensor cores, fp32 accumulator); other dtypes upcast to
    the accumulation dtype."""
    return x.dtype if x.dtype in _LOW_PRECISION else _acc_dtype(x.dtype)


def _bmm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b (3-D) with the result in `acc`. bf16/fp16 operands: exact products summed in fp32, by bmm's out_dtype
    on CUDA; CPU has no bmm out_dtype, and upcasting the operands there does the same arithmetic, so CPU tests check
    the GPU's numerics."""
    if a.dtype == acc:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=acc)
    return torch.bmm(a.to(acc), b.to(acc))


def _parts(x: torch.Tensor, op: torch.dtype) -> tuple[torch.Tensor, ...]:
    """P or dS (fp32/fp64) as GEMM operands of dtype `op` that sum to it: x itself when `op` is its dtype; for
    bf16/fp16 a hi + lo pair, equal to x within 2^-16 relative in bf16 (fp16: 2^-22, or its subnormal spacing
    2^-24), against 2^-8 for x.to(bf16) alone.

    Why: with P and dS rounded to bf16, out, dq, dk, dv had 1.27x, 1.42x, 1.42x, 1.17x stock SDPA MATH's error vs
    fp64 (bench/attention.py's full-layer inputs at L 1024 on CPU, which runs the GPU's bf16 arithmetic); with the
    pair they equal it. Cost: a second GEMM for each product with P or dS, 7 -> 11 GEMMs per query chunk in forward
    + backward (+57% GEMM FLOPs), plus writing lo.

    hi is x with its low mantissa bits cleared (`reference.truncated_to`, which says why not x.to(op)), so it is
    exact in `op` and x - hi is exact in fp32; lo is that remainder rounded once."""
    if x.dtype == op:
        return (x,)
    hi = truncated_to(x, op)
    return hi.to(op), (x - hi).to(op)


def _bmm_sum(parts: tuple[torch.Tensor, ...], b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """sum(part @ b for part in parts), in `acc`."""
    out = _bmm(parts[0], b, acc)
    for part in parts[1:]:
        out = out + _bmm(part, b, acc)
    return out


def _transposed(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(part.transpose(1, 2) for part in parts)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[rows, keys] bool: key position k is visible from query position p (k <= p, and k > p - window)."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
    return seen


def _key_range(q0: int, q1: int, offset: int, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that query rows [q0, q1) (positions offset + q0 ...) can see."""
    hi = offset + q1
    lo = 0 if window is None else max(0, offset + q0 - window + 1)
    return lo, hi


# q [B, Hkv, G, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], all contiguous; out [B, Hkv, G, L, Dv].
# A chunk of G * rows query rows of one kv head is one GEMM batch entry: [B * Hkv, G * rows, D].


def _seen(q0: int, q1: int, lo: int, hi: int, offset: int, window: int | None, mask, device) -> torch.Tensor:
    """Visibility of keys [lo, hi) from query rows [q0, q1), broadcastable to the [b, hkv, g, rows, keys] scores:
    the pattern [rows, keys], and with `mask` ([B or 1, 1, L, S] bool) [B or 1, 1, 1, rows, keys]."""
    seen = _visible(torch.arange(q0 + offset, q1 + offset, device=device), torch.arange(lo, hi, device=device), window)
    if mask is None:
        return seen
    return (seen & mask[:, :, q0:q1, lo:hi])[:, :, None]


def _forward(q, k, v, scale: float, window: int | None, chunk: int, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, the fp32 row logsumexp the backward needs; 0 for a row that sees no key)."""
    b, hkv, g, n, d = q.shape
    s_len, e = k.shape[2], v.shape[3]
    acc, op = _acc_dtype(q.dtype), _operand_dtype(q)
    offset = s_len - n
    qo, ko, vo = q.to(op), k.to(op), v.to(op)  # no-op but for dtypes the GEMMs upcast (fp8)
    outs, lses = [], []
    with torch.autocast(q.device.type, enabled=False):  # the GEMM dtypes below are chosen on purpose
        for q0 in range(0, n, chunk):
            q1 = min(q0 + chunk, n)
            lo, hi = _key_range(q0, q1, offset, window)
            rows = q1 - q0
            qc = qo[:, :, :, q0:q1].reshape(b * hkv, g * rows, d)
            kc = ko[:, :, lo:hi].reshape(b * hkv, hi - lo, d)
            vc = vo[:, :, lo:hi].reshape(b * hkv, hi - lo, e)
            s = (_bmm(qc, kc.transpose(1, 2), acc) * scale).view(b, hkv, g, rows, hi - lo)
            s = s.masked_fill(~_seen(q0, q1, lo, hi, offset, window, mask, q.device), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)  # without a mask every row sees at least its own key: finite
            if mask is not None:  # a row without a key: -inf; as 0 its P is exp(-inf) = 0, so out 0, no gradient
                lse = lse.masked_fill(lse == float("-inf"), 0.0)
            p = _parts(torch.exp(s - lse[..., None]).view(b * hkv, g * rows, hi - lo), op)
            outs.append(_bmm_sum(p, vc, acc).view(b, hkv, g, rows, e).to(q.dtype))
            lses.append(lse)
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _backward(grad_out, q, k, v, lse, scale: float, window: int | None, chunk: int, mask=None):
    """-> (dq, dk, dv). dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)), dQ = dS K * scale,
    dK += dS^T Q * scale."""
    b, hkv, g, n, d = q.shape
    s_len, e = k.shape[2], v.shape[3]
    acc, op = _acc_dtype(q.dtype), _operand_dtype(q)
    offset = s_len - n
    qo, ko, vo = q.to(op), k.to(op), v.to(op)
    grad_out = grad_out.contiguous().to(op)
    dk = torch.zeros(b, hkv, s_len, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, hkv, s_len, e, dtype=acc, device=q.device)
    dqs = []
    with torch.autocast(q.device.type, enabled=False):
        for q0 in range(0, n, chunk):
            q1 = min(q0 + chunk, n)
            lo, hi = _key_range(q0, q1, offset, window)
            rows, width = q1 - q0, hi - lo
            qc = qo[:, :, :, q0:q1].reshape(b * hkv, g * rows, d)
            doc = grad_out[:, :, :, q0:q1].reshape(b * hkv, g * rows, e)
            kc = ko[:, :, lo:hi].reshape(b * hkv, width, d)
            vc = vo[:, :, lo:hi].reshape(b * hkv, width, e)
            s = (_bmm(qc, kc.transpose(1, 2), acc) * scale).view(b, hkv, g, rows, width)
            seen = _seen(q0, q1, lo, hi, offset, window, mask, q.device)
            p = torch.exp(s.masked_fill(~seen, float("-inf")) - lse[:, :, :, q0:q1, None])
            dp = _bmm(doc, vc.transpose(1, 2), acc).view(b, hkv, g, rows, width)
            # rowsum(P * dP) equals rowsum(dO * O) (every key a row sees is in this block), but to fp32: taken
            # from the bf16 O, the cancellation in dP - rowsum amplified O's rounding to 3.5x stock's dq, dk error
            ds = _parts((p * (dp - (p * dp).sum(-1, keepdim=True))).view(b * hkv, g * rows, width), op)
            p = _parts(p.view(b * hkv, g * rows, width), op)
            dv[:, :, lo:hi] += _bmm_sum(_transposed(p), doc, acc).view(b, hkv, width, e)
            dk[:, :, lo:hi] += _bmm_sum(_transposed(ds), qc, acc).view(b, hkv, width, d) * scale
            dqs.append((_bmm_sum(ds, kc, acc) * scale).view(b, hkv, g, rows, d).to(q.dtype))
    return torch.cat(dqs, dim=3), dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, window: int | None, chunk: int, mask):
        out, lse = _forward(q, k, v, scale, window, chunk, mask)
        ctx.save_for_backward(q, k, v, lse, mask)
        ctx.scale, ctx.window, ctx.chunk = scale, window, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse, mask = ctx.saved_tensors
        return *_backward(grad_out, q, k, v, lse, ctx.scale, ctx.window, ctx.chunk, mask), None, None, None, None


# The op `attention` calls when a gradient is wanted (module docstring): q already grouped by kv head, 5-D.
_lib.define(
    "attention(Tensor q, Tensor k, Tensor v, float scale, SymInt? window, SymInt chunk, Tensor? mask=None) -> Tensor"
)


def _attention_kernel(q, k, v, scale, window, chunk, mask=None):
    return _forward(q, k, v, scale, window, chunk, mask)[0]


def _attention_autograd(keyset, q, k, v, scale, window, chunk, mask=None):
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, scale, window, chunk, mask)
    return torch.ops.g4ops.attention.default.redispatch(keyset & _BELOW_AUTOGRAD, q, k, v, scale, window, chunk, mask)


@torch.library.register_fake("g4ops::attention", lib=_lib)
def _attention_fake(q, k, v, scale, window, chunk, mask=None):
    torch._check(q.dim() == 5 and k.dim() == 4 and v.dim() == 4,
                 lambda: "g4ops::attention: q [B, Hkv, G, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]")  # fmt: skip
    torch._check(mask is None or mask.dim() == 4, lambda: "g4ops::attention: mask [B or 1, 1, L, S]")
    return q.new_empty((*q.shape[:4], v.shape[3]))


_lib.impl("attention", _attention_kernel, "CompositeExplicitAutograd")
_lib.impl("attention", _attention_autograd, "Autograd", with_keyset=True)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window, chunk: int, mask=None) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"g4ops.attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"g4ops.attention: {name} must be 4-D [batch, heads, seq, head_dim], got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"g4ops.attention: {name} must be floating point, got {t.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"g4ops.attention: {name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"g4ops.attention: {name} is on {t.device}, query on {query.device}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"g4ops.attention: value shape {tuple(value.shape)} must match key {tuple(key.shape)} in batch, heads, seq"
        )
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"g4ops.attention: key batch {key.shape[0]} != query batch {query.shape[0]}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"g4ops.attention: key head_dim {key.shape[-1]} != query head_dim {query.shape[-1]}")
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"g4ops.attention: query heads {hq} must be a multiple of key/value heads {hkv}")
    if query.shape[2] == 0:
        raise ValueError("g4ops.attention: query has no positions (length 0)")
    if query.shape[2] > key.shape[2]:
        raise ValueError(
            f"g4ops.attention: query length {query.shape[2]} > key length {key.shape[2]} (queries are the last "
            "positions of the keys)"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"g4ops.attention: window must be a positive int or None, got {window!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"g4ops.attention: chunk must be a positive int, got {chunk!r}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"g4ops.attention: mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
        b, _, n, _ = query.shape
        shape_ok = mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1
        if not shape_ok or mask.shape[2:] != (n, key.shape[2]):
            raise ValueError(f"g4ops.attention: mask shape {tuple(mask.shape)} must be [{b} or 1, 1, {n}, {key.shape[2]}] "
                             "(batch or 1, one mask for all heads, query length, key length)")  # fmt: skip
        if mask.device != query.device:
            raise ValueError(f"g4ops.attention: mask is on {mask.device}, query on {query.device}")


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention, optionally sliding-window, exact (see the module docstring for the semantics).

    query [B, Hq, L, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv] (any strides; Hq a multiple of Hkv; L <= S, the
    queries being the last L positions); scale defaults to 1/sqrt(D) like SDPA; window: a query at position p sees
    keys p - window < k <= p; chunk: query rows per GEMM block (default `default_chunk(L)`); mask: [B or 1, 1, L, S]
    bool, keys hidden where False (padding, packed sequences; rows left without a key give 0). Returns
    [B, Hq, L, Dv] in the query's dtype."""
    if chunk is None:
        chunk = default_chunk(query.shape[2])
    _check(query, key, value, window, chunk, mask)
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    if scale is None:
        scale = d**-0.5
    q = query.contiguous().view(b, hkv, hq // hkv, n, d)
    k, v = key.contiguous(), value.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = torch.ops.g4ops.attention(q, k, v, float(scale), window, chunk, mask)
    else:
        out = _forward(q, k, v, float(scale), window, chunk, mask)[0]
    return out.view(b, hq, n, value.shape[-1])


# ----------------------------------------------------------------------------------------------------------------
# Sliding-window layers through FlexAttention (CUDA, under torch.compile).
#
# Why: transformers gives a sliding layer a dense [L, L] mask, so SDPA (cuDNN) computes every causal block although
# only a 512-token band is visible: at 8192 tokens ~9 ms fwd+bwd per layer on the H200, 35 such layers in E4B. The
# chunked GEMM path above is exact but slower than cuDNN there. FlexAttention with a block mask skips the blocks
# outside the band, and Inductor compiles it into one flash-style Triton kernel per direction (bf16 P like cuDNN's).
# It only runs fused under torch.compile, and compiled it is trusted on CUDA only (`_flex_compiled_trusted`), so
# `flex_sliding_usable` gates it. A padding or packed-sequence mask joins the band inside the mask_mod (one lookup per
# pair of a block the block mask lists as partial): those calls otherwise leave FlexAttention for SDPA with the dense
# mask, which takes no causal or band shortcut at all.


def _band(offset: int, window: int):
    """FlexAttention mask_mod: query q_idx (position q_idx + offset) sees key kv_idx when q - window < kv <= q."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        return (kv_idx <= q_pos) & (kv_idx > q_pos - window)

    return mask_mod


def _band_and(band, mask: torch.Tensor):
    """The band's mask_mod narrowed by a [B, 1, L, S] bool mask (batch index b, as the kernel passes it)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return band(b, h, q_idx, kv_idx) & mask[b, 0, q_idx, kv_idx]

    return mask_mod


def band_block_mask(q_len: int, kv_len: int, window: int, device, mask: torch.Tensor | None = None):
    """The BlockMask `sliding_window_attention` runs with: the band of `attention(..., window=window, mask=mask)` for
    L queries at the last positions of S keys; blocks with no visible pair are left out. `mask`: [B, 1, L, S] bool
    (expanded to the query batch) or None."""
    from torch.nn.attention.flex_attention import create_block_mask

    # a symbolic offset (torch.compile's dynamic shapes) inside mask_mod fails Inductor's lowering (torch 2.13):
    # training calls have L == S, so pass a plain 0 there (one guard on L == S)
    offset = 0 if kv_len == q_len else kv_len - q_len
    band = _band(offset, window)
    if mask is None:
        return create_block_mask(band, None, None, q_len, kv_len, device=device)
    return create_block_mask(_band_and(band, mask), mask.shape[0], None, q_len, kv_len, device=device)


def _flex_compiled_trusted(query: torch.Tensor) -> bool:
    """Whether Inductor's compiled FlexAttention gives right numbers on query's device: CUDA only (checked on the
    H200, tests/test_attention.py). On CPU, torch 2.13's compiled forward is wrong on AVX2 (AMD EPYC, 2026-12-01;
    plain torch flex_attention, without g4ops, too): with head_dim 8 or 16 and L = S <= 128 (one block),
    L = 8 mod 16 (24, 40, 56, ...), query rows 0-7 came out as zeros, NaN or off by O(1) (in our runs in the heads
    of the last kv head). Cause: Inductor's CPU micro-GEMM for q k^T (cpp_micro_gemm.py, CppMicroGemmFP32Vec, the
    transposed-B N-tail kernel) takes its full-tile branch when the 8-key tail is one AVX2 vector and computes 16
    columns: it reads 8 keys past the block (past the key tensor's end for the last head) and writes 8 scores past
    the score buffer, over the running row maxima of rows 0-7. AVX-512 (16-float vectors) never takes that branch.
    CPU therefore keeps the stock dense-mask path."""
    return query.is_cuda


FLEX_MIN_CAPABILITY = (9, 0)  # measured and tested on the H200 only; the head_dim-256 backward needs Hopper's shared
# memory, and on smaller GPUs Triton may fail to fit the kernel: those keep stock's path


@torch.compiler.assume_constant_result  # evaluated once while tracing, a constant in the graph
def _flex_checked_gpu(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= FLEX_MIN_CAPABILITY


# FlexAttention with a padding or packing mask inside the mask_mod (`sliding_window_attention(..., mask=...)`) failed
# compiled on CUDA under torch 2.11 (the GPU image; H100, 2026-12-05, tests/test_attention.py and test_packing.py):
# Inductor's lowering raised NoValidChoicesError for per-row masks of 3 rows, "convert FlexibleLayout to FixedLayout
# first" for the mask a compiled model builds in its graph, and one compiled kernel ended the process's CUDA context
# (cudaErrorInvalidAddressSpace). Never run on a GPU under a newer torch: from this version on the path is let through
# (opt-in, hf.attention_interface.MASKED_SLIDING_VIA_FLEX) and its CUDA tests run, so that they decide.
MASKED_FLEX_MIN_TORCH = (2, 12)
_masked_flex_warned = False


@torch.compiler.assume_constant_result  # evaluated once while tracing, a constant in the graph
def masked_flex_supported() -> bool:
    """Whether this torch may compile FlexAttention with a batch mask (MASKED_FLEX_MIN_TORCH); warns once when not."""
    global _masked_flex_warned
    if _torch_version.torch_version() >= MASKED_FLEX_MIN_TORCH:
        return True
    if not _masked_flex_warned:
        _masked_flex_warned = True
        warnings.warn(
            f"g4ops: FlexAttention with a padding or packing mask needs torch >= {MASKED_FLEX_MIN_TORCH[0]}."
            f"{MASKED_FLEX_MIN_TORCH[1]} (torch 2.11's Inductor failed to compile it or ran a bad kernel); torch "
            f"{torch.__version__} is installed, so masked sliding layers keep stock SDPA with the dense mask",
            stacklevel=2,
        )
    return False


# FlexAttention kernel options (torch's FlexKernelOptions) for the sliding layers on Hopper (sm90) at head_dim 256
# (E4B, E2B), bf16/fp16: the backward tile Inductor picks there (torch 2.11: 64 x 64 blocks, 2 stages) with 8 warps
# instead of 4. Measured on an H100 (torch 2.11, 2026-12-05, bench/flex_options.py, E4B's sliding layer at 2048
# tokens): 0.248 against 0.360 ms of GPU time per layer, forward + backward, with the same errors against fp64
# (bench/results/2026-12-05-h100-session30.md). Elsewhere (other GPUs, head dims, fp32) Inductor's defaults stay.
SM90_HEAD256_FLEX_OPTIONS = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                             "bwd_num_warps": 8, "bwd_num_stages": 2}  # fmt: skip
# An override for benchmarks (bench/e2e.py --flex-options): a dict is passed as given ({}: Inductor's defaults).
SLIDING_FLEX_KERNEL_OPTIONS: dict | None = None


@torch.compiler.assume_constant_result  # evaluated once while tracing, a constant in the graph
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def tuned_sliding_options(device_index: int, dtype: torch.dtype, head_dim: int) -> dict | None:
    """The kernel options the sliding layers' flex call takes on a CUDA device (None: Inductor's defaults)."""
    if dtype in _LOW_PRECISION and head_dim == 256 and _is_sm90(device_index):
        return dict(SM90_HEAD256_FLEX_OPTIONS)
    return None


def sliding_flex_kernel_options(query: torch.Tensor) -> dict | None:
    """What `sliding_window_attention` passes to flex_attention as kernel_options: the override if set, else the
    tuned options for query's GPU, dtype and head_dim (none on CPU)."""
    if SLIDING_FLEX_KERNEL_OPTIONS is not None:
        return dict(SLIDING_FLEX_KERNEL_OPTIONS) or None
    if not query.is_cuda:
        return None
    return tuned_sliding_options(_cuda_index(query), query.dtype, query.shape[-1])


def _cuda_index(query: torch.Tensor) -> int:
    index = query.device.index
    return torch.cuda.current_device() if index is None else index


def flex_sliding_usable(query: torch.Tensor) -> bool:
    """FlexAttention is the faster sliding path only where it compiles into its fused kernel and that kernel is
    trusted: inside torch.compile (eager flex_attention materializes the full score matrix), on CUDA, on a GPU of the
    kind it was checked on."""
    if not (_flex_compiled_trusted(query) and torch.compiler.is_compiling()):
        return False
    return _flex_checked_gpu(_cuda_index(query))


def sliding_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    window: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same semantics and shapes as `attention(..., window=window, mask=mask)`, computed by FlexAttention with a
    block-sparse mask (blocks with no visible pair are skipped; a query row that sees no key gives 0). Returns
    [B, Hq, L, Dv]. Under torch.compile where the compiled kernel is not trusted (`_flex_compiled_trusted`: CPU) it
    computes `attention(...)` instead; eager FlexAttention (its reference path, slow, forward only on CPU) runs
    anywhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if window is None:
        raise ValueError("g4ops.sliding_window_attention: window must be a positive int, got None")
    _check(query, key, value, window, CHUNK, mask)
    if torch.compiler.is_compiling() and not _flex_compiled_trusted(query):
        # not a raise: without fullgraph Dynamo would skip this frame and still compile flex_attention's own frame,
        # the wrong kernel (measured)
        return attention(query, key, value, scale, window=window, mask=mask)
    if mask is not None:  # one mask per batch row: the kernel indexes it with the row's batch index
        mask = mask.expand(query.shape[0], 1, *mask.shape[2:])
    block_mask = band_block_mask(query.shape[2], key.shape[2], window, query.device, mask)
    return flex_attention(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=sliding_flex_kernel_options(query),
    )
