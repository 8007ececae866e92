"""Which torch each part of g4ops runs on.

pyproject.toml admits torch >= 2.9 so that the package installs beside the Neuron SDK's torch 2.9 (torch-neuronx
2.9.x is built against it) without replacing it. What runs there is neuron_backend and the reference kernels of the
ops it calls (g4ops.rms_norm, g4ops.geglu_mlp), checked by `bash .ci/neuron-stack` under torch 2.9.1. The CUDA
kernels are built and tested (H200 rounds, .ci/gpu-image-stack) on torch 2.11 to 2.13 only, so building them on an
older torch raises instead of running something no one has checked.

Seen under torch 2.9.1 on CPU (.ci/neuron-stack's venv): neuron_backend's tests pass, and so do the CPU tests of the
ops, the loss, attention and `enable()` in eager mode; `torch.compile(fullgraph=True)` of an enabled Gemma-4 model
breaks its graph 3 times inside transformers' cache_utils (torch 2.9's Dynamo skips a frame there), so compiling a
patched model needs torch >= 2.11 as well. No API newer than torch 2.9 was found in g4ops/ or csrc/ by grep.
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
