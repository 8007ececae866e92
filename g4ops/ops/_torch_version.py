"""Which torch each part of g4ops runs on.

pyproject.toml admits torch >= 2.9 so that the package installs beside the Neuron SDK's torch 2.9 (torch-neuronx
2.9.x is built against it) without replacing it. What runs there is neuron_backend and the reference kernels of the
ops it calls (g4ops.rms_norm, g4ops.geglu_mlp), checked by `bash .ci/neuron-stack` under torch 2.9.1. The CUDA
kernels are built and tested (H200 rounds, .ci/gpu-image-stack) on torch 2.11 to 2.13 only, so building them on an
older torch raises instead of running something no one has checked.

Seen on 2026-12-01 under torch 2.9.1 on CPU (.ci/neuron-stack's venv, transformers 5.24): neuron_backend's tests
pass, and the CPU tests of the ops, enable(), the loss, attention, the embedding and the decoder pass but for 6.
Five are one cause: compiling a g4ops-patched Gemma-4 model with fullgraph=True fails (or breaks its graph 3
times) because torch 2.9's Dynamo will not inline transformers' cache_utils.get_layer_types_and_kwargs, called by
DynamicCache(config=...) inside the model's forward; so compiling a patched model needs torch >= 2.11 as well. The
sixth: on one hypothesis case the embedding op's gradient is 3.4e-6 from fp64 against a bound of 2.1e-6. No torch
API newer than 2.9 was found in g4ops/ or csrc/ by grep; 2.11 is the oldest release anything was tested on.
"""

from __future__ import annotations

import torch

CUDA_MIN_TORCH = (2, 11)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch ("2.9.1+cu128" -> (2, 9))."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torch_too_old(feature: str, minimum: tuple[int, int] = CUDA_MIN_TORCH) -> str | None:
    """None when the installed torch is new enough for `feature`, else the message saying what it needs."""
    if torch_version() >= minimum:
        return None
    return (
        f"{feature} need torch >= {minimum[0]}.{minimum[1]} (built and tested on 2.11 to 2.13); torch "
        f"{torch.__version__} is installed. torch 2.9 is admitted for neuron_backend on the Neuron SDK, whose ops "
        "run on the reference kernels."
    )


def traced_by_compile() -> bool:
    """Whether this code runs inside a torch.compile trace, Dynamo's or AOTAutograd's (an autograd.Function's backward
    is traced by AOTAutograd, not Dynamo). torch.compiler.is_compiling() alone says so in both from torch 2.13 on; on
    2.11 (the H200 image) it is False in a traced backward (seen 2026-12-05: the loss's backward kept its opaque op
    there), so the active TracingContext, which Dynamo holds while it calls the backend, answers that case. Under
    Dynamo, is_compiling() is True and the second check is never traced."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None
