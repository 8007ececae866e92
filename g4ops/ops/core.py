"""The g4ops operators: schemas (declared here, once), input checks, reference/fake/autograd/autocast registrations.

Public ops (design.md section 3):
    torch.ops.g4ops.rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor
    torch.ops.g4ops.geglu_mlp(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down) -> Tensor
    torch.ops.g4ops.sandwich_norm(Tensor branch, Tensor residual, Tensor? post_weight, Tensor? pre_weight, float eps)
        -> (Tensor sum, Tensor normed)     Gemma's post-norm + residual add + next pre-norm (reference.py says how)
    torch.ops.g4ops.gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor
                                           gelu_tanh(gate) * up, one rounding: the GeGLU product alone (Gemma-4's
                                           per-layer-input gate; `gelu_tanh_mul` below says why it is an op)
    torch.ops.g4ops.embedding(Tensor indices, Tensor weight, SymInt padding_idx) -> Tensor
                                           F.embedding whose weight gradient is embedding_backward (`embedding`)
    torch.ops.g4ops.decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor
                                           one query token per sequence over a KV cache, grouped-query without
                                           repeating K/V; inference only (`decode_attention` below)
    torch.ops.g4ops.adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs,
        Tensor(c!)[] exp_avg_sqs, Tensor[] steps, float lr, float beta1, float beta2, float weight_decay,
        float eps) -> ()                   one AdamW update in place, fp32 math (g4ops/optim.py)
Internal ops, each a real operator so autograd, torch.compile and CUDA graphs see them:
    rms_norm_backward      grad_x and the weight gradient (fp32 reduction) of rms_norm
    geglu_mlp_forward      the training forward: also returns the gate and up GEMM outputs for the backward
    geglu_mlp_backward     grad_x and all three weight gradients, from the saved gate/up (h is recomputed)
    sandwich_norm_backward grad_branch, grad_residual and both weight gradients, from the saved branch and sum
    gelu_tanh_mul_backward grad_gate and grad_up of gelu_tanh_mul
    embedding_backward     the weight gradient of an embedding lookup (`embedding` below), kept opaque to Inductor

Kernels per op: the reference math (reference.py) is registered as CompositeExplicitAutograd, so it runs on every
device; csrc/ registers CUDA kernels for the same names, which the dispatcher prefers on CUDA tensors. Autograd is
an `Autograd` kernel (like a C++ op's) so that the training forward can save tensors the public op does not return.
Input checks run in a `BackendSelect` kernel, which the dispatcher visits in every mode (also under
torch.inference_mode, which skips the Autograd kernels) right before the device kernel; the fake kernels call the
same checks, so compile-time and run-time errors agree.
"""

from __future__ import annotations

import torch

from . import reference
from ._build import ensure_cuda_kernels

NAMESPACE = "g4ops"
_lib = torch.library.Library(NAMESPACE, "DEF")

_SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor",
    "rms_norm_backward": (
        "rms_norm_backward(Tensor grad_out, Tensor x, Tensor? weight, float eps, bool weight_grad)"
        " -> (Tensor, Tensor)"
    ),
    "geglu_mlp": "geglu_mlp(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down) -> Tensor",
    "geglu_mlp_forward": (
        "geglu_mlp_forward(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down) -> (Tensor, Tensor, Tensor)"
    ),
    "geglu_mlp_backward": (
        "geglu_mlp_backward(Tensor grad_out, Tensor x, Tensor gate, Tensor up, Tensor w_gate, Tensor w_up,"
        " Tensor w_down, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "sandwich_norm": (
        "sandwich_norm(Tensor branch, Tensor residual, Tensor? post_weight, Tensor? pre_weight, float eps)"
        " -> (Tensor, Tensor)"
    ),
    "sandwich_norm_backward": (
        "sandwich_norm_backward(Tensor grad_sum, Tensor grad_normed, Tensor branch, Tensor sum, Tensor? post_weight,"
        " Tensor? pre_weight, float eps, bool[2] weight_grads) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "gelu_tanh_mul": "gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor",
    "gelu_tanh_mul_backward": (
        "gelu_tanh_mul_backward(Tensor grad_out, Tensor gate, Tensor up, bool[2] output_mask) -> (Tensor, Tensor)"
    ),
    "embedding": "embedding(Tensor indices, Tensor weight, SymInt padding_idx) -> Tensor",
    "embedding_backward": (
        "embedding_backward(Tensor grad_out, Tensor indices, SymInt num_weights, SymInt padding_idx) -> Tensor"
    ),
    "decode_attention": "decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor",
    "adamw_step": (
        "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,"
        " Tensor[] steps, float lr, float beta1, float beta2, float weight_decay, float eps) -> ()"
    ),
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)


# ----------------------------------------------------------------------------------------------------------------
# Input checks, run before any kernel sees the input (the BackendSelect guard below, and the fake kernels).
# torch._check* keeps them trace-safe.

