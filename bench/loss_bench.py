"""Time g4ops' fused linear cross-entropy (training forward: loss and gradients) against its own GEMM floor.

    python bench/loss_bench.py                          # E4B's vocabulary and width, 2048 and 8192 rows, on CUDA
    python bench/loss_bench.py --rows 512 --vocab 4099 --hidden 64 --device cpu --repeats 2   # seconds: the smoke

For each row count and each of "frozen" (no weight gradient: a LoRA finetune's tied embedding) and "trained" (the
weight gradient too: a full finetune), it reports the median time of `g4ops::linear_cross_entropy_forward` and of
the vocabulary-wide GEMMs alone that the op issues (counted by a dispatch mode over one call, then replayed as bare
`torch.mm`s of the same shapes), so the difference is what the op spends beyond its matrix products: the softcap,
logsumexp and softmax passes over the logits and the gradient's scaling and casts. bf16 on CUDA, random inputs
(never zeros); CUDA events, warm-up first. `G4OPS_LOSS_KERNEL=0` times the op with Inductor's helpers instead of its
CUDA kernel for the elementwise part (csrc/softcap_xent.cu; the JSON's meta says which ran).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import g4ops.ops.loss
from attention import time_ms  # bench/attention.py: this script's own directory is on sys.path

_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}


class _GemmShapes(TorchDispatchMode):
    """Records (m, k, n) of every 2-D matrix product one call issues."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _GEMMS:
            a, b = args[:2] if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) else args[1:3]
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def bench(rows: int, vocab: int, hidden: int, trained: bool, device: str, dtype, repeats: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(rows + vocab)
    h = (torch.randn(rows, hidden, generator=gen) * 0.5).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    labels[::7] = -100  # some ignored rows, as a padded or packed batch has

    def op():
        return torch.ops.g4ops.linear_cross_entropy_forward(h, w, labels, 30.0, -100, "mean", 0, [True, trained])

    # The op's own GEMMs, from one call of its math with the elementwise helpers eager (a dispatch mode and
    # torch.compile do not mix; the GEMMs are the same either way).
    compile_setting, g4ops.ops.loss._LOSS_COMPILE = g4ops.ops.loss._LOSS_COMPILE, "0"
    try:
        with _GemmShapes() as rec:
            g4ops.ops.loss.linear_cross_entropy_reference(h, w, labels, 30.0, -100, "mean", 0, (True, trained))
    finally:
        g4ops.ops.loss._LOSS_COMPILE = compile_setting
    operands = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
                for m, k, n in rec.shapes]  # fmt: skip

    def gemms():
        for a, b in operands:
            torch.mm(a, b)

    op_s, gemm_s = (time_ms(fn, repeats, device == "cuda") / 1e3 for fn in (op, gemms))
    flops = sum(2 * m * k * n for m, k, n in rec.shapes)
    return dict(rows=rows, vocab=vocab, hidden=hidden, weight_grad=trained, op_ms=op_s * 1e3, gemm_ms=gemm_s * 1e3,
                beyond_gemms_ms=(op_s - gemm_s) * 1e3, gemms=len(rec.shapes), gemm_tflop=flops / 1e12,
                gemm_tflops=flops / gemm_s / 1e12)  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="2048,8192")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    results = []
    for rows in [int(r) for r in args.rows.split(",") if r]:
        for trained in (False, True):
            r = bench(rows, args.vocab, args.hidden, trained, args.device, dtype, args.repeats)
            results.append(r)
            print(f"rows={rows:6d} weight_grad={trained!s:5}  op {r['op_ms']:8.3f} ms  its {r['gemms']} GEMMs "
                  f"alone {r['gemm_ms']:8.3f} ms ({r['gemm_tflops']:.0f} TFLOP/s)  beyond them "
                  f"{r['beyond_gemms_ms']:8.3f} ms", flush=True)  # fmt: skip
    if args.json:
        meta = dict(torch=torch.__version__, loss_kernel=g4ops.ops.loss._LOSS_KERNEL,
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
