"""FlexAttention kernel options on Gemma-4 E4B's attention layers: can a tuned flex kernel beat what g4ops runs?

    python bench/flex_options.py --json $OUT/flex.json                  # H200: sliding and full layers, 2048 tokens
    python bench/flex_options.py --kinds sliding --seqs 8192 --variants default,autotune
    python bench/flex_options.py --device cpu --smoke                   # seconds: the harness against fp64

Why: in the graphed 4-layer LoRA step on the H200 the sliding layers' flex backward ran ~320 us per layer for about
19 GFLOP of band work (bench/results/2026-12-04-h200-session24.md), and a full layer (head_dim 512) costs g4ops'
chunked attention 2.30 ms fwd+bwd compiled at 2048 tokens (g4ops/ops/attention.py): the 35 sliding and 7 full layers
are a large share of the gap between the 42-layer step and its GEMMs. g4ops calls flex with the options this script
found (g4ops.ops.attention.SM90_HEAD256_FLEX_OPTIONS on sm90 at head_dim 256, else Inductor's defaults); stock flex with
defaults does not fit head_dim 512 in shared memory (issue 18).

Per kind and length: fwd+bwd median ms (CUDA events), GPU busy ms per call (kernel time, what a CUDA-graphed step
pays), and the relative errors of out, dq, dk, dv against an fp64 reference, for these variants (`--variants`):
  g4ops     what g4ops runs: `sliding_window_attention` (flex, g4ops' kernel options) for sliding layers, the chunked
            `g4ops.ops.attention.attention` for full layers; both under torch.compile
  default   flex_attention compiled with default kernel options (g4ops' band or causal block mask)
  autotune  the same compiled with mode="max-autotune-no-cudagraphs": Inductor times its own candidate configs and
            keeps the fastest (which one is not recorded here; Inductor's autotune output may name it)
  any name in PRESETS: flex with those kernel options
  sdpa-cudnn, sdpa-efficient, sdpa-flash: stock SDPA on that backend (eager; kv heads repeated as transformers'
            sdpa path does; causal for full layers, transformers' dense band mask for sliding ones): the kernels
            stock users get, and whether cuDNN takes head_dim 512 on this GPU
Each variant compiles separately (torch._dynamo.reset() between them); one that fails (e.g. Triton out of shared
memory) is reported with its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from attention import HKV, HQ, LAYERS, measure_fwd_bwd, reference, stock_mask  # bench/ is on sys.path
from profile_steps import _kernel_table

# Kernel options to try (FlexKernelOptions; fwd_/bwd_ prefixes apply to one pass). Sliding (head_dim 256): safety
# hints and TMA, then block shapes. Full (head_dim 512): blocks small enough for a 512-wide tile in shared memory.
PRESETS = {
    "hints": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
    "tma": {"USE_TMA": True},
    "fwd128x64-w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd64x64-w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "bwd64x64-w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd32x64-w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                    "bwd_num_warps": 4, "bwd_num_stages": 2},
    # around bwd64x64-w8 (what g4ops runs): wider key tiles for dK/dV (N1) and query tiles for dQ (M2), deeper
    # pipelines, TMA loads (flex needs N1 a multiple of M1 and M2 a multiple of N2)
    "bwd64x64-w8-s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 8, "bwd_num_stages": 3},
    "bwd64x64-w8-tma": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 8, "bwd_num_stages": 2, "USE_TMA": True},
    "bwd64x128-w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                     "bwd_num_warps": 8, "bwd_num_stages": 1},
    "bwd32x128-w8": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                     "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd32x64-w8": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                    "bwd_num_warps": 8, "bwd_num_stages": 3},
    "small-512": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "fwd_num_warps": 8, "fwd_num_stages": 1,
                  "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 16,
                  "bwd_num_warps": 4, "bwd_num_stages": 1},
    "tiny-512": {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 32, "fwd_num_warps": 4, "fwd_num_stages": 1,
                 "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 16, "bwd_BLOCK_M2": 16, "bwd_BLOCK_N2": 16,
                 "bwd_num_warps": 4, "bwd_num_stages": 1},
}
DEFAULT_VARIANTS = {
    "sliding": "g4ops,default,hints,tma,fwd128x64-w8,fwd64x64-w4,bwd64x64-w8,bwd32x64-w4,sdpa-cudnn",
    "full": "g4ops,default,small-512,tiny-512,sdpa-cudnn,sdpa-efficient",
}


def block_mask(n: int, window, device):
    """The block mask g4ops' sliding path builds, or the causal one for a full layer."""
    from g4ops.ops.attention import band_block_mask

    return band_block_mask(n, n, window if window is not None else n, device)  # a window of n is plain causal