_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(cond, message) -> None:
    """torch._check, without its cost when `cond` is a plain True: the guard runs every op call's checks on the host
    (an uncaptured training step makes hundreds), and torch._check takes about 5 us each where `is` takes 0.05 (2-core
    CPU). Anything else (False, a SymBool in a fake kernel) goes to torch._check: same errors, same deferred asserts."""
    if cond is not True:
        torch._check(cond, message)


def _check_type(cond, message) -> None:
    """torch._check_type (a TypeError), with _check's shortcut."""
    if cond is not True:
        torch._check_type(cond, message)


def _check_floating(name: str, t: torch.Tensor) -> None:
    _check_type(
        t.dtype in _ACTIVATION_DTYPES,
        lambda: f"g4ops: `{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}",
    )


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        _check(
            t.device == first.device,
            lambda: f"g4ops.{op}: `{name}` is on {t.device} but `{first_name}` is on {first.device}",
        )


def _check_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, op: str = "rms_norm",
                    x_name: str = "x", weight_name: str = "weight") -> None:  # fmt: skip
    _check_floating(x_name, x)
    _check(x.dim() >= 1, lambda: f"g4ops.{op}: `{x_name}` must have at least one dimension")
    _check(eps >= 0.0, lambda: f"g4ops.{op}: `eps` must be >= 0, got {eps}")
    if weight is not None:
        _check_floating(weight_name, weight)
        _check(
            weight.dim() == 1 and weight.shape[0] == x.shape[-1],
            lambda: f"g4ops.{op}: `{weight_name}` must have shape [{x.shape[-1]}] (the last dim of `{x_name}`), "
            f"got {list(weight.shape)}",
        )
        _check_same_device(op, **{x_name: x, weight_name: weight})


def _check_geglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    _check_floating("x", x)
    _check(x.dim() >= 1, lambda: "g4ops.geglu_mlp: `x` must have at least one dimension")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check_floating(name, w)
        _check(w.dim() == 2, lambda: f"g4ops.geglu_mlp: `{name}` must be 2-D [out, in], got {list(w.shape)}")
        _check(
            w.dtype == x.dtype,
            lambda: f"g4ops.geglu_mlp: `{name}` is {w.dtype} but `x` is {x.dtype}; the MLP weights must have the "
            "activation dtype (under torch.autocast the op casts them for you)",
        )
    hidden, inter = x.shape[-1], w_gate.shape[0]
    _check(
        w_gate.shape[1] == hidden,
        lambda: f"g4ops.geglu_mlp: `w_gate` must be [intermediate, {hidden}], got {list(w_gate.shape)}",
    )
    _check(
        w_up.shape[0] == inter and w_up.shape[1] == hidden,
        lambda: f"g4ops.geglu_mlp: `w_up` must be [{inter}, {hidden}] like `w_gate`, got {list(w_up.shape)}",
    )
    _check(
        w_down.shape[0] == hidden and w_down.shape[1] == inter,
        lambda: f"g4ops.geglu_mlp: `w_down` must be [{hidden}, {inter}], got {list(w_down.shape)}",
    )
    _check_same_device("geglu_mlp", x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)


def _check_gelu_tanh_mul(gate, up, op="gelu_tanh_mul"):
    _check_floating("gate", gate)
    _check_shape(op, "up", up, gate.shape, "`gate`")
    _check_type(
        up.dtype == gate.dtype,
        lambda: f"g4ops.{op}: `up` is {up.dtype} but `gate` is {gate.dtype}; they must match",
    )
    _check_same_device(op, gate=gate, up=up)


def _check_gelu_tanh_mul_backward(grad_out, gate, up, output_mask):
    op = "gelu_tanh_mul_backward"
    _check_gelu_tanh_mul(gate, up, op)
    _check_shape(op, "grad_out", grad_out, gate.shape, "`gate`")
    _check_type(
        grad_out.dtype == gate.dtype,
        lambda: f"g4ops.{op}: `grad_out` is {grad_out.dtype} but `gate` is {gate.dtype}; they must match",
    )
    _check_same_device(op, gate=gate, grad_out=grad_out)


def _check_shape(op: str, name: str, t: torch.Tensor, shape, like: str) -> None:
    _check(
        tuple(t.shape) == tuple(shape),
        lambda: f"g4ops.{op}: `{name}` must have the shape of {like} {list(shape)}, got {list(t.shape)}",
    )


def _check_rms_norm_backward(grad_out, x, weight, eps, weight_grad):
    _check_rms_norm(x, weight, eps)
    _check_floating("grad_out", grad_out)
    _check_shape("rms_norm_backward", "grad_out", grad_out, x.shape, "`x`")
    _check_same_device("rms_norm_backward", x=x, grad_out=grad_out)


