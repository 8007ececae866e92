"""LoRA inside g4ops' Gemma-4 MLP: peft-wrapped gate/up/down projections as one op with low-rank-only gradients;
and the same formula for one projection (`g4ops::lora_linear`, attention's q/k/v/o_proj, section "One projection").

peft's `lora.Linear` computes, for each active adapter a with weights A_a [r, in], B_a [out, r] and scale s_a
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`; peft's own `scaling` dict is read, so `set_scale`
and `scale_layer` count too):

    y = base(z) + sum_a B_a(A_a(dropout_a(z_a))) * s_a,    z_a = z cast to A_a's dtype (peft casts the input once
                                                           per adapter, cumulatively), the sum in the promoted dtype,
                                                           then rounded to base(z)'s dtype

Merged adapters (`merge_adapter`): the base weight holds the deltas and peft runs the base layer alone; so do we.
Disabled adapters (`disable_adapter()`): the base layer alone. No active adapter: the base layer alone. An MLP whose
three projections then have no low-rank term runs the plain `g4ops.geglu_mlp` op on the base weights.

`g4ops::lora_geglu_mlp` is that formula on gate and up, g4ops' GeGLU product (fp32 inside, rounded once, as
`geglu_mlp`), and the formula on down. Its autograd formula saves x, the gate and up outputs and the [T, r] products
A_a(z_a) (h is recomputed from gate and up in the backward, as geglu_mlp does; no fp32 copy of x or h is kept, where
peft's autograd keeps both for fp32 adapters of a bf16 model), and computes, per projection with output gradient dY:

    u_a  = s_a * (dY_a @ B_a)          [T, r]        dY_a = dY cast to the adapter's dtype
    dA_a = u_a^T @ d_a(z_a)            [r, in]       dB_a = s_a * dY_a^T @ A_a(d_a(z_a))   [out, r]
    dz   = dY @ W + sum_a d_a(u_a @ A_a)    (summed in fp32, rounded once; d_a: adapter a's dropout, below)

A base weight gradient (a full [out, in] GEMM) is computed only when that base weight requires grad (peft freezes
them). The down projection's input gradient dh stays in fp32 into the GeGLU backward.

Dropout (nn.Dropout, training mode): d_a(t) = t * mask_a / (1 - p_a), with one bool keep-mask per adapter of its
input's shape, drawn before the op by ATen's dropout over a tensor of the adapter's dtype, adapter by adapter in
peft's order (gate's, up's, down's): the generator calls of peft's forward, so a seeded run draws peft's masks (the
tests compare against peft that way). The masks are saved for the backward (bool, as ATen's dropout saves its own).
In eval mode, or with p = 0, dropout is the identity and nothing is drawn.

Kernels: the reference math below is the kernel on every device. Called eagerly on CUDA, the op runs it through
torch.compile (`_fused`, as loss.py's elementwise helpers do): the GEMMs stay on cuBLAS and Inductor fuses what lies
between them (the low-rank adds and casts, dropout masks, the GeGLU product and its backward), where eager mode makes
about a dozen full-size fp32 passes per MLP backward. csrc's MLP kernels do not fit: geglu_mlp_backward computes dh from
the base down weight alone and returns no dgate/dup, which the adapter gradients need; the GeGLU product alone
(`g4ops.gelu_tanh_mul`) runs in eager mode when the compiled path is off, and where it is on Inductor fuses the product
with the casts around it. In the ops called from a compile that replays CUDA graphs (or everywhere on CUDA with
G4OPS_LORA_SPLIT=1; never with =0), fp32 adapters of a bf16 model take their products on bf16 tensor cores, the fp32
operands split exactly into bf16 parts (`_split_mm`; the ops' `split` flag, `SPLIT_DEVICES` says why only there), and
the K=r products that land in a bf16 output (B's in y, A's in dz) fold into the base GEMM with one rounding of the
sum (`_linear_plus_low_rank`). In the default order (FOLD_ORDER "base_first") one GEMM adds them to the base GEMM's
bf16 output: y then has peft's roundings; in dz the base GEMM's output is rounded to bf16 before the adapters' terms
are added, as peft does (the path without split sums them in fp32), and dh reaches the GeGLU backward in bf16, as
peft's does. "base_last" rounds the low-rank sum instead and lets the base GEMM add into it.

Inside an outer torch.compile (`torch.compiler.is_compiling()` in `lora_geglu_mlp`) that does not replay CUDA
graphs there is no opaque op (below: when, and the measurements): the
same two math functions run as a torch.autograd.Function (`_TracedLoraGeglu`, the op's formula without its ops),
which Dynamo traces, forward and backward, into the caller's graph, and Inductor fuses across the MLP as it does
across peft's stock forward. The op's input checks run while tracing, on the trace's fake tensors (`_check_traced`),
and leave nothing in the graph. The op inside a compiled model cost host time on every call (issue 18: 2.3-3.7 ms
of CPU per MLP forward and backward in the inner compiled calls' guards and wrappers and the checks; a 42-layer LoRA
step on an H200 ran at 9666 tok/s, 13155 with peft's stock MLP traced). What changes under compile: what the
backward keeps is then the partitioner's choice over the whole graph, not the list above (on CPU, 2026-12-01, for a
bf16 MLP with fp32 adapters it kept fp32 copies of x and h, as peft's autograd does); and the dropout masks come
from the trace of the same `native_dropout` calls, so from the backend's generator: aot_eager runs ATen's (a seeded
step draws peft's masks), Inductor its own (the masks compiled stock peft draws with the same seed, not eager mode's,
unless `torch._inductor.config.fallback_random`).
Where the traced path is on (`TRACE_UNDER_COMPILE`: torch >= 2.11, where it was tested; `G4OPS_LORA_TRACE=1` turns
it on anywhere, `=0` off) it is taken unless the outer compile replays CUDA graphs (mode="reduce-overhead", or
triton.cudagraphs asked for another way: `_outer_compile_replays_graphs` reads the compile being traced): there the
graph calls the op, whose own graphed step is faster. Both measured on an H100 (torch 2.11, 42 layers, r=16, 2048
tokens, g4ops attention, 2026-12-06, bench/results/2026-12-06-h100-session37.md):
- default mode: traced 13276 tok/s, 24.7 GiB, stock compile 8902 and 32.1 GiB in the same call. The op's per-call
  host cost, 132 attention projections and 42 MLPs, made that step host-bound (a 6-layer step: 63.3 ms of wall time
  against 28.6 ms of GPU work; traced 30.1 against 28.3); packed 4 x 512 ran at 4441 tok/s with the op, 9148 traced.
- graphed: the op 17890 tok/s (session 32, with G4OPS_LORA_SPLIT=1, what a graphed compile now asks for by
  itself), traced 13669 (without split products; traced with them, graphed, not yet timed).
Under torch 2.11 every traced gradient once came back all zeros (pytorch issue 180642) until the traced forward
returned a fresh tensor. Session 19 (H200, 2026-12-03, older code, attention projections on peft) timed the traced
default-mode step at 8119 tok/s against the op's 12424 and kept the path off below torch 2.13; what made the
difference since was not measured. A trace that calls the op outside CUDA graphs (the traced path off) warns once
(`_trace_in_this_compile`).

peft's LoRA layers reach these ops through g4ops/hf/peft_lora.py, which says which layers it reproduces and
makes autocast's casts before calling them.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn.functional as F

from . import core, reference
from ._fused import run_compiled
from ._torch_version import torch_version

logger = logging.getLogger("g4ops")
_logged: set = set()  # what was said once at INFO

_lib = torch.library.Library(core.NAMESPACE, "FRAGMENT")
_ADAPTER_ARGS = (
    "Tensor[] lora_a, Tensor[] lora_b, float[] scaling, int[3] counts, float[] dropout, Tensor[] dropout_mask"
)
_LINEAR_ADAPTER_ARGS = "Tensor[] lora_a, Tensor[] lora_b, float[] scaling, float[] dropout, Tensor[] dropout_mask"
_SCHEMAS = {
    # lora_a/lora_b/scaling/dropout: the adapters of gate_proj (counts[0] of them), then up_proj's, then down_proj's.
    # dropout_mask: one bool mask (True = kept) of the adapter's input shape per adapter whose dropout p is > 0.
    # split: fp32 adapters of a bf16 model take their products split into bf16 parts (`_splits`), on any device.
    "lora_geglu_mlp": (
        f"lora_geglu_mlp(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, {_ADAPTER_ARGS}, bool split=False)"
        " -> Tensor"
    ),
    "lora_geglu_mlp_forward": (
        f"lora_geglu_mlp_forward(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, {_ADAPTER_ARGS},"
        " bool split=False) -> (Tensor, Tensor, Tensor, Tensor[])"
    ),
    "lora_geglu_mlp_backward": (
        "lora_geglu_mlp_backward(Tensor grad_out, Tensor x, Tensor gate, Tensor up, Tensor w_gate, Tensor w_up,"
        f" Tensor w_down, {_ADAPTER_ARGS}, Tensor[] lora_mid, bool[4] output_mask, bool[] lora_mask,"
        " bool split=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor[], Tensor[])"
    ),
    # One projection (attention's q/k/v/o): its adapters, all of them on `weight`.
    "lora_linear": f"lora_linear(Tensor x, Tensor weight, {_LINEAR_ADAPTER_ARGS}, bool split=False) -> Tensor",
    "lora_linear_forward": (
        f"lora_linear_forward(Tensor x, Tensor weight, {_LINEAR_ADAPTER_ARGS}, bool split=False)"
        " -> (Tensor, Tensor[])"
    ),
    "lora_linear_backward": (
        f"lora_linear_backward(Tensor grad_out, Tensor x, Tensor weight, {_LINEAR_ADAPTER_ARGS}, Tensor[] lora_mid,"
        " bool[2] output_mask, bool[] lora_mask, bool split=False) -> (Tensor, Tensor, Tensor[], Tensor[])"
    ),
}
for _schema in _SCHEMAS.values():
    _lib.define(_schema)

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------------------------
# Input checks (reference kernels and fake kernels call them, so compile-time and run-time errors agree)


def _check_adapters(op, x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask, split=False):
    core._check_geglu(x, w_gate, w_up, w_down)
    core._check(
        len(counts) == 3 and all(c >= 0 for c in counts),
        lambda: f"g4ops.{op}: `counts` must be 3 adapter counts >= 0 (gate, up, down), got {list(counts)}",
    )
    n = sum(counts)
    core._check(len(lora_a) == n, lambda: f"g4ops.{op}: `lora_a` has {len(lora_a)} entries but `counts` sums to {n}")
    hidden, inter = x.shape[-1], w_gate.shape[0]
    dims = [(hidden, inter)] * (counts[0] + counts[1]) + [(inter, hidden)] * counts[2]
    _check_adapter_list(op, x, lora_a, lora_b, scaling, dropout, dropout_mask, dims)


def _check_linear(op, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, split=False):
    core._check_floating("x", x)
    core._check_floating("weight", weight)
    core._check(x.dim() >= 1, lambda: f"g4ops.{op}: `x` must have at least one dimension")
    core._check(
        weight.dim() == 2 and weight.shape[1] == x.shape[-1],
        lambda: f"g4ops.{op}: `weight` must be [out, {x.shape[-1]}] (nn.Linear's layout), got {list(weight.shape)}",
    )
    core._check_type(weight.dtype == x.dtype, lambda: f"g4ops.{op}: `weight` is {weight.dtype} but `x` is {x.dtype}")
    core._check_same_device(op, x=x, weight=weight)
    dims = [(x.shape[-1], weight.shape[0])] * len(lora_a)
    _check_adapter_list(op, x, lora_a, lora_b, scaling, dropout, dropout_mask, dims)


def _check_adapter_list(op, x, lora_a, lora_b, scaling, dropout, dropout_mask, dims):
    """The adapters: adapter i maps dims[i] = (fan_in, fan_out), its input having x's leading shape."""
    n = len(dims)
    for name, seq in (("lora_a", lora_a), ("lora_b", lora_b), ("scaling", scaling), ("dropout", dropout)):
        core._check(
            len(seq) == n, lambda: f"g4ops.{op}: `{name}` has {len(seq)} entries, `lora_a` {n}"
        )
    for i, (a, b, (fan_in, fan_out)) in enumerate(zip(lora_a, lora_b, dims)):
        core._check_floating(f"lora_a[{i}]", a)
        core._check(
            a.dim() == 2 and a.shape[1] == fan_in,
            lambda: f"g4ops.{op}: `lora_a[{i}]` must be [r, {fan_in}], got {list(a.shape)}",
        )
        core._check(
            b.dim() == 2 and b.shape[0] == fan_out and b.shape[1] == a.shape[0],
            lambda: f"g4ops.{op}: `lora_b[{i}]` must be [{fan_out}, {a.shape[0]}] ([out, r] of `lora_a[{i}]`), "
            f"got {list(b.shape)}",
        )
        core._check_type(
            b.dtype == a.dtype, lambda: f"g4ops.{op}: `lora_b[{i}]` is {b.dtype} but `lora_a[{i}]` is {a.dtype}"
        )
        core._check_same_device(op, x=x, **{f"lora_a[{i}]": a, f"lora_b[{i}]": b})
    dropped = [i for i, p in enumerate(dropout) if p != 0.0]
    core._check(
        all(0.0 <= p < 1.0 for p in dropout), lambda: f"g4ops.{op}: `dropout` must be in [0, 1), got {list(dropout)}"
    )
    core._check(
        len(dropout_mask) == len(dropped),
        lambda: f"g4ops.{op}: `dropout_mask` has {len(dropout_mask)} masks but `dropout` has {len(dropped)} "
        "adapters with p > 0",
    )
    for j, (i, mask) in enumerate(zip(dropped, dropout_mask)):
        core._check_type(
            mask.dtype == torch.bool, lambda: f"g4ops.{op}: `dropout_mask[{j}]` must be bool, got {mask.dtype}"
        )
        core._check_shape(op, f"dropout_mask[{j}]", mask, (*x.shape[:-1], dims[i][0]), f"adapter {i}'s input")
        core._check_same_device(op, x=x, **{f"dropout_mask[{j}]": mask})


