"""`g4ops.enable()`: make HF transformers' Gemma-4 modules call the g4ops ops, at run time, reversibly.

The module patches of g4ops.hf, the package that knows transformers' Gemma-4 classes and quirks (design.md 5):
- `Gemma4RMSNorm.forward` -> `g4ops.rms_norm` (no `1 + w` offset; `with_scale=False` norms have no weight; the
  vision/audio towers reuse the class at other widths, which the op handles).
- `Gemma4TextMLP.forward` -> `g4ops.geglu_mlp`, but only when the three projections are plain `nn.Linear` without
  bias, hooks or an instance-level forward. Projections wrapped by peft's plain LoRA run `g4ops::lora_geglu_mlp`
  with the adapters (g4ops/hf/peft_lora.py; LoRA features it does not reproduce keep peft's forward, logged
  once).
  A projection replaced by a quantized layer, sharded as a DTensor or hooked by accelerate keeps the stock forward,
  so an adapter is never silently bypassed.
  The double-wide MLP of E2B's KV-shared layers is just a wider weight.
- peft's plain LoRA layers on a Gemma4TextAttention's q/k/v/o_proj, with `enable(model)` called after peft wrapped
  them: an instance-level forward that runs `g4ops::lora_linear` (`_route_projection_lora`; the attention's own
  forward stays stock). The class-wide `enable()` leaves them to peft and the decoder layer says so once.
- `Gemma4TextDecoderLayer.forward` -> stock's layer code with its middle (post_attention_layernorm, the residual add,
  pre_feedforward_layernorm) as one `g4ops.sandwich_norm`, and the per-layer-input gate as `g4ops.gelu_tanh_mul`.
  Only for the signature it knows (5.6 to 5.25: the cache argument is `past_key_values` or `cache`), without MoE,
  and when both norms compute Gemma4RMSNorm unhooked;
  otherwise the layer runs its stock forward (whose norms still use g4ops.rms_norm).
- `Gemma4TextScaledWordEmbedding.forward` -> the same lookup and scale through `g4ops.ops.embedding`, whose weight
  gradient is ATen's kernel kept opaque to Inductor (no 10.5 GiB fp32 transient for E4B's per-layer table under
  torch.compile). max_norm / scale_grad_by_freq / sparse embeddings keep the stock forward.

- Attention (opt-in): `enable()` registers a "g4ops" attention implementation with transformers' AttentionInterface
  and AttentionMaskInterface (`from_pretrained(..., attn_implementation="g4ops")` then works), and
  `enable(model, attention=True)` switches that model's Gemma-4 text attention from "sdpa" to it. It runs
  `g4ops.attention` (exact, GEMM-chunked, any head_dim) on the full-attention layers for training and prefill, with
  stock's padding or packed-sequence mask where there is one; on the sliding layers of such a call without a mask
  FlexAttention over the window's band when compiled on CUDA (with a mask too, narrowed by it, where
  `MASKED_SLIDING_VIA_FLEX` is on; with it, on g4ops.attention where `MASKED_SLIDING_VIA_G4OPS` is), else stock
  SDPA with the dense window mask; and stock SDPA with the mask stock would have built everywhere else
  (g4ops/hf/attention_interface.py).

- Decode: `Gemma4ForCausalLM.generate` (and the multimodal class's, for text-only calls) is wrapped so that calls on
  CUDA that the decoder reproduces exactly (greedy or sampled, default or static cache: g4ops/hf/generate.py says
  which) run `g4ops.engine.decoder.Decoder` (the whole step in one CUDA graph); every other call runs stock
  generate untouched (`enable(..., decode=False)` leaves it alone).

Only `forward` and `generate` attributes are replaced (on the class, or on one model's module instances), plus the
attention implementation name of the Gemma-4 text configs that `enable(model)` switches; classes are never swapped
and no file of the install is touched. Each patch remembers the forward it replaced, and `disable()` puts
those back. Before patching, a probe checks that the installed transformers computes what the ops compute, so a
future change of semantics is refused loudly instead of producing a silently different model.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref

import torch
from torch import nn

from .. import ops
from . import attention_interface, peft_lora
from .causal_lm import make_causal_lm_forward
from .generate import _STOCK_GENERATE, make_generate, release_decoders
from .modules import HF_MODULE, MARK, gemma4, is_plain_linear, is_plain_tensor

_GELU_TANH_NAMES = {"gelu_pytorch_tanh"}  # ACT2FN names whose function is gelu(x, approximate="tanh")


# ----------------------------------------------------------------------------------------------------------------
# Replacement forwards


def _make_norm_forward(stock_forward):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = _norm_weight(self)
        if not is_plain_tensor(hidden_states) or (weight is not None and not is_plain_tensor(weight)):
            return stock_forward(self, hidden_states)
        return ops.rms_norm(hidden_states, weight, norm_eps(self))

    setattr(forward, MARK, stock_forward)
    return forward


def _make_embedding_forward(stock_forward):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        plain = is_plain_tensor(input_ids) and is_plain_tensor(self.weight)
        if not plain or self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return stock_forward(self, input_ids)
        # stock: nn.Embedding's lookup, then the scale in the weight dtype
        return ops.embedding(input_ids, self.weight, self.padding_idx) * self.embed_scale.to(self.weight.dtype)

    setattr(forward, MARK, stock_forward)
    return forward


def _computes_gelu_tanh(module: nn.Module) -> bool:
    """The module's config names the tanh GELU (the MLP's and the decoder layer's `act_fn`)."""
    return getattr(getattr(module, "config", None), "hidden_activation", None) in _GELU_TANH_NAMES


