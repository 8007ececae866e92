"""g4ops: Gemma-4 RMSNorm and gated-GELU MLP as PyTorch custom ops with CUDA kernels, and run-time patching of
HF transformers' Gemma-4 modules to use them (`g4ops.enable()`)."""

from .ops._build import KernelBuildError, allow_reference_fallback
from .ops._build import build as build_kernels
from .ops._build import status as kernel_status
from .hf import Route, disable, enable, generation_route, is_enabled
from .ops.loss import linear_cross_entropy
from .ops import decode_attention, geglu_mlp, gelu_tanh_mul, rms_norm, sandwich_norm
from . import optim  # g4ops.optim.AdamW

__all__ = [
    "KernelBuildError",
    "Route",
    "generation_route",
    "disable",
    "enable",
    "is_enabled",
    "allow_reference_fallback",
    "build_kernels",
    "kernel_status",
    "decode_attention",
    "geglu_mlp",
    "gelu_tanh_mul",
    "linear_cross_entropy",
    "rms_norm",
    "sandwich_norm",
]