def _check_backward(grad_out, x, gate, up, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout,
                    dropout_mask, lora_mid, output_mask, lora_mask, split=False):  # fmt: skip
    op = "lora_geglu_mlp_backward"
    _check_adapters(op, x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask)
    out_shape, inter_shape = (*x.shape[:-1], w_down.shape[0]), (*x.shape[:-1], w_gate.shape[0])
    for name, t, shape in (("grad_out", grad_out, out_shape), ("gate", gate, inter_shape), ("up", up, inter_shape)):
        core._check_floating(name, t)
        core._check_shape(op, name, t, shape, "the MLP's" if name == "grad_out" else "x @ w_gate.T")
        core._check_same_device(op, x=x, **{name: t})
    _check_mids(op, x, lora_a, lora_mid, lora_mask)


def _check_mids(op, x, lora_a, lora_mid, lora_mask):
    """A backward's saved [T, r] products A_a(z_a) and its per-adapter gradient mask (dA's, then dB's)."""
    core._check(
        len(lora_mid) == len(lora_a) and len(lora_mask) == 2 * len(lora_a),
        lambda: f"g4ops.{op}: `lora_mid` must have one entry per adapter ({len(lora_a)}) and `lora_mask` two, got "
        f"{len(lora_mid)} and {len(lora_mask)}",
    )
    for i, (a, mid) in enumerate(zip(lora_a, lora_mid)):
        core._check_shape(op, f"lora_mid[{i}]", mid, (*x.shape[:-1], a.shape[0]), f"the input @ lora_a[{i}].T")