def _check_sandwich_norm(branch, residual, post_weight, pre_weight, eps, op="sandwich_norm"):
    _check_rms_norm(branch, post_weight, eps, op, "branch", "post_weight")
    _check_shape(op, "residual", residual, branch.shape, "`branch`")
    _check(
        residual.dtype == branch.dtype,
        lambda: f"g4ops.{op}: `residual` is {residual.dtype} but `branch` is {branch.dtype}; they must match",
    )
    _check_same_device(op, branch=branch, residual=residual)
    _check_rms_norm(residual, pre_weight, eps, op, "residual", "pre_weight")


def _check_sandwich_norm_backward(grad_sum, grad_normed, branch, s, post_weight, pre_weight, eps, weight_grads):
    op = "sandwich_norm_backward"
    _check_sandwich_norm(branch, s, post_weight, pre_weight, eps, op)
    for name, t in (("grad_sum", grad_sum), ("grad_normed", grad_normed)):
        _check_floating(name, t)
        _check_shape(op, name, t, branch.shape, "`branch`")
        _check_same_device(op, branch=branch, **{name: t})


def _check_embedding_rows(op: str, indices, num_weights, padding_idx):
    _check_type(
        indices.dtype in (torch.int32, torch.int64),
        lambda: f"g4ops.{op}: `indices` must be int32 or int64, got {indices.dtype}",
    )
    _check(num_weights >= 1, lambda: f"g4ops.{op}: `num_weights` must be >= 1, got {num_weights}")
    _check(
        -1 <= padding_idx < num_weights,
        lambda: f"g4ops.{op}: `padding_idx` must be -1 (none) or a row in [0, {num_weights}), got {padding_idx}",
    )


def _check_embedding(indices, weight, padding_idx):
    op = "embedding"
    _check_floating("weight", weight)
    _check(weight.dim() == 2, lambda: f"g4ops.{op}: `weight` must be 2-D [rows, dim], got {list(weight.shape)}")
    _check_embedding_rows(op, indices, weight.shape[0], padding_idx)
    _check_same_device(op, weight=weight, indices=indices)


def _check_embedding_backward(grad_out, indices, num_weights, padding_idx):
    op = "embedding_backward"
    _check_floating("grad_out", grad_out)
    _check_embedding_rows(op, indices, num_weights, padding_idx)
    _check_shape(op, "grad_out", grad_out, (*indices.shape, grad_out.shape[-1]), "`indices` + [embedding_dim]")
    _check_same_device(op, grad_out=grad_out, indices=indices)


def _check_decode_attention(q, k, v, mask, scale):
    op = "decode_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_floating(name, t)
        _check(t.dim() == 4, lambda: f"g4ops.{op}: `{name}` must be 4-D, got {list(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        _check_type(
            t.dtype == q.dtype, lambda: f"g4ops.{op}: `{name}` is {t.dtype} but `q` is {q.dtype}; they must match"
        )
    _check_type(
        mask.dtype == torch.bool, lambda: f"g4ops.{op}: `mask` must be bool (True = attend), got {mask.dtype}"
    )
    b, hq, tokens, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    _check(
        tokens == 1,
        lambda: f"g4ops.{op}: `q` must hold one query token per sequence [B, Hq, 1, D], got {list(q.shape)}",
    )
    _check(
        k.shape[0] == b and k.shape[3] == d and hkv >= 1 and s >= 1,
        lambda: f"g4ops.{op}: `k` must be [{b}, Hkv >= 1, S >= 1, {d}] (B and D of `q`), got {list(k.shape)}",
    )
    _check(
        hq % hkv == 0,
        lambda: f"g4ops.{op}: the {hq} query heads of `q` must be a multiple of the {hkv} KV heads of `k`",
    )
    _check_shape(op, "v", v, k.shape, "`k`")
    _check(
        mask.dim() == 4 and mask.shape[0] in (1, b) and mask.shape[1] == 1 and mask.shape[2] == 1
        and mask.shape[3] == s,
        lambda: f"g4ops.{op}: `mask` must be [{b}, 1, 1, {s}] or [1, 1, 1, {s}], got {list(mask.shape)}",
    )
    for name, t in (("k", k), ("v", v)):
        _check(
            t.stride(-1) == 1 or d == 1,
            lambda: f"g4ops.{op}: `{name}` must have a contiguous last dim (stride 1), got strides {t.stride()}",
        )
    _check_same_device(op, q=q, k=k, v=v, mask=mask)


