"""`g4ops.enable()`: make HF transformers' Gemma-4 modules call the g4ops ops, at run time, reversibly.

This is the only module that knows transformers' Gemma-4 class names and quirks (design.md section 5):
- `Gemma4RMSNorm.forward` -> `g4ops.rms_norm` (no `1 + w` offset; `with_scale=False` norms have no weight; the
  vision/audio towers reuse the class at other widths, which the op handles).
- `Gemma4TextMLP.forward` -> `g4ops.geglu_mlp`, but only when the three projections are plain `nn.Linear` without
  bias, hooks or an instance-level forward. Projections wrapped by peft's plain LoRA run `g4ops::lora_geglu_mlp`
  with the adapters (g4ops/lora.py; LoRA features it does not reproduce keep peft's forward and are logged once).
  A projection replaced by a quantized layer, sharded as a DTensor or hooked by accelerate keeps the stock forward,
  so an adapter is never silently bypassed.
  The double-wide MLP of E2B's KV-shared layers is just a wider weight.
- peft's plain LoRA layers on a Gemma4TextAttention's q/k/v/o_proj, with `enable(model)` called after peft wrapped
  them: an instance-level forward that runs `g4ops::lora_linear` (`_route_projection_lora`; the attention's own
  forward stays stock). The class-wide `enable()` leaves them to peft and the decoder layer says so once.
- `Gemma4TextDecoderLayer.forward` -> stock's layer code with its middle (post_attention_layernorm, the residual add,
  pre_feedforward_layernorm) as one `g4ops.sandwich_norm`. Only for the signature it knows (5.6 to 5.25: the cache
  argument is `past_key_values` or `cache`), without MoE, and when both norms compute Gemma4RMSNorm unhooked;
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
  SDPA with the dense window mask; and stock SDPA with the mask stock would have built everywhere else (section
  "Attention" below).

- Decode: `Gemma4ForCausalLM.generate` (and the multimodal class's, for text-only calls) is wrapped so that calls on
  CUDA that the decoder reproduces exactly (greedy or sampled, default or static cache: g4ops/decode.py says which)
  run `g4ops.engine.decoder.Decoder` (the whole step in one CUDA graph); every other call runs stock generate
  untouched (`enable(..., decode=False)` leaves it alone).

Only `forward` and `generate` attributes are replaced (on the class, or on one model's module instances), plus the
attention implementation name of the Gemma-4 text configs that `enable(model)` switches; classes are never swapped
and no file of the install is touched. Each patch remembers the forward it replaced, and `disable()` puts
those back. Before patching, a probe checks that the installed transformers computes what the ops compute, so a
future change of semantics is refused loudly instead of producing a silently different model.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import weakref

import torch
from torch import nn

from . import lora, ops
from .decode import _STOCK_GENERATE, make_generate, release_decoders

_HF_MODULE = "transformers.models.gemma4.modeling_gemma4"
_GELU_TANH_NAMES = {"gelu_pytorch_tanh"}  # ACT2FN names whose function is gelu(x, approximate="tanh")
_MARK = "_g4ops_stock_forward"  # attribute on every forward we install: the forward it replaced


def _gemma4():
    try:
        import importlib

        return importlib.import_module(_HF_MODULE)
    except ImportError as exc:
        raise ImportError(
            "g4ops.enable() needs HF transformers with Gemma-4 (transformers >= 5.6): " + str(exc)
        ) from exc


# ----------------------------------------------------------------------------------------------------------------
# Replacement forwards


def _is_plain_tensor(t) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def _is_plain_linear(module) -> bool:
    return (
        type(module) is nn.Linear
        and module.bias is None
        and "forward" not in vars(module)
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and _is_plain_tensor(module.weight)
    )


def _make_norm_forward(stock_forward):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = _norm_weight(self)
        if not _is_plain_tensor(hidden_states) or (weight is not None and not _is_plain_tensor(weight)):
            return stock_forward(self, hidden_states)
        return ops.rms_norm(hidden_states, weight, norm_eps(self))

    setattr(forward, _MARK, stock_forward)
    return forward


def _make_embedding_forward(stock_forward):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        plain = _is_plain_tensor(input_ids) and _is_plain_tensor(self.weight)
        if not plain or self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return stock_forward(self, input_ids)
        # stock: nn.Embedding's lookup, then the scale in the weight dtype
        return ops.embedding(input_ids, self.weight, self.padding_idx) * self.embed_scale.to(self.weight.dtype)

    setattr(forward, _MARK, stock_forward)
    return forward


def _gelu_tanh_mlp(mlp: nn.Module) -> bool:
    return getattr(getattr(mlp, "config", None), "hidden_activation", None) in _GELU_TANH_NAMES


def mlp_uses_g4ops(mlp: nn.Module) -> bool:
    """Whether a Gemma4TextMLP can run as one geglu_mlp op (else g4ops.lora's LoRA path or its stock forward)."""
    return _gelu_tanh_mlp(mlp) and all(_is_plain_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj",
                                                                                          "down_proj"))  # fmt: skip