# ----------------------------------------------------------------------------------------------------------------
# Reference math (every device)


def _split(seq, counts):
    g, u = counts[0], counts[0] + counts[1]
    return list(seq[:g]), list(seq[g:u]), list(seq[u:])


def _per_adapter_masks(dropout, dropout_mask):
    """[(p, mask or None)] per adapter."""
    masks = iter(dropout_mask)
    return [(p, next(masks) if p != 0.0 else None) for p in dropout]


def _dropped(t, drop):
    """nn.Dropout's training output (or its backward) for a drawn mask: t * mask * 1/(1 - p), as ATen computes it."""
    p, mask = drop
    return t if mask is None else (t * mask.to(t.dtype)) * (1.0 / (1.0 - p))


# The split products: fp32 adapters of a bf16 model take their products over tokens and features on bf16 tensor cores
# (`_split_mm`) and fold the K=r ones into the base GEMMs (`_linear_plus_low_rank`). They trade host time (more, smaller
# kernels) for GPU time, so they pay where the op's per-call host cost is gone: under CUDA graphs. On the H200 (torch
# 2.11, 2026-12-04, E4B shapes, r=16, 2048 tokens): an MLP forward and backward took 2.47 ms of GPU against 3.60 ms; the
# 42-layer default-mode compiled step, host-bound, fell from 11610 to 10030 tok/s (session 22), while a graphed 4-layer
# step rose from 69440 to 75191 tok/s (bench/results/2026-12-04-h200-session23.md), and a graphed 42-layer step from
# 13610 to 17060 on an H100 (2026-12-07, bench/results/2026-12-07-h100-session52.md). So the op calls from a compile
# that replays CUDA graphs ask for them (`split=True`, `_split_in_this_compile`), and nothing else does.
# G4OPS_LORA_SPLIT=1 also takes them in every call on CUDA (SPLIT_DEVICES; the tests add "cpu", where the same
# arithmetic runs in fp32); =0 never, graphed compiles included.
_SPLIT_SETTING = {"1": True, "0": False}.get(os.environ.get("G4OPS_LORA_SPLIT", ""))
SPLIT_DEVICES = {"cuda"} if _SPLIT_SETTING else set()
SPLIT_WHEN_GRAPHED = _SPLIT_SETTING is not False


def _splits(bf16_operand, lora_a, split: bool) -> bool:
    """Whether the products of these fp32 adapters with this bf16 operand go through `_split_mm`: the op was asked
    to (`split`) or the operand's device always splits (SPLIT_DEVICES)."""
    return ((split or bf16_operand.device.type in SPLIT_DEVICES) and bf16_operand.dtype == torch.bfloat16
            and all(a.dtype == torch.float32 for a in lora_a))  # fmt: skip


def _bf16_parts(t):
    """(hi, mid, lo) in bf16 with hi + mid + lo == t exactly for normal fp32 values: 24 significant bits are three
    times 8. hi is t with its low 16 bits cleared (`reference.truncated_to`: exact in bf16), mid the same of the
    remainder t - hi (exact in fp32, at most 16 significant bits), lo the last remainder (at most 8). Not from
    t.to(bf16): under torch.compile (how the op's math runs on CUDA) mid and lo then came out zero."""
    bf16 = torch.bfloat16
    hi = reference.truncated_to(t, bf16)
    rest = t - hi
    mid = reference.truncated_to(rest, bf16)
    return hi.to(bf16), mid.to(bf16), (rest - mid).to(bf16)


