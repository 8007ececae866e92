"""Device helpers shared by the test files: the parametrisation (every test runs on CPU, and the same checks run on
CUDA, marked `cuda` and skipped without a GPU), CUDA-graph capture, one intra-op thread, and a counter of the g4ops
ops a piece of code really dispatched; a recorder of the LoRA ops' split path."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from g4ops.ops._torch_version import torch_version
from g4ops.ops.attention import MASKED_FLEX_MIN_TORCH

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")],
    ),
]

# compiled FlexAttention with a batch mask failed on CUDA under torch 2.11 (g4ops.ops.attention.MASKED_FLEX_MIN_TORCH),
# where the integration never takes it; one failing kernel ended its worker's CUDA context
NEEDS_MASKED_FLEX_TORCH = pytest.mark.skipif(
    torch_version() < MASKED_FLEX_MIN_TORCH,
    reason="compiled FlexAttention with a mask failed on CUDA under torch 2.11 (attention.MASKED_FLEX_MIN_TORCH)",
)


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


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Tiny matmuls: one intra-op thread is faster, and far faster on a shared, loaded machine. A module that
    imports this fixture runs with it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class G4opsCalls(TorchDispatchMode):
    """`with G4opsCalls() as c:` counts the g4ops op calls by name in `c.calls` (a silent fallback to stock shows
    as a missing name)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("g4ops."):
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class LoraSplitPath:
    """Sets the LoRA ops' split path on `device` (`split_order`, a lora.FOLD_ORDERS entry; None: fp32 products, as
    peft) and records what took it: `split_mm`, one entry per `_split_mm` call; `folds`, one per call that folds at
    least one product into a base GEMM; `base_last`, one per fold in the "base_last" order."""

    def __init__(self, monkeypatch, device: str, split_order: str | None):
        from g4ops.ops import lora

        self.split_mm, self.folds, self.base_last = [], [], []
        monkeypatch.setattr(lora, "SPLIT_DEVICES", {device} if split_order else set())
        monkeypatch.setattr(lora, "FOLD_ORDER", split_order or lora.FOLD_ORDER)
        split_mm, fold, base_last = lora._split_mm, lora._linear_plus_low_rank, lora._low_rank_plus_base
        monkeypatch.setattr(lora, "_split_mm", lambda a, b: self.split_mm.append(1) or split_mm(a, b))
        monkeypatch.setattr(lora, "_linear_plus_low_rank",
                            lambda z, w, pairs: self.folds.extend(pairs[:1]) or fold(z, w, pairs))  # fmt: skip
        monkeypatch.setattr(lora, "_low_rank_plus_base", lambda *a: self.base_last.append(1) or base_last(*a))
