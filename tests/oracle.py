"""Test oracle for the g4ops ops: fp64 math, stock transformers, an error metric, one tolerance table, random inputs.

- fp64 oracle: the forward and every gradient of both ops, written here in closed form from design.md sections 3
  and 4 (not imported from g4ops.ops.reference, so a bug there cannot hide in its own yardstick). `test_ops.py` checks
  the closed forms against torch autograd in fp64. Also decode attention (forward only: the op is inference only)
  and one AdamW update (Loshchilov and Hutter's decoupled weight decay with Adam's bias corrections).
- stock: what a user of HF transformers runs today, taken from transformers itself: `Gemma4RMSNorm` and
  `down(act(gate(x)) * up(x))` with `ACT2FN["gelu_pytorch_tanh"]`. Its gradients are torch autograd through it.
- `rel_err`: ||out - ref|| / ||ref|| in fp64; NaN or inf anywhere counts as a failure (returns inf).
- `TOLERANCE` and the functions below it: the only place a test takes a tolerance from.
- random inputs that never contain zeros, in contiguous and strided layouts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from g4ops.hf.patches import norm_eps

F64 = torch.float64

# ----------------------------------------------------------------------------------------------------------------
# fp64 oracle. Every function takes tensors of any floating dtype and device, and computes in fp64.


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(F64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x * (mean(x^2) + eps)^-1/2 * weight  (no `1 + w` offset)."""
    x, w = _f64(x), _f64(weight)
    y = x * (x.square().mean(-1, keepdim=True) + eps).rsqrt()
    return y if w is None else y * w


def rms_norm_grads(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dL/dx, dL/dweight or None), from y_i = w_i x_i r with r = (sum_j x_j^2 / D + eps)^-1/2.

    dy_i/dx_k = w_i (r delta_ik - x_i r^3 x_k / D), so with g_i = grad_out_i w_i:
        dL/dx_k = r g_k - r^3 x_k / D * sum_i g_i x_i
        dL/dw_i = sum over rows of grad_out_i x_i r
    """
    dy, x, w = _f64(grad_out), _f64(x), _f64(weight)
    d = x.shape[-1]
    r = (x.square().mean(-1, keepdim=True) + eps).rsqrt()
    g = dy if w is None else dy * w
    dx = r * g - r.pow(3) * x * (g * x).sum(-1, keepdim=True) / d
    dw = None if w is None else (dy * x * r).reshape(-1, d).sum(0)
    return dx, dw


def fp64_model(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers model whose Gemma4RMSNorms really compute in fp64. Stock's forward casts
    its input to fp32 (`hidden_states.float()`), so a plain `.double()` copy rounds every norm exactly as the fp32
    model does: an oracle that flatters stock fp32 and charges any other fp32 norm kernel with its own rounding."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    exact = copy.deepcopy(model).to(F64)
    for module in exact.modules():
        if isinstance(module, Gemma4RMSNorm):
            module.forward = functools.partial(_fp64_norm_forward, module)  # an instance attribute wins
    return exact


def _fp64_norm_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = x * (x.square().mean(-1, keepdim=True) + norm_eps(norm)).rsqrt()
    return y * norm.weight if norm.with_scale else y  # differentiable in the weight, unlike rms_norm above


def sandwich_norm(branch, residual, post_weight, pre_weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = residual + rms_norm(branch, post_weight), y = rms_norm(s, pre_weight), exact (s not rounded)."""
    s = _f64(residual) + rms_norm(branch, post_weight, eps)
    return s, rms_norm(s, pre_weight, eps)