def mlp_uses_g4ops(mlp: nn.Module) -> bool:
    """Whether a Gemma4TextMLP can run as one geglu_mlp op (else peft_lora's LoRA path or its stock forward)."""
    return _computes_gelu_tanh(mlp) and all(is_plain_linear(getattr(mlp, n, None)) for n in peft_lora.MLP_PROJECTIONS)


def _make_mlp_forward(stock_forward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_plain_tensor(x) and mlp_uses_g4ops(self):
            return ops.geglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if is_plain_tensor(x) and _computes_gelu_tanh(self):
            out = peft_lora.lora_mlp_forward(self, x)  # peft LoRA projections; None: not reproduced
            if out is not None:
                return out
        return stock_forward(self, x)

    setattr(forward, MARK, stock_forward)
    return forward


# The decoder layer's stock forward, parameter by parameter: all but `per_layer_input` go to the attention. One of
# the two cache names, by transformers release. Another signature keeps the stock layer forward (no fused norms).
_LAYER_PARAMS = ("hidden_states", "per_layer_input", "shared_kv_states", "position_embeddings", "attention_mask",
                 "position_ids")  # fmt: skip
_LAYER_CACHE_PARAMS = ("past_key_values", "cache")


def _layer_params(stock_forward) -> tuple[list[str], dict] | None:
    """(parameter names after self, their defaults) when the layer forward has the known signature, else None."""
    params = list(inspect.signature(stock_forward).parameters.values())[1:]
    names = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if (tuple(names[:-1]) != _LAYER_PARAMS or names[-1] not in _LAYER_CACHE_PARAMS
            or len(names) != len(params) - 1 or params[-1].kind is not params[-1].VAR_KEYWORD):  # fmt: skip
        return None
    return names, {p.name: p.default for p in params if p.default is not p.empty}


def _is_our_forward(forward) -> bool:
    """Whether `forward` (a function or a bound method) is one we installed. The mark is read through the bound
    method, not via `getattr(method, "__func__", None)`: Dynamo in torch 2.11 traced that as None, so under
    torch.compile every layer of an `enable(model)` model silently ran its stock forward (`_runs_gemma_norm`: two
    norms and an add where sandwich_norm fuses them)."""
    return forward is not None and hasattr(forward, MARK)


def _runs_gemma_norm(norm, hf) -> bool:
    """The module computes Gemma4RMSNorm as stock or our patch does: no hooks, no foreign forward, a plain weight."""
    forward, weight = vars(norm).get("forward"), _norm_weight(norm)
    return (
        isinstance(norm, hf.Gemma4RMSNorm)
        and _stock_forward_of(type(norm)) is _stock_forward_of(hf.Gemma4RMSNorm)
        and (forward is None or _is_our_forward(forward))
        and not norm._forward_hooks
        and not norm._forward_pre_hooks
        and (weight is None or is_plain_tensor(weight))
    )


def _norm_weight(norm):
    return getattr(norm, "weight", None) if getattr(norm, "with_scale", True) else None


def norm_eps(norm) -> float:
    """A Gemma4RMSNorm's epsilon: `eps` through transformers 5.24, `variance_epsilon` from 5.25. Read from the
    instance dict: probing a missing attribute of a module (`getattr(norm, "eps", None)`) becomes a compiled step's
    "not hasattr" guard, which runs nn.Module.__getattr__ and raises inside every guard check."""
    attrs = vars(norm)
    return attrs["eps"] if "eps" in attrs else attrs["variance_epsilon"]


def _gated_per_layer_input(layer, gate, per_layer_input):
    """stock's `act_fn(gate) * per_layer_input`, as `g4ops.gelu_tanh_mul` (one rounding, no intermediate) where a
    gradient flows through it, the activation is gelu_tanh and both are plain tensors of one dtype (not under
    autocast, where the gate is bf16 and the per-layer input fp32). The op is for training: its gradient for the
    per-layer input is computed once per layer, where Inductor would recompute every layer's gate arithmetic inside
    the sum over layers (`ops.gelu_tanh_mul` says more). Inference keeps stock's two steps, which a compiled decode
    step fuses with what surrounds them."""
    fused = (_computes_gelu_tanh(layer) and per_layer_input is not None and torch.is_grad_enabled()
             and (gate.requires_grad or per_layer_input.requires_grad) and is_plain_tensor(gate)
             and is_plain_tensor(per_layer_input) and gate.dtype == per_layer_input.dtype
             and gate.shape == per_layer_input.shape)  # fmt: skip
    if fused:
        return ops.gelu_tanh_mul(gate, per_layer_input)
    return layer.act_fn(gate) * per_layer_input


def _make_decoder_layer_forward(stock_forward):
    """Stock Gemma4TextDecoderLayer.forward with its middle (post_attention_layernorm, the residual add,
    pre_feedforward_layernorm) as one `g4ops.sandwich_norm`. Everything else is stock's code, in stock's order."""
    hf = gemma4()
    params = _layer_params(stock_forward)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            peft_lora.explain_unrouted_projections(getattr(self, "self_attn", None), _ATTENTION_PROJECTIONS)
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        if (params is None or getattr(self, "enable_moe_block", False) or len(args) > len(params[0])
                or not (_runs_gemma_norm(post, hf) and _runs_gemma_norm(pre, hf))
                or norm_eps(post) != norm_eps(pre)):  # fmt: skip
            return stock_forward(self, *args, **kwargs)
        names, defaults = params
        call = dict(defaults)
        call.update(zip(names, args))
        call.update(kwargs)
        hidden_states = call.pop("hidden_states")
        per_layer_input = call.pop("per_layer_input", None)
        if not is_plain_tensor(hidden_states):
            return stock_forward(self, *args, **kwargs)

        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **call)
        if hidden_states.dtype == residual.dtype:
            residual, hidden_states = ops.sandwich_norm(hidden_states, residual, _norm_weight(post),
                                                        _norm_weight(pre), norm_eps(post))  # fmt: skip
        else:  # autocast: a bf16 attention output beside the fp32 residual; stock's three steps, its promotion
            residual = residual + post(hidden_states)
            hidden_states = pre(residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + self.post_feedforward_layernorm(hidden_states)

        if self.hidden_size_per_layer_input:
            residual = hidden_states
            hidden_states = _gated_per_layer_input(self, self.per_layer_input_gate(hidden_states), per_layer_input)
            hidden_states = self.per_layer_projection(hidden_states)
            hidden_states = self.post_per_layer_input_norm(hidden_states)
            hidden_states = residual + hidden_states

        hidden_states *= self.layer_scalar
        return hidden_states

    setattr(forward, MARK, stock_forward)
    return forward


# ----------------------------------------------------------------------------------------------------------------
# Gradient checkpointing. transformers 5.6 to 5.22 checkpoints a GradientCheckpointingLayer in `__call__`, around
# whatever `forward` the module has, so replacing `forward` kept it. Since 5.23 `__init_subclass__` wraps each layer
# class's own `forward` in a `forward_with_checkpointing`, which checkpoints only when `type(self).forward` is that
# wrapper: replacing the class's forward silently turned checkpointing off (the layer's activations stayed alive; the
# losses and gradients were equal, so only memory showed it). So a forward we put on such a class is wrapped by
# transformers' own `__init_subclass__` again, and one we put on a single instance checkpoints itself the same way.


def _checkpoint_wrapper_code():
    """The code object every `forward_with_checkpointing` shares (transformers >= 5.23), else None."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    probe = type("_G4opsCheckpointProbe", (GradientCheckpointingLayer,), {"forward": forward})
    wrapped = vars(probe)["forward"]
    return None if wrapped is forward else wrapped.__code__


_CHECKPOINT_WRAPPER_CODE = None  # looked up on first use (importing transformers' modeling_layers is not free)


def _is_checkpoint_wrapper(forward) -> bool:
    global _CHECKPOINT_WRAPPER_CODE
    if _CHECKPOINT_WRAPPER_CODE is None:
        _CHECKPOINT_WRAPPER_CODE = _checkpoint_wrapper_code() or False
    return bool(_CHECKPOINT_WRAPPER_CODE) and getattr(forward, "__code__", None) is _CHECKPOINT_WRAPPER_CODE


def _unwrap_checkpoint(forward):
    """The forward inside transformers' checkpoint wrappers (one per subclass level, e.g. FSDP2's generated class)."""
    while _is_checkpoint_wrapper(forward):
        forward = forward.__wrapped__
    return forward


def _class_forward(cls: type, make_forward):
    """The replacement for `cls.forward`, built around the forward it replaces and keeping transformers' checkpoint
    wrapper outermost: a throwaway subclass lets the same `__init_subclass__` wrap ours."""
    stock = cls.forward
    if not _is_checkpoint_wrapper(stock):
        return make_forward(stock)
    ours = make_forward(_unwrap_checkpoint(stock))
    return vars(type(f"_G4ops{cls.__name__}", (cls,), {"forward": ours, "__module__": __name__}))["forward"]


def _instance_forward(module: nn.Module, make_forward):
    """The replacement for one module's forward (enable(model)). A checkpointing layer class's wrapper never sees an
    instance-level forward, so for such a class ours checkpoints itself as transformers' wrapper does (5.23, 5.24)."""
    if not _is_checkpoint_wrapper(type(module).forward):
        return types.MethodType(make_forward(_stock_forward_of(type(module))), module)
    ours = make_forward(_stock_forward_of(type(module)))

    def forward(self, *args, **kwargs):
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return ours(self, *args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            for name in ("cache", "layer_past"):  # the names transformers' wrapper clears
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        return self._gradient_checkpointing_func(functools.partial(ours, self, **kwargs), *args)

    setattr(forward, MARK, getattr(ours, MARK))
    return types.MethodType(forward, module)


def _patch_table() -> dict[type, callable]:
    """Class -> factory of its replacement forward."""
    hf = gemma4()
    table = {
        hf.Gemma4RMSNorm: _make_norm_forward,
        hf.Gemma4TextMLP: _make_mlp_forward,
        hf.Gemma4TextDecoderLayer: _make_decoder_layer_forward,
        hf.Gemma4TextScaledWordEmbedding: _make_embedding_forward,
    }
    for cls in _causal_lm_classes(hf):
        table[cls] = make_causal_lm_forward
    return table


# ----------------------------------------------------------------------------------------------------------------
# Probes: the installed transformers must compute what we replace it with.


@torch.no_grad()
def _probe(hf) -> None:
    from ..models import text_config

    gen = torch.Generator().manual_seed(0)
    norm = hf.Gemma4RMSNorm(24, eps=1e-6)
    norm.weight.copy_(torch.randn(24, generator=gen))
    x = torch.randn(3, 24, generator=gen)
    if not torch.allclose(norm(x), ops.rms_norm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6):
        raise RuntimeError(
            f"{HF_MODULE}.Gemma4RMSNorm no longer computes x * rsqrt(mean(x^2) + eps) * weight; g4ops refuses to "
            "patch this transformers version (please report it)"
        )
    config = text_config("tiny-e4b")
    try:
        mlp = hf.Gemma4TextMLP(config, 0)
    except TypeError:  # releases whose MLP takes only the config
        mlp = hf.Gemma4TextMLP(config)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.2)
    x = torch.randn(3, config.hidden_size, generator=gen)
    got = ops.geglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    if not torch.allclose(mlp(x), got, rtol=1e-4, atol=1e-5):
        raise RuntimeError(
            f"{HF_MODULE}.Gemma4TextMLP no longer computes down(gelu_tanh(gate(x)) * up(x)); g4ops refuses to "
            "patch this transformers version (please report it)"
        )
    embed = hf.Gemma4TextScaledWordEmbedding(10, 4, 0, embed_scale=3.0)
    embed.weight.copy_(torch.randn(10, 4, generator=gen))
    ids = torch.tensor([[0, 3, 9, 3]])
    if not torch.equal(embed(ids), _make_embedding_forward(None)(embed, ids)):
        raise RuntimeError(
            f"{HF_MODULE}.Gemma4TextScaledWordEmbedding no longer computes embedding(ids) * embed_scale; g4ops "
            "refuses to patch this transformers version (please report it)"
        )