def _mm_to_fp32(a, b):
    """a @ b of bf16 matrices with fp32 accumulation and an fp32 result: cuBLAS's bf16 tensor-core GEMM on CUDA;
    elsewhere the same math in fp32 (a bf16 value and a product of two are exact in fp32)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _split_mm(a, b):
    """a @ b for 2-D a and b, one fp32 and one bf16, as an fp32 GEMM computes it up to the order of its sums: the
    fp32 operand as its three bf16 parts (`_bf16_parts`) side by side, one bf16 GEMM, the three partial products
    summed in fp32. It reads the bf16 operand as it is (an fp32 GEMM needs an fp32 copy) on tensor cores (fp32
    GEMMs run on FFMA units: the LoRA products of session 21's H200 profile, about 0.9 ms of a 3.0 ms layer).

    The fp32 side may be a list of matrices that share the bf16 operand (gate's and up's adapters read the same x):
    then all their parts go side by side into that one GEMM, which reads the bf16 operand once, and the products
    come back as a list."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return _split_mm_shared(a, b)
    return _split_mm_shared([a], b)[0] if a.dtype == torch.float32 else _split_mm_shared(a, [b])[0]


def _split_mm_shared(a, b):
    """`_split_mm` with its fp32 side (a or b) a list: one GEMM, then each operand's hi + mid + lo products."""
    dim = 0 if isinstance(a, (list, tuple)) else 1  # where the parts lie side by side
    fp32 = a if dim == 0 else b
    stacked = torch.cat([p for t in fp32 for p in _bf16_parts(t)], dim)
    parts = _mm_to_fp32(stacked, b) if dim == 0 else _mm_to_fp32(a, stacked)
    products, at = [], 0
    for t in fp32:
        n = t.shape[dim]
        hi, mid, lo = (parts.narrow(dim, at + k * n, n) for k in range(3))
        products.append(hi + mid + lo)
        at += 3 * n
    return products


def _split_pairs(left, right):
    """(L, R) in bf16, [m, 9r] and [n, 9r], with L @ R^T == left @ right^T for fp32 left [m, r] and right [n, r] up to
    the order of an fp32 sum: the nine products of their bf16 parts (`_bf16_parts`), each exact in fp32."""
    left_parts, right_parts = _bf16_parts(left), _bf16_parts(right)
    return (torch.cat([p for p in left_parts for _ in range(3)], 1), torch.cat(right_parts * 3, 1))


@torch.library.custom_op(f"{core.NAMESPACE}::add_product_rounded", mutates_args=("c",))
def _add_product_rounded(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in place for bf16 matrices, accumulated in fp32 and rounded once to bf16: cuBLAS's bf16 GEMM adds c
    (beta=1) to its fp32 accumulator; elsewhere the same math in fp32.

    An op that writes c, not `torch.baddbmm(c, a, b)`: ATen's out-of-place baddbmm first copies c into its result
    (a full [T, n] memcpy per fold, 49 of them and 0.41 ms in a 4-layer LoRA step on the H200, 2026-12-05), and a
    traced in-place `baddbmm_` is functionalized back into that copy. Inductor re-inplaces a mutating custom op
    whose input dies there, as every caller's c (a base GEMM's fresh output) does. Inside the op Inductor rewrites
    nothing, so the GEMM's one rounding holds (test_plus_low_rank_rounds_once)."""
    if _gemm_adds_c_unrounded(c):
        c[None].baddbmm_(a[None], b[None])
    else:
        c.copy_(c.float() + a.float() @ b.float())


@_add_product_rounded.register_fake
def _(c, a, b) -> None:
    return None


def _gemm_adds_c_unrounded(c) -> bool:
    """Whether a bf16 baddbmm on c's device is trusted to add c to the fp32 accumulator before its one rounding:
    cuBLAS's is. (The CPU tests also run this branch on CPU, whose kernels measured the same.)"""
    return c.is_cuda


# The fold's order. "base_first": the base GEMM writes its bf16 output, then a K=9r GEMM reads it, adds the low-rank
# products and writes it again (`_plus_low_rank`; peft's roundings in y). "base_last": the K=9r GEMM writes the
# low-rank products first, rounded to bf16, and the base GEMM adds its product into them before its one rounding
# (`_low_rank_plus_base`): the [T, n] output is read once less, the rounding moves from the base product to the
# low-rank term, the smaller one. G4OPS_LORA_FOLD picks; bench/lora_fold.py times both.
FOLD_ORDERS = ("base_first", "base_last")
FOLD_ORDER = os.environ.get("G4OPS_LORA_FOLD", "base_first")
if FOLD_ORDER not in FOLD_ORDERS:
    raise ValueError(f"G4OPS_LORA_FOLD={FOLD_ORDER!r}: expected one of {FOLD_ORDERS}")


def _linear_plus_low_rank(z, weight, pairs):
    """F.linear(z, weight) in bf16 plus the low-rank products of `pairs` (`_plus_low_rank`), folded in FOLD_ORDER."""
    if pairs and FOLD_ORDER == "base_last":
        return _low_rank_plus_base(z, weight, pairs)
    return _plus_low_rank(F.linear(z, weight), pairs)


def _folded_pairs(pairs):
    """(L, R^T) in bf16 with L @ R^T == sum of left @ right^T over `pairs` up to an fp32 sum's order: each pair's
    `_split_pairs` side by side."""
    lefts, rights = zip(*(_split_pairs(_rows(left), right) for left, right in pairs))
    return torch.cat(lefts, 1), torch.cat(rights, 1).t()


def _low_rank_plus_base(z, weight, pairs):
    """The "base_last" fold: the low-rank sum of `pairs` rounded once to bf16, then z @ weight^T added to it by the
    base GEMM (beta=1) and the sum rounded once."""
    low_rank = torch.mm(*_folded_pairs(pairs))
    torch.ops.g4ops.add_product_rounded(low_rank, _rows(z), weight.t())
    return low_rank.view(*z.shape[:-1], weight.shape[0])


def _plus_low_rank(out, pairs):
    """bf16 `out` [..., n] + sum of left @ right^T over `pairs` of fp32 left [..., r] and right [n, r], rounded once
    to bf16, in one bf16 GEMM (`_split_pairs` side by side, `_add_product_rounded`) that writes into `out`: callers
    pass a base GEMM's fresh output and use only what this returns. The split path's low-rank terms (B's in the
    forward, A's in the backward's dx) go this way instead of as fp32 GEMMs, whose fp32 [T, n] results are written
    and read back (84 MB per gate/up term at 2048 tokens)."""
    if not pairs:
        return out
    rows = _rows(out)
    torch.ops.g4ops.add_product_rounded(rows, *_folded_pairs(pairs))
    return rows.view(out.shape)


def _split_products(source, *projections, split: bool):
    """A_a(source) of every adapter that takes the split path (`_splits`, no dropout), for projections that read the
    same source (gate's and up's adapters read x), as one `_split_mm`; None for the others. projections: (lora_a,
    drops) per projection; returns one list per projection."""
    wanted = [(k, i) for k, (lora_a, drops) in enumerate(projections) if _splits(source, lora_a, split)
              for i, drop in enumerate(drops) if drop[1] is None]  # fmt: skip
    out = [[None] * len(lora_a) for lora_a, _ in projections]
    if wanted:
        products = _split_mm(_rows(source), [projections[k][0][i].t() for k, i in wanted])
        for (k, i), mid in zip(wanted, products):
            out[k][i] = mid.reshape(*source.shape[:-1], mid.shape[1])
    return out


def _with_adapters(z, weight, lora_a, lora_b, scaling, drops, split: bool, split_mids=None):
    """peft's `lora.Linear.forward` with base layer F.linear(z, weight), in its order and dtypes:
    (y, [A_a(dropout_a(z_a))]). Split (`_splits`): the same sum, with A's products from `_split_products`
    (`split_mids`, when the caller took them together with another projection's) and B's folded into the base GEMM
    (`_linear_plus_low_rank`)."""
    mids = []
    if split_mids is None:
        split_mids = _split_products(z, (lora_a, drops), split=split)[0]
    split = _splits(z, lora_a, split)  # then every cast below is bf16 -> fp32: exact
    y = None if split else F.linear(z, weight)
    z_a = z
    for a, b, s, drop, split_mid in zip(lora_a, lora_b, scaling, drops, split_mids):
        z_a = z_a.to(a.dtype)  # peft's _cast_input_dtype, cumulative like its loop
        mid = split_mid if split_mid is not None else F.linear(_dropped(z_a, drop), a)
        mids.append(mid.contiguous())
        if not split:
            y = y + F.linear(mid, b) * s
    if split:
        folds = [(mid, b * s) for mid, b, s in zip(mids, lora_b, scaling)]
        return _linear_plus_low_rank(z, weight, folds).contiguous(), mids
    return y.to(z.dtype).contiguous(), mids


def _gelu_tanh_mul(gate, up):
    """g4ops' GeGLU product: the op (its CUDA kernel) in eager mode on CUDA, else the reference math, which a trace
    fuses (same semantics)."""
    if gate.is_cuda and not torch.compiler.is_compiling():
        return torch.ops.g4ops.gelu_tanh_mul(gate, up)
    return reference.gelu_tanh_mul(gate, up)


def lora_geglu_mlp_forward_math(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask,
                                split=False):  # fmt: skip
    ga, ua, da = _split(lora_a, counts)
    gb, ub, db = _split(lora_b, counts)
    gs, us, ds = _split(scaling, counts)
    gd, ud, dd = _split(_per_adapter_masks(dropout, dropout_mask), counts)
    gate_split, up_split = _split_products(x, (ga, gd), (ua, ud), split=split)  # one GEMM over x for both
    gate, gate_mid = _with_adapters(x, w_gate, ga, gb, gs, gd, split, gate_split)
    up, up_mid = _with_adapters(x, w_up, ua, ub, us, ud, split, up_split)
    h = _gelu_tanh_mul(gate, up)
    out, down_mid = _with_adapters(h, w_down, da, db, ds, dd, split)
    return out, gate, up, gate_mid + up_mid + down_mid


def _low_rank_grads(grad_y, lora_a, lora_b, scaling, drops, mids, mask_b, acc, split: bool):
    """One projection's adapters, the part that needs no input z: (sum_a dropout_a'(u_a @ A_a) in `acc` or None,
    [(u_a, A_a^T)] to fold into dz's base GEMM, [u_a], [dB_a]) with u_a = s_a * (dY_a @ B_a) and
    dB_a = s_a * dY_a^T @ A_a(z_a) (module docstring). Split (`_splits`), an adapter without dropout goes into the fold
    list (`_linear_plus_low_rank`) instead of the sum."""
    grad_z, folds, us, grad_b = None, [], [], []
    split = _splits(grad_y, lora_a, split)  # dY_a = dY cast to fp32: exact, so the products can read dY itself
    for a, b, s, drop, mid, want_b in zip(lora_a, lora_b, scaling, drops, mids, mask_b):
        if split:
            u = _split_mm(_rows(grad_y), b).reshape(*grad_y.shape[:-1], b.shape[1]) * s
            grad_b.append(_split_mm(_rows(grad_y).t(), _rows(mid)) * s if want_b else b.new_empty(0))
        else:
            g = grad_y.to(a.dtype)
            u = (g @ b) * s
            grad_b.append((_rows(g).t() @ _rows(mid)) * s if want_b else b.new_empty(0))
        us.append(u)
        if split and drop[1] is None:
            folds.append((u, a.t()))
            continue
        term = _dropped(u @ a, drop).to(acc)
        grad_z = term if grad_z is None else grad_z + term
    return grad_z, folds, us, grad_b


def _a_grads(z, *projections, split: bool):
    """dA_a = u_a^T @ dropout_a(z_a), with z_a cast as the forward cast it and the forward's dropout mask, for
    projections that read the same z: (us, lora_a, drops, mask_a) each; one list of dA per projection. The split
    products (`_splits`, no dropout) of all of them are one `_split_mm`, which reads z once."""
    wanted = [(k, i) for k, (us, lora_a, drops, mask_a) in enumerate(projections) if _splits(z, lora_a, split)
              for i, (drop, want) in enumerate(zip(drops, mask_a)) if want and drop[1] is None]  # fmt: skip
    split_grads = dict(zip(wanted, _split_mm([_rows(projections[k][0][i]).t() for k, i in wanted], _rows(z))
                           if wanted else []))  # fmt: skip
    out = []
    for k, (us, lora_a, drops, mask_a) in enumerate(projections):
        grads, zk = [], z
        for i, (u, a, drop, want) in enumerate(zip(us, lora_a, drops, mask_a)):
            zk = zk.to(a.dtype)  # peft's cast, cumulative like its forward loop
            if not want:
                grads.append(a.new_empty(0))
            elif (k, i) in split_grads:
                grads.append(split_grads[k, i])
            else:
                grads.append(_rows(u).t() @ _rows(_dropped(zk, drop)))
        out.append(grads)
    return out


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def lora_geglu_mlp_backward_math(grad_out, x, gate, up, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts,
                                 dropout, dropout_mask, lora_mid, output_mask, lora_mask, split=False):  # fmt: skip
    n = len(lora_a)
    by_projection = lambda seq: _split(seq, counts)  # noqa: E731
    (ga, ua, da), (gb, ub, db), (gs, us, ds), (gm, um, dm) = map(by_projection, (lora_a, lora_b, scaling, lora_mid))
    gd, ud, dd = by_projection(_per_adapter_masks(dropout, dropout_mask))
    (gma, uma, dma), (gmb, umb, dmb) = by_projection(lora_mask[:n]), by_projection(lora_mask[n:])
    acc = reference.accumulation_dtype(x.dtype)
    empty = lambda: x.new_empty(0)  # noqa: E731

    # down: dh = grad_out @ W_down + sum_a u_a @ A_a, kept in fp32 into the GeGLU backward, which recomputes h
    # (split: the terms folded into the base GEMM, `_linear_plus_low_rank`)
    lora_h, down_folds, down_us, grad_db = _low_rank_grads(grad_out, da, db, ds, dd, dm, dmb, acc, split)
    grad_h = _linear_plus_low_rank(grad_out, w_down.t(), down_folds)
    if lora_h is not None:
        grad_h = grad_h.to(acc) + lora_h
    grad_gate, grad_up, h = reference.gelu_tanh_mul_backward(grad_h, gate, up)
    (grad_da,) = _a_grads(h, (down_us, da, dd, dma), split=split)

    lora_gx, gate_folds, gate_us, grad_gb = _low_rank_grads(grad_gate, ga, gb, gs, gd, gm, gmb, acc, split)
    lora_ux, up_folds, up_us, grad_ub = _low_rank_grads(grad_up, ua, ub, us, ud, um, umb, acc, split)
    # one GEMM over x for both
    grad_ga, grad_ua = _a_grads(x, (gate_us, ga, gd, gma), (up_us, ua, ud, uma), split=split)
    if output_mask[0]:
        grad_x = _linear_plus_low_rank(grad_gate, w_gate.t(), gate_folds + up_folds).to(acc)
        grad_x = grad_x + F.linear(grad_up, w_up.t()).to(acc)
        for term in (lora_gx, lora_ux):
            if term is not None:
                grad_x = grad_x + term
        grad_x = grad_x.to(x.dtype).contiguous()
    else:
        grad_x = empty()
    # full base-weight gradients only when asked for (peft freezes the base weights)
    grad_wg = _rows(grad_gate).t() @ _rows(x) if output_mask[1] else empty()
    grad_wu = _rows(grad_up).t() @ _rows(x) if output_mask[2] else empty()
    grad_wd = _rows(grad_out).t() @ _rows(h) if output_mask[3] else empty()
    return grad_x, grad_wg, grad_wu, grad_wd, grad_ga + grad_ua + grad_da, grad_gb + grad_ub + grad_db


# G4OPS_LORA_COMPILE=0 keeps the CUDA kernels eager, =1 compiles on every device (a CPU test uses that); a failed
# compilation warns once and runs eagerly from then on, a signature past Dynamo's recompile limit alone (_fused.py).
_LORA_COMPILE = os.environ.get("G4OPS_LORA_COMPILE")
# Inside an outer torch.compile: trace the math into its graph, or call the opaque op (module docstring, "Inside an
# outer torch.compile"). G4OPS_LORA_TRACE=1 always traces, =0 never; unset, the math is traced on torch >= 2.11
# unless that compile replays CUDA graphs, where the op's own graphed step is faster.
_TRACE_SETTING = {"1": True, "0": False}.get(os.environ.get("G4OPS_LORA_TRACE", ""))
TRACE_UNDER_COMPILE = _TRACE_SETTING if _TRACE_SETTING is not None else torch_version() >= (2, 11)
TRACE_WHEN_GRAPHED = _TRACE_SETTING is True
_compiled: dict = {}
_compile_failed: list = []
_opaque_warned = False


def _outer_compile_replays_graphs() -> bool:
    """Whether the torch.compile being traced now replays CUDA graphs: Inductor with triton.cudagraphs (what
    mode="reduce-overhead" and "max-autotune" set, as options or in the global config) or the "cudagraphs" backend.
    Read from Dynamo's tracing state, a private API (torch 2.11 and 2.13 tested): where it cannot be read, False."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception as exc:  # noqa: BLE001 - another torch's internals: treat as not graphed (the traced path)
        if "graphed-unknown" not in _logged:
            _logged.add("graphed-unknown")
            logger.info("g4ops: cannot tell whether this torch.compile replays CUDA graphs (%r); tracing the LoRA "
                        "math into its graph (under CUDA graphs the ops' own step is faster)", exc)  # fmt: skip
        return False
    backend = getattr(backend, "_torchdynamo_orig_backend", backend)  # torch.compile's wrapper of the backend
    options = getattr(backend, "config", None)
    if isinstance(options, dict):  # Inductor: its mode's and options' settings, over the global config
        import torch._inductor.config as inductor_config

        return bool(options.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
    return getattr(backend, "compiler_name", None) == "cudagraphs"


@torch.compiler.assume_constant_result  # run once while tracing, a constant in the graph: no graph break
def _trace_in_this_compile() -> bool:
    """Whether this trace runs the LoRA math in its graph (True) or calls the ops (False). Where it calls them
    outside CUDA graphs, it says once that each call then costs host time on every step."""
    global _opaque_warned
    graphed = _outer_compile_replays_graphs()
    if TRACE_UNDER_COMPILE and (TRACE_WHEN_GRAPHED or not graphed):
        return True
    if not graphed and not _opaque_warned:
        _opaque_warned = True
        warnings.warn(
            "g4ops: this torch.compile graph calls g4ops' LoRA ops opaquely (g4ops.ops.lora.TRACE_UNDER_COMPILE is "
            f"off: G4OPS_LORA_TRACE=0, or torch {torch.__version__} < 2.11): each call costs host time on every step "
            "unless the model is compiled with mode='reduce-overhead' (CUDA graphs). In the default mode a 42-layer "
            "LoRA step ran at about half of stock torch.compile's speed (bench/results/2026-12-06-h100-session36.md)",
            stacklevel=2,
        )
    return False


@torch.compiler.assume_constant_result  # as `_trace_in_this_compile`
def _split_in_this_compile() -> bool:
    """Whether the LoRA ops (or math) of this trace take the split products: the compile replays CUDA graphs and
    G4OPS_LORA_SPLIT is not 0 (SPLIT_DEVICES' comment says why only there)."""
    return SPLIT_WHEN_GRAPHED and _outer_compile_replays_graphs()


def _fused(fn, *args):
    return run_compiled(fn, args, _LORA_COMPILE, _compiled, _compile_failed,
                        "g4ops.lora: torch.compile of a LoRA op's math")  # fmt: skip


def _contiguous(result):
    """The kernels' outputs in the fake kernels' (contiguous) layout. Inductor may hand back a padded layout: on the
    H200 (torch 2.11, 2026-12-02) the compiled math returned a rank-3 adapter's A(z) [3, 7, 3] with row stride 4,
    and an outer torch.compile's size/stride check of the op failed. Free where the layout already is contiguous."""
    if isinstance(result, (list, tuple)):
        return type(result)(_contiguous(t) for t in result)
    strides, step = [], 1  # torch's contiguous strides, size-1 dimensions included (a fake's are exactly these)
    for n in reversed(result.shape):
        strides.append(step)
        step *= max(n, 1)
    if result.stride() == tuple(reversed(strides)):
        return result
    return result.clone(memory_format=torch.contiguous_format)


def _forward_kernel(*args):
    _check_adapters("lora_geglu_mlp_forward", *args)
    return _contiguous(_fused(lora_geglu_mlp_forward_math, *args))


def _op_kernel(*args):
    _check_adapters("lora_geglu_mlp", *args)
    return _contiguous(_fused(lora_geglu_mlp_forward_math, *args)[0])


def _backward_kernel(*args):
    _check_backward(*args)
    return _contiguous(_fused(lora_geglu_mlp_backward_math, *args))


_lib.impl("lora_geglu_mlp", _op_kernel, "CompositeExplicitAutograd")
_lib.impl("lora_geglu_mlp_forward", _forward_kernel, "CompositeExplicitAutograd")
_lib.impl("lora_geglu_mlp_backward", _backward_kernel, "CompositeExplicitAutograd")


# ----------------------------------------------------------------------------------------------------------------
# Fake kernels


def _mid_shapes(x, lora_a):
    return [(*x.shape[:-1], a.shape[0]) for a in lora_a]


@torch.library.register_fake("g4ops::lora_geglu_mlp", lib=_lib)
def _op_fake(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask, split=False):
    _check_adapters("lora_geglu_mlp", x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask)
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


@torch.library.register_fake("g4ops::lora_geglu_mlp_forward", lib=_lib)
def _forward_fake(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask, split=False):
    _check_adapters("lora_geglu_mlp_forward", x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout,
                    dropout_mask)  # fmt: skip
    inter = (*x.shape[:-1], w_gate.shape[0])
    # A(z) has the adapter's dtype after peft's cast chain: the last cast is to the adapter's own dtype
    mids = [a.new_empty(shape) for a, shape in zip(lora_a, _mid_shapes(x, lora_a))]
    return x.new_empty((*x.shape[:-1], w_down.shape[0])), x.new_empty(inter), x.new_empty(inter), mids


@torch.library.register_fake("g4ops::lora_geglu_mlp_backward", lib=_lib)
def _backward_fake(grad_out, x, gate, up, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout,
                   dropout_mask, lora_mid, output_mask, lora_mask, split=False):  # fmt: skip
    _check_backward(grad_out, x, gate, up, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout,
                    dropout_mask, lora_mid, output_mask, lora_mask)  # fmt: skip
    return _grad_fakes(x, (x, w_gate, w_up, w_down), output_mask, lora_a, lora_b, lora_mask)


def _grad_fakes(x, inputs, output_mask, lora_a, lora_b, lora_mask):
    """A backward's fake outputs: each input's gradient (or an empty tensor where not wanted), then dA's and dB's."""
    n = len(lora_a)
    base = [t.new_empty(t.shape) if wanted else x.new_empty(0) for t, wanted in zip(inputs, output_mask)]
    grad_a = [a.new_empty(a.shape) if wanted else a.new_empty(0) for a, wanted in zip(lora_a, lora_mask[:n])]
    grad_b = [b.new_empty(b.shape) if wanted else b.new_empty(0) for b, wanted in zip(lora_b, lora_mask[n:])]
    return (*base, grad_a, grad_b)


# ----------------------------------------------------------------------------------------------------------------
# Autograd: the backward is one registered op, as for geglu_mlp; inside a compiled trace, its math.


def _save(ctx, forward, scaling, counts, dropout, split, x, w_gate, w_up, w_down, tensors):
    """The forward of both autograd formulas: `forward` is the op or its math; saves x, gate, up, the weights, the
    adapters, the masks and the [T, r] products (not h: the backward recomputes it)."""
    n = len(scaling)
    lora_a, lora_b, masks = list(tensors[:n]), list(tensors[n : 2 * n]), list(tensors[2 * n :])
    out, gate, up, mids = forward(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, masks, split)
    ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down, *tensors, *mids)
    ctx.lists, ctx.n, ctx.masks = (scaling, counts, dropout, split), n, len(masks)
    return out


def _grads(ctx, backward, grad_out):
    """The backward of both autograd formulas: `backward` is the op or its math."""
    n, n_masks = ctx.n, ctx.masks
    x, gate, up, w_gate, w_up, w_down, *rest = ctx.saved_tensors
    lora_a, lora_b = list(rest[:n]), list(rest[n : 2 * n])
    masks, mids = list(rest[2 * n : 2 * n + n_masks]), list(rest[2 * n + n_masks :])
    scaling, counts, dropout, split = ctx.lists
    wanted = list(ctx.needs_input_grad[4 : 8 + 2 * n])  # x, the weights and the adapters (never the masks)
    grads = backward(grad_out.contiguous(), x, gate, up, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts,
                     dropout, masks, mids, wanted[:4], wanted[4:], split)  # fmt: skip
    flat = [*grads[:4], *grads[4], *grads[5]]
    return None, None, None, None, *(g if want else None for g, want in zip(flat, wanted)), *([None] * n_masks)


class _LoraGegluFunction(torch.autograd.Function):
    """The op's autograd formula, eager: its steps are the opaque ops. Inputs after the three lists and the split
    flag: x, the three weights, the n lora_a, the n lora_b, then the dropout masks."""

    @staticmethod
    def forward(ctx, scaling, counts, dropout, split, x, w_gate, w_up, w_down, *tensors):
        return _save(ctx, torch.ops.g4ops.lora_geglu_mlp_forward, scaling, counts, dropout, split, x, w_gate, w_up,
                     w_down, tensors)  # fmt: skip

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        return _grads(ctx, torch.ops.g4ops.lora_geglu_mlp_backward, grad_out)


class _TracedLoraGeglu(torch.autograd.Function):
    """The same formula for an outer torch.compile to trace (module docstring): the math itself, no opaque op, so
    the outer graph holds it and Dynamo traces this forward and backward into it. Same inputs."""

    @staticmethod
    def forward(ctx, scaling, counts, dropout, split, x, w_gate, w_up, w_down, *tensors):
        out = _save(ctx, lora_geglu_mlp_forward_math, scaling, counts, dropout, split, x, w_gate, w_up, w_down,
                    tensors)  # fmt: skip
        # A fresh tensor, not the math's last intermediate itself: torch 2.11's Dynamo can route the output's
        # gradient to another slot when the returned tensor is an intermediate it also collects (pytorch issue
        # 180642), and the backward then got zeros (all-zero gradients, reproduced on CPU). Inductor fuses the copy.
        return out.clone()

    @staticmethod
    def backward(ctx, grad_out):
        return _grads(ctx, lora_geglu_mlp_backward_math, grad_out)


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset


def _op_autograd(keyset, x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, dropout_mask,
                 split=False):  # fmt: skip
    tensors = (x, w_gate, w_up, w_down, *lora_a, *lora_b)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LoraGegluFunction.apply(list(scaling), list(counts), list(dropout), split, *tensors, *dropout_mask)
    return torch.ops.g4ops.lora_geglu_mlp.default.redispatch(keyset & _BELOW_AUTOGRAD, x, w_gate, w_up, w_down, lora_a,
                                                             lora_b, scaling, counts, dropout, dropout_mask,
                                                             split)  # fmt: skip


_lib.impl("lora_geglu_mlp", _op_autograd, "Autograd", with_keyset=True)
for _name in ("lora_geglu_mlp_forward", "lora_geglu_mlp_backward"):
    _lib.impl(_name, core._internal_op_autograd(_name), "Autograd", with_keyset=True)


# (getattr: importing this module must not need it; the traced path is off on releases that might lack it)
@getattr(torch._dynamo, "nonstrict_trace", lambda fn: fn)
def _check_traced(x, *args):
    """The op's input checks, once per trace on its fake tensors: Dynamo refuses (a graph break) torch._check
    messages that close over tensors; a non-strict call runs them as Python and leaves no node in the graph."""
    _check_adapters("lora_geglu_mlp", x, *args)
    return x.new_empty(0)  # unused (dead code to the compiler): nonstrict_trace refuses None


def _adapter_lists(entries, op: str):
    """(lora_a, lora_b, scaling, dropout, masks) from (A, B, scale) or (A, B, scale, p, keep-mask) entries."""
    for i, entry in enumerate(entries):
        if len(entry) not in (3, 5):
            raise ValueError(f"g4ops.{op}: adapter {i} must be (A, B, scale) or (A, B, scale, p, mask), "
                             f"got {len(entry)} items")  # fmt: skip
    lora_a, lora_b = [e[0] for e in entries], [e[1] for e in entries]
    scaling = [float(e[2]) for e in entries]
    dropout = [float(e[3]) if len(e) == 5 else 0.0 for e in entries]
    masks = [e[4] for e, p in zip(entries, dropout) if p != 0.0]
    return lora_a, lora_b, scaling, dropout, masks


def lora_geglu_mlp(x, w_gate, w_up, w_down, gate_adapters=(), up_adapters=(), down_adapters=()) -> torch.Tensor:
    """The Gemma-4 MLP with vanilla LoRA adapters on its projections (module docstring): each `*_adapters` is a
    sequence of (A [r, in], B [out, r], scale) or (A, B, scale, dropout p, bool keep-mask of the adapter's input
    shape) in peft's order. Weights in nn.Linear layout, no bias. Eager: the op `g4ops::lora_geglu_mlp`; inside an
    outer torch.compile trace: its math, traced into the caller's graph, unless that compile replays CUDA graphs
    (`_trace_in_this_compile`)."""
    groups = (gate_adapters, up_adapters, down_adapters)
    lora_a, lora_b, scaling, dropout, masks = _adapter_lists([e for group in groups for e in group], "lora_geglu_mlp")
    counts = [len(g) for g in groups]
    compiling = torch.compiler.is_compiling()
    split = compiling and _split_in_this_compile()
    if not (compiling and _trace_in_this_compile()):
        return torch.ops.g4ops.lora_geglu_mlp(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, masks,
                                              split)  # fmt: skip
    # inside an outer compile: the math into its graph, no per-call host cost (module docstring)
    _check_traced(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, masks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w_gate, w_up, w_down, *lora_a, *lora_b)):
        return _TracedLoraGeglu.apply(scaling, counts, dropout, split, x, w_gate, w_up, w_down, *lora_a, *lora_b,
                                      *masks)  # fmt: skip
    return lora_geglu_mlp_forward_math(x, w_gate, w_up, w_down, lora_a, lora_b, scaling, counts, dropout, masks,
                                       split)[0]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# One projection: a peft lora.Linear outside the MLP (attention's q/k/v/o_proj), as `g4ops::lora_linear`.