def sandwich_norm_grads(grad_sum, grad_normed, branch, residual, post_weight, pre_weight, eps):
    """(dL/dbranch, dL/dresidual, dL/dpost_weight or None, dL/dpre_weight or None): s feeds the loss directly
    (grad_sum) and through y (grad_normed), so ds = grad_sum + (dy/ds)^T grad_normed = dL/dresidual."""
    s, _ = sandwich_norm(branch, residual, post_weight, pre_weight, eps)
    ds_from_y, d_pre = rms_norm_grads(grad_normed, s, pre_weight, eps)
    ds = _f64(grad_sum) + ds_from_y
    d_branch, d_post = rms_norm_grads(ds, branch, post_weight, eps)
    return d_branch, ds, d_post, d_pre


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    """0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), the `approximate="tanh"` GELU."""
    g = _f64(g)
    return 0.5 * g * (1.0 + torch.tanh(_GELU_C * (g + _GELU_A * g.pow(3))))


def gelu_tanh_grad(g: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh / dg = 0.5 (1 + t) + 0.5 g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2)."""
    g = _f64(g)
    t = torch.tanh(_GELU_C * (g + _GELU_A * g.pow(3)))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t.square()) * _GELU_C * (1.0 + 3.0 * _GELU_A * g.square())


def geglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(gelu_tanh(x Wg^T) * (x Wu^T)), weights [out, in]."""
    x, wg, wu, wd = map(_f64, (x, w_gate, w_up, w_down))
    return (gelu_tanh(x @ wg.T) * (x @ wu.T)) @ wd.T


def geglu_mlp_grads(
    grad_out: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dw_gate, dL/dw_up, dL/dw_down) of out = h Wd^T, h = gelu(g) * u, g = x Wg^T, u = x Wu^T."""
    dout, x, wg, wu, wd = map(_f64, (grad_out, x, w_gate, w_up, w_down))
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    g, u = x @ wg.T, x @ wu.T
    h = gelu_tanh(g) * u
    dh = dout @ wd
    dg = dh * u * gelu_tanh_grad(g)
    du = dh * gelu_tanh(g)
    dx = dg @ wg + du @ wu
    return dx, rows(dg).T @ rows(x), rows(du).T @ rows(x), rows(dout).T @ rows(h)


def _decode_attention_probs(q, k, mask, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p = softmax(scale * q k^T) over the visible keys [B, Hq, 1, S], 0 in a row without one; k repeated to the
    query heads [B, Hq, S, D]; the mask [B or 1, 1, 1, S]), in fp64. Query head h reads KV head h // (Hq / Hkv), as
    transformers' repeat_kv."""
    q, k = _f64(q), _f64(k)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    visible = mask.to(q.device)
    scores = torch.where(visible, q @ k.transpose(-1, -2) * scale, -math.inf)
    probs = torch.where(visible.any(-1, keepdim=True), torch.softmax(scores, -1), 0.0)  # all -inf: NaN -> 0
    return probs, k, visible