_probed = False


def _probe_once(hf) -> None:
    global _probed
    if not _probed:
        with torch.random.fork_rng(devices=[]):  # its nn.Linear inits must not move a seeded user's CPU RNG
            _probe(hf)
        _probed = True


# ----------------------------------------------------------------------------------------------------------------
# Layer-type order. Gemma4TextModel keeps `unique_layer_types` as a set of strings and computes one rotary table per
# element, in the set's iteration order, which follows the process's string-hash seed (PYTHONHASHSEED). torch.compile
# traces that order into the graph, so a new process builds a different graph about half the time and PyTorch's
# compile caches miss (tests/test_compile_cache.py). enable() iterates it sorted; a set has no order to preserve.

_LAYER_TYPES = "unique_layer_types"
_SORTED_COPY = "_g4ops_sorted_layer_types"  # the sorted tuple the class property returns, kept beside stock's set


def _layer_types_sorted(self):
    # Plain attribute reads only: torch 2.11's Dynamo traces `self.__dict__.get(name)` on a module as
    # `getattr(self, name)`, which re-entered this property until the recursion limit (H200, 2026-11-30).
    types_ = getattr(self, _SORTED_COPY, None)
    if types_ is None:  # built before enable(): stock made its set from the config (AttributeError before that)
        types_ = tuple(sorted(set(self.config.layer_types)))
    return types_


