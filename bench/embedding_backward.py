"""Peak memory and time of an embedding lookup's forward + backward at Gemma-4 E4B's per-layer-input table
(262144 x 42*256, bf16), 1 x 2048 tokens: stock eager, stock under torch.compile (Inductor decomposes the backward
into an fp32 [rows, dim] table), and `g4ops.ops.embedding` under torch.compile (ATen's kernel, opaque).

    python bench/embedding_backward.py                       # CUDA: about a minute
    python bench/embedding_backward.py --device cpu --rows 4096 --dim 64 --tokens 128   # CPU check that it runs

Peak memory is above what was allocated before the step (the table itself); the weight gradient (rows x dim in the
table dtype) is part of every variant's peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from g4ops import ops


def step_fn(lookup):
    def step(ids, weight):
        return lookup(ids, weight, 0) * 3.0  # Gemma's scaled embedding: lookup, then the scale

    return step


VARIANTS = {
    "stock eager": (lambda i, w, p: F.embedding(i, w, p), False),
    "stock compile": (lambda i, w, p: F.embedding(i, w, p), True),
    "g4ops compile": (ops.embedding, True),
}


def measure(name, ids, weight, grad_out, reps, device):
    lookup, compiled = VARIANTS[name]
    fn = step_fn(lookup)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    cuda = device.type == "cuda"

    def run():
        weight.grad = None
        fn(ids, weight).backward(grad_out)

    run()  # compile / warm up
    weight.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    run()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"variant": name, "peak_gib_above_table": peak, "ms": statistics.median(times),
            "grad": weight.grad.detach().clone()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--dim", type=int, default=42 * 256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)  # on the device: the E4B table is 2.8e9 values
    weight = torch.randn(args.rows, args.dim, generator=gen, device=device, dtype=torch.bfloat16)
    weight = (weight * 0.02).requires_grad_()
    ids = torch.randint(0, args.rows, (1, args.tokens), generator=gen, device=device)
    grad_out = torch.randn(1, args.tokens, args.dim, generator=gen, device=device, dtype=torch.bfloat16)
    rows, reference = [], None
    for name in VARIANTS:
        row = measure(name, ids, weight, grad_out, args.reps, device)
        grad = row.pop("grad")
        if reference is None:
            reference = grad
        row["grad_max_abs_diff_vs_stock_eager"] = float((grad.float() - reference.float()).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "rows": args.rows, "dim": args.dim, "tokens": args.tokens, "results": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