def _check_adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps):
    op = "adamw_step"
    lists = dict(grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    for name, tensors in lists.items():
        _check(
            len(tensors) == len(params),
            lambda: f"g4ops.{op}: `{name}` has {len(tensors)} tensors but `params` has {len(params)}",
        )
    for name, value, ok, rule in (
        ("lr", lr, lr >= 0.0, ">= 0"), ("beta1", beta1, 0.0 <= beta1 < 1.0, "in [0, 1)"),
        ("beta2", beta2, 0.0 <= beta2 < 1.0, "in [0, 1)"), ("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0"),
        ("eps", eps, eps >= 0.0, ">= 0"),
    ):  # fmt: skip
        _check(ok, lambda: f"g4ops.{op}: `{name}` must be {rule}, got {value}")
    # One cheap test per entry, the named checks only for an entry that fails it: an optimizer passes hundreds of
    # entries every step, and the named checks took 22 ms for E4B's 623 (the cheap test: 1.2 ms).
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        shape, strides, device = p.shape, p.stride(), p.device
        if not (
            p.dtype in _ACTIVATION_DTYPES and g.dtype == m.dtype == v.dtype == p.dtype
            and g.shape == m.shape == v.shape == shape and g.stride() == m.stride() == v.stride() == strides
            and g.device == m.device == v.device == step.device == device
            and step.dtype == torch.float32 and step.numel() == 1
            and (p.is_contiguous() or torch._prims_common.is_non_overlapping_and_dense_or_false(p))
        ):  # fmt: skip
            _check_adamw_entry(op, i, p, g, m, v, step)


def _check_adamw_entry(op, i, p, g, m, v, step):
    _check_floating(f"params[{i}]", p)
    _check(
        torch._prims_common.is_non_overlapping_and_dense_or_false(p),
        lambda: f"g4ops.{op}: `params[{i}]` must be non-overlapping and dense (a parameter, not a strided view), "
        f"got shape {list(p.shape)} with strides {p.stride()}",
    )
    for name, t in ((f"grads[{i}]", g), (f"exp_avgs[{i}]", m), (f"exp_avg_sqs[{i}]", v)):
        _check_type(
            t.dtype == p.dtype, lambda: f"g4ops.{op}: `{name}` is {t.dtype} but `params[{i}]` is {p.dtype}"
        )
        _check(
            t.shape == p.shape and t.stride() == p.stride(),
            lambda: f"g4ops.{op}: `{name}` must have the shape and strides of `params[{i}]` "
            f"({list(p.shape)}, {p.stride()}), got {list(t.shape)}, {t.stride()}",
        )
        _check_same_device(op, **{f"params[{i}]": p, name: t})
    _check_type(
        step.dtype == torch.float32 and step.numel() == 1,
        lambda: f"g4ops.{op}: `steps[{i}]` must be a float32 scalar tensor (the step number), got {step.dtype} "
        f"with {step.numel()} elements",
    )
    _check_same_device(op, **{f"params[{i}]": p, f"steps[{i}]": step})


def _check_geglu_backward(grad_out, x, gate, up, w_gate, w_up, w_down, output_mask):
    _check_geglu(x, w_gate, w_up, w_down)
    for name, t in (("grad_out", grad_out), ("gate", gate), ("up", up)):
        _check_floating(name, t)
        _check_same_device("geglu_mlp_backward", x=x, **{name: t})
    _check_shape("geglu_mlp_backward", "grad_out", grad_out, (*x.shape[:-1], w_down.shape[0]), "the MLP output")
    inter = (*x.shape[:-1], w_gate.shape[0])
    _check_shape("geglu_mlp_backward", "gate", gate, inter, "x @ w_gate.T")
    _check_shape("geglu_mlp_backward", "up", up, inter, "x @ w_up.T")


# ----------------------------------------------------------------------------------------------------------------
# Reference kernels (every device). On a CUDA tensor they first make sure the compiled kernels were tried: once
# they load, the dispatcher routes CUDA calls to them and the reference only runs if the user allowed the fallback.


def _cuda_kernels_just_loaded(args: tuple) -> bool:
    first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]  # adamw_step takes lists
    return isinstance(first, torch.Tensor) and first.device.type == "cuda" and ensure_cuda_kernels()


# op name -> (its input check, its reference math); one row per op, read by the guard and reference kernels.
_OPS = {
    "rms_norm": (_check_rms_norm, reference.rms_norm),
    "rms_norm_backward": (_check_rms_norm_backward, reference.rms_norm_backward),
    "geglu_mlp": (_check_geglu, reference.geglu_mlp),
    "geglu_mlp_forward": (_check_geglu, reference.geglu_mlp_forward),
    "geglu_mlp_backward": (_check_geglu_backward, reference.geglu_mlp_backward),
    "sandwich_norm": (_check_sandwich_norm, reference.sandwich_norm),
    "sandwich_norm_backward": (_check_sandwich_norm_backward, reference.sandwich_norm_backward),
    "gelu_tanh_mul": (_check_gelu_tanh_mul, reference.gelu_tanh_mul),
    "gelu_tanh_mul_backward": (_check_gelu_tanh_mul_backward, reference.gelu_tanh_mul_grads),
    "decode_attention": (_check_decode_attention, reference.decode_attention),
    "adamw_step": (_check_adamw_step, reference.adamw_step),
}
# Ops whose kernel on every device is ATen's own (no csrc kernel): op name -> (check, kernel).
_ATEN_OPS = {
    "embedding": (_check_embedding, reference.embedding),
    "embedding_backward": (_check_embedding_backward, reference.embedding_backward),
}