def _store_layer_types(self, value):
    self.__dict__[_LAYER_TYPES] = value  # stock's set, which shows again after disable()
    self.__dict__[_SORTED_COPY] = tuple(sorted(value))


_SORTED_LAYER_TYPES = property(_layer_types_sorted, _store_layer_types)  # on the class: every instance, old and new
_sorted_layer_types_classes: list[type] = []


def _sort_layer_types_of_class(cls: type) -> bool:
    if cls in _sorted_layer_types_classes:
        return False
    setattr(cls, _LAYER_TYPES, _SORTED_LAYER_TYPES)
    _sorted_layer_types_classes.append(cls)
    return True


def _unsort_layer_types_of_class(cls: type) -> None:
    if cls in _sorted_layer_types_classes:
        delattr(cls, _LAYER_TYPES)  # each instance's own set shows again
        _sorted_layer_types_classes.remove(cls)


def _sort_layer_types_of_module(module: nn.Module) -> bool:
    types_ = vars(module).get(_LAYER_TYPES)
    if not isinstance(types_, set):
        return False
    module.__dict__[_LAYER_TYPES] = tuple(sorted(types_))
    return True


# ----------------------------------------------------------------------------------------------------------------
# Patch bookkeeping


_class_patches: dict[type, callable] = {}  # class -> the forward we replaced
_instance_patches: list[weakref.ref] = []  # modules whose instance-level forward we set


