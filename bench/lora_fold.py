"""Issue 18, LoRA step: in which order should a projection's low-rank term fold into its base GEMM?

Under CUDA graphs g4ops' LoRA ops fold the K=9r products of the split path into the base GEMM's bf16 output
(`g4ops.ops.lora._plus_low_rank`): the base GEMM writes y, then `g4ops::add_product_rounded` runs a K=9r GEMM with
beta=1 that reads y and writes it again. That second GEMM is memory-bound: in the H100 profile of a graphed 42-layer
r=16 step those "badd" GEMMs took 7.3 ms of 107.8 (bench/results/2026-12-07-h100-session54.md). The other order
writes the low-rank product first (a fresh output: one write) and lets the base GEMM add its product into it with
beta=1, where reading C in the epilogue may hide behind the compute-bound main loop. Its rounding differs: the
low-rank term is rounded to bf16 once before the sum, instead of the base product (peft rounds the base output, as
today's order does), so the result is no less accurate against fp64 when the low-rank term is the smaller one.

This times both orders for E4B's folds at 2048 tokens (r=16, one adapter: K=144; the MLP's dx fold takes gate's and
up's: K=288), each replayed from a CUDA graph, next to the base GEMM alone, and reports each order's error against
fp64. g4ops runs the order G4OPS_LORA_FOLD names (`_linear_plus_low_rank`, default base_first); this times the two
GEMMs of each order alone, without the splits that form their operands.

    python bench/lora_fold.py --json $OUT/lora-fold.json     # CUDA: about 20 s
    python bench/lora_fold.py --device cpu --smoke            # CPU: the harness and the errors at small shapes
"""

from __future__ import annotations

import argparse
import json

import torch

import g4ops.ops.lora  # noqa: F401 - registers g4ops::add_product_rounded
from kernel_bench import time_graph  # bench/kernel_bench.py: this script's own directory is on sys.path

# (name, N output width, K base inner dim, low-rank K, folds of this shape per layer and step)
FOLDS = (
    ("fwd q", 2048, 2560, 144, 1),
    ("fwd k/v", 512, 2560, 144, 2),
    ("fwd o", 2560, 2048, 144, 1),
    ("fwd gate/up", 10240, 2560, 144, 2),
    ("fwd down", 2560, 10240, 144, 1),
    ("dx q", 2560, 2048, 144, 1),
    ("dx k/v", 2560, 512, 144, 2),
    ("dx o", 2048, 2560, 144, 1),
    ("dh down", 10240, 2560, 144, 1),
    ("dx gate+up", 2560, 10240, 288, 1),
)


def fold_base_first(x, w_t, left, right_t):
    """Today's order: y = x @ W^T rounded to bf16, then y += left @ right^T (one rounding of the sum)."""
    y = torch.mm(x, w_t)
    torch.ops.g4ops.add_product_rounded(y, left, right_t)
    return y


def fold_base_last(x, w_t, left, right_t):
    """The other order: y = left @ right^T rounded to bf16, then y += x @ W^T (one rounding of the sum)."""
    y = torch.mm(left, right_t)
    torch.ops.g4ops.add_product_rounded(y, x, w_t)
    return y


def rel_err(out, ref) -> float:
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def run(tokens: int, folds, device: str) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k, k_low, count in folds:
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

        # the low-rank term about a tenth of the base product, as a trained adapter's is
        x, w_t = rand(tokens, k), rand(k, n, scale=k**-0.5)
        left, right_t = rand(tokens, k_low), rand(k_low, n, scale=0.1 * k_low**-0.5)
        truth = x.double() @ w_t.double() + left.double() @ right_t.double()
        row = dict(fold=name, tokens=tokens, n=n, k=k, k_low=k_low, per_layer=count)
        for order, fn in (("base_first", fold_base_first), ("base_last", fold_base_last)):
            row[f"{order}_rel_err"] = rel_err(fn(x, w_t, left, right_t), truth)
        if device == "cuda":
            row["base_gemm_us"] = time_graph(lambda: torch.mm(x, w_t))
            row["base_first_us"] = time_graph(lambda: fold_base_first(x, w_t, left, right_t))
            row["base_last_us"] = time_graph(lambda: fold_base_last(x, w_t, left, right_t))
        rows.append(row)
        print(", ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in row.items()))  # fmt: skip
    if device == "cuda":
        per_layer = {order: sum(r[f"{order}_us"] * r["per_layer"] for r in rows)
                     for order in ("base_gemm", "base_first", "base_last")}  # fmt: skip
        print("per layer and step (us): " + ", ".join(f"{k} {v:.1f}" for k, v in per_layer.items()))
        rows.append({"per_layer_us": per_layer})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="small shapes (the harness and the errors)")
    parser.add_argument("--json")
    args = parser.parse_args()
    folds = FOLDS
    if args.smoke:
        folds = tuple((name, max(n // 64, 8), max(k // 64, 8), k_low, c) for name, n, k, k_low, c in FOLDS[:3])
        args.tokens = min(args.tokens, 64)
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")
    rows = run(args.tokens, folds, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
