"""pyproject admits torch 2.9 for neuron_backend on the Neuron SDK; g4ops' CUDA kernels refuse to build on a torch
older than they were tested on (2.11), with a message naming the requirement. The real torch 2.9.1 run is
`bash .ci/neuron-stack`."""

from __future__ import annotations

import pytest
import torch

from g4ops.ops import _build
from g4ops.ops._torch_version import CUDA_MIN_TORCH, torch_too_old, torch_version


def test_installed_torch_is_recognised():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert torch_version() == (major, minor)
    assert (torch_too_old("x") is None) == ((major, minor) >= CUDA_MIN_TORCH)


def test_message_names_the_feature_and_both_versions(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    assert torch_version() == (2, 9)
    msg = torch_too_old("the widget")
    assert "the widget" in msg and "torch >= 2.11" in msg and "2.9.1+cu128" in msg
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert torch_too_old("the widget") is None


def test_cuda_kernel_build_refuses_an_old_torch(monkeypatch):
    """As on a CUDA machine with torch 2.9: the build stops at the version, before looking for nvcc."""
    monkeypatch.setattr(_build, "_state", {"attempted": False, "loaded": False, "error": None, "library": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(_build.KernelBuildError, match=r"CUDA kernels need torch >= 2\.11.*2\.9\.1"):
        _build.build()
    assert "torch >= 2.11" in _build._state["error"]
