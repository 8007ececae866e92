"""Fused linear cross-entropy with Gemma's final logit softcap, chunked so the full [tokens, vocab] logits never exist.

Public op (declared on the same `g4ops` library as core.py):
    torch.ops.g4ops.linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, float? softcap,
                                         int ignore_index, str reduction, int chunk_size) -> Tensor
Internal ops, each a real operator so autograd, torch.compile and CUDA graphs see them:
    linear_cross_entropy_forward   the training forward: the loss and, computed chunk by chunk in the same op,
                                   d loss / d hidden and d loss / d weight (Liger's trick: nothing of size
                                   [tokens, vocab] is kept for the backward)
    linear_cross_entropy_backward  scales those saved gradients by the incoming grad_output (eager; a traced backward
                                   runs the same scale as ATen ops that Inductor fuses with its neighbours)

Semantics (what HF transformers computes for Gemma-4 with `labels`, written out once):
    z      = softcap * tanh((hidden @ weight.T) / softcap)        (no cap when softcap is None or 0)
    loss_i = logsumexp(z_i) - z_i[labels_i]                       for rows whose label != ignore_index
    "mean": sum_i loss_i / #(labels != ignore_index)              (HF's default; NaN when every label is ignored,
                                                                   as F.cross_entropy gives)
    "sum" : sum_i loss_i                                          (HF's `num_items_in_batch` path divides this sum
                                                                   by num_items_in_batch outside the op; the Python
                                                                   wrapper `linear_cross_entropy(...,
                                                                   num_items_in_batch=...)` does that, accepting a
                                                                   tensor without a host sync)
`hidden` is [..., H] (any leading shape, already shifted: row i predicts labels_i), `weight` is the nn.Linear
layout [V, H] (the tied embedding), `labels` is an integer tensor of shape hidden.shape[:-1]. The loss is a 0-d
fp32 tensor (fp64 for fp64 inputs), like HF's `logits.float()` loss.

Algorithm: pass 1 walks chunks of tokens; each chunk's logits come from one GEMM, and a fused helper (on CUDA a
hand-written kernel, see Kernels) turns them into each row's logsumexp and loss. In
training, d loss / d logits = (softmax - onehot) * (1 - tanh^2) * row scale feeds the gradients by the first of
three cases that applies:
  (a) no weight gradient wanted (a frozen tied embedding, as in LoRA finetuning), any number of tokens: the helper
      also returns d for the chunk's logits, and grad_hidden[chunk] = d @ weight is one GEMM written straight into the
      result (fp32 accumulation inside the GEMM, one rounding: no fp32 [N, H] accumulator).
  (b) a weight gradient wanted and every row fits one chunk (`fits_one_pass`: at most ONE_PASS_LOGITS logits, or an
      explicit `chunk_size` covering every row): the same on that one chunk, plus grad_weight = d.T @ hidden (one
      GEMM written into the result: one rounding).
  (c) otherwise, pass 2 walks blocks of the vocabulary, recomputes that block's logits for all tokens, builds d, then
      grad_weight[block] = d.T @ hidden (one GEMM over all tokens, written straight into the result) and
      grad_hidden += d @ weight[block] (one partial per block in the input dtype, summed in an fp32 [N, H]
      accumulator, rounded once at the end).
(a) and (b) issue one logits GEMM fewer than (c) (2 resp. 3 GEMMs of [tokens x vocab x hidden] instead of 3 resp. 4)
and skip one elementwise pass over the logits: at E4B's shape (vocab 262144, hidden 2560, 2048 tokens) a GEMM is
2.75 TFLOP, ~4 ms on an H200: a graphed 42-layer LoRA step went from 135.3 to 130.2 ms with this change
(bench/results/2026-12-04-h200-session23.md; separate calls). (c) keeps two passes
where one pass would need to sum the weight gradient over token chunks, in the weight dtype with one rounding per
chunk, or in an fp32 [V, H] accumulator (2.7 GB at E4B's vocabulary); (c) needs neither and rounds the weight
gradient once. (b) and (c) give the same gradients up to the GEMMs' own summation order.

Kernels (default on CUDA; G4OPS_LOSS_KERNEL=0 turns it off): with fp16/bf16/fp32 inputs, pass 1's helper (logsumexp
and loss per row) and, in cases (a) and (b), the one-pass helper (those plus d) run as one hand-written kernel per
chunk (csrc/softcap_xent.cu, the internal op g4ops_kernels.softcap_xent_rows; `_kernel_usable` decides): one CTA per
row reads the row once for its logsumexp and, for d, once more (from its end, the likeliest to still be in L2) to
write d over the chunk's logits in place. Measured on an H200 (bf16, E4B's vocabulary, bench/loss_bench.py, one call
each, 2026-12-04 session 24): the op beyond its GEMMs took 1.6 / 1.9 ms with the kernel against 3.2 / 2.8 ms with
the Inductor helpers at 2048 tokens (frozen / trained weight), 4.6 / 11.1 against 8.8 / 13.8 ms at 8192. Case (c)'s
pass-2 helper, the backward's scaling, fp64 and CPU keep the helpers.

Numerics: each chunk's logits come from one GEMM in the input dtype (fp32 accumulation inside cuBLAS / the CPU
BLAS, one rounding: exactly stock's `lm_head` output); the softcap, logsumexp, softmax and the softcap derivative
run in fp32 (fp64 for fp64 inputs) from there. Stock transformers applies the softcap in bf16 (three roundings) and
only then upcasts, so this is closer to an fp64 oracle than stock (measured on CPU, bf16, 256 tokens x 4099 words:
relative error of grad_hidden 0.0048 vs stock's 0.0105, grad_weight 0.0046 vs 0.0106, loss 2e-5 vs 3.9e-5). When
the backward's grad_output is not exactly 1 (loss scaling, gradient accumulation divided into the loss) the saved
gradients are multiplied by it (in fp32, fp64 for fp64): one more rounding in bf16.
The CUDA kernel (Kernels) computes the same fp32 formulas with CUDA's accurate tanhf / expf / logf (at most 2 ulp each)
and x / softcap as x * (1 / softcap), as ATen's CUDA division by a scalar does: equal to the helpers up to those fp32
roundings.

Memory: per chunk / block about CHUNK_LOGITS logits (2**27: 512 tokens at V = 262144) in the input dtype for the
logits and for d, plus, in eager mode (CPU, or a failed compilation), a few fp32 buffers of that size (0.5 GiB each;
on CUDA Inductor fuses that fp32 math into its kernels). Case (b)'s one chunk holds up to ONE_PASS_LOGITS (2**29)
logits: 1 GiB each for the bf16 logits and d (1 GiB in all where the CUDA kernel writes d over the logits; eager:
2 GiB per fp32 buffer). Case (a) writes grad_hidden chunk by chunk into the result; case (c) adds the per-row
logsumexp and an fp32 [N, H] accumulator. Between forward and backward only the two gradients (in the input dtypes)
are kept, as Liger keeps them. No host sync anywhere on CUDA (the mean divides by a device tensor, and the case is
chosen from shapes alone; out-of-range labels trip a device-side assert, as F.cross_entropy does; on CPU they raise
an error naming `labels`). `chunk_size` > 0 fixes the tokens per pass-1 chunk (pass-2 blocks hold as many logits;
case (b) only when it covers every row); 0 = automatic.

Double backward is not supported (once_differentiable), like Liger's fused loss.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ._build import ensure_cuda_kernels, status
from ._fused import run_compiled
from ._torch_version import traced_by_compile
from .core import _internal_op_autograd, _lib
from .reference import accumulation_dtype

_SCHEMAS = {
    "linear_cross_entropy": (
        "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, float? softcap=None, "
        "int ignore_index=-100, str reduction=\"mean\", int chunk_size=0) -> Tensor"
    ),
    "linear_cross_entropy_forward": (
        "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor labels, float? softcap, "
        "int ignore_index, str reduction, int chunk_size, bool[2] output_mask) -> (Tensor, Tensor, Tensor)"
    ),
    "linear_cross_entropy_backward": (
        "linear_cross_entropy_backward(Tensor grad_output, Tensor grad_hidden, Tensor grad_weight, "
        "bool[2] output_mask) -> (Tensor, Tensor)"
    ),
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)

# About 2**27 logits per chunk: 512 tokens at Gemma's 262144-word vocabulary, 0.5 GiB per fp32 [chunk, V] buffer.
CHUNK_LOGITS = 1 << 27
# Up to 2**29 logits (2048 tokens at V = 262144) the training forward with a weight gradient takes every row in one
# chunk and skips pass 2's logits GEMM (case (b) in the module docstring): this bounds the transient bf16 logits and
# d loss / d logits of that chunk at 1 GiB each.
ONE_PASS_LOGITS = 1 << 29
_REDUCTIONS = ("mean", "sum")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # csrc/softcap_xent.cu's; fp64 keeps the helpers
_LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


# ----------------------------------------------------------------------------------------------------------------
# Input checks, shared by the reference kernels and the fake kernels (torch._check* keeps them trace-safe).


def _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size) -> None:
    op = "g4ops.linear_cross_entropy"
    torch._check_type(
        hidden.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: `hidden` must be float16, bfloat16, float32 or float64, got {hidden.dtype}",
    )
    torch._check_type(
        weight.dtype in _FLOAT_DTYPES,
        lambda: f"{op}: `weight` must be float16, bfloat16, float32 or float64, got {weight.dtype}",
    )
    torch._check_type(
        labels.dtype in _LABEL_DTYPES,
        lambda: f"{op}: `labels` must be an integer tensor (int64 token ids), got {labels.dtype}",
    )
    torch._check(hidden.dim() >= 1, lambda: f"{op}: `hidden` must have at least one dimension")
    torch._check(
        weight.dim() == 2 and weight.shape[1] == hidden.shape[-1],
        lambda: f"{op}: `weight` must be [vocab, {hidden.shape[-1]}] (nn.Linear layout, in = the last dim of "
        f"`hidden`), got {list(weight.shape)}",
    )
    torch._check(
        weight.dtype == hidden.dtype,
        lambda: f"{op}: `weight` is {weight.dtype} but `hidden` is {hidden.dtype}; they must match (under "
        "torch.autocast the op casts them for you)",
    )
    torch._check(
        tuple(labels.shape) == tuple(hidden.shape[:-1]),
        lambda: f"{op}: `labels` must have shape {list(hidden.shape[:-1])} (`hidden` without its last dim), got "
        f"{list(labels.shape)}",
    )
    torch._check(
        softcap is None or softcap >= 0.0, lambda: f"{op}: `softcap` must be None or >= 0, got {softcap}"
    )
    torch._check(
        reduction in _REDUCTIONS, lambda: f"{op}: `reduction` must be 'mean' or 'sum', got {reduction!r}"
    )
    torch._check(chunk_size >= 0, lambda: f"{op}: `chunk_size` must be >= 0 (0 = automatic), got {chunk_size}")
    for name, t in (("weight", weight), ("labels", labels)):
        torch._check(
            t.device == hidden.device,
            lambda: f"{op}: `{name}` is on {t.device} but `hidden` is on {hidden.device}",
        )


def _check_labels_in_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Out-of-range labels: a clear error on CPU; a device-side assert (no host sync) elsewhere."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.device.type == "cpu":
        if bool(bad.any()):
            first = labels[bad][0].item()
            raise IndexError(
                f"g4ops.linear_cross_entropy: `labels` holds {first}, outside [0, {vocab}) and not the "
                f"ignore_index {ignore_index}"
            )
    elif labels.device.type == "cuda":
        torch._assert_async(~bad.any(), "g4ops.linear_cross_entropy: `labels` out of range")


def chunk_rows(num_rows: int, vocab: int, chunk_size: int) -> int:
    """Tokens per chunk of the first pass: `chunk_size`, or about CHUNK_LOGITS logits."""
    if chunk_size > 0:
        return min(chunk_size, max(num_rows, 1))
    return max(1, min(max(num_rows, 1), CHUNK_LOGITS // max(vocab, 1)))


def fits_one_pass(num_rows: int, vocab: int, chunk_size: int) -> bool:
    """Whether the weight gradient can come from one chunk of every row (case (b)): with an explicit `chunk_size`,
    when it covers every row (the caller allowed a chunk that big); automatically, when pass 1 is one chunk anyway
    or every row's logits number at most ONE_PASS_LOGITS."""
    if chunk_size > 0:
        return num_rows <= chunk_size
    return num_rows <= chunk_rows(num_rows, vocab, 0) or num_rows * vocab <= ONE_PASS_LOGITS