#
# The same formula, per projection, as the MLP's (module docstring), with the same helpers: y = x W^T plus the
# adapters (`_with_adapters`); dx = dY W + sum_a d_a(u_a A_a) summed in fp32 and rounded once, or split, dY W
# rounded first (peft rounds each adapter's term to x's dtype and then adds); dA, dB as above; no dW unless the
# base weight requires grad. Why an op:
# peft runs an fp32 adapter of a bf16 model as fp32 GEMMs on an fp32 copy of x, on FFMA units: in a graphed 4-layer
# E4B LoRA step on the H200 (2026-12-04, session 24) those were 1.9 of 21.4 ms of GPU time, nearly all in the four
# attention projections once the MLP's products ran split (`_split_mm`, which this op uses too). With this op (and
# G4OPS_LORA_SPLIT=1) they fell to about 1.0 ms, the K=r products that then stayed fp32, and the graphed 42-layer
# step went from 15444 to 16081 tok/s (bench/results/2026-12-04-h200-session24.md). Those products are now folded
# into the base GEMMs (`_linear_plus_low_rank`): 16916 tok/s (bench/results/2026-12-05-h200-session27.md).


def lora_linear_forward_math(x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, split=False):
    drops = _per_adapter_masks(dropout, dropout_mask)
    return _with_adapters(x, weight, lora_a, lora_b, scaling, drops, split)


