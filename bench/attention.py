"""Attention micro-benchmark: stock SDPA as transformers calls it vs the "g4ops" attention (g4ops/ops/attention.py), at
Gemma-4 E4B attention shapes: B=1, 8 query / 2 kv heads, bf16, scaling 1.0;
full layers: head_dim 512, causal (transformers passes no mask: SDPA is_causal; flash/cuDNN refuse head_dim 512);
sliding layers: head_dim 256, window 512 (transformers passes a dense [L, L] boolean mask once L >= 512).

Both sides go through the attention-interface entry the model calls (transformers' `sdpa_attention_forward`, and
`g4ops.hf.attention_interface.g4ops_attention_forward` with mask None), so the [B, L, H, D] output transpose is
included.
Correctness first, in the same run: out, dq, dk, dv of both against an fp64 reference at a smaller length (errors
are norm-wise relative), then the timings: forward, forward+backward (CUDA events, median after warm-up, fresh
non-zero random inputs), eager and torch.compile, and the peak memory of one forward+backward above the inputs.
Each timed row also carries the errors of the timed function (compiled ones included) against fp64 on its inputs,
and g4ops rows must be no worse than the stock row of the same mode, layer and length.

    python bench/attention.py --json bench/results/attention.json          # H200: about 2 minutes
    python bench/attention.py --device cpu --smoke                         # a CPU check that the script runs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from g4ops.hf.attention_interface import g4ops_attention_forward

HQ, HKV = 8, 2
LAYERS = {"full": (512, None), "sliding": (256, 512)}  # kind -> (head_dim, window)


def module_stub(window):
    """What the attention functions read from Gemma4TextAttention."""
    return types.SimpleNamespace(num_key_value_groups=HQ // HKV, is_causal=True, sliding_window=window, training=True)


def stock_mask(length: int, window, device):
    """The mask transformers' sdpa mask function builds for this layer in a training forward (None: is_causal)."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    if window is None:
        return None
    return sdpa_mask(
        batch_size=1,
        q_length=length,
        kv_length=length,
        mask_function=sliding_window_causal_mask_function(window),
        local_size=window,
        device=device,
    )


def impls(length: int, window, device):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = module_stub(window)
    mask = stock_mask(length, window, device)

    def stock(q, k, v):
        return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=1.0, sliding_window=window)[0]

    def g4ops(q, k, v):
        return g4ops_attention_forward(module, q, k, v, None, dropout=0.0, scaling=1.0, sliding_window=window)[0]

    return {"stock": stock, "g4ops": g4ops}, mask


def sdpa_backend(q, k, v, mask) -> str:
    """The SDPA backend torch picks for transformers' call (GQA: repeat_kv when a mask is given)."""
    group = HQ // HKV
    if mask is not None:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, mask is None, scale=1.0, enable_gqa=mask is None)
        return torch.nn.attention.SDPBackend(choice).name
    except Exception as exc:  # noqa: BLE001 (private API: report instead of failing the run)
        return f"unknown ({type(exc).__name__})"


