"""peft's LoRA layers on a Gemma-4 model -> g4ops' LoRA ops (g4ops/ops/lora.py: the formula, the gradients, the
kernels): which peft layers the ops reproduce exactly, their base weights and adapters as the ops take them, the
forwards g4ops.hf.patches installs, and why a layer keeps peft's own forward.

Not implemented, so peft's own forward runs and `lora_mlp_forward` below says why once at INFO on the "g4ops"
logger (`fallback_reason` answers anytime): LoRA variants (DoRA, aLoRA, ... anything in peft's `lora_variant`),
`lora_bias`, a dropout module other than a plain nn.Dropout, a base layer that is not a plain bias-free nn.Linear
(quantized bases use other peft classes), `fan_in_fan_out`, hooks on the peft layer (peft's mixed-batch
`adapter_names` inference is such a hook), and adapters merged but disabled (peft unmerges them inside its forward).

Under torch.autocast (HF Trainer's and TRL's bf16=True: accelerate wraps the model's forward in it), peft's layers
run every product in the autocast dtype: each of their F.linear calls casts x, the base weight and the adapter's
weight to it, so the base output, A(z), B(A(z)), the scaled term and the sum are all in that dtype. `_autocast_call`
makes the same casts before the op (differentiable, so the gradients go back to each tensor's own dtype, as
autocast's casts send them) and runs the op with autocast off: the op's formula with adapters in the autocast dtype.
The dropout masks are drawn before, in the adapters' own dtype, as peft's dropout sees x cast to it.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from .. import ops
from ..ops.lora import lora_geglu_mlp, lora_linear
from .modules import is_plain_linear, is_plain_tensor

logger = logging.getLogger("g4ops")

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# Eager calls (no torch.compile tracing the model: HF Trainer's default) of a routed projection run peft's own forward
# instead (`make_linear_forward`): there the op's per-call host cost outweighs what it saves on the GPU, a few
# elementwise passes over [T, out] that its inner compile fuses (the split products are off outside CUDA graphs; the
# adapter GEMMs are peft's). On an H100 machine (torch 2.11, 2026-12-06, bench/lora_host.py at
# tiny widths, where the time is the host's) a q_proj forward and backward took 1139-1340 us through the op against
# 537-826 us through peft; a 42-layer eager E4B LoRA step (r=16, 2048 tokens, packed or padded) that called the op on
# its 132 projections ran at 0.82-0.87x stock eager's speed (bench/results/2026-12-06-h100-session40.md), about the
# 100 ms of host time per step those calls added; with peft's forward there it ran at 1.05x (packed) and 1.14x
# (padded) at 36-39% less memory (bench/results/2026-12-06-h100-session41.md). G4OPS_LORA_EAGER_LINEAR=op keeps the
# op in eager too.
EAGER_LINEAR_VIA_OP = os.environ.get("G4OPS_LORA_EAGER_LINEAR") == "op"


def is_peft_lora_layer(module) -> bool:
    """Any peft LoRA layer (plain, quantized, conv, ...): it has a base layer and lora_A/lora_B dicts (submodules,
    looked up in `_modules`: `hasattr` on a plain nn.Linear would become a compiled step's "not hasattr" guard, which
    runs nn.Module.__getattr__ and raises inside every guard check)."""
    submodules = getattr(module, "_modules", None)
    return (submodules is not None and "base_layer" in submodules
            and isinstance(submodules.get("lora_A"), nn.ModuleDict))  # fmt: skip


def is_plain_lora_linear(module) -> bool:
    cls = type(module)  # the exact class: peft's quantized LoRA layers are other classes of other modules
    return cls.__name__ == "Linear" and cls.__module__ == "peft.tuners.lora.layer"


def projection_terms(layer, x_dtype, from_our_forward: bool = False):
    """(base weight, [(A, B, scale)]) for a peft lora.Linear the fused path reproduces, else a str: why not.
    `from_our_forward`: called from the forward `make_linear_forward` put on the layer, which is then the layer's own
    forward by construction (read from the layer while Dynamo traces, its marker did not show, measured on the H200)."""
    if not is_plain_lora_linear(layer):
        return f"{type(layer).__module__}.{type(layer).__name__} is not peft's plain lora.Linear (quantized base?)"
    foreign_forward = "forward" in vars(layer) and not from_our_forward
    if foreign_forward or layer._forward_hooks or layer._forward_pre_hooks:
        return "the peft layer has hooks or its own forward (e.g. peft's mixed-batch adapter_names)"
    # the direct base layer, not peft's get_base_layer() (which probes hasattr(..., "base_layer") down to a plain
    # module: a "not hasattr" guard under compile, see is_peft_lora_layer); a nested tuner layer is not plain
    base = layer._modules["base_layer"]
    if not is_plain_linear(base):
        return f"its base layer is {type(base).__name__}, not a plain bias-free nn.Linear"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True"
    if layer.disable_adapters:
        if layer.merged:
            return "adapters are merged but disabled (peft unmerges them inside its forward)"
        return base.weight, []
    if layer.merged:
        return base.weight, []  # the deltas are in the base weight; peft then runs the base layer alone
    variants, dora = getattr(layer, "lora_variant", {}), getattr(layer, "use_dora", {})
    terms = []
    cast = getattr(layer, "cast_input_dtype_enabled", True)
    for name in layer.active_adapters:
        if name not in layer.lora_A.keys():
            continue  # peft skips it too
        if name in variants or dora.get(name, False):
            kind = type(variants[name]).__name__ if name in variants else "DoRA"
            return f"adapter {name!r} is a LoRA variant ({kind})"
        if layer.lora_bias.get(name, False):
            return f"adapter {name!r} has lora_bias=True"
        dropout = layer.lora_dropout[name]
        if type(dropout) is nn.Identity or (type(dropout) is nn.Dropout and not dropout.training):
            p = 0.0
        elif type(dropout) is nn.Dropout and not dropout.inplace:
            p = float(dropout.p)
        else:
            return f"adapter {name!r} has lora_dropout {dropout} (not plain nn.Dropout)"
        lin_a, lin_b = layer.lora_A[name], layer.lora_B[name]
        if not (is_plain_linear(lin_a) and is_plain_linear(lin_b)):
            return f"adapter {name!r}'s lora_A/lora_B are not plain bias-free nn.Linear"
        if lin_a.weight.dtype != lin_b.weight.dtype:
            return f"adapter {name!r} has lora_A in {lin_a.weight.dtype} but lora_B in {lin_b.weight.dtype}"
        if not cast and lin_a.weight.dtype != x_dtype:
            return f"adapter {name!r} is {lin_a.weight.dtype} and peft's input casting is disabled"
        terms.append((lin_a.weight, lin_b.weight, layer.scaling[name], p))
    return base.weight, terms


_logged: set = set()


def _explain(reason: str, what: str = "a Gemma4TextMLP keeps peft's forward (not g4ops' fused LoRA MLP)") -> None:
    # Logging inside a compiled region would break the graph: eager calls say it (`fallback_reason` answers anytime).
    if not torch.compiler.is_compiling() and (what, reason) not in _logged:
        _logged.add((what, reason))
        logger.info("g4ops: %s: %s", what, reason)


def _plan(mlp: nn.Module, x_dtype):
    """None: no peft layer here (patches' own test decides); a str: why the fused path does not reproduce it;
    else (the three base weights, the three projections' adapter lists)."""
    projections = [getattr(mlp, name, None) for name in MLP_PROJECTIONS]
    if not any(is_peft_lora_layer(p) for p in projections):
        return None
    weights, groups = [], []
    for name, proj in zip(MLP_PROJECTIONS, projections):
        if is_plain_linear(proj):
            weights.append(proj.weight)
            groups.append([])
            continue
        if not is_peft_lora_layer(proj):
            return f"{name} is a {type(proj).__name__}, neither a plain nn.Linear nor a peft LoRA layer"
        terms = projection_terms(proj, x_dtype)
        if isinstance(terms, str):
            return f"{name}: {terms}"
        weights.append(terms[0])
        groups.append(terms[1])
    return weights, groups


def lora_mlp_forward(mlp: nn.Module, x: torch.Tensor):
    """The MLP's output through g4ops when at least one projection is a peft LoRA layer and each is either a plain
    linear (`modules.is_plain_linear`) or a peft lora.Linear this module reproduces; None otherwise (the
    caller runs the stock forward). A LoRA layer it does not reproduce is logged once with the reason."""
    plan = _plan(mlp, x.dtype)
    if plan is None:
        return None
    if isinstance(plan, str):
        _explain(plan)
        return None
    weights, groups = plan
    if not any(groups):
        return ops.geglu_mlp(x, *weights)  # merged, disabled or no active adapter: the base weights alone
    # Dropout masks drawn as peft's forward draws them: per adapter, gate's then up's then down's, in the adapter's
    # dtype and the shape of its input, by ATen's dropout (the same generator calls: the same masks).
    inter = weights[0].shape[0]
    shapes = (x.shape, x.shape, (*x.shape[:-1], inter))
    groups = [_with_masks(group, shape, x.device) for group, shape in zip(groups, shapes)]
    return _autocast_call(lora_geglu_mlp, x, weights, groups)


def _autocast_call(op, x, weights, groups):
    """`op(x, *weights, *groups)` (groups: adapter lists as `_with_masks` gives them); under torch.autocast, with x,
    the weights and the adapters' A and B cast to the autocast dtype first (`ops.to_autocast_dtype`) and autocast
    off inside (module docstring)."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return op(x, *weights, *groups)
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: ops.to_autocast_dtype(t, dtype)  # noqa: E731
    groups = [[(cast(a), cast(b), *rest) for a, b, *rest in group] for group in groups]
    with torch.autocast(device_type, enabled=False):
        return op(cast(x), *map(cast, weights), *groups)


LINEAR_FORWARD_MARK = "_g4ops_lora_linear"  # on the forward `make_linear_forward` builds


def make_linear_forward(peft_forward):
    """The forward g4ops.hf.patches puts on a peft lora.Linear projection of a Gemma-4 attention (enable(model)): inside
    a torch.compile trace, the layer through `lora_linear` where `projection_terms` says the op reproduces peft, else
    `peft_forward` (peft's class forward), the reason logged once; eager calls run `peft_forward` unless
    EAGER_LINEAR_VIA_OP (its comment says why). Merged, disabled or inactive adapters: peft's forward,
    which then runs the base layer alone."""

    def forward(self, x, *args, **kwargs):
        if not (torch.compiler.is_compiling() or EAGER_LINEAR_VIA_OP):
            if "eager-linear" not in _logged:
                _logged.add("eager-linear")
                logger.info("g4ops: eager calls of the Gemma-4 attention projections' LoRA run peft's forward, "
                            "faster there than g4ops.lora_linear; a torch.compile'd model runs g4ops' LoRA math "
                            "(G4OPS_LORA_EAGER_LINEAR=op: the op in eager too)")  # fmt: skip
            return peft_forward(self, x, *args, **kwargs)
        if args or kwargs or not is_plain_tensor(x):  # peft's extra arguments (adapter_names, ...)
            return peft_forward(self, x, *args, **kwargs)
        terms = projection_terms(self, x.dtype, from_our_forward=True)
        if isinstance(terms, str):
            _explain(terms, "a Gemma-4 attention projection keeps peft's forward (not g4ops.lora_linear)")
            return peft_forward(self, x)
        weight, adapters = terms
        if not adapters:
            return peft_forward(self, x)
        adapters = _with_masks(adapters, x.shape, x.device)  # masks as peft draws them
        return _autocast_call(lora_linear, x, [weight], [adapters])

    setattr(forward, LINEAR_FORWARD_MARK, True)
    return forward


def runs_lora_linear(layer: nn.Module) -> bool:
    """Whether this layer's forward is the one `make_linear_forward` built (enable(model) routed it)."""
    return hasattr(getattr(vars(layer).get("forward"), "__func__", None), LINEAR_FORWARD_MARK)


def explain_unrouted_projections(attention, names) -> None:
    """Say once (INFO, "g4ops" logger) when an attention's projections are peft LoRA layers without the forward
    `make_linear_forward` builds: they run peft's forward under torch.compile too, because only enable(model) called
    after peft wrapped them routes them (`patches._route_projection_lora`). Eager calls only (the caller
    checks; a trace cannot log)."""
    if attention is None or "unrouted" in _logged:
        return
    for name in names:
        proj = getattr(attention, name, None)
        if proj is not None and is_plain_lora_linear(proj) and "forward" not in vars(proj):
            _logged.add("unrouted")
            logger.info("g4ops: the Gemma-4 attention projections with peft LoRA run peft's forward, under "
                        "torch.compile too; call g4ops.enable(model) after peft wraps the model so that a compiled "
                        "model runs them through g4ops.lora_linear's math")  # fmt: skip
            return


def _with_masks(adapters, shape, device) -> list[tuple]:
    """One projection's (A, B, scale, p) adapters as the ops take them: (A, B, scale) where p == 0, else with p and a
    keep-mask of the adapter input's `shape`, drawn in adapter order and dtype (`_keep_mask`)."""
    return [(a, b, s) if p == 0.0 else (a, b, s, p, _keep_mask(shape, a.dtype, device, p)) for a, b, s, p in adapters]


def _keep_mask(shape, dtype, device, p: float) -> torch.Tensor:
    # native_dropout is what F.dropout runs on CUDA; on CPU it draws bernoulli_(1 - p) over a tensor of the input's
    # dtype and shape, as F.dropout's CPU path does: either way the generator advances as peft's call would.
    return torch.native_dropout(torch.ones(shape, dtype=dtype, device=device), p, True)[1]


def fallback_reason(mlp: nn.Module) -> str | None:
    """Why this Gemma4TextMLP with peft LoRA layers would keep peft's forward under g4ops.enable() (None: it runs
    g4ops' fused path, or has no peft layer). For compiled models, whose traces do not log: call it outside."""
    weight = mlp.gate_proj.get_base_layer().weight if is_peft_lora_layer(mlp.gate_proj) else mlp.gate_proj.weight
    plan = _plan(mlp, weight.dtype)
    return plan if isinstance(plan, str) else None