def lora_linear_backward_math(grad_out, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, lora_mid,
                              output_mask, lora_mask, split=False):  # fmt: skip
    n = len(lora_a)
    drops = _per_adapter_masks(dropout, dropout_mask)
    acc = reference.accumulation_dtype(x.dtype)
    lora_x, folds, us, grad_b = _low_rank_grads(grad_out, lora_a, lora_b, scaling, drops, lora_mid, lora_mask[n:],
                                                acc, split)  # fmt: skip
    (grad_a,) = _a_grads(x, (us, lora_a, drops, lora_mask[:n]), split=split)
    if output_mask[0]:
        grad_x = _linear_plus_low_rank(grad_out, weight.t(), folds)
        if lora_x is not None:
            grad_x = (grad_x.to(acc) + lora_x).to(x.dtype)
        grad_x = grad_x.contiguous()
    else:
        grad_x = x.new_empty(0)
    grad_w = _rows(grad_out).t() @ _rows(x) if output_mask[1] else x.new_empty(0)
    return grad_x, grad_w, grad_a, grad_b


def _linear_op_kernel(*args):
    _check_linear("lora_linear", *args)
    return _contiguous(_fused(lora_linear_forward_math, *args)[0])


def _linear_forward_kernel(*args):
    _check_linear("lora_linear_forward", *args)
    return _contiguous(_fused(lora_linear_forward_math, *args))