def _reference_kernel(name: str):
    op = getattr(torch.ops.g4ops, name)
    math = _OPS[name][1]

    def kernel(*args):
        if _cuda_kernels_just_loaded(args):  # from x, grad_out (on x's device, checked) or params[0]
            return op(*args)  # the compiled kernels have just loaded: dispatch to them
        return math(*args)

    return kernel


def _guard_kernel(name: str):
    """Runs the op's check, then dispatches on to the device kernel. A Python error here is clean everywhere; a
    failing C++ check inside the CUDA extension crashed the process on the H200 image (2026-11-29)."""
    op = getattr(torch.ops.g4ops, name).default
    check = {**_OPS, **_ATEN_OPS}[name][0]

    def kernel(keyset, *args):
        check(*args)
        return op.redispatch(keyset.remove(torch._C.DispatchKey.BackendSelect), *args)

    return kernel


for _name in _OPS:
    _lib.impl(_name, _reference_kernel(_name), "CompositeExplicitAutograd")
    _lib.impl(_name, _guard_kernel(_name), "BackendSelect", with_keyset=True)
for _name, (_, _kernel) in _ATEN_OPS.items():
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    _lib.impl(_name, _guard_kernel(_name), "BackendSelect", with_keyset=True)


# ----------------------------------------------------------------------------------------------------------------
# Fake kernels: exact sizes, strides (always contiguous) and dtypes.


@torch.library.register_fake("g4ops::rms_norm", lib=_lib)
def _rms_norm_fake(x, weight, eps):
    _check_rms_norm(x, weight, eps)
    return x.new_empty(x.shape)


@torch.library.register_fake("g4ops::rms_norm_backward", lib=_lib)
def _rms_norm_backward_fake(grad_out, x, weight, eps, weight_grad):
    _check_rms_norm_backward(grad_out, x, weight, eps, weight_grad)
    grad_w = weight.new_empty(weight.shape) if (weight is not None and weight_grad) else x.new_empty(0)
    return x.new_empty(x.shape), grad_w


def _mlp_out_shape(x, w_down):
    return (*x.shape[:-1], w_down.shape[0])


def _mlp_inter_shape(x, w_gate):
    return (*x.shape[:-1], w_gate.shape[0])


@torch.library.register_fake("g4ops::geglu_mlp", lib=_lib)
def _geglu_mlp_fake(x, w_gate, w_up, w_down):
    _check_geglu(x, w_gate, w_up, w_down)
    return x.new_empty(_mlp_out_shape(x, w_down))


@torch.library.register_fake("g4ops::geglu_mlp_forward", lib=_lib)
def _geglu_mlp_forward_fake(x, w_gate, w_up, w_down):
    _check_geglu(x, w_gate, w_up, w_down)
    inter = _mlp_inter_shape(x, w_gate)
    return x.new_empty(_mlp_out_shape(x, w_down)), x.new_empty(inter), x.new_empty(inter)


@torch.library.register_fake("g4ops::geglu_mlp_backward", lib=_lib)
def _geglu_mlp_backward_fake(grad_out, x, gate, up, w_gate, w_up, w_down, output_mask):
    _check_geglu_backward(grad_out, x, gate, up, w_gate, w_up, w_down, output_mask)
    # one fresh empty tensor per skipped output (outputs must not alias), as the real kernels return
    return tuple(
        t.new_empty(t.shape) if wanted else x.new_empty(0)
        for t, wanted in zip((x, w_gate, w_up, w_down), output_mask)
    )


@torch.library.register_fake("g4ops::sandwich_norm", lib=_lib)
def _sandwich_norm_fake(branch, residual, post_weight, pre_weight, eps):
    _check_sandwich_norm(branch, residual, post_weight, pre_weight, eps)
    return branch.new_empty(branch.shape), branch.new_empty(branch.shape)


@torch.library.register_fake("g4ops::sandwich_norm_backward", lib=_lib)
def _sandwich_norm_backward_fake(grad_sum, grad_normed, branch, s, post_weight, pre_weight, eps, weight_grads):
    _check_sandwich_norm_backward(grad_sum, grad_normed, branch, s, post_weight, pre_weight, eps, weight_grads)
    weight_grad = [w.new_empty(w.shape) if (w is not None and wanted) else branch.new_empty(0)
                   for w, wanted in zip((post_weight, pre_weight), weight_grads)]  # fmt: skip
    return branch.new_empty(branch.shape), branch.new_empty(branch.shape), *weight_grad


@torch.library.register_fake("g4ops::gelu_tanh_mul", lib=_lib)
def _gelu_tanh_mul_fake(gate, up):
    _check_gelu_tanh_mul(gate, up)
    return gate.new_empty(gate.shape)


