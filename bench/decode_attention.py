"""Decode-attention micro-benchmark: `g4ops.decode_attention` vs what transformers runs for a decode step over a
static cache (repeat_kv, then SDPA with the bool mask), and SDPA with `enable_gqa=True` (no repeat; what stock could
do without a mask), at Gemma-4 E4B decode shapes: 8 query / 2 KV heads, bf16, one query token per sequence;
sliding layers: head_dim 256 over 512 ring slots; full layers: head_dim 512 over `--full-slots` slots.

Each implementation is checked against an fp64 reference on the same fresh random inputs first (norm-wise relative
error; the g4ops row must be no worse than stock's plus 1%), then timed per call inside a CUDA graph of `--calls`
calls that cycle through enough cache copies to exceed the L2 cache (so K/V come from HBM, as in a decode step),
median of `--repeats` replays. `fill` < 1 masks the cache's tail (a cache not yet full).

    python bench/decode_attention.py --json $OUT/decode_attention.json     # H200: well under a minute
    python bench/decode_attention.py --device cpu --smoke                  # a CPU check that the script runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import g4ops
from kernel_bench import time_graph  # bench/kernel_bench.py: this script's own directory is on sys.path

HQ, HKV = 8, 2


def make_inputs(batch, slots, head_dim, fill, device, gen):
    def rand(*shape):  # never zeros: |x| in [0.1, 1.1) with a random sign
        x = torch.rand(*shape, generator=gen) + 0.1
        return torch.where(torch.rand(*shape, generator=gen) < 0.5, -x, x).to(device, torch.bfloat16)

    q = rand(batch, 1, HQ, head_dim).transpose(1, 2)  # the transposed view transformers passes
    k, v = rand(batch, HKV, slots, head_dim), rand(batch, HKV, slots, head_dim)
    visible = max(1, round(fill * slots))
    mask = (torch.arange(slots) < visible).expand(batch, 1, 1, slots).to(device)
    return q, k, v, mask


def reference(q, k, v, mask, scale):
    g = HQ // HKV
    k64, v64 = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v64


def implementations(scale):
    def stock(q, k, v, mask):  # transformers' sdpa_attention_forward with a mask: repeat_kv, then SDPA
        g = HQ // HKV
        k_rep = k[:, :, None].expand(-1, -1, g, -1, -1).reshape(k.shape[0], HQ, *k.shape[2:])
        v_rep = v[:, :, None].expand(-1, -1, g, -1, -1).reshape(v.shape[0], HQ, *v.shape[2:])
        return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=scale)

    def stock_gqa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def ours(q, k, v, mask):
        return g4ops.decode_attention(q, k, v, mask, scale)

    return {"g4ops": ours, "stock": stock, "stock_gqa": stock_gqa}


def rel_err(out, ref):
    out = out.double()
    return ((out - ref).norm() / ref.norm()).item() if torch.isfinite(out).all() else float("inf")


def time_per_call_us(fn, inputs, calls, repeats, device):
    """Microseconds per call, each call on the next of the rotating inputs: in one CUDA graph of `calls` calls on
    CUDA (bench/kernel_bench.py's time_graph), a plain loop elsewhere."""
    rotation = itertools.cycle(inputs)

    def call():
        fn(*next(rotation))

    if device == "cuda":
        return time_graph(call, calls=calls, reps=repeats)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--full-slots", type=int, default=1100, help="full-layer cache slots (prompt + new tokens)")
    ap.add_argument("--fills", default="1.0,0.6")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--l2-bytes", type=float, default=2 * 60e6, help="cache copies until their bytes exceed this")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on any device: proves the script runs")
    args = ap.parse_args(argv)
    layers = {"sliding": (256, 512), "full": (512, args.full_slots)}
    batches = [int(b) for b in args.batches.split(",")]
    fills = [float(f) for f in args.fills.split(",")]
    if args.smoke:
        layers, batches, fills = {"sliding": (64, 40), "full": (128, 70)}, [1, 2], [1.0, 0.6]
        args.calls, args.repeats, args.l2_bytes = 2, 2, 0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layer, (head_dim, slots) in layers.items():
        scale = 1.0  # Gemma-4's q/k norms make its attention scaling 1
        impls = implementations(scale)
        for batch in batches:
            for fill in fills:
                first = make_inputs(batch, slots, head_dim, fill, args.device, gen)
                copies = 1 + int(args.l2_bytes // (2 * first[1].numel() * first[1].element_size()))
                inputs = [first] + [make_inputs(batch, slots, head_dim, fill, args.device, gen)
                                    for _ in range(min(copies, 64) - 1)]  # fmt: skip
                ref = reference(*first, scale)
                row = dict(layer=layer, batch=batch, slots=slots, head_dim=head_dim, fill=fill)
                for name, fn in impls.items():
                    with torch.no_grad():
                        row[f"err_{name}"] = rel_err(fn(*first), ref)
                        row[f"{name}_us"] = time_per_call_us(fn, inputs, args.calls, args.repeats, args.device)
                row["speedup_vs_stock"] = row["stock_us"] / row["g4ops_us"]
                row["no_worse_than_stock"] = row["err_g4ops"] <= row["err_stock"] * 1.01
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'layer':<8}{'B':>3}{'slots':>7}{'D':>5}{'fill':>6}{'g4ops us':>10}{'stock us':>10}{'gqa us':>9}"
          f"{'x stock':>9}{'err g4ops':>11}{'err stock':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['layer']:<8}{r['batch']:>3}{r['slots']:>7}{r['head_dim']:>5}{r['fill']:>6.1f}{r['g4ops_us']:>10.2f}"
              f"{r['stock_us']:>10.2f}{r['stock_gqa_us']:>9.2f}{r['speedup_vs_stock']:>9.2f}{r['err_g4ops']:>11.2e}"
              f"{r['err_stock']:>11.2e}")  # fmt: skip
    if args.json:
        meta = dict(device=args.device, torch=torch.__version__,
                    gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)  # fmt: skip
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    bad = [r for r in rows if not r["no_worse_than_stock"]]
    if bad:
        raise SystemExit(f"g4ops.decode_attention is less accurate than stock in {len(bad)} rows")
    return rows


if __name__ == "__main__":
    main()