def make(variant: str, n: int, window, device):
    """fn(q, k, v) -> [B, Hq, L, D] for one variant (scale 1.0, as Gemma-4's query norm replaces 1/sqrt(d))."""
    from torch.nn.attention.flex_attention import flex_attention

    from g4ops.ops import attention as g4

    if variant.startswith("sdpa-"):
        return sdpa(variant, n, window, device)
    if variant == "g4ops":
        if window is not None:
            fn = lambda q, k, v: g4.sliding_window_attention(q, k, v, 1.0, window)  # noqa: E731
        else:
            fn = lambda q, k, v: g4.attention(q, k, v, 1.0)  # noqa: E731
    else:
        mask = block_mask(n, window, device)
        options = {} if variant in ("default", "autotune") else PRESETS[variant]
        fn = lambda q, k, v: flex_attention(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True,  # noqa: E731
                                            kernel_options=options or None)  # fmt: skip
    if device == "cpu":
        return fn  # eager (flex's dense reference path): the harness, not the kernels
    return torch.compile(fn, mode="max-autotune-no-cudagraphs" if variant == "autotune" else None)


def sdpa(variant: str, n: int, window, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa-flash": SDPBackend.FLASH_ATTENTION}[variant]  # fmt: skip
    mask = stock_mask(n, window, device)

    def fn(q, k, v):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                    scale=1.0)  # fmt: skip

    return fn


def gpu_busy_ms(step, calls: int = 5) -> float:
    """Kernel time per call (torch.profiler): what a CUDA-graphed training step pays, without the host time of
    launching a compiled graph's kernels one by one that `fwd_bwd_ms` includes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return _kernel_table(prof, calls, 0)[0] / 1e3


def run(kind: str, n: int, variants, device, dtype, repeats: int, dims=None):
    dim, window = dims or LAYERS[kind]
    gen = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = ((torch.randn(1, h, n, dim, generator=gen) * 0.5).to(device, dtype) for h in (HQ, HKV, HKV))
    grad = torch.randn(1, HQ, n, dim, generator=gen).to(device, dtype)
    out, grads = reference(q, k, v, grad.transpose(1, 2), window)  # its output (and gradient) is [B, L, H, D]
    refs = [out.transpose(1, 2), *grads]
    visible = sum(min(p + 1, window or n) for p in range(n))
    flop = 4 * HQ * dim * visible * 3.5  # forward (2 GEMMs over the visible scores) + 2.5x for the backward
    rows = []
    for variant in variants:
        torch._dynamo.reset()
        row = dict(kind=kind, seq=n, head_dim=dim, window=window, variant=variant,
                   kernel_options=PRESETS.get(variant, {}))  # fmt: skip
        try:
            t0 = time.perf_counter()
            errors, ms, step = measure_fwd_bwd(make(variant, n, window, device), q, k, v, grad, refs, repeats,
                                               device == "cuda")  # fmt: skip
            row["seconds"] = time.perf_counter() - t0  # compilation (and autotuning) included
            row.update(rel_err=dict(zip(("out", "dq", "dk", "dv"), errors)), fwd_bwd_ms=ms, tflops=flop / ms / 1e9)
            if device == "cuda":
                row["gpu_busy_ms"] = gpu_busy_ms(step)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why; the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
        if "error" in row:
            print(f"{kind:7s} seq={n:6d} {variant:14s} error: {row['error']}", flush=True)
        else:
            busy = f", GPU busy {row['gpu_busy_ms']:.3f}" if "gpu_busy_ms" in row else ""
            print(f"{kind:7s} seq={n:6d} {variant:14s} fwd+bwd {row['fwd_bwd_ms']:8.3f} ms{busy} ({row['tflops']:6.1f} "
                  f"TFLOP/s)  {row['seconds']:6.1f} s in all  rel err out/dq/dk/dv "
                  + " ".join(f"{e:.2e}" for e in errors), flush=True)  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kinds", default="sliding,full")
    ap.add_argument("--seqs", default="2048")
    ap.add_argument("--variants", default=None, help="comma separated (default: per kind, DEFAULT_VARIANTS)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the harness against fp64, in seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    dims = None
    if args.smoke:  # tiny fp32 shapes; on CPU flex has no backward: g4ops' full-layer path and SDPA's CPU flash run
        args.seqs, args.repeats, dims = "48", 2, (16, 16)
        if args.device == "cpu":
            args.kinds, args.variants = "full", "g4ops,sdpa-flash"
    rows = []
    for kind in args.kinds.split(","):
        variants = (args.variants or DEFAULT_VARIANTS[kind]).split(",")
        kind_dims = dims and (dims[0], dims[1] if kind == "sliding" else None)
        for n in (int(s) for s in args.seqs.split(",") if s):
            rows += run(kind, n, variants, args.device, dtype, args.repeats, kind_dims)
    if args.json:
        meta = dict(torch=torch.__version__, dtype=str(dtype), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu")  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
