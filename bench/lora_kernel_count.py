"""Issue 18, LoRA step: how many kernels does each LoRA op's compiled math launch, forward and backward?

The graphed 42-layer r=16 LoRA step launched 6866 kernels against the full step's 3325 on an H100 (session 54,
bench/results/2026-12-07-h100-session54.md), 84 more per layer. Under CUDA graphs each launch still costs the GPU a
gap of about a microsecond or more, and the small LoRA GEMMs and elementwise kernels take a few microseconds each, so
the count is a lever on the step time that a CPU can read: this compiles the split path's math
(`g4ops.ops.lora`, what the ops run when a graphed compile asks for split products) with Inductor on CPU and counts
the generated kernels and the GEMM calls (cuBLAS on CUDA, `extern_kernels.mm` and `g4ops::add_product_rounded` in
the generated code), for one attention projection (`lora_linear`) and the MLP (`lora_geglu_mlp`), in the fold order
G4OPS_LORA_FOLD selects. Inductor's CPU code fuses the elementwise work much as its Triton code does, but the counts
are the CPU's: the GPU profile is the truth. One CPU difference is taken out: a bf16 GEMM with an fp32 result is one
cuBLAS call on CUDA but bf16-to-fp32 copies and an fp32 GEMM on CPU, so here it is one opaque op (`_gemm_to_fp32`).

    python bench/lora_kernel_count.py                            # CPU, about a minute
    G4OPS_LORA_FOLD=base_last python bench/lora_kernel_count.py
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from torch._inductor.utils import run_and_get_code

from g4ops.ops import lora

BF16 = torch.bfloat16


@torch.library.custom_op("lora_kernel_count::gemm_to_fp32", mutates_args=())
def _gemm_to_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`lora._mm_to_fp32` as one call in the generated code, as cuBLAS's bf16 GEMM with an fp32 result is on CUDA."""
    return a.float() @ b.float()


@_gemm_to_fp32.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)


def count(fn, *args) -> dict:
    """Kernels and GEMM calls in the Inductor code of fn(*args), compiled whole (fullgraph)."""
    torch._dynamo.reset()
    try:
        _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    finally:
        torch._dynamo.reset()
    code = "\n".join(line for line in "\n".join(codes).splitlines() if not line.lstrip().startswith("#"))
    kernel = r"^\s+(?:cpp|triton)_\w+\("  # indented: calls, not definitions
    gemm = (r"^\s+(?:\w+ = )?(?:extern_kernels\.(?:mm|bmm|addmm|baddbmm)"
            r"|torch\.ops\.(?:g4ops\.add_product_rounded|lora_kernel_count\.gemm_to_fp32)\.default)\(")
    return dict(kernels=len(re.findall(kernel, code, re.M)), gemms=len(re.findall(gemm, code, re.M)))


def run(tokens: int, hidden: int, inter: int, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32, scale=0.1):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    lora.SPLIT_DEVICES.add("cpu")  # the split path's arithmetic, as a graphed compile asks for it on CUDA
    lora._mm_to_fp32 = torch.ops.lora_kernel_count.gemm_to_fp32
    x, scaling = rand(tokens, hidden, dtype=BF16, scale=1.0), [2.0]
    rows = []

    # one projection, hidden -> hidden, one fp32 adapter, no dropout; the base weight frozen (no dW)
    w, a, b = rand(hidden, hidden, dtype=BF16), rand(rank, hidden), rand(hidden, rank)
    grad = rand(tokens, hidden, dtype=BF16, scale=1.0)

    def linear_fwd(x, w, a, b):
        return lora.lora_linear_forward_math(x, w, [a], [b], scaling, [0.0], [], split=True)

    def linear_bwd(grad, x, w, a, b, mid):
        return lora.lora_linear_backward_math(grad, x, w, [a], [b], scaling, [0.0], [], [mid], [True, False],
                                              [True, True], split=True)  # fmt: skip

    _, (mid,) = linear_fwd(x, w, a, b)
    rows.append(dict(op="lora_linear", part="forward", **count(linear_fwd, x, w, a, b)))
    rows.append(dict(op="lora_linear", part="backward", **count(linear_bwd, grad, x, w, a, b, mid)))
    rows.append(dict(op="base linear", part="forward", **count(lambda x, w: x @ w.t(), x, w)))
    rows.append(dict(op="base linear", part="backward dx", **count(lambda g, w: g @ w, grad, w)))

    # the MLP: gate, up, down each with one fp32 adapter
    ws = (rand(inter, hidden, dtype=BF16), rand(inter, hidden, dtype=BF16), rand(hidden, inter, dtype=BF16))
    la = [rand(rank, hidden), rand(rank, hidden), rand(rank, inter)]
    lb = [rand(inter, rank), rand(inter, rank), rand(hidden, rank)]
    counts, scales = [1, 1, 1], scaling * 3

    def mlp_fwd(x, *tensors):
        return lora.lora_geglu_mlp_forward_math(x, *tensors[:3], list(tensors[3:6]), list(tensors[6:]), scales,
                                                counts, [0.0] * 3, [], split=True)  # fmt: skip

    def mlp_bwd(grad, x, gate, up, *tensors):
        return lora.lora_geglu_mlp_backward_math(grad, x, gate, up, *tensors[:3], list(tensors[3:6]),
                                                 list(tensors[6:9]), scales, counts, [0.0] * 3, [],
                                                 list(tensors[9:]), [True, False, False, False], [True] * 6,
                                                 split=True)  # fmt: skip

    _, gate, up, mids = mlp_fwd(x, *ws, *la, *lb)
    rows.append(dict(op="lora_geglu_mlp", part="forward", **count(mlp_fwd, x, *ws, *la, *lb)))
    rows.append(dict(op="lora_geglu_mlp", part="backward", **count(mlp_bwd, grad, x, gate, up, *ws, *la, *lb, *mids)))
    for row in rows:
        row["fold"] = lora.FOLD_ORDER
        print(f"{row['op']:>15} {row['part']:<12} kernels {row['kernels']:>2}  gemms {row['gemms']:>2}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--inter", type=int, default=160)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = run(args.tokens, args.hidden, args.inter, args.rank)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=dict(torch=torch.__version__, device="cpu"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