def _repeat_values(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return _f64(v).repeat_interleave(q.shape[1] // v.shape[1], dim=1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """One query token per sequence: sum_s p_s v_s over the visible keys (`_decode_attention_probs`); a row with no
    visible key is 0, and masked keys' k and v are not used."""
    probs, _, visible = _decode_attention_probs(q, k, mask, scale)
    return probs @ torch.where(visible.transpose(-1, -2), _repeat_values(v, q), 0.0)


def decode_attention_abs_terms(q, k, v, mask, scale) -> tuple[torch.Tensor, float]:
    """(sum_s p_s |v_s|, the largest scale * sum_d |q_d k_sd| over the visible keys): the terms of the weighted sum
    and of the q.k dot products over absolute values, for `decode_attention_noise`."""
    probs, k_rep, visible = _decode_attention_probs(q, k, mask, scale)
    score_terms = torch.where(visible, _f64(q).abs() @ k_rep.abs().transpose(-1, -2) * abs(scale), 0.0)
    return probs @ _repeat_values(v, q).abs(), score_terms.max().item()


def rms_norm_abs_terms(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, dx, dw) computed with every term of their final sum replaced by its absolute value.

    ||abs_terms|| / ||result|| is the condition number of that sum (>= 1): how much relative errors in its terms
    are amplified by cancellation (`condition`, used by `floor`). y = x r w has no sum. dx = r g - r^3 x sum(g x) / D
    cancels when g is nearly parallel to x; dw sums over rows."""
    dy, x, w = _f64(grad_out), _f64(x), _f64(weight)
    d = x.shape[-1]
    r = (x.square().mean(-1, keepdim=True) + eps).rsqrt()
    g = dy if w is None else dy * w
    y = rms_norm(x, w, eps).abs()
    dx = r * g.abs() + r.pow(3) * x.abs() * (g * x).abs().sum(-1, keepdim=True) / d
    dw = None if w is None else (dy * x * r).abs().reshape(-1, d).sum(0)
    return y, dx, dw


def geglu_mlp_abs_terms(
    grad_out: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, dx, dw_gate, dw_up, dw_down) with the GEMM that produces each from the [rows, intermediate] tensors
    (h, dg, du: where implementations round differently) taken over absolute values: |A| |B| for A B."""
    dout, x, wg, wu, wd = map(_f64, (grad_out, x, w_gate, w_up, w_down))
    rows = lambda t: t.reshape(-1, t.shape[-1]).abs()  # noqa: E731
    g, u = x @ wg.T, x @ wu.T
    h = gelu_tanh(g) * u
    dh = dout @ wd
    dg = dh * u * gelu_tanh_grad(g)
    du = dh * gelu_tanh(g)
    return (
        h.abs() @ wd.abs().T,
        dg.abs() @ wg.abs() + du.abs() @ wu.abs(),
        rows(dg).T @ rows(x),
        rows(du).T @ rows(x),
        rows(dout).T @ rows(h),
    )


# ----------------------------------------------------------------------------------------------------------------
# Stock transformers: the baseline g4ops must be at least as accurate as.


@contextlib.contextmanager
def jittered_norms(model: torch.nn.Module, seed: int):
    """While open, every Gemma4RMSNorm output of `model` is scaled by 1 +- 2^-23 per row (random sign from `seed`):
    a norm as accurate as stock's that rounds the other way. A small model's fp32 gradient amplifies such per-row
    rounding about 300-fold, and which way each rounding falls moves stock's own error 1.3-2.5x (CPU, 2026-12-01),
    so whole-model gradient tests take the worst of stock and stock run under this as their yardstick. A real defect
    (a wrong term, a 16-bit sum) lands orders of magnitude past it."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gen = torch.Generator().manual_seed(seed)

    def jitter(module, args, out):
        sign = torch.randint(0, 2, (*out.shape[:-1], 1), generator=gen).to(out) * 2 - 1
        return out * (1 + sign * 2.0**-23)

    handles = [m.register_forward_hook(jitter) for m in model.modules() if type(m) is Gemma4RMSNorm]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record_norm_calls(model: torch.nn.Module, inputs: torch.Tensor):
    """[(name, module, x, grad_out)] for each Gemma4RMSNorm call of one `model(inputs, labels=inputs)` forward and
    backward whose output gets a gradient, with copies of x and grad_out in the strides the call saw (so a replay
    takes the kernel's strided route: v_norm's gradient comes strided from the attention)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    def strided(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t.detach())

    calls = []

    def record(name):
        def hook(module, args, out):
            if out.requires_grad:  # the norms before the first adapter of a LoRA model see no gradient
                entry = [name, module, strided(args[0]), None]
                calls.append(entry)
                out.register_hook(lambda g: entry.__setitem__(3, strided(g)))

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if isinstance(m, Gemma4RMSNorm)]
    try:
        model(inputs, labels=inputs).loss.backward()
    finally:
        for h in handles:
            h.remove()
    return [tuple(c) for c in calls]


def stock_rms_norm_module(dim: int, weight: torch.Tensor | None, eps: float) -> torch.nn.Module:
    """transformers' Gemma4RMSNorm with `weight` (any dtype; None means with_scale=False) as its parameter."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    module = Gemma4RMSNorm(dim, eps=eps, with_scale=weight is not None)
    if weight is not None:
        module.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return module


def stock_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm(x) with a copy of `weight` as its parameter (`stock_rms_norm_with_grads` for gradients)."""
    return stock_rms_norm_module(x.shape[-1], weight, eps)(x)


def stock_rms_norm_with_grads(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, dL/dx, dL/dweight or None) from autograd through Gemma4RMSNorm, in the inputs' own dtypes."""
    module = stock_rms_norm_module(x.shape[-1], weight, eps)
    if weight is not None:
        module.weight.requires_grad_(True)
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad, (module.weight.grad if weight is not None else None)


def stock_sandwich_norm(branch, residual, post_weight, pre_weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma4TextDecoderLayer's middle: s = residual + post_attention_layernorm(branch); pre_feedforward_layernorm(s).
    Differentiable in all four inputs: the modules use the given weight tensors themselves."""
    post = stock_rms_norm_module(branch.shape[-1], None, eps) if post_weight is None else None
    pre = stock_rms_norm_module(branch.shape[-1], None, eps) if pre_weight is None else None
    s = residual + (post(branch) if post is not None else _stock_norm_with(branch, post_weight, eps))
    return s, (pre(s) if pre is not None else _stock_norm_with(s, pre_weight, eps))


def _stock_norm_with(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm.forward run with `weight` itself (not a copy) as the module's weight, so gradients reach it."""
    module = stock_rms_norm_module(x.shape[-1], weight, eps)
    del module.weight
    module.weight = weight
    return module(x)


def stock_decode_attention(q, k, v, mask, scale) -> torch.Tensor:
    """What transformers' SDPA attention does for a decode step: K/V repeated to the query heads (repeat_kv), then
    torch's scaled_dot_product_attention with the bool mask, in the inputs' dtype."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=scale)


def stock_geglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Gemma4TextMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)), as F.linear with these weights."""
    from transformers.activations import ACT2FN

    act = ACT2FN["gelu_pytorch_tanh"]
    return F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def with_grads(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(fn(*inputs), [dL/d input for each input]) with fresh leaves that keep the inputs' strides."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), list(grads)


def adamw_step(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float):
    """(p, m, v) after one AdamW update at step number `step` (1 for the first), exact in fp64:
    p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
    p <- p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)."""
    p, g, m, v = (_f64(t) for t in (p, g, m, v))
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1**step) * m / ((v / (1 - beta2**step)).sqrt() + eps)
    return p, m, v


# ----------------------------------------------------------------------------------------------------------------
# Error metric


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_2 / ||ref||_2 in fp64. NaN/inf in `out` (or a 0/0) returns inf, which fails every bound."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    o, r = out.detach().to(F64).cpu(), ref.detach().to(F64).cpu()
    if not torch.isfinite(o).all():
        return math.inf
    num, den = torch.linalg.vector_norm(o - r).item(), torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    err = num / den
    return err if math.isfinite(err) else math.inf


def condition(abs_terms: torch.Tensor, ref: torch.Tensor) -> float:
    """||abs_terms|| / ||ref|| (>= 1; inf when the result is exactly zero): the amplification of relative errors
    in the terms of the final sum that produced `ref` (see `rms_norm_abs_terms`, `geglu_mlp_abs_terms`)."""
    den = torch.linalg.vector_norm(ref.detach().to(F64)).item()
    return math.inf if den == 0.0 else max(1.0, torch.linalg.vector_norm(abs_terms.detach().to(F64)).item() / den)


# ----------------------------------------------------------------------------------------------------------------
# Tolerances: the one table, and the two bounds derived from it.
#
# Each row holds the unit roundoff u = eps/2 of a storage dtype (the largest relative error of one
# round-to-nearest) and u_acc, that of the dtype its reductions accumulate in: bf16/fp16 GEMMs and the ops'
# reductions accumulate in fp32 on CPU and CUDA, so u_acc = 2^-24 for them.
#
# (1) `tolerance(dtype, k, roundings)`: an upper bound on the norm-wise relative error, against the fp64 oracle
#     evaluated on the same (already rounded) inputs, of a result that went through `roundings` roundings to
#     `dtype` and reductions of length k in u_acc. Each rounding adds at most u (norm-wise, since every element's
#     error is at most u times itself; errors that pass through a GEMM stay about that size because their signs are
#     random). A k-term sum in u_acc has worst-case error k * u_acc * sum|terms| (Higham, Thm. 3.1) but, with
#     rounding errors of random sign, grows like sqrt(k) * u_acc; we use 4 sqrt(k) u_acc. Callers count roundings
#     generously (every intermediate that is stored in `dtype`), which is the margin.
# (2) `floor(dtype, k, n, kappa, draws, rounded_terms)`: the additive slack in
#     "err_g4ops <= 1.05 * err_stock + floor". Two terms, both noise that says nothing about which implementation
#     is more accurate:
#     - reordering noise: g4ops may sum the k terms of a reduction in another order than stock; the difference is
#       of the size of the accumulation error, 4 sqrt(k) u_acc. Far below one bf16/fp16 rounding, so comparisons in
#       those dtypes stay strict; in fp32 it is the whole error budget (fp32 results differ by order only).
#     - sampling noise: a norm-wise error over n independent samples is an average of n rounding errors, each
#       within [-u, u] relative, so it scatters by about u / sqrt(n) from draw to draw. An implementation with
#       fewer roundings is more accurate on average but can lose the draw on a handful of elements; we allow
#       4 u / sqrt(n * draws) (four standard deviations of the mean over `draws` draws). n counts independent
#       error samples: the elements of the result, or fewer when the result mixes fewer differently-rounded
#       values (the caller knows which).
#     Both terms are amplified by the condition number kappa of the final sum (||sum of |terms| || / ||result||)
#     when the differently rounded values are its terms. With k = 769, n = 4096 and kappa = 1 the floor is
#     0.06 u in bf16: the 5% margin dominates. Measured on this floor (test_ops.py's property harness, 600 random
#     MLP configurations, sizes 1 to 1025, all layouts and dtypes, plus 400 with every size <= 3): the largest
#     (err_g4ops - 1.05 err_stock) was 0.6 of it, and on average g4ops' error is 10% below stock's. Mutants
#     (exact-erf gelu, a bf16-summed norm weight gradient, a dropped weight in dx) exceed it; rounding twice like
#     stock does not, and test_geglu_mlp_rounds_intermediates_once catches that instead.


@dataclass(frozen=True)
class DtypeTolerance:
    u: float  # unit roundoff of the storage dtype: eps / 2
    u_acc: float  # unit roundoff of the accumulation dtype of reductions over values of this dtype


TOLERANCE: dict[torch.dtype, DtypeTolerance] = {
    torch.bfloat16: DtypeTolerance(u=torch.finfo(torch.bfloat16).eps / 2, u_acc=torch.finfo(torch.float32).eps / 2),
    torch.float16: DtypeTolerance(u=torch.finfo(torch.float16).eps / 2, u_acc=torch.finfo(torch.float32).eps / 2),
    torch.float32: DtypeTolerance(u=torch.finfo(torch.float32).eps / 2, u_acc=torch.finfo(torch.float32).eps / 2),
    torch.float64: DtypeTolerance(u=torch.finfo(torch.float64).eps / 2, u_acc=torch.finfo(torch.float64).eps / 2),
}


def _accumulation_noise(row: DtypeTolerance, k: int) -> float:
    return 4.0 * math.sqrt(max(k, 1)) * row.u_acc


def tolerance(dtype: torch.dtype, k: int, roundings: int = 1) -> float:
    """Bound (1): relative error vs fp64 after `roundings` roundings to `dtype` and length-k fp32/fp64 reductions."""
    row = TOLERANCE[dtype]
    return roundings * row.u + _accumulation_noise(row, k)


SAMPLING_SIGMAS = 4.0


def _sampling_noise(row: DtypeTolerance, n: int, draws: int) -> float:
    return SAMPLING_SIGMAS * row.u / math.sqrt(max(n * draws, 1))


def floor(
    dtype: torch.dtype, k: int, n: int, kappa: float = 1.0, draws: int = 1, rounded_terms: bool = True
) -> float:
    """Bound (2): slack of "err_g4ops <= 1.05 * err_stock + floor" for errors averaged over `draws` independent
    draws, each with n values rounded differently by the two implementations, reductions of length k, and a final
    sum of condition `kappa` (root mean square over the draws; 1 when there is no cancellation).

    `rounded_terms`: the differently rounded values are terms of that final sum (the MLP's h, dgate, dup), so
    their errors are amplified by kappa too; False when the implementations differ only in how they round the
    result itself (RMSNorm: both compute in fp32 and round once at the end), which no cancellation amplifies."""
    row = TOLERANCE[dtype]
    sampling = _sampling_noise(row, n, draws)
    return kappa * _accumulation_noise(row, k) + (kappa if rounded_terms else 1.0) * sampling


def decode_attention_noise(dtype: torch.dtype, keys: int, head_dim: int, kappa: float, score_terms: float) -> float:
    """Accumulation error of decode attention relative to ||out|| (the reductions run in u_acc): the weighted sum of
    `keys` values with condition kappa = ||sum_s p_s |v_s| || / ||out|| (`decode_attention_abs_terms`), and the q.k
    dot products of length head_dim, whose absolute error is that relative noise times `score_terms` (the largest
    scale * sum |q_d k_sd|); an error e in the scores moves the output by at most 2 e sum_s p_s |v_s|. The softmax's
    exp and division, and the split-K rescaling, add a few u_acc per term, inside the 4 of `_accumulation_noise`."""
    row = TOLERANCE[dtype]
    return kappa * (_accumulation_noise(row, keys) + 2.0 * score_terms * _accumulation_noise(row, head_dim))


def decode_attention_tolerance(dtype: torch.dtype, keys: int, head_dim: int, kappa: float, score_terms: float):
    """Bound (1) for decode attention: one rounding to `dtype` plus `decode_attention_noise`."""
    return TOLERANCE[dtype].u + decode_attention_noise(dtype, keys, head_dim, kappa, score_terms)


def decode_attention_floor(dtype, keys, head_dim, n, kappa, score_terms, draws=1) -> float:
    """Bound (2) for decode attention: `decode_attention_noise` (the reordering noise) plus the sampling noise of
    `floor` for n output elements per draw. g4ops rounds only the result, and so does stock at best
    (rounded_terms=False; a stock kernel that also rounds P to 16 bits only has a larger error)."""
    noise = decode_attention_noise(dtype, keys, head_dim, kappa, score_terms)
    return noise + _sampling_noise(TOLERANCE[dtype], n, draws)


STOCK_MARGIN = 1.05  # g4ops may be 5% worse than stock before the floor: a margin for the comparison, not a budget


def assert_no_worse_than_stock(name: str, err_g4: float, err_stock: float, slack: float) -> None:
    bound = STOCK_MARGIN * err_stock + slack
    assert err_g4 <= bound, (
        f"{name}: g4ops error vs fp64 {err_g4:.3e} > {STOCK_MARGIN} * stock error {err_stock:.3e} + floor "
        f"{slack:.3e} = {bound:.3e}"
    )


def assert_run_no_worse_than_stock(ours, stock, truth, out_k: int, grad_k: int, dtype: torch.dtype) -> None:
    """Runs of one layer as (output, input gradient, {parameter: gradient}, ...): each of g4ops' results no worse
    than stock's against the fp64 truth's, with reductions of `out_k` for the output and the input gradient and of
    `grad_k` for the parameters' gradients (bound (2), `floor`)."""
    pairs = [("out", ours[0], stock[0], truth[0], out_k), ("grad_x", ours[1], stock[1], truth[1], out_k)]
    pairs += [(name, ours[2][name], stock[2][name], truth[2][name], grad_k) for name in truth[2]]
    for name, g4, st, ref, k in pairs:
        assert_no_worse_than_stock(name, rel_err(g4, ref), rel_err(st, ref), floor(dtype, k, ref.numel()))


# ----------------------------------------------------------------------------------------------------------------
# Random inputs. Values never are zero (|v| >= 2^-8 before scaling), and layouts cover the strided cases the ops
# see in a model: slices of a wider projection, transposed storage, every other row, q/k-norm head views.

LAYOUTS = ("contiguous", "sliced", "transposed", "rowstep")


def nonzero_randn(shape, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """fp32 normal samples with |v| >= 2^-8 (then times `scale`), on CPU from `gen`."""
    v = torch.randn(shape, generator=gen, dtype=torch.float32)
    v = torch.where(v < 0, -1.0, 1.0) * v.abs().clamp_min(2.0**-8)
    return v * scale


def _materialise(base: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    out = base.to(dtype=dtype, device=device)
    assert (out != 0).all(), "random input underflowed to zero: use a larger scale"
    return out


def make_tensor(
    shape,
    dtype: torch.dtype,
    gen: torch.Generator,
    layout: str = "contiguous",
    device="cpu",
    scale: float = 1.0,
) -> torch.Tensor:
    """A random nonzero tensor of `shape` whose memory layout is `layout`:

    contiguous  plain
    sliced      x[..., :D] of a wider [..., D + 5] tensor: rows strided, last dim contiguous (a fused-QKV slice)
    transposed  the transpose of a contiguous tensor of the reversed shape: last dim not contiguous
    rowstep     x[::2] along the first dim: non-contiguous rows, last dim contiguous
    The result is a view into a larger or permuted base (callers that want a leaf use .detach()).
    """
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) == 0:
        return _materialise(nonzero_randn(shape, gen, scale), dtype, device)
    if layout == "sliced":
        wide = _materialise(nonzero_randn((*shape[:-1], shape[-1] + 5), gen, scale), dtype, device)
        return wide[..., : shape[-1]]
    if layout == "transposed":
        base = _materialise(nonzero_randn(shape[::-1], gen, scale), dtype, device)
        return base.permute(*reversed(range(len(shape))))
    if layout == "rowstep":
        base = _materialise(nonzero_randn((2 * shape[0], *shape[1:]), gen, scale), dtype, device)
        return base[::2]
    raise ValueError(f"unknown layout {layout!r}")


def make_qk_view(
    batch: int, seq: int, heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator, device="cpu",
    transpose: bool = False, extra_heads: int = 2, scale: float = 1.0,
) -> torch.Tensor:
    """A q/k-norm style 4-D view: the first heads * head_dim columns of a [b, s, (heads + extra) * head_dim] fused
    projection, viewed as [b, s, heads, head_dim] (or transposed to [b, heads, s, head_dim] when `transpose`)."""
    proj = _materialise(nonzero_randn((batch, seq, (heads + extra_heads) * head_dim), gen, scale), dtype, device)
    x = proj[..., : heads * head_dim].view(batch, seq, heads, head_dim)
    return x.transpose(1, 2) if transpose else x


def make_mlp_weights(
    hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator, device="cpu", layout: str = "contiguous"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate [inter, hidden], w_up [inter, hidden], w_down [hidden, inter]) scaled by 1/sqrt(fan_in) like
    nn.Linear's init, so activations stay O(1) (fp16 does not overflow at any tested size)."""
    return (
        make_tensor((inter, hidden), dtype, gen, layout, device, scale=hidden**-0.5),
        make_tensor((inter, hidden), dtype, gen, layout, device, scale=hidden**-0.5),
        make_tensor((hidden, inter), dtype, gen, layout, device, scale=inter**-0.5),
    )