@torch.library.register_fake("g4ops::gelu_tanh_mul_backward", lib=_lib)
def _gelu_tanh_mul_backward_fake(grad_out, gate, up, output_mask):
    _check_gelu_tanh_mul_backward(grad_out, gate, up, output_mask)
    return tuple(gate.new_empty(gate.shape) if wanted else gate.new_empty(0) for wanted in output_mask)


@torch.library.register_fake("g4ops::decode_attention", lib=_lib)
def _decode_attention_fake(q, k, v, mask, scale):
    _check_decode_attention(q, k, v, mask, scale)
    return q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3]))


@torch.library.register_fake("g4ops::adamw_step", lib=_lib)
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps):
    _check_adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps)


@torch.library.register_fake("g4ops::embedding", lib=_lib)
def _embedding_fake(indices, weight, padding_idx):
    _check_embedding(indices, weight, padding_idx)
    return weight.new_empty((*indices.shape, weight.shape[1]))


@torch.library.register_fake("g4ops::embedding_backward", lib=_lib)
def _embedding_backward_fake(grad_out, indices, num_weights, padding_idx):
    _check_embedding_backward(grad_out, indices, num_weights, padding_idx)
    return grad_out.new_empty((num_weights, grad_out.shape[-1]))


# ----------------------------------------------------------------------------------------------------------------
# Autograd. Each formula's backward is one registered op (no Python math in the backward), so torch.compile puts
# the CUDA backward kernels straight into the graph. Double backward is not supported (once_differentiable).


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return torch.ops.g4ops.rms_norm(x, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        grad_x, grad_w = torch.ops.g4ops.rms_norm_backward(grad_out, x, weight, ctx.eps, weight_grad)
        return (grad_x if ctx.needs_input_grad[0] else None), (grad_w if weight_grad else None), None


class _GegluMlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        out, gate, up = torch.ops.g4ops.geglu_mlp_forward(x, w_gate, w_up, w_down)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        mask = list(ctx.needs_input_grad)
        grads = torch.ops.g4ops.geglu_mlp_backward(grad_out.contiguous(), x, gate, up, w_gate, w_up, w_down, mask)
        return tuple(g if wanted else None for g, wanted in zip(grads, mask))


class _SandwichNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, branch, residual, post_weight, pre_weight, eps):
        s, y = torch.ops.g4ops.sandwich_norm(branch, residual, post_weight, pre_weight, eps)
        ctx.save_for_backward(branch, s, post_weight, pre_weight)
        ctx.eps = eps
        return s, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sum, grad_normed):
        branch, s, post_weight, pre_weight = ctx.saved_tensors
        # (autograd hands zeros for an output that did not reach the loss: materialize_grads is on)
        grad_sum, grad_normed = grad_sum.contiguous(), grad_normed.contiguous()
        wanted = [w is not None and ctx.needs_input_grad[i] for i, w in ((2, post_weight), (3, pre_weight))]
        grad_branch, grad_residual, grad_post, grad_pre = torch.ops.g4ops.sandwich_norm_backward(
            grad_sum, grad_normed, branch, s, post_weight, pre_weight, ctx.eps, wanted
        )
        return (
            grad_branch if ctx.needs_input_grad[0] else None,
            grad_residual if ctx.needs_input_grad[1] else None,
            grad_post if wanted[0] else None,
            grad_pre if wanted[1] else None,
            None,
        )


class _GeluTanhMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.ops.g4ops.gelu_tanh_mul(gate, up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        mask = list(ctx.needs_input_grad)
        grads = torch.ops.g4ops.gelu_tanh_mul_backward(grad_out.contiguous(), gate, up, mask)
        return tuple(g if wanted else None for g, wanted in zip(grads, mask))


class _EmbeddingFunction(torch.autograd.Function):
    """F.embedding whose weight gradient is `g4ops.embedding_backward`. The forward is plain ATen, so AOTAutograd
    traces the gather itself and Inductor fuses it with what follows; only the backward is opaque (see `embedding`)."""

    @staticmethod
    def forward(ctx, indices, weight, padding_idx):
        ctx.save_for_backward(indices)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return reference.embedding(indices, weight, padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (indices,) = ctx.saved_tensors
        grad_w = torch.ops.g4ops.embedding_backward(grad_out.contiguous(), indices, ctx.num_weights, ctx.padding_idx)
        return None, grad_w, None


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _rms_norm_autograd(keyset, x, weight, eps):
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return _RMSNormFunction.apply(x, weight, eps)
    return torch.ops.g4ops.rms_norm.default.redispatch(keyset & _BELOW_AUTOGRAD, x, weight, eps)


def _geglu_mlp_autograd(keyset, x, w_gate, w_up, w_down):
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate, w_up, w_down)):
        return _GegluMlpFunction.apply(x, w_gate, w_up, w_down)
    return torch.ops.g4ops.geglu_mlp.default.redispatch(keyset & _BELOW_AUTOGRAD, x, w_gate, w_up, w_down)


