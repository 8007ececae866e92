"""A drop-in `forward` for transformers' `Gemma4ForCausalLM` (and `Gemma4ForConditionalGeneration`, what
`AutoModelForCausalLM` loads for the released E4B/E2B checkpoints) that trains with the fused, chunked loss.

`make_causal_lm_forward(stock_forward)` returns a forward that, when the model is in training mode and `labels` are
given, runs the decoder (`self.model(...)`, the same call and arguments stock makes), and computes the loss with
`g4ops.linear_cross_entropy` on `lm_head.weight` (the tied embedding) and `config.final_logit_softcapping`, so the
[batch, seq, 262144] logits are never materialised. The output is the stock output class with `loss` set and
`logits=None` (as Liger does); every other field (cache, hidden_states, attentions, ...) is carried over. The
decoder (`self.model`) gets exactly the arguments the stock forward would hand it: every argument its forward names
(so `labels` only where it takes them, as Gemma4Model does for multimodal masks) plus the extra keyword arguments.

Loss semantics are HF's `ForCausalLMLoss` exactly:
- the shift: `labels` padded with `ignore_index` on the right and shifted left by one, so position t predicts
  labels[t + 1] and the last position predicts nothing. That is the same as hidden[..., :-1, :] vs labels[..., 1:]
  without copying the hidden states; a given `shift_labels` kwarg is used as is (no shift);
- `ignore_index` (kwarg, default -100) rows are skipped; the mean is over the others;
- `num_items_in_batch` (kwarg, tensor or number, as the HF Trainer passes it): the sum divided by it.

Everything else runs the stock forward unchanged: no labels, eval mode (so `model.eval()` + labels still returns
logits, which evaluation loops with metrics need), `logits_to_keep != 0`, a custom loss (`model.loss_function = ...`
or a `loss_type` whose HF loss is not ForCausalLMLoss), or an `lm_head` that is not a plain bias-free `nn.Linear`
(peft-wrapped, quantized or hooked: its own forward must run).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch.nn.functional as F

from ..ops.loss import linear_cross_entropy
from .modules import MARK, is_plain_linear



def _explicit_params(fn) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _output_class(stock_forward):
    """The output class stock returns (its forward's return annotation: Gemma4CausalLMOutputWithPast in recent
    transformers, CausalLMOutputWithPast in 5.6), and its field names."""
    function = inspect.unwrap(stock_forward)
    namespace = getattr(function, "__globals__", {})
    cls = getattr(function, "__annotations__", {}).get("return")
    if isinstance(cls, str):
        cls = namespace.get(cls.split(".")[-1].strip("'\""))
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        from transformers.modeling_outputs import CausalLMOutputWithPast as cls
    return cls, frozenset(f.name for f in dataclasses.fields(cls))


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _causal_loss_types() -> frozenset:
    """The `loss_type`s whose loss is HF's ForCausalLMLoss (ForCausalLM, ForConditionalGeneration, ...) and None.
    An unknown loss_type keeps the stock forward."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return frozenset({None, "ForCausalLM"})
    return frozenset({None, *(k for k, fn in LOSS_MAPPING.items() if fn is ForCausalLMLoss)})


def _fused_applies(model, arguments: dict, causal_types: frozenset) -> bool:
    logits_to_keep = arguments.get("logits_to_keep", 0)
    loss_type = getattr(model, "loss_type", None)
    return (
        model.training
        and arguments.get("labels") is not None
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and "_loss_function" not in vars(model)
        and loss_type in causal_types
        and is_plain_linear(getattr(model, "lm_head", None))
    )


def make_causal_lm_forward(stock_forward):
    """The fused-loss forward for `Gemma4ForCausalLM`, given the forward it replaces (called for every case the
    fused path does not cover). Usable on the class (`cls.forward = make_causal_lm_forward(cls.forward)`) or bound to
    one instance (`types.MethodType`)."""
    signature = inspect.signature(stock_forward)  # follows __wrapped__ to the real parameter names
    names = list(signature.parameters)
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    out_cls, out_fields = _output_class(stock_forward)  # looked up once here, not while torch.compile traces
    causal_types = _causal_loss_types()

    def fused(self, arguments: dict, extra: dict):
        # Read each call, not memoised: a memo filled on the first call changed what torch.compile had guarded on,
        # and every compiled model recompiled on its second call (minutes at 42 layers). Dynamo folds it.
        accepted = _explicit_params(type(self.model).forward)
        call = {k: v for k, v in arguments.items() if k in accepted}  # what stock hands the decoder
        outputs = self.model(**call, **extra)
        hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]

        labels = arguments["labels"]
        ignore_index = extra.get("ignore_index", -100)
        shift_labels = extra.get("shift_labels")
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        loss = linear_cross_entropy(
            hidden,
            self.lm_head.weight,
            shift_labels.to(hidden.device),
            _text_config(self).final_logit_softcapping,
            ignore_index,
            extra.get("num_items_in_batch"),
        )
        carried = {
            name: getattr(outputs, name)
            for name in out_fields
            if name not in ("loss", "logits") and getattr(outputs, name, None) is not None
        }
        return out_cls(loss=loss, logits=None, **carried)

    labels_at = names.index("labels") - 1 if "labels" in names else None  # positional index after self

    @functools.wraps(stock_forward)
    def forward(self, *args, **kwargs):
        # Inference (generate, eval) goes straight to stock, with nothing for torch.compile to trace on the way.
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        if not self.training or labels is None:
            return stock_forward(self, *args, **kwargs)
        # return_dict is consumed by stock's @can_return_tuple; keep it out of the binding.
        return_dict = kwargs.pop("return_dict", None)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            arguments = dict(bound.arguments)
            arguments.pop(names[0], None)  # self
            extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
            if _fused_applies(self, arguments, causal_types):
                output = fused(self, arguments, extra)
                if return_dict is None:
                    return_dict = getattr(self.config, "return_dict", True)
                return output if return_dict else output.to_tuple()
        if return_dict is not None:
            kwargs["return_dict"] = return_dict
        return stock_forward(self, *args, **kwargs)

    # functools.wraps copied __wrapped__, which would make inspect and transformers see the stock signature; that is
    # what we want (same parameters), but the mark must point at what we replaced.
    setattr(forward, MARK, stock_forward)
    return forward