def _check_linear_backward(grad_out, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, lora_mid,
                           output_mask, lora_mask, split=False):  # fmt: skip
    op = "lora_linear_backward"
    _check_linear(op, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask)
    core._check_floating("grad_out", grad_out)
    core._check_shape(op, "grad_out", grad_out, (*x.shape[:-1], weight.shape[0]), "x @ weight.T")
    _check_mids(op, x, lora_a, lora_mid, lora_mask)


def _linear_backward_kernel(*args):
    _check_linear_backward(*args)
    return _contiguous(_fused(lora_linear_backward_math, *args))


_lib.impl("lora_linear", _linear_op_kernel, "CompositeExplicitAutograd")
_lib.impl("lora_linear_forward", _linear_forward_kernel, "CompositeExplicitAutograd")
_lib.impl("lora_linear_backward", _linear_backward_kernel, "CompositeExplicitAutograd")


@torch.library.register_fake("g4ops::lora_linear", lib=_lib)
def _linear_op_fake(x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, split=False):
    _check_linear("lora_linear", x, weight, lora_a, lora_b, scaling, dropout, dropout_mask)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("g4ops::lora_linear_forward", lib=_lib)
def _linear_forward_fake(x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, split=False):
    _check_linear("lora_linear_forward", x, weight, lora_a, lora_b, scaling, dropout, dropout_mask)
    mids = [a.new_empty(shape) for a, shape in zip(lora_a, _mid_shapes(x, lora_a))]
    return x.new_empty((*x.shape[:-1], weight.shape[0])), mids