def _make_mlp_forward(stock_forward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_plain_tensor(x) and mlp_uses_g4ops(self):
            return ops.geglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if _is_plain_tensor(x) and _gelu_tanh_mlp(self):
            out = lora.geglu_mlp(self, x, _is_plain_linear)  # peft LoRA projections; None: not reproduced
            if out is not None:
                return out
        return stock_forward(self, x)

    setattr(forward, _MARK, stock_forward)
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
    return forward is not None and hasattr(forward, _MARK)


def _runs_gemma_norm(norm, hf) -> bool:
    """The module computes Gemma4RMSNorm as stock or our patch does: no hooks, no foreign forward, a plain weight."""
    forward, weight = vars(norm).get("forward"), _norm_weight(norm)
    return (
        isinstance(norm, hf.Gemma4RMSNorm)
        and _stock_forward_of(type(norm)) is _stock_forward_of(hf.Gemma4RMSNorm)
        and (forward is None or _is_our_forward(forward))
        and not norm._forward_hooks
        and not norm._forward_pre_hooks
        and (weight is None or _is_plain_tensor(weight))
    )


def _norm_weight(norm):
    return getattr(norm, "weight", None) if getattr(norm, "with_scale", True) else None


def norm_eps(norm) -> float:
    """A Gemma4RMSNorm's epsilon: `eps` through transformers 5.24, `variance_epsilon` from 5.25. Read from the
    instance dict: probing a missing attribute of a module (`getattr(norm, "eps", None)`) becomes a compiled step's
    "not hasattr" guard, which runs nn.Module.__getattr__ and raises inside every guard check."""
    attrs = vars(norm)
    return attrs["eps"] if "eps" in attrs else attrs["variance_epsilon"]


def _make_decoder_layer_forward(stock_forward):
    """Stock Gemma4TextDecoderLayer.forward with its middle (post_attention_layernorm, the residual add,
    pre_feedforward_layernorm) as one `g4ops.sandwich_norm`. Everything else is stock's code, in stock's order."""
    hf = _gemma4()
    params = _layer_params(stock_forward)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            lora.explain_unrouted_projections(getattr(self, "self_attn", None), _ATTENTION_PROJECTIONS)
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
        if not _is_plain_tensor(hidden_states):
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
            hidden_states = self.per_layer_input_gate(hidden_states)
            hidden_states = self.act_fn(hidden_states)
            hidden_states = hidden_states * per_layer_input
            hidden_states = self.per_layer_projection(hidden_states)
            hidden_states = self.post_per_layer_input_norm(hidden_states)
            hidden_states = residual + hidden_states

        hidden_states *= self.layer_scalar
        return hidden_states

    setattr(forward, _MARK, stock_forward)
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

    setattr(forward, _MARK, getattr(ours, _MARK))
    return types.MethodType(forward, module)


def _patch_table() -> dict[type, callable]:
    """Class -> factory of its replacement forward."""
    hf = _gemma4()
    from .hf_loss import make_causal_lm_forward  # imports this module: loaded on first use

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
    from .models import text_config

    gen = torch.Generator().manual_seed(0)
    norm = hf.Gemma4RMSNorm(24, eps=1e-6)
    norm.weight.copy_(torch.randn(24, generator=gen))
    x = torch.randn(3, 24, generator=gen)
    if not torch.allclose(norm(x), ops.rms_norm(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-6):
        raise RuntimeError(
            f"{_HF_MODULE}.Gemma4RMSNorm no longer computes x * rsqrt(mean(x^2) + eps) * weight; g4ops refuses to "
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
            f"{_HF_MODULE}.Gemma4TextMLP no longer computes down(gelu_tanh(gate(x)) * up(x)); g4ops refuses to "
            "patch this transformers version (please report it)"
        )
    embed = hf.Gemma4TextScaledWordEmbedding(10, 4, 0, embed_scale=3.0)
    embed.weight.copy_(torch.randn(10, 4, generator=gen))
    ids = torch.tensor([[0, 3, 9, 3]])
    if not torch.equal(embed(ids), _make_embedding_forward(None)(embed, ids)):
        raise RuntimeError(
            f"{_HF_MODULE}.Gemma4TextScaledWordEmbedding no longer computes embedding(ids) * embed_scale; g4ops "
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
    return _unwrap_checkpoint(getattr(forward, _MARK, forward))


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
                _restore_attention(config)
        if self.registered:
            _unregister_attention()
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


# ----------------------------------------------------------------------------------------------------------------
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
# query row (`_open_empty_rows`), and those rows' outputs are 0, as CPU sdpa gives them and g4ops.attention does: a fully masked row (a
# left-pad query, or a pad run longer than the window) is reported NaN from CUDA sdpa (unsloth PR 9848: B200,
# torch 2.13), and a NaN there reaches real tokens through 0 * NaN in P @ V in the next layer (transformers issue
# 45201's NaN losses with padding at batch > 1).
# transformers builds the block-diagonal mask of packed sequences (position_ids that restart) only without a cache
# (masking_utils' _preprocess_mask_arguments): with one, e.g. a training forward under the config's use_cache=True,
# it hands over the plain pattern and sequences would see each other. In eager we read position_ids and add the
# sequence boundaries to the mask (`_packed_segments`). Under torch.compile that read is impossible: transformers
# then builds the packed mask whenever there is no cache (it cannot tell packed from plain positions while tracing),
# and a call that got no mask asserts on the device that its positions do not restart, so a compiled packed
# forward with a cache fails loudly (use_cache=False: what Trainer and TRL pass). A given attention_mask is trusted
# there, as transformers does (it detects packing only without one).

ATTENTION = "g4ops"
# Sliding layers of a compiled CUDA model run FlexAttention with a block-sparse band (g4ops.attention's section on
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

    from .attention import attention, flex_sliding_usable, masked_flex_supported, sliding_window_attention

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
    training_masked = (plain and causal and q_len == kv_len and query.dtype == key.dtype == value.dtype
                       and getattr(getattr(module, "config", None), "use_bidirectional_attention", None) is None)  # fmt: skip

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


def _register_attention() -> bool:
    """Register "g4ops" with both interfaces; True when this call did it."""
    attn, mask = _interfaces()
    if attn._global_mapping.get(ATTENTION) is g4ops_attention_forward:
        return False
    attn.register(ATTENTION, g4ops_attention_forward)
    mask.register(ATTENTION, g4ops_mask)
    return True


def _unregister_attention() -> None:
    attn, mask = _interfaces()
    for interface, fn in ((attn, g4ops_attention_forward), (mask, g4ops_mask)):
        if interface._global_mapping.get(ATTENTION) is fn:
            del interface._global_mapping[ATTENTION]


def _switch_attention(model: nn.Module, hf) -> list:
    """Move the Gemma-4 text configs of `model` that use "sdpa" to "g4ops" (eager/flash/flex choices are kept)."""
    switched = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(module, hf.Gemma4TextAttention) and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = ATTENTION
            _switched_configs.append(weakref.ref(config))
            switched.append(config)
    return switched


def _restore_attention(config) -> None:
    for i, ref in enumerate(_switched_configs):  # by identity: weakref == would call the config's __eq__
        if ref() is config:
            config._attn_implementation = "sdpa"
            del _switched_configs[i]
            return


def _maybe_build_kernels() -> None:
    """On a GPU machine, build (or load) the kernels now, so a failure shows at enable() and not mid-forward."""
    if torch.cuda.is_available():
        from ._build import ensure_cuda_kernels

        ensure_cuda_kernels()


def enable(model: nn.Module | None = None, attention: bool = False, decode: bool = True) -> _Patches:
    """Patch every Gemma-4 norm/MLP (and the causal-LM loss) class, or only the modules of `model`; register the
    "g4ops" attention implementation, and with `model` and `attention=True`, switch its Gemma-4 text attention from
    "sdpa" to it. Opt-in, because on the H200 (2026-11-29) it beat stock only under torch.compile: a 42-layer finetune
    step 1.36x stock compile at 2048 tokens and 2.37x at 8192; in eager its full layers are 0.8x stock
    (g4ops.attention's docstring has the per-layer numbers).

    `decode`: route eligible `generate()` calls of Gemma4ForCausalLM to g4ops.engine.decoder.Decoder (module docstring).
    Gemma4TextModel's set of layer types is iterated sorted, so compile caches work across processes ("Layer-type
    order" above).

    Idempotent; returns a handle that works as a context manager (`with g4ops.enable(): ...`) and undoes on exit
    only what this call changed."""
    hf = _gemma4()
    _probe_once(hf)
    _maybe_build_kernels()
    registered = _register_attention()
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
    return _Patches([], patched_modules, _switch_attention(model, hf) if attention else [], registered)


_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _route_projection_lora(attention: nn.Module) -> list[nn.Module]:
    """Give each peft lora.Linear among the attention's projections g4ops.lora's forward (`make_linear_forward`):
    the module calls inside stock Gemma4TextAttention.forward then run `g4ops::lora_linear` (its math) under
    torch.compile, peft's forward in eager (`lora.EAGER_LINEAR_VIA_OP` says why). Only through enable(model): a
    class-wide enable() cannot see which peft layers sit in a Gemma-4 attention."""
    routed = []
    for name in _ATTENTION_PROJECTIONS:
        proj = getattr(attention, name, None)
        if proj is None or not lora.is_plain_lora_linear(proj) or "forward" in vars(proj):
            continue
        peft_forward = type(proj).forward
        forward = lora.make_linear_forward(peft_forward, _is_plain_linear, _is_plain_tensor)
        setattr(forward, _MARK, peft_forward)  # what _unpatch_module recognizes and removes
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
        for ref in _switched_configs:
            config = ref()
            if config is not None:
                config._attn_implementation = "sdpa"
        _switched_configs.clear()
        _unregister_attention()
        return
    for module in model.modules():
        _unpatch_module(module)
        config = getattr(module, "config", None)
        if config is not None:
            _restore_attention(config)


def is_enabled(model: nn.Module | None = None) -> bool:
    """True when the classes are patched, or (given a model) when any of its modules runs a g4ops forward."""
    if model is None:
        return bool(_class_patches)
    for module in model.modules():
        if _is_our_forward(getattr(module, "forward", None)):
            return True
    return False