def vocab_block(num_rows: int, vocab: int, chunk_size: int) -> int:
    """Vocabulary rows per block of the second pass: about as many logits as a first-pass chunk, in whole multiples of
    128 rows. An odd block width is the leading dimension of the block's logits and gradient, and cuBLAS then falls
    back to unaligned kernels (sm75 align1: 35 of a 4-layer 1664-token LoRA step's 55 ms of GPU time on an H200)."""
    logits = chunk_rows(num_rows, vocab, chunk_size) * vocab
    block = max(1, min(vocab, logits // max(num_rows, 1)))
    return block - block % 128 if 128 <= block < vocab else block


# ----------------------------------------------------------------------------------------------------------------
# Reference math (every device): the CPU kernel, the CUDA kernel (GEMMs are cuBLAS through ATen), the test
# oracle's fast twin and the benchmark baseline.


def _capped(logits: torch.Tensor, cap: float):
    """The logits as the GEMM returned them (input dtype) -> (z in fp32 (fp64 for fp64), tanh(logits / cap) or
    None without a cap): the shared first step of every helper below."""
    z = logits.to(accumulation_dtype(logits.dtype))
    if not cap:
        return z, None
    t = torch.tanh(z / cap)
    return t * cap, t


def _lse_and_loss(z: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor):
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, safe.unsqueeze(1)).squeeze(1)
    return lse, torch.where(valid, lse - picked, 0.0)


def _grad_from(z, t, lse, label_col, row_scale, dtype: torch.dtype) -> torch.Tensor:
    """d loss / d logits from the capped logits `z` (and `t` = tanh, or None), rounded once to `dtype`."""
    p = torch.exp(z - lse.unsqueeze(1))  # softmax, with the row's logsumexp
    cols = torch.arange(z.shape[1], device=z.device)
    p = (p - (cols.unsqueeze(0) == label_col.unsqueeze(1)).to(p.dtype)) * row_scale
    if t is not None:
        p = p * (1.0 - t * t)  # d z / d logits = 1 - tanh^2
    return p.to(dtype)


def _chunk_loss(logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor, cap: float):
    """Pass 1 on one chunk of tokens: (logsumexp per row, loss per row; 0 where ignored), from the chunk's logits as
    the GEMM returned them (input dtype)."""
    return _lse_and_loss(_capped(logits, cap)[0], safe, valid)


def _block_grad(logits: torch.Tensor, lse: torch.Tensor, label_col: torch.Tensor, row_scale: torch.Tensor, cap: float):
    """Pass 2 on one vocabulary block: d loss / d logits in the input dtype. `label_col` is the label's column in
    this block, or -1 (label elsewhere, or ignored); `row_scale` is [n, 1] (0 for ignored rows)."""
    z, t = _capped(logits, cap)
    return _grad_from(z, t, lse, label_col, row_scale, logits.dtype)


def _chunk_loss_grad(
    logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor, row_scale: torch.Tensor, cap: float
):
    """The one-pass scheme on one chunk of tokens over the whole vocabulary: (logsumexp per row, loss per row,
    d loss / d logits in the input dtype), pass 1's and pass 2's math on the same logits (one GEMM, not two)."""
    z, t = _capped(logits, cap)
    lse, row_loss = _lse_and_loss(z, safe, valid)
    label_col = torch.where(valid, safe, -1)
    return lse, row_loss, _grad_from(z, t, lse, label_col, row_scale, logits.dtype)


def _scale_grad(g: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """The backward: a saved gradient times grad_output, computed in fp32 (fp64 for fp64) and rounded once to g's
    dtype. Eager, through `_run_fused`, because ATen runs bf16 times a 0-d fp32 CUDA tensor in its non-vectorized
    mixed-dtype kernel (1.2 ms for E4B's [262144, 2560] weight gradient on an H200); Inductor emits one vectorized
    kernel. Traced by an outer torch.compile, inline (`_LinearCrossEntropyFunction.backward`)."""
    acc = accumulation_dtype(g.dtype)
    return (g.to(acc) * grad_output.to(acc)).to(g.dtype)


# On CUDA the elementwise helpers that reach `_run_fused` (_block_grad and _scale_grad always; _chunk_loss and
# _chunk_loss_grad unless `_kernel_usable`: by default, and for fp64) run through torch.compile (dynamic
# shapes): Inductor fuses each into one or two kernels reading the bf16 logits once, instead of a dozen full-size
# fp32 passes in eager mode. The op stays opaque to an outer torch.compile (the compiled helpers run inside its
# kernel). G4OPS_LOSS_COMPILE=0 turns this off, =1 forces it on every device (the CPU tests use that); a failed
# compilation warns once and runs eagerly.
_LOSS_COMPILE = os.environ.get("G4OPS_LOSS_COMPILE")
_compiled: dict = {}
_compile_failed: list = []


def _run_fused(fn, *args):
    return run_compiled(fn, args, _LOSS_COMPILE, _compiled, _compile_failed,
                        "g4ops.linear_cross_entropy: torch.compile of its elementwise part")  # fmt: skip


# Pass 1 on CUDA (fp16/bf16/fp32) through csrc/softcap_xent.cu unless G4OPS_LOSS_KERNEL=0 (module docstring, Kernels).
_LOSS_KERNEL = os.environ.get("G4OPS_LOSS_KERNEL") != "0"


def _kernel_usable(logits: torch.Tensor) -> bool:
    """The one place that decides whether a chunk's logits go through the CUDA kernel: CUDA logits in fp16, bf16 or
    fp32 with the compiled kernels loaded (this loads them once; as for every g4ops op, a failed build raises unless
    the reference fallback is allowed). fp64 (gradcheck) and CPU keep the helpers, and so does code being traced by
    torch.compile (the kernel is an opaque op without a fake kernel; the loss op itself is never traced into)."""
    if not (_LOSS_KERNEL and logits.is_cuda and logits.dtype in _KERNEL_DTYPES) or torch.compiler.is_compiling():
        return False
    ensure_cuda_kernels()
    return bool(status()["loaded"])


def softcap_xent_rows(logits, safe, valid, row_scale, cap: float):
    """The kernel op `g4ops_kernels.softcap_xent_rows` after its argument checks, which live here, not in C++: on the
    H200 image (torch 2.11) a failed C++ check (a c10::Error) crashes the process instead of raising
    (csrc/g4ops_common.cuh). The checks guard the kernel's pointer arithmetic; the device check comes last, so the
    others run (and are tested) on any device."""
    name = "g4ops_kernels.softcap_xent_rows"
    if logits.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: `logits` must be float16, bfloat16 or float32, got {logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"{name}: `logits` must be [rows, vocab], got {logits.dim()} dims")
    n, v = logits.shape
    if v > 1 and logits.stride(1) != 1:
        raise ValueError(f"{name}: `logits` must have a contiguous last dim, got its stride {logits.stride(1)}")
    if n > 1 and logits.stride(0) < v:
        raise ValueError(f"{name}: the rows of `logits` must not overlap (row stride {logits.stride(0)} < vocab {v})")
    if n and not v:
        raise ValueError(f"{name}: `logits` has rows but an empty vocabulary")
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"{name}: `cap` must be finite and >= 0 (0 = no softcap), got {cap}")
    rows = [("safe", safe, torch.int64), ("valid", valid, torch.bool)]
    for arg, t, dtype in rows + ([("row_scale", row_scale, torch.float32)] if row_scale is not None else []):
        if t.dtype != dtype:
            raise TypeError(f"{name}: `{arg}` must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name}: `{arg}` must have shape [{n}] (one per row of `logits`), got {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name}: `{arg}` is on {t.device} but `logits` is on {logits.device}")
    if not logits.is_cuda:
        raise ValueError(f"{name}: `logits` must be a CUDA tensor, got one on {logits.device}")
    return torch.ops.g4ops_kernels.softcap_xent_rows(logits, safe, valid, row_scale, cap)


def _pass1_loss(logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor, cap: float):
    """`_chunk_loss` of one chunk (logsumexp per row, loss per row): the CUDA kernel where usable (it only reads
    `logits`), else the helper through `_run_fused`."""
    if _kernel_usable(logits):
        return softcap_xent_rows(logits, safe, valid, None, cap)
    return _run_fused(_chunk_loss, logits, safe, valid, cap)


def _pass1_loss_grad(
    logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor, row_scale: torch.Tensor, cap: float
):
    """`_chunk_loss_grad` of one chunk (logsumexp, loss per row, d loss / d logits in the input dtype). The CUDA
    kernel writes d over `logits` and returns that tensor as d: `logits` must be a fresh GEMM output that nothing
    else holds, and the caller must not read it as logits afterwards."""
    if _kernel_usable(logits):
        lse, row_loss = softcap_xent_rows(logits, safe, valid, row_scale.reshape(-1), cap)
        return lse, row_loss, logits
    return _run_fused(_chunk_loss_grad, logits, safe, valid, row_scale, cap)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
    output_mask: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight) for grad_output = 1; a gradient not asked for is an empty tensor.

    Pass 1, over chunks of tokens: logits -> softcap -> logsumexp and the label's logit, so the loss and every
    row's logsumexp. Gradients, by the first case that applies (the module docstring says why):
    (a) no weight gradient: in pass 1 itself, d loss / d logits from the chunk's logits (`_pass1_loss_grad`), then
        grad_hidden[chunk] = d @ weight (one GEMM, written straight into the result);
    (b) every row in one chunk (`fits_one_pass`): the same on that one chunk, plus grad_weight = d.T @ hidden;
    (c) otherwise pass 2, over blocks of the vocabulary: the block's logits again (one more GEMM), d loss / d logits
        = (softmax - onehot) * (1 - tanh^2) * row scale, then grad_weight[block] = d.T @ hidden in one GEMM over all
        tokens (written straight into the result: one rounding, no [V, H] accumulator) and
        grad_hidden += d @ weight[block] (partials in the input dtype, summed in an fp32 [N, H] accumulator, rounded
        once).
    """
    acc = accumulation_dtype(hidden.dtype)
    vocab, width = weight.shape
    h2 = hidden.reshape(-1, width)
    lab = labels.reshape(-1).long()
    rows = h2.shape[0]
    _check_labels_in_range(lab, vocab, ignore_index)
    cap = float(softcap) if softcap else 0.0
    valid = lab != ignore_index
    safe = torch.where(valid, lab, 0)
    if reduction == "mean":
        # A device tensor: no host sync. 0 valid tokens -> NaN loss, as F.cross_entropy(reduction="mean").
        scale = 1.0 / valid.sum().to(acc)
    else:
        scale = torch.ones((), dtype=acc, device=hidden.device)
    want_h, want_w = bool(output_mask[0]), bool(output_mask[1])
    want_grad = (want_h or want_w) and rows > 0
    # Cases (a) and (b): the gradients come from pass 1's logits; (c) needs pass 2. Decided on shapes alone.
    one_pass = want_grad and (not want_w or fits_one_pass(rows, vocab, chunk_size))
    # d loss / d logits per row: 1/#valid over ALL rows for the mean (a device tensor), 0 for ignored rows.
    row_scale = (valid.to(acc) * scale).unsqueeze(1) if want_grad else None

    grad_hidden = hidden.new_empty(0)
    grad_weight = weight.new_empty(0)
    if want_w:
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
        if rows == 0:
            grad_weight.zero_()
    grad_h2 = None
    if want_h and one_pass:
        grad_h2 = torch.empty(h2.shape, dtype=hidden.dtype, device=hidden.device)  # every row written once below

    # Pass 1: loss and per-row logsumexp; in cases (a) and (b) the gradients too.
    lse_all = torch.empty(rows, dtype=acc, device=hidden.device) if want_grad and not one_pass else None
    total = torch.zeros((), dtype=acc, device=hidden.device)
    step = rows if one_pass and want_w else chunk_rows(rows, vocab, chunk_size)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        logits = F.linear(h2[r0:r1], weight)  # one GEMM in the input dtype, exactly stock's lm_head output
        if one_pass:
            # on CUDA, d IS `logits`, overwritten in place: from here on only d is used
            _, row_loss, d = _pass1_loss_grad(logits, safe[r0:r1], valid[r0:r1], row_scale[r0:r1], cap)
            del logits
            if want_w:  # case (b): this one chunk holds every row
                torch.mm(d.t(), h2.contiguous(), out=grad_weight)
            if want_h:  # fp32 accumulation inside the GEMM, one rounding, no [N, H] accumulator
                torch.mm(d, weight, out=grad_h2[r0:r1])
            del d
        else:
            lse, row_loss = _pass1_loss(logits, safe[r0:r1], valid[r0:r1], cap)
            del logits
            if want_grad:
                lse_all[r0:r1] = lse
        total = total + row_loss.sum()
    loss = total * scale

    if want_grad and not one_pass:
        # Case (c), pass 2: gradients, one vocabulary block at a time.
        grad_h_acc = torch.zeros(h2.shape, dtype=acc, device=hidden.device) if want_h else None
        h_c = h2.contiguous()
        block = vocab_block(rows, vocab, chunk_size)
        for v0 in range(0, vocab, block):
            v1 = min(v0 + block, vocab)
            w_b = weight[v0:v1]
            label_col = torch.where(valid & (lab >= v0) & (lab < v1), lab - v0, -1)
            d = _run_fused(_block_grad, F.linear(h_c, w_b), lse_all, label_col, row_scale, cap)
            if want_w:
                torch.mm(d.t(), h_c, out=grad_weight[v0:v1])
            if want_h:
                if acc == hidden.dtype:
                    grad_h_acc.addmm_(d, w_b)
                else:
                    grad_h_acc.add_(torch.mm(d, w_b))  # bf16/fp16 partial per block, summed in fp32
        if want_h:
            grad_h2 = grad_h_acc.to(hidden.dtype)
    if want_h:
        grad_hidden = (grad_h2 if grad_h2 is not None else hidden.new_zeros(h2.shape)).reshape(hidden.shape)
    return loss, grad_hidden, grad_weight


def _forward_impl(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size, output_mask):
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    return linear_cross_entropy_reference(
        hidden, weight, labels, softcap, ignore_index, reduction, chunk_size, tuple(output_mask)
    )


def _loss_impl(hidden, weight, labels, softcap=None, ignore_index=-100, reduction="mean", chunk_size=0):
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    return linear_cross_entropy_reference(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)[0]


def _check_backward(grad_output, grad_hidden, grad_weight, output_mask) -> None:
    torch._check(
        grad_output.dim() == 0,
        lambda: f"g4ops.linear_cross_entropy_backward: `grad_output` must be 0-d, got {list(grad_output.shape)}",
    )


def _check_forward(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size, output_mask) -> None:
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)


def _backward_impl(grad_output, grad_hidden, grad_weight, output_mask):
    _check_backward(grad_output, grad_hidden, grad_weight, output_mask)

    def scaled(g, wanted):
        return _run_fused(_scale_grad, g, grad_output) if wanted else g.new_empty(0)

    return scaled(grad_hidden, output_mask[0]), scaled(grad_weight, output_mask[1])


_lib.impl("linear_cross_entropy", _loss_impl, "CompositeExplicitAutograd")
_lib.impl("linear_cross_entropy_forward", _forward_impl, "CompositeExplicitAutograd")
_lib.impl("linear_cross_entropy_backward", _backward_impl, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------------------------------------------------
# Fake kernels: exact sizes, strides (contiguous) and dtypes.


@torch.library.register_fake("g4ops::linear_cross_entropy", lib=_lib)
def _loss_fake(hidden, weight, labels, softcap=None, ignore_index=-100, reduction="mean", chunk_size=0):
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    return hidden.new_empty((), dtype=accumulation_dtype(hidden.dtype))


@torch.library.register_fake("g4ops::linear_cross_entropy_forward", lib=_lib)
def _forward_fake(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size, output_mask):
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    loss = hidden.new_empty((), dtype=accumulation_dtype(hidden.dtype))
    grad_h = hidden.new_empty(hidden.shape) if output_mask[0] else hidden.new_empty(0)
    grad_w = weight.new_empty(weight.shape) if output_mask[1] else weight.new_empty(0)
    return loss, grad_h, grad_w


@torch.library.register_fake("g4ops::linear_cross_entropy_backward", lib=_lib)
def _backward_fake(grad_output, grad_hidden, grad_weight, output_mask):
    return (
        grad_hidden.new_empty(grad_hidden.shape) if output_mask[0] else grad_hidden.new_empty(0),
        grad_weight.new_empty(grad_weight.shape) if output_mask[1] else grad_weight.new_empty(0),
    )


# ----------------------------------------------------------------------------------------------------------------
# Autograd: the forward computes the gradients for grad_output = 1 (so no [tokens, vocab] tensor survives the
# forward); the backward is one registered op that scales them.


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, softcap, ignore_index, reduction, chunk_size):
        mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
        loss, grad_h, grad_w = torch.ops.g4ops.linear_cross_entropy_forward(
            hidden, weight, labels, softcap, ignore_index, reduction, chunk_size, mask
        )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mask = mask
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        if traced_by_compile():
            # traced (AOTAutograd): plain ATen, so Inductor fuses the scale into what reads the gradients; with a
            # tied embedding that is the sum of the two weight gradients, one pass over [V, H] fewer
            gh, gw = (_scale_grad(g, grad_output) if wanted else None for g, wanted in zip((grad_h, grad_w), ctx.mask))
        else:
            gh, gw = torch.ops.g4ops.linear_cross_entropy_backward(grad_output, grad_h, grad_w, ctx.mask)
        return (gh if ctx.mask[0] else None), (gw if ctx.mask[1] else None), None, None, None, None, None


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _loss_autograd(keyset, hidden, weight, labels, softcap=None, ignore_index=-100, reduction="mean", chunk_size=0):
    _check(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropyFunction.apply(hidden, weight, labels, softcap, ignore_index, reduction, chunk_size)
    return torch.ops.g4ops.linear_cross_entropy.default.redispatch(
        keyset & _BELOW_AUTOGRAD, hidden, weight, labels, softcap, ignore_index, reduction, chunk_size
    )


_lib.impl("linear_cross_entropy", _loss_autograd, "Autograd", with_keyset=True)
# The internal ops are steps of the formula above: they check their input and refuse to be differentiated.
_lib.impl(
    "linear_cross_entropy_forward",
    _internal_op_autograd("linear_cross_entropy_forward", _check_forward), "Autograd", with_keyset=True,
)
_lib.impl(
    "linear_cross_entropy_backward",
    _internal_op_autograd("linear_cross_entropy_backward", _check_backward), "Autograd", with_keyset=True,
)


# Autocast: like the stock lm_head (an nn.Linear), the GEMMs run in the autocast dtype; the loss stays fp32.
def _make_autocast(device_type: str, key: str):
    exclude = torch._C.DispatchKeySet(key)

    def _autocast(hidden, weight, labels, softcap=None, ignore_index=-100, reduction="mean", chunk_size=0):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return torch.ops.g4ops.linear_cross_entropy(
                hidden.to(dtype), weight.to(dtype), labels, softcap, ignore_index, reduction, chunk_size
            )

    return _autocast


for _device_type, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    _lib.impl("linear_cross_entropy", _make_autocast(_device_type, _key), _key)


# ----------------------------------------------------------------------------------------------------------------
# Python API


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None = 30.0,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    chunk_size: int = 0,
) -> torch.Tensor:
    """Cross-entropy of `softcap * tanh(hidden @ weight.T / softcap)` against `labels`, without materialising the
    logits. Rows are already aligned (row i predicts labels[i]); shift before calling for causal LM.

    Reduction follows HF's `fixed_cross_entropy`: the mean over non-ignored labels, or, when `num_items_in_batch`
    is given (a tensor or a number), the sum divided by it (no host sync for a tensor)."""
    if num_items_in_batch is None:
        return torch.ops.g4ops.linear_cross_entropy(hidden, weight, labels, softcap, ignore_index, "mean", chunk_size)
    total = torch.ops.g4ops.linear_cross_entropy(hidden, weight, labels, softcap, ignore_index, "sum", chunk_size)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