@torch.library.register_fake("g4ops::lora_linear_backward", lib=_lib)
def _linear_backward_fake(grad_out, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, lora_mid,
                          output_mask, lora_mask, split=False):  # fmt: skip
    _check_linear_backward(grad_out, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, lora_mid,
                           output_mask, lora_mask)  # fmt: skip
    return _grad_fakes(x, (x, weight), output_mask, lora_a, lora_b, lora_mask)


def _linear_save(ctx, forward, scaling, dropout, split, x, weight, tensors):
    """The forward of both autograd formulas (`forward`: the op or its math): saves x, the weights, the masks and
    the [T, r] products A_a(z_a)."""
    n = len(scaling)
    lora_a, lora_b, masks = list(tensors[:n]), list(tensors[n : 2 * n]), list(tensors[2 * n :])
    out, mids = forward(x, weight, lora_a, lora_b, scaling, dropout, masks, split)
    ctx.save_for_backward(x, weight, *tensors, *mids)
    ctx.lists, ctx.n, ctx.masks = (scaling, dropout, split), n, len(masks)
    return out


def _linear_grads(ctx, backward, grad_out):
    n, n_masks = ctx.n, ctx.masks
    x, weight, *rest = ctx.saved_tensors
    lora_a, lora_b = list(rest[:n]), list(rest[n : 2 * n])
    masks, mids = list(rest[2 * n : 2 * n + n_masks]), list(rest[2 * n + n_masks :])
    scaling, dropout, split = ctx.lists
    wanted = list(ctx.needs_input_grad[3 : 5 + 2 * n])  # x, weight and the adapters (never the masks)
    grads = backward(grad_out.contiguous(), x, weight, lora_a, lora_b, scaling, dropout, masks, mids, wanted[:2],
                     wanted[2:], split)  # fmt: skip
    flat = [*grads[:2], *grads[2], *grads[3]]
    return None, None, None, *(g if want else None for g, want in zip(flat, wanted)), *([None] * n_masks)


class _LoraLinearFunction(torch.autograd.Function):
    """`g4ops::lora_linear`'s autograd formula, eager: its steps are the opaque ops. Inputs after the two lists and the
    split flag: x, the weight, the n lora_a, the n lora_b, then the dropout masks."""

    @staticmethod
    def forward(ctx, scaling, dropout, split, x, weight, *tensors):
        return _linear_save(ctx, torch.ops.g4ops.lora_linear_forward, scaling, dropout, split, x, weight, tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        return _linear_grads(ctx, torch.ops.g4ops.lora_linear_backward, grad_out)


class _TracedLoraLinear(torch.autograd.Function):
    """The same formula for an outer torch.compile to trace, as `_TracedLoraGeglu`."""

    @staticmethod
    def forward(ctx, scaling, dropout, split, x, weight, *tensors):
        return _linear_save(ctx, lora_linear_forward_math, scaling, dropout, split, x, weight, tensors).clone()

    @staticmethod
    def backward(ctx, grad_out):
        return _linear_grads(ctx, lora_linear_backward_math, grad_out)


def _linear_op_autograd(keyset, x, weight, lora_a, lora_b, scaling, dropout, dropout_mask, split=False):
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *lora_a, *lora_b)):
        return _LoraLinearFunction.apply(list(scaling), list(dropout), split, x, weight, *lora_a, *lora_b,
                                         *dropout_mask)  # fmt: skip
    return torch.ops.g4ops.lora_linear.default.redispatch(keyset & _BELOW_AUTOGRAD, x, weight, lora_a, lora_b,
                                                          scaling, dropout, dropout_mask, split)  # fmt: skip


_lib.impl("lora_linear", _linear_op_autograd, "Autograd", with_keyset=True)
for _name in ("lora_linear_forward", "lora_linear_backward"):
    _lib.impl(_name, core._internal_op_autograd(_name), "Autograd", with_keyset=True)


@getattr(torch._dynamo, "nonstrict_trace", lambda fn: fn)
def _check_linear_traced(x, *args):
    """`_check_traced` for the single projection."""
    _check_linear("lora_linear", x, *args)
    return x.new_empty(0)


def lora_linear(x, weight, adapters=()) -> torch.Tensor:
    """peft's lora.Linear forward for a bias-free base weight ([out, in]) and its active adapters, each (A [r, in],
    B [out, r], scale) or (A, B, scale, dropout p, bool keep-mask of x's shape) in peft's order. Eager: the op
    `g4ops::lora_linear`; inside an outer torch.compile trace: its math, traced into the caller's graph unless
    that compile replays CUDA graphs (as `lora_geglu_mlp`)."""
    lora_a, lora_b, scaling, dropout, masks = _adapter_lists(adapters, "lora_linear")
    compiling = torch.compiler.is_compiling()
    split = compiling and _split_in_this_compile()
    if not (compiling and _trace_in_this_compile()):
        return torch.ops.g4ops.lora_linear(x, weight, lora_a, lora_b, scaling, dropout, masks, split)
    _check_linear_traced(x, weight, lora_a, lora_b, scaling, dropout, masks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *lora_a, *lora_b)):
        return _TracedLoraLinear.apply(scaling, dropout, split, x, weight, *lora_a, *lora_b, *masks)
    return lora_linear_forward_math(x, weight, lora_a, lora_b, scaling, dropout, masks, split)[0]