def _stock_forward_of(cls: type):
    """The forward transformers defined for `cls`: ours point to it, and checkpoint wrappers are peeled off."""
    forward = cls.forward
    return _unwrap_checkpoint(getattr(forward, MARK, forward))


class _Patches:
    """What one `enable()` call changed; a context manager that undoes exactly that on exit."""

    def __init__(self, classes: list[type], modules: list[nn.Module], configs=(), registered: bool = False,
                 generate_classes=(), layer_order_classes=()):  # fmt: skip
        self.classes = classes
        self.generate_classes = list(generate_classes)
        self.layer_order_classes = list(layer_order_classes)
        self.modules = [weakref.ref(m) for m in modules]
        self.configs = [weakref.ref(c) for c in configs]
        self.registered = registered

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for cls in self.classes:
            _unpatch_class(cls)
        for cls in self.generate_classes:
            _unpatch_generate(cls)
        for cls in self.layer_order_classes:
            _unsort_layer_types_of_class(cls)
        if self.generate_classes:
            release_decoders()
        for ref in self.modules:
            module = ref()
            if module is not None:
                _unpatch_module(module)
        for ref in self.configs:
            config = ref()
            if config is not None:
                attention_interface.restore_config(config)
        if self.registered:
            attention_interface.unregister()
        return False