def _sandwich_norm_autograd(keyset, branch, residual, post_weight, pre_weight, eps):
    inputs = (branch, residual, post_weight, pre_weight)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _SandwichNormFunction.apply(branch, residual, post_weight, pre_weight, eps)
    return torch.ops.g4ops.sandwich_norm.default.redispatch(keyset & _BELOW_AUTOGRAD, *inputs, eps)


def _gelu_tanh_mul_autograd(keyset, gate, up):
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _GeluTanhMulFunction.apply(gate, up)
    return torch.ops.g4ops.gelu_tanh_mul.default.redispatch(keyset & _BELOW_AUTOGRAD, gate, up)


def _embedding_autograd(keyset, indices, weight, padding_idx):
    if torch.is_grad_enabled() and weight.requires_grad:
        return _EmbeddingFunction.apply(indices, weight, padding_idx)
    return torch.ops.g4ops.embedding.default.redispatch(keyset & _BELOW_AUTOGRAD, indices, weight, padding_idx)


def _internal_op_autograd(
    name: str, check=None, why: str = "is an internal step of an autograd formula and is not differentiable"
):
    """The internal ops are steps of the public ops' autograd formulas: they refuse to be differentiated (no silent
    missing gradient), as does the inference-only decode_attention. `check`: an input check to run first, for ops
    without a BackendSelect guard; `why`: the error message after the op's name."""
    op = getattr(torch.ops.g4ops, name).default

    def kernel(keyset, *args):
        if check is not None:
            check(*args)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise RuntimeError(f"g4ops.{name} {why}")
        return op.redispatch(keyset & _BELOW_AUTOGRAD, *args)

    return kernel


_lib.impl("rms_norm", _rms_norm_autograd, "Autograd", with_keyset=True)
_lib.impl("geglu_mlp", _geglu_mlp_autograd, "Autograd", with_keyset=True)
_lib.impl("sandwich_norm", _sandwich_norm_autograd, "Autograd", with_keyset=True)
_lib.impl("gelu_tanh_mul", _gelu_tanh_mul_autograd, "Autograd", with_keyset=True)
_lib.impl("embedding", _embedding_autograd, "Autograd", with_keyset=True)
for _name in ("rms_norm_backward", "geglu_mlp_forward", "geglu_mlp_backward", "sandwich_norm_backward",
              "gelu_tanh_mul_backward", "embedding_backward"):
    _lib.impl(_name, _internal_op_autograd(_name), "Autograd", with_keyset=True)
_lib.impl(
    "decode_attention", _internal_op_autograd("decode_attention", why="has no backward (inference only)"), "Autograd",
    with_keyset=True,
)


def _adamw_step_autograd(keyset, params, grads, exp_avgs, exp_avg_sqs, *rest):
    """An optimizer update is not differentiable; like torch's in-place ops, it refuses to modify a tensor that
    requires grad while grad mode is on. (The version counters of what it modifies are bumped by PyTorch's
    ADInplaceOrView kernel for mutating ops, so autograd notices a parameter changed after a forward saved it.)"""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*params, *exp_avgs, *exp_avg_sqs)):
        raise RuntimeError(
            "g4ops.adamw_step updates `params`, `exp_avgs` and `exp_avg_sqs` in place and is not differentiable: "
            "call it under torch.no_grad(), as optimizers do"
        )
    torch.ops.g4ops.adamw_step.default.redispatch(keyset & _BELOW_AUTOGRAD, params, grads, exp_avgs, exp_avg_sqs,
                                                  *rest)  # fmt: skip


_lib.impl("adamw_step", _adamw_step_autograd, "Autograd", with_keyset=True)


# ----------------------------------------------------------------------------------------------------------------
# Autocast: like nn.Linear, the MLP runs in the autocast dtype; rms_norm needs nothing (it computes in fp32 and
# returns x's dtype either way, as stock does).


def to_autocast_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as torch.autocast casts an input of a lower-precision op (F.linear, SDPA): floating tensors other than
    float64 to `dtype`, the rest unchanged."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t



def _make_geglu_autocast(device_type: str, key: str):
    exclude = torch._C.DispatchKeySet(key)

    def _geglu_mlp_autocast(x, w_gate, w_up, w_down):
        dtype = torch.get_autocast_dtype(device_type)
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return torch.ops.g4ops.geglu_mlp(cast(x), cast(w_gate), cast(w_up), cast(w_down))

    return _geglu_mlp_autocast


for _device_type, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    _lib.impl("geglu_mlp", _make_geglu_autocast(_device_type, _key), _key)


