"""The device parametrisation shared by the test files: every test runs on CPU, and the same checks run on CUDA
(marked `cuda`, skipped without a GPU)."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")],
    ),
]