def make_inputs(length: int, head_dim: int, device, gen: torch.Generator, dtype=torch.bfloat16):
    """q, k, v as transformers passes them ([B, H, L, D] transposed views of [B, L, H, D]), RMS 1 like the q/k/v
    norms' outputs, never zero; and an output gradient."""

    def randn(heads):
        t = torch.randn(1, length, heads, head_dim, generator=gen)
        t = torch.where(t < 0, -1.0, 1.0) * t.abs().clamp_min(2.0**-8)
        return t.to(device=device, dtype=dtype).transpose(1, 2)

    q, k, v = randn(HQ), randn(HKV), randn(HKV)
    dout = torch.randn(1, length, HQ, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, dout


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def reference(q, k, v, dout, window):
    """fp64 masked softmax attention and its gradients (scaling 1.0), output in [B, L, H, D] like the entries."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    length = q.shape[2]
    pos = torch.arange(length, device=q.device)
    seen = pos[None, :] <= pos[:, None]
    if window is not None:
        seen &= pos[None, :] > pos[:, None] - window
    kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    s = (q @ kr.transpose(-1, -2)).masked_fill(~seen, -math.inf)
    out = (s.softmax(-1) @ vr).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), dout.double())
    return out.detach(), grads


def run_with_grads(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), grads


def errors(fn, q, k, v, dout, ref, ref_grads) -> dict:
    """Relative errors of fn's out, dq, dk, dv against the fp64 reference."""
    out, grads = run_with_grads(fn, q, k, v, dout)
    return {"out": rel_err(out, ref), **{f"d{x}": rel_err(g, r) for x, g, r in zip("qkv", grads, ref_grads)}}


def no_worse(errs: dict, stock: dict) -> bool:
    """The bar (tests/oracle.py): no worse than stock + a tenth of a bf16 rounding of slack for sampling noise."""
    return all(errs[key] <= 1.05 * stock[key] + 2.0**-9 / 10 for key in stock)


def correctness(length: int, device) -> list[dict]:
    rows = []
    for kind, (head_dim, window) in LAYERS.items():
        q, k, v, dout = make_inputs(length, head_dim, device, torch.Generator().manual_seed(1))
        ref, ref_grads = reference(q, k, v, dout, window)
        errs = {
            name: errors(fn, q, k, v, dout, ref, ref_grads) for name, fn in impls(length, window, device)[0].items()
        }
        ok = no_worse(errs["g4ops"], errs["stock"])
        rows.append({"kind": kind, "length": length, "head_dim": head_dim, "window": window, "errors": errs, "ok": ok})
    return rows


def measure_fwd_bwd(fn, q, k, v, grad, refs, reps: int, cuda: bool):
    """fn(q, k, v) with `grad` as its output's gradient: (the relative errors of out, dq, dk, dv against `refs` from
    the first call, compilation included; the median fwd+bwd ms; the step it timed). Raises what fn raises."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(grad)
        return out

    out = step()
    errors = [rel_err(got, want) for got, want in zip([out.detach()] + [t.grad for t in leaves], refs)]
    return errors, time_ms(step, reps, cuda), step


def time_ms(fn, reps: int, cuda: bool, warmup: int = 3) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(fn, mode: str, q, k, v, dout, ref, ref_grads, reps: int, device) -> dict:
    f = torch.compile(fn, fullgraph=True) if mode == "compile" else fn
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            f(q, k, v)

    def fwd_bwd():
        out = f(*leaves)
        torch.autograd.grad(out, leaves, dout)

    cuda = device.type == "cuda"
    row = {"fwd_ms": time_ms(fwd, reps, cuda), "fwd_bwd_ms": time_ms(fwd_bwd, reps, cuda)}
    row["peak_mib_fwd_bwd"] = peak_mib(fwd_bwd, device)
    row["errors"] = errors(f, q, k, v, dout, ref, ref_grads)  # of what was timed, at this length
    return row


def bench(length: int, kind: str, mode: str, device, reps: int) -> list[dict]:
    head_dim, window = LAYERS[kind]
    q, k, v, dout = make_inputs(length, head_dim, device, torch.Generator().manual_seed(2))
    fns, mask = impls(length, window, device)
    ref, ref_grads = reference(q, k, v, dout, window)
    rows = []
    for name, fn in fns.items():
        row = {"kind": kind, "length": length, "head_dim": head_dim, "window": window, "impl": name, "mode": mode}
        if name == "stock":
            row["sdpa_backend"] = sdpa_backend(q, k, v, mask)
            row["mask"] = "dense [L, L] bool" if mask is not None else "None (is_causal)"
        try:
            row.update(measure(fn, mode, q, k, v, dout, ref, ref_grads, reps, device))
        except Exception as exc:  # noqa: BLE001 (keep the other rows; the JSON says what failed)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    stock, ours = (next(r for r in rows if r["impl"] == name) for name in ("stock", "g4ops"))
    if "errors" in stock and "errors" in ours:
        ours["no_worse_than_stock"] = no_worse(ours["errors"], stock["errors"])
    return rows


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--check-length", type=int, default=1024, help="length of the fp64 correctness check")
    ap.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny lengths, eager only (CPU check that it runs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.smoke:
        args.lengths, args.check_length, args.modes, args.reps = [600], 600, ["eager"], 2
    torch._dynamo.config.cache_size_limit = 64  # one graph per (length, layer kind, implementation)

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    import transformers

    env["transformers"] = transformers.__version__
    result = {"env": env, "correctness": correctness(args.check_length, device), "timings": []}
    print(f"== {env} ==")
    print(f"\n== correctness: rel. error vs fp64 at L={args.check_length} (bf16) ==")
    for r in result["correctness"]:
        for name, errs in r["errors"].items():
            print(f"{r['kind']:8s} {name:6s} " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        print(f"{r['kind']:8s} g4ops no worse than stock: {r['ok']}")

    for mode in args.modes:
        for length in args.lengths:
            for kind in LAYERS:
                result["timings"].extend(bench(length, kind, mode, device, args.reps))
                if args.json:  # partial results survive a timeout
                    args.json.write_text(json.dumps(result, indent=1))

    print("\n== timings (median ms; peak MiB of one fwd+bwd above the inputs; rel. error vs fp64 of the timed run) ==")
    print(
        f"{'mode':8s}{'kind':9s}{'L':>6s} {'impl':7s}{'fwd':>9s}{'fwd+bwd':>10s}{'peak MiB':>10s}"
        f"{'out':>10s}{'dq':>10s}{'dk':>10s}{'dv':>10s}  note"
    )
    stock_of = {(r["mode"], r["kind"], r["length"]): r for r in result["timings"] if r["impl"] == "stock"}
    for r in result["timings"]:
        note = r.get("error", "")
        if r["impl"] == "stock" and not note:
            note = f"SDPA {r['sdpa_backend']}, mask {r['mask']}"
        elif not note:
            s = stock_of[(r["mode"], r["kind"], r["length"])]
            if "fwd_bwd_ms" in s:
                note = (
                    f"fwd {s['fwd_ms'] / r['fwd_ms']:.2f}x, fwd+bwd {s['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x vs stock"
                    f", no worse than stock: {r.get('no_worse_than_stock')}"
                )
        errs = r.get("errors", {})
        print(
            f"{r['mode']:8s}{r['kind']:9s}{r['length']:6d} {r['impl']:7s}{fmt(r.get('fwd_ms')):>9s}"
            f"{fmt(r.get('fwd_bwd_ms')):>10s}{fmt(r.get('peak_mib_fwd_bwd'), '.0f'):>10s}"
            + "".join(f"{fmt(errs.get(key), '.2e'):>10s}" for key in ("out", "dq", "dk", "dv"))
            + f"  {note}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    ok = all(r["ok"] for r in result["correctness"]) and not any("error" in r for r in result["timings"])
    ok = ok and all(r.get("no_worse_than_stock", True) for r in result["timings"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