_generate_patches: dict[type, object] = {}  # class -> its own `generate` attribute before ours (None: inherited)


def _causal_lm_classes(hf) -> list[type]:
    """The causal LMs: their forward gets the fused loss, their generate the decode routing (ForConditionalGeneration,
    what AutoModelForCausalLM loads for the released checkpoints: text-only generate calls; an image or audio input
    is an extra argument, which keeps the call on stock generate)."""
    return [getattr(hf, n) for n in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration") if hasattr(hf, n)]


def _text_model_classes(hf) -> list[type]:
    """The text decoders whose `unique_layer_types` set is iterated in forward (see "Layer-type order")."""
    return [hf.Gemma4TextModel] if hasattr(hf, "Gemma4TextModel") else []


def _patch_generate(cls: type) -> bool:
    if cls in _generate_patches:
        return False
    _generate_patches[cls] = vars(cls).get("generate")
    cls.generate = make_generate(cls.generate)
    return True


def _unpatch_generate(cls: type) -> None:
    if cls not in _generate_patches:
        return
    own = _generate_patches.pop(cls)
    if own is None:
        del cls.generate  # it was inherited from GenerationMixin
    else:
        cls.generate = own


def _unpatch_class(cls: type) -> None:
    stock = _class_patches.pop(cls, None)
    if stock is not None:
        cls.forward = stock


def _unpatch_module(module: nn.Module) -> None:
    forward = vars(module).get("forward")
    if _is_our_forward(forward):
        del module.forward
    generate = vars(module).get("generate")
    if generate is not None and hasattr(getattr(generate, "__func__", None), _STOCK_GENERATE):
        del module.generate
        vars(module).pop("_g4ops_decoder", None)
    if isinstance(vars(module).get(_LAYER_TYPES), tuple):  # stock keeps a set: a tuple is ours
        module.__dict__[_LAYER_TYPES] = set(module.__dict__[_LAYER_TYPES])
    _instance_patches[:] = [r for r in _instance_patches if r() is not None and r() is not module]


def _maybe_build_kernels() -> None:
    """On a GPU machine, build (or load) the kernels now, so a failure shows at enable() and not mid-forward."""
    if torch.cuda.is_available():
        from ..ops._build import ensure_cuda_kernels

        ensure_cuda_kernels()


def enable(model: nn.Module | None = None, attention: bool = False, decode: bool = True) -> _Patches:
    """Patch every Gemma-4 norm/MLP (and the causal-LM loss) class, or only the modules of `model`; register the
    "g4ops" attention implementation, and with `model` and `attention=True`, switch its Gemma-4 text attention from
    "sdpa" to it. Opt-in, because on the H200 (2026-11-29) it beat stock only under torch.compile: a 42-layer finetune
    step 1.36x stock compile at 2048 tokens and 2.37x at 8192; in eager its full layers are 0.8x stock
    (g4ops.ops.attention's docstring has the per-layer numbers).

    `decode`: route eligible `generate()` calls of Gemma4ForCausalLM to g4ops.engine.decoder.Decoder (module docstring).
    Gemma4TextModel's set of layer types is iterated sorted, so compile caches work across processes ("Layer-type
    order" above).

    Idempotent; returns a handle that works as a context manager (`with g4ops.enable(): ...`) and undoes on exit
    only what this call changed."""
    hf = gemma4()
    _probe_once(hf)
    _maybe_build_kernels()
    registered = attention_interface.register()
    table = _patch_table()
    if model is None:
        if attention:
            raise ValueError("g4ops.enable(attention=True) needs the model whose attention to switch: enable(model, "
                             "attention=True), or load it with attn_implementation=\"g4ops\"")
        patched = []
        for cls, make_forward in table.items():
            if cls not in _class_patches:
                forward = _class_forward(cls, make_forward)
                _class_patches[cls] = cls.forward
                cls.forward = forward
                patched.append(cls)
        generate = [cls for cls in _causal_lm_classes(hf) if decode and _patch_generate(cls)]
        layer_order = [cls for cls in _text_model_classes(hf) if _sort_layer_types_of_class(cls)]
        return _Patches(patched, [], registered=registered, generate_classes=generate,
                        layer_order_classes=layer_order)  # fmt: skip
    patched_modules = []
    if (decode and isinstance(model, tuple(_causal_lm_classes(hf))) and "generate" not in vars(model)
            and not any(isinstance(model, cls) for cls in _generate_patches)):  # fmt: skip
        model.generate = types.MethodType(make_generate(type(model).generate), model)
        _instance_patches.append(weakref.ref(model))
        patched_modules.append(model)
    for module in model.modules():
        if isinstance(module, tuple(_text_model_classes(hf))) and _sort_layer_types_of_module(module):
            _instance_patches.append(weakref.ref(module))
            patched_modules.append(module)
        if isinstance(module, hf.Gemma4TextAttention):
            patched_modules += _route_projection_lora(module)
        # isinstance, not type equality: FSDP2's fully_shard turns a module's class into a generated subclass.
        cls = next((c for c in table if isinstance(module, c)), None)
        if cls is None or "forward" in vars(module) or cls in _class_patches:
            continue  # not ours, already patched on the instance, or the class patch covers it
        if _stock_forward_of(type(module)) is not _stock_forward_of(cls):
            continue  # a subclass with a forward of its own: not what the patch reproduces
        module.forward = _instance_forward(module, table[cls])
        _instance_patches.append(weakref.ref(module))
        patched_modules.append(module)
    patched_modules = list(dict.fromkeys(patched_modules))  # the model itself may have both patches
    return _Patches([], patched_modules, attention_interface.switch_model(model, hf) if attention else [], registered)


_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _route_projection_lora(attention: nn.Module) -> list[nn.Module]:
    """Give each peft lora.Linear among the attention's projections peft_lora's forward (`make_linear_forward`):
    the module calls inside stock Gemma4TextAttention.forward then run `g4ops::lora_linear` (its math) under
    torch.compile, peft's forward in eager (`peft_lora.EAGER_LINEAR_VIA_OP` says why). Only through enable(model): a
    class-wide enable() cannot see which peft layers sit in a Gemma-4 attention."""
    routed = []
    for name in _ATTENTION_PROJECTIONS:
        proj = getattr(attention, name, None)
        if proj is None or not peft_lora.is_plain_lora_linear(proj) or "forward" in vars(proj):
            continue
        peft_forward = type(proj).forward
        forward = peft_lora.make_linear_forward(peft_forward)
        setattr(forward, MARK, peft_forward)  # what _unpatch_module recognizes and removes
        proj.forward = types.MethodType(forward, proj)
        _instance_patches.append(weakref.ref(proj))
        routed.append(proj)
    return routed


def disable(model: nn.Module | None = None) -> None:
    """Undo `enable()`: everything (the "g4ops" attention registration included), or only the instance patches and
    the attention switch of `model`."""
    if model is None:
        for cls in list(_class_patches):
            _unpatch_class(cls)
        for cls in list(_generate_patches):
            _unpatch_generate(cls)
        for cls in list(_sorted_layer_types_classes):
            _unsort_layer_types_of_class(cls)
        release_decoders()
        for ref in list(_instance_patches):
            module = ref()
            if module is not None:
                _unpatch_module(module)
        _instance_patches.clear()
        attention_interface.restore_all()
        attention_interface.unregister()
        return
    for module in model.modules():
        _unpatch_module(module)
        config = getattr(module, "config", None)
        if config is not None:
            attention_interface.restore_config(config)


def is_enabled(model: nn.Module | None = None) -> bool:
    """True when the classes are patched, or (given a model) when any of its modules runs a g4ops forward."""
    if model is None:
        return bool(_class_patches)
    for module in model.modules():
        if _is_our_forward(getattr(module, "forward", None)):
            return True
    return False
