"""Reference math for every g4ops op, written once.

These functions are the kernels that run on any device without compiled code (CPU, XLA, CUDA when the user allowed
the fallback), the fast twin of the tests' fp64 oracle, and what neuron_backend lowers. They take already-validated
inputs (core.py checks them) and follow the numerics contract of design.md section 4:

- RMSNorm reproduces transformers' `Gemma4RMSNorm.forward` (modeling_gemma4.py: `x.float()`, `pow(2).mean(-1)`,
  `torch.pow(ms + eps, -0.5)`, times `weight.float()`, `type_as(x)`), so fp32 models match stock bit for bit on CPU.
  Accumulation is fp32, or fp64 for fp64 inputs so gradcheck works; one rounding to the output dtype.
- GeGLU: `gelu_tanh(g) * u` computed in fp32 from the GEMM outputs and rounded once. Stock rounds twice (after the
  gelu and after the product); one rounding is closer to the exact value.
- decode_attention: scores, softmax and the weighted sum of values in the accumulation dtype, rounded once. A row
  with no visible key is 0, and masked keys are never used (csrc/decode_attention.cu does not read them).
- adamw_step: in place, AdamW in the accumulation dtype with coefficients rounded once from double, as
  csrc/adamw.cu computes it (`adamw_step` says where torch's fused AdamW differs).

Every output is a fresh contiguous tensor (the fake kernels promise exactly that); adamw_step returns nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (gradcheck); every other floating dtype computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def truncated_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` with the mantissa bits that bf16/fp16 `dtype` lacks cleared: a value exact in `dtype` (for normal
    values in its range), and x - it is exact in fp32. Taken from the bits, not by rounding with x.to(dtype):
    Inductor keeps fused bf16/fp16 values in fp32 (it drops the rounding of x.to(dtype).float()), so a remainder
    computed from a rounding comes out zero under torch.compile."""
    keep = -(1 << (23 - _MANTISSA_BITS[dtype]))  # int32 mask of the sign, exponent and the leading mantissa bits
    return (x.view(torch.int32) & keep).view(torch.float32)


