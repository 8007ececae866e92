"""Device helpers shared by the test files: the parametrisation (every test runs on CPU, and the same checks run on
CUDA, marked `cuda` and skipped without a GPU) and CUDA-graph capture."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")],
    ),
]


def capture_cuda_graph(step):
    """Run `step` twice on a side stream (lazy initialisation, allocator warm-up; capture forbids both), then
    capture one call in a CUDA graph: (graph, the outputs of the captured call, which replays overwrite)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