# ----------------------------------------------------------------------------------------------------------------
# Python API


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Gemma-4 RMSNorm over the last dim: `x * (mean(x^2) + eps)^-0.5 * weight` in fp32, cast once to x.dtype."""
    return torch.ops.g4ops.rms_norm(x, weight, float(eps))


def geglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """`down(gelu_tanh(x @ w_gate.T) * (x @ w_up.T))` with weights in nn.Linear layout [out, in], no bias."""
    return torch.ops.g4ops.geglu_mlp(x, w_gate, w_up, w_down)


def sandwich_norm(
    branch: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor | None,
    pre_weight: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's sandwich norms in one op: `s = residual + rms_norm(branch, post_weight)` (rounded once) and
    `rms_norm(s, pre_weight)`; returns both (s is the new residual stream, the second the next block's input)."""
    return torch.ops.g4ops.sandwich_norm(branch, residual, post_weight, pre_weight, float(eps))


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`gelu(gate, approximate="tanh") * up` in fp32 (fp64 for fp64 inputs), rounded once to gate's dtype; gate and
    up have one shape and dtype, any strides (the CUDA kernels read a slice along a middle dim in place).

    Why an op, where Inductor would fuse the two steps itself: Gemma-4's decoder layer multiplies its gate by
    per_layer_inputs[:, :, i, :], so the backward sums one select_backward per layer into the per-layer-input
    gradient. Inductor fuses every layer's gate arithmetic into that sum and, for each of the 42 x 256 output
    columns of a token, evaluates all 42 layers' terms: one 3.25 ms kernel per E4B step at 2048 tokens (an H100,
    2026-12-07). With the gradient an op's output, the sum only picks each column's one input (so the CPU's
    generated code reads; the one A/B on an H200 showed no change in GPU time yet, and did not show whether that
    run took the op: bench/results/2026-12-07-h200-session55.md)."""
    return torch.ops.g4ops.gelu_tanh_mul(gate, up)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query token per sequence over a KV cache: `softmax(scale * q k^T) v` over the visible keys.

    q [B, Hq, 1, D] (any strides); k, v [B, Hkv, S, D] with a contiguous last dim (any other strides: a view of a
    larger cache is fine); mask bool [B, 1, 1, S] or [1, 1, 1, S], True = attend. Query head h reads KV head
    h // (Hq / Hkv) (transformers' repeat_kv order), but K/V are not repeated: the CUDA kernel reads each KV head
    once for all its query heads, split over the keys ("flash-decoding"). Scores, softmax and the weighted sum in
    fp32 (fp64 for fp64 inputs), rounded once; returns a contiguous [B, Hq, 1, D] of q's dtype. Masked keys are never
    read; a row with no visible key gives zeros (SDPA would give NaN). Inference only: inputs that require grad
    raise (there is no backward)."""
    return torch.ops.g4ops.decode_attention(q, k, v, mask, float(scale))


def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """`F.embedding(indices, weight, padding_idx)`, same values and gradient, with the weight gradient computed by
    ATen's embedding backward kernel inside an op Inductor cannot decompose.

    Why: under torch.compile Inductor decomposes the embedding backward into a zero-filled fp32 [rows, dim] table,
    an index_put and a cast. For Gemma-4 E4B's per-layer-input table (262144 x 10752) that is a 10.5 GiB fp32
    transient next to the 5.25 GiB bf16 gradient; ATen's kernel (what eager runs) accumulates each index's rows in
    fp32 and writes the bf16 gradient directly.

    With a gradient to compute, the call is the registered op `g4ops::embedding` (so torch.compile sees an op, not
    an autograd.Function, which PyTorch's AOTAutograd cache refuses to store); without one, plain F.embedding."""
    if not isinstance(indices, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("g4ops.embedding: `indices` and `weight` must be tensors")
    if weight.dim() != 2:
        raise ValueError(f"g4ops.embedding: `weight` must be 2-D [num_embeddings, dim], got {list(weight.shape)}")
    rows = weight.shape[0]
    if padding_idx is None:
        padding_idx = -1
    elif not -rows <= padding_idx < rows:
        raise ValueError(f"g4ops.embedding: `padding_idx` {padding_idx} is outside [-{rows}, {rows})")
    elif padding_idx < 0:
        padding_idx += rows
    if torch.is_grad_enabled() and weight.requires_grad:
        return torch.ops.g4ops.embedding(indices, weight, padding_idx)
    return reference.embedding(indices, weight, padding_idx)


def adamw_step(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float, beta2: float,
    weight_decay: float, eps: float,
) -> None:
    """One AdamW update of every (param, grad, exp_avg, exp_avg_sq) in place, at step number steps[i] (a float32
    scalar tensor on the parameter's device, already counted: 1 on the first update), computed in fp32 (fp64 for
    fp64 tensors) with each value rounded once to its dtype (reference.adamw_step). The four tensors of an entry
    share dtype, shape and strides, and are dense. Call it under torch.no_grad(); g4ops.optim.AdamW is the
    optimizer."""
    torch.ops.g4ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, float(lr), float(beta1), float(beta2),
                               float(weight_decay), float(eps))  # fmt: skip