def _inverse_rms(x_acc: torch.Tensor, eps: float) -> torch.Tensor:
    # torch.pow(..., -0.5) rather than rsqrt: the same expression as transformers, for bitwise-equal fp32 results.
    return torch.pow(x_acc.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def _normalized(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rms_norm in the accumulation dtype, before its one rounding."""
    x_acc = x.to(accumulation_dtype(x.dtype))
    y = x_acc * _inverse_rms(x_acc, eps)
    return y * weight.to(y.dtype) if weight is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _normalized(x, weight, eps).to(x.dtype).contiguous()


def _rms_norm_backward_acc(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in the accumulation dtype, grad_weight in weight.dtype or an empty tensor); `dy` in any dtype."""
    acc = accumulation_dtype(x.dtype)
    x_acc = x.to(acc)
    inv_rms = _inverse_rms(x_acc, eps)
    x_hat = x_acc * inv_rms
    dy = dy.to(acc)
    dy_w = dy * weight.to(acc) if weight is not None else dy
    # d/dx [x * r(x)] with r = (mean(x^2)+eps)^-1/2:  r * (g - x_hat * mean(g * x_hat))
    grad_x = inv_rms * (dy_w - x_hat * (dy_w * x_hat).mean(-1, keepdim=True))
    if weight is not None and weight_grad:
        grad_w = (dy * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    else:
        grad_w = x.new_empty(0)
    return grad_x, grad_w


def rms_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (grad_x in x.dtype, grad_weight in weight.dtype, or an empty tensor when not asked for)."""
    grad_x, grad_w = _rms_norm_backward_acc(grad_out, x, weight, eps, weight_grad)
    return grad_x.to(x.dtype).contiguous(), grad_w


def sandwich_norm(
    branch: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
    pre_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's sandwich: (s, y) with s = residual + rms_norm(branch, post_weight), rounded once (stock rounds the norm
    and then the sum), and y = rms_norm(s, pre_weight) of the rounded s, which is what the next layer reads."""
    acc = accumulation_dtype(residual.dtype)
    s = (residual.to(acc) + _normalized(branch, post_weight, eps)).to(residual.dtype).contiguous()
    return s, rms_norm(s, pre_weight, eps)


def sandwich_norm_backward(
    grad_sum: torch.Tensor, grad_normed: torch.Tensor, branch: torch.Tensor, s: torch.Tensor,
    post_weight: torch.Tensor | None, pre_weight: torch.Tensor | None, eps: float, weight_grads: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_branch, grad_residual, grad_post_weight, grad_pre_weight); `s` is the forward's rounded sum. The sum's
    gradient ds = grad_sum + d(y)/ds stays in the accumulation dtype for grad_branch and is rounded once for
    grad_residual. A weight gradient not asked for (or without a weight) is an empty tensor."""
    grad_s, grad_pre = _rms_norm_backward_acc(grad_normed, s, pre_weight, eps, weight_grads[1])
    ds = grad_s + grad_sum.to(grad_s.dtype)
    grad_branch, grad_post = _rms_norm_backward_acc(ds, branch, post_weight, eps, weight_grads[0])
    return grad_branch.to(branch.dtype).contiguous(), ds.to(s.dtype).contiguous(), grad_post, grad_pre


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up in the accumulation dtype, rounded once to gate.dtype (contiguous)."""
    acc = accumulation_dtype(gate.dtype)
    return (F.gelu(gate.to(acc), approximate="tanh") * up.to(acc)).to(gate.dtype).contiguous()


def gelu_tanh_mul_backward(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up, h): h is recomputed here for the down-projection weight gradient instead of saved."""
    acc = accumulation_dtype(gate.dtype)
    g, u, dh = gate.to(acc), up.to(acc), grad_h.to(acc)
    gelu_g = F.gelu(g, approximate="tanh")
    grad_gate = torch.ops.aten.gelu_backward(dh * u, g, approximate="tanh")
    return grad_gate.to(gate.dtype), (dh * gelu_g).to(gate.dtype), (gelu_g * u).to(gate.dtype)


def gelu_tanh_mul_grads(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, output_mask: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """g4ops.gelu_tanh_mul_backward: (grad_gate, grad_up), contiguous; an output whose mask entry is False is an
    empty tensor."""
    grad_gate, grad_up, _ = gelu_tanh_mul_backward(grad_out, gate, up)
    grads = (grad_gate, grad_up)
    return tuple(g.contiguous() if wanted else gate.new_empty(0) for g, wanted in zip(grads, output_mask))


def geglu_mlp_forward(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, gate, up): the training forward keeps the two GEMM outputs for the backward."""
    gate = F.linear(x, w_gate)
    up = F.linear(x, w_up)
    out = F.linear(gelu_tanh_mul(gate, up), w_down)
    return out.contiguous(), gate.contiguous(), up.contiguous()


def geglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return geglu_mlp_forward(x, w_gate, w_up, w_down)[0]


def geglu_mlp_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_w_gate, grad_w_up, grad_w_down); an output whose mask entry is False is an empty tensor."""
    grad_h = F.linear(grad_out, w_down.t())
    grad_gate, grad_up, h = gelu_tanh_mul_backward(grad_h, gate, up)
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    # a fresh empty tensor per skipped output: outputs of a functional op must not alias each other
    empty = lambda: x.new_empty(0)  # noqa: E731
    grad_x = (F.linear(grad_gate, w_gate.t()) + F.linear(grad_up, w_up.t())).contiguous() if output_mask[0] else empty()
    grad_wg = (rows(grad_gate).t() @ rows(x)) if output_mask[1] else empty()
    grad_wu = (rows(grad_up).t() @ rows(x)) if output_mask[2] else empty()
    grad_wd = (rows(grad_out).t() @ rows(h)) if output_mask[3] else empty()
    return grad_x, grad_wg, grad_wu, grad_wd


def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """The lookup itself: ATen's, as stock (padding_idx -1: none)."""
    return torch.nn.functional.embedding(indices, weight, None if padding_idx < 0 else padding_idx)


def embedding_backward(grad_out: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int):
    """Weight gradient of an embedding lookup: grad_out's rows summed into the rows `indices` name (the padding row
    gets none) in the accumulation dtype. On CUDA that is ATen's kernel as is: fp32 partial sums and no
    [rows, dim] fp32 table; for up to 3072 indices it rounds into grad_out's dtype once per 32-index chunk, beyond
    that once per row. ATen's CPU kernel sums bf16/fp16 in their own dtype, so on other devices the sum runs on an
    upcast copy and rounds once."""
    if grad_out.is_cuda:
        return torch.ops.aten.embedding_dense_backward(grad_out, indices, num_weights, padding_idx, False)
    acc = accumulation_dtype(grad_out.dtype)
    grad_w = torch.ops.aten.embedding_dense_backward(grad_out.to(acc), indices, num_weights, padding_idx, False)
    return grad_w.to(grad_out.dtype)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, 1, D], k and v [B, Hkv, S, D], mask bool [B or 1, 1, 1, S] (True =
    attend); query head h reads KV head h // (Hq / Hkv) (transformers' repeat_kv order), without repeating K/V.
    out = sum_s p_s v_s with p = softmax over the visible keys of (q . k_s) * scale. A row with no visible key is 0
    (SDPA gives NaN); the k and v of masked keys do not matter (an unwritten cache slot may hold NaN)."""
    acc = accumulation_dtype(q.dtype)
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    hidden = ~mask
    scores = (q.to(acc).reshape(b, hkv, hq // hkv, d) @ k.to(acc).transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    scores = scores.masked_fill(hidden, float("-inf"))
    # the max of a row with no visible key is -inf: clamped, every exp is 0 and so is that row's output
    p = torch.exp(scores - scores.amax(-1, keepdim=True).clamp_min(torch.finfo(acc).min))
    values = v.to(acc).masked_fill(hidden.transpose(-1, -2), 0.0)
    # the sum is >= 1 when a key is visible (the largest score gives exp(0)); the clamp only keeps empty rows at 0
    out = (p @ values) / p.sum(-1, keepdim=True).clamp_min(1.0)
    return out.reshape(b, hq, 1, d).to(q.dtype)


def adamw_step(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: float, beta1: float, beta2: float,
    weight_decay: float, eps: float,
) -> None:
    """One AdamW update of each (param, grad, exp_avg, exp_avg_sq) in place, at step number steps[i] (already counted).

    In the accumulation dtype A (fp32; fp64 for fp64), every coefficient rounded once from its double value to A,
    the bias corrections computed in double:
        p = p - (lr * weight_decay) * p;   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
        p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    then p, m and v are rounded once to their dtype. torch's fused AdamW evaluates the moments and the decay in
    double instead, per its source (csrc/adamw.cu says why g4ops does not); its foreach AdamW in the tensors' dtype.
    Reads each step number on the host (this is not the fast path)."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        if p.numel() == 0:
            continue
        acc = accumulation_dtype(p.dtype)

        def coefficient(value: float) -> torch.Tensor:
            return torch.tensor(value, dtype=acc)  # rounded once from the double

        t = float(step)
        p_acc, g_acc = p.to(acc), g.to(acc)
        if weight_decay != 0:
            p_acc = p_acc - coefficient(lr * weight_decay) * p_acc
        m_acc = coefficient(beta1) * m.to(acc) + coefficient(1 - beta1) * g_acc
        v_acc = coefficient(beta2) * v.to(acc) + coefficient(1 - beta2) * g_acc * g_acc
        denom = v_acc.sqrt() / coefficient(math.sqrt(1 - beta2**t)) + coefficient(eps)
        p_acc = p_acc - coefficient(lr / (1 - beta1**t)) * m_acc / denom
        p.copy_(p_acc)
        m.copy_(m_acc)
        v.copy_(v_acc)
