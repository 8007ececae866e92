"""How g4ops tells which transformers modules it may replace: the facts every patch in this package shares."""

from __future__ import annotations

import importlib

import torch
from torch import nn

HF_MODULE = "transformers.models.gemma4.modeling_gemma4"
MARK = "_g4ops_stock_forward"  # attribute on every forward we install: the forward it replaced


def gemma4():
    """transformers' Gemma-4 modeling module, or an ImportError that says which transformers g4ops needs."""
    try:
        return importlib.import_module(HF_MODULE)
    except ImportError as exc:
        raise ImportError(
            "g4ops.enable() needs HF transformers with Gemma-4 (transformers >= 5.6): " + str(exc)
        ) from exc


def is_plain_tensor(t) -> bool:
    """Not a subclass (DTensor, a quantized tensor, ...), whose semantics the ops do not know."""
    return type(t) in (torch.Tensor, nn.Parameter)


def is_plain_linear(module) -> bool:
    """An nn.Linear the ops may read the weight of and replace the call of: bias-free, unhooked, its own forward."""
    return (
        type(module) is nn.Linear
        and module.bias is None
        and "forward" not in vars(module)
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and is_plain_tensor(module.weight)
    )
