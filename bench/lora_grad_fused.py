"""Prototype for issue 18: a LoRA projection's two backward products u and dB in ONE pass over dY (Triton), timed
against what g4ops runs today, before anything is wired into g4ops/ops/lora.py.

For one peft LoRA projection with output gradient dY [T, N] (bf16), adapter B [N, r] and the saved product
mid = A(z) [T, r] (fp32 adapters of a bf16 model), the backward needs

    u  = s * (dY @ B)        [T, r]        (then dA and the fold into dz)
    dB = s * (dY^T @ mid)    [N, r]

Today (`G4OPS_LORA_SPLIT=1`, g4ops/ops/lora.py `_low_rank_grads`) they are two `_split_mm` calls: each splits its fp32
operand into three bf16 parts, runs one skinny cuBLAS GEMM (split-K for u), and sums the three partial products,
so dY ([2048, 10240] bf16 = 42 MB for gate and up) is read twice and about six kernels launch. In the H100 profile of
a graphed 8-layer LoRA step (bench/results/2026-12-05-h100-session32-prof-lora8-after.json) the small GEMMs took
3.06 ms and the bf16 splits 0.93 ms per 8 layers: about 0.5 ms per layer, roughly 3x what reading their operands once
costs (bench/results/2026-12-05-cpu-session33.md).

The kernel here reads each dY tile once and feeds both products from it: the fp32 operands (B's tile, mid's rows)
are split into their three bf16 parts in registers (hi + mid + lo == the fp32 value, as `lora._bf16_parts`), and
each product is three bf16 tensor-core dots accumulated in fp32: an fp32 GEMM's result up to the order of its sums,
the same contract as `_split_mm`. No atomics: each program writes its partial u (per column chunk) and its dB rows
(per row block) to fp32 buffers that one deterministic `sum` per output reduces, then the scale.

    python bench/lora_grad_fused.py --json $OUT/lora-grad-fused.json     # CUDA: E4B's projections, r=16, 2048 rows
    TRITON_INTERPRET=1 python bench/lora_grad_fused.py --check-only     # CPU: correctness at small odd shapes

Reported per projection (eager: CUDA events around back-to-back calls, which for kernels this small measures the
host's launch cost; graphed: the same calls replayed from one CUDA graph, the GPU time a graphed step pays):
microseconds for today's pair (compiled as the op compiles its math), for peft's fp32 pair, for each kernel
configuration and the best (with its two `sum` reductions, and the kernel alone); the memory floor (the bytes the
pair must move, at the copy bandwidth measured in the same run); and each result's largest error
relative to an fp64 oracle. Triton's interpreter (CPU) computes bf16 dots wrongly (triton 3.6, 2026-12-05), so under
TRITON_INTERPRET the parts enter fp32 "ieee" dots instead: their products are exact in fp32 either way, so the check
covers the splitting, tiling and reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from g4ops.ops import lora
from kernel_bench import time_graph  # bench/kernel_bench.py: this script's own directory is on sys.path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# E4B's LoRA projections: (name, N = the output width, whose gradient dY is [T, N])
PROJECTIONS = (("gate/up", 10240), ("down", 2560), ("q", 2048), ("k/v", 512), ("o", 2560))
# (BT rows, BN columns per tile, tiles per program, warps, stages)
CONFIGS = [(bt, bn, tiles, warps, 3) for bt in (64, 128) for bn in (64, 128) for tiles in (4, 8, 16)
           for warps in (4, 8)]  # fmt: skip


@triton.jit
def _parts(x):
    """fp32 x as (hi, mid, lo), fp32 values each exact in bf16 (lo after its rounding), hi + mid + lo == x."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    rest = x - hi
    mid = (rest.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return hi, mid, (rest - mid).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _dot_parts(a, hi, mid, lo, acc, FP32_DOTS: tl.constexpr):
    """acc + a @ (hi + mid + lo) for bf16 a: three bf16 dots accumulated in fp32 (products exact)."""
    if FP32_DOTS:
        a = a.to(tl.float32)
        acc = tl.dot(a, hi, acc, input_precision="ieee")
        acc = tl.dot(a, mid, acc, input_precision="ieee")
        return tl.dot(a, lo, acc, input_precision="ieee")
    acc = tl.dot(a, hi.to(tl.bfloat16), acc)
    acc = tl.dot(a, mid.to(tl.bfloat16), acc)
    return tl.dot(a, lo.to(tl.bfloat16), acc)


@triton.jit
def _u_db_partials(dy_ptr, b_ptr, mid_ptr, part_u_ptr, part_db_ptr, T, N, stride_dy, R: tl.constexpr,
                   RP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr,
                   FP32_DOTS: tl.constexpr):  # fmt: skip
    """Program (t, c): rows [t*BT, (t+1)*BT) against TILES column tiles of BN from column c*TILES*BN. Writes its
    partial u for those rows to part_u[c] and the dB rows of its columns, partial over this row block, to
    part_db[t]. R is padded to RP (>= 16, a tensor-core dot's least width) with zero columns."""
    t, c = tl.program_id(0), tl.program_id(1)
    rows = t * BT + tl.arange(0, BT)
    ranks = tl.arange(0, RP)
    row_ok, rank_ok = rows < T, ranks < R
    mid = tl.load(mid_ptr + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    mid_hi, mid_mid, mid_lo = _parts(mid)
    u = tl.zeros((BT, RP), tl.float32)
    for i in range(TILES):
        cols = (c * TILES + i) * BN + tl.arange(0, BN)
        col_ok = cols < N
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                     other=0.0)  # fmt: skip
        b = tl.load(b_ptr + cols[:, None] * R + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
        b_hi, b_mid, b_lo = _parts(b)
        u = _dot_parts(dy, b_hi, b_mid, b_lo, u, FP32_DOTS)
        db = _dot_parts(tl.trans(dy), mid_hi, mid_mid, mid_lo, tl.zeros((BN, RP), tl.float32), FP32_DOTS)
        tl.store(part_db_ptr + t * N * RP + cols[:, None] * RP + ranks[None, :], db, mask=col_ok[:, None])
    tl.store(part_u_ptr + c * T * RP + rows[:, None] * RP + ranks[None, :], u, mask=row_ok[:, None])


def fused_u_db(dy, b, mid, scale: float, config=(128, 64, 8, 4, 3)):
    """(u, dB) of one projection (module docstring), one pass over dY. dy [T, N] bf16 with unit column stride;
    b [N, r] and mid [T, r] fp32, contiguous."""
    r = b.shape[1]
    part_u, part_db = fused_partials(dy, b, mid, config)
    return part_u.sum(0)[:, :r] * scale, part_db.sum(0)[:, :r] * scale


def fused_partials(dy, b, mid, config):
    """The kernel alone: the partial sums of u (one per column chunk) and of dB (one per row block)."""
    bt, bn, tiles, warps, stages = config
    T, N = dy.shape
    r = b.shape[1]
    rp = max(16, triton.next_power_of_2(r))
    chunks = triton.cdiv(triton.cdiv(N, bn), tiles)
    row_blocks = triton.cdiv(T, bt)
    part_u = torch.empty(chunks, T, rp, device=dy.device, dtype=torch.float32)
    part_db = torch.empty(row_blocks, N, rp, device=dy.device, dtype=torch.float32)
    launch = dict(num_warps=warps, num_stages=stages) if not INTERPRETED else {}
    _u_db_partials[(row_blocks, chunks)](dy, b, mid, part_u, part_db, T, N, dy.stride(0), R=r, RP=rp, BT=bt, BN=bn,
                                         TILES=tiles, FP32_DOTS=INTERPRETED, **launch)  # fmt: skip
    return part_u, part_db


def split_pair(dy, b, mid, scale: float):
    """What `lora._low_rank_grads` runs today for one adapter on the split path."""
    return lora._split_mm(dy, b) * scale, lora._split_mm(dy.t(), mid) * scale


def peft_pair(dy, b, mid, scale: float):
    """peft's fp32 products (autograd of lora_B(lora_A(x)) * s for fp32 adapters, dY cast to fp32)."""
    g = dy.float() * scale
    return g @ b, g.t() @ mid


def oracle(dy, b, mid, scale: float):
    d = dy.double()
    return (d @ b.double()) * scale, (d.t() @ mid.double()) * scale


def max_rel_err(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def inputs(T: int, N: int, r: int, device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dy = torch.randn(T, N, generator=gen).to(device, torch.bfloat16)
    b = (torch.randn(N, r, generator=gen) * 0.02).to(device)
    mid = torch.randn(T, r, generator=gen).to(device)
    return dy, b, mid


def check(T: int, N: int, r: int, device, config) -> dict:
    """Errors against fp64 of the kernel, today's split pair and peft's fp32 pair."""
    dy, b, mid = inputs(T, N, r, device, seed=T * 131 + N * 7 + r)
    want_u, want_db = oracle(dy, b, mid, 2.0)
    row = {"T": T, "N": N, "r": r, "config": list(config)}
    for name, fn in (("fused", lambda *a: fused_u_db(*a, config=config)), ("split", split_pair), ("peft", peft_pair)):
        u, db = fn(dy, b, mid, 2.0)
        row[f"{name}_err_u"], row[f"{name}_err_db"] = max_rel_err(u, want_u), max_rel_err(db, want_db)
    return row


def time_us(fn, calls: int = 50, reps: int = 7) -> float:
    """Median over `reps` of the mean GPU time of `calls` back-to-back calls (CUDA events around the batch)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device) -> float:
    """Bytes per microsecond of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / time_us(lambda: dst.copy_(src), calls=5)


def bench(T: int, N: int, r: int, device, bandwidth: float) -> dict:
    dy, b, mid = inputs(T, N, r, device, seed=N)
    compiled_split = torch.compile(split_pair, dynamic=False, fullgraph=True)
    row = {"T": T, "N": N, "r": r, "split_us": time_us(lambda: compiled_split(dy, b, mid, 2.0)),
           "peft_fp32_us": time_us(lambda: peft_pair(dy, b, mid, 2.0)),
           "split_graphed_us": time_graph(lambda: compiled_split(dy, b, mid, 2.0)),
           "peft_fp32_graphed_us": time_graph(lambda: peft_pair(dy, b, mid, 2.0))}  # fmt: skip
    moved = dy.numel() * 2 + (b.numel() + mid.numel()) * 4 * 2  # dY once; b, mid read; u, dB written
    row["floor_us"] = moved / bandwidth
    timed, row["configs"] = {}, {}
    for config in CONFIGS:
        try:
            timed[config] = row["configs"][str(config)] = time_us(lambda: fused_u_db(dy, b, mid, 2.0, config))
        except Exception as exc:  # noqa: BLE001 - a config Triton cannot compile is reported, not fatal
            row["configs"][str(config)] = repr(exc)[:200]
    if timed:
        best = min(timed, key=timed.get)
        row["fused_best_us"], row["fused_best_config"] = timed[best], list(best)
        # what one launch costs without the two reductions (which an integrated version would fold into the kernel)
        row["fused_best_kernel_only_us"] = time_us(lambda: fused_partials(dy, b, mid, best))
        # graphed: the GPU time the step would pay; the best eager config, and every config again under the graph
        graphed = {c: time_graph(lambda c=c: fused_u_db(dy, b, mid, 2.0, c)) for c in timed}
        best_graphed = min(graphed, key=graphed.get)
        row["fused_graphed_best_us"], row["fused_graphed_best_config"] = graphed[best_graphed], list(best_graphed)
        row["fused_graphed_kernel_only_us"] = time_graph(lambda: fused_partials(dy, b, mid, best_graphed))
        row.update(check(T, N, r, device, best))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--check-only", action="store_true", help="correctness at small odd shapes (any device)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
    rows = []
    if args.check_only or device.type != "cuda":
        for T, N, r in ((37, 203, 4), (64, 130, 16), (100, 64, 24)):
            for config in ((16, 32, 2, 4, 3), (32, 16, 3, 4, 3)):
                t0 = time.perf_counter()
                row = check(T, N, r, device, config)
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                print(json.dumps(row))
    else:
        bandwidth = copy_bandwidth(device)
        print(f"copy bandwidth {bandwidth / 1e3:.0f} GB/s on {torch.cuda.get_device_name()}")
        for name, N in PROJECTIONS:
            row = {"projection": name, **bench(args.tokens, N, args.rank, device, bandwidth)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "configs"}))
    if args.json:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__, "interpreted": INTERPRETED}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
