"""Kernel benchmark on E4B shapes: stock eager, stock torch.compile, Liger-Kernel (where importable), g4ops, and the
ceilings measured in the same run (device-to-device copy bandwidth, bf16 matmul rate).

    python bench/kernel_bench.py [--json PATH] [--quick]

(Not named kernels.py: a script's directory comes first on sys.path, and that name shadows HF's `kernels` package,
which transformers imports from 5.25.)

Rows (bf16, hidden 2560, intermediate 10240, eps 1e-6):
  RMSNorm fwd 4096 x 2560 and 16384 x 2560; RMSNorm fwd+bwd with weight grad 16384 x 2560;
  sandwich norms (post-norm, residual add, next pre-norm) fwd and fwd+bwd 16384 x 2560: stock's two modules and a
  `+` (eager, compiled), g4ops' rms_norm twice with the add between (what enable() ran before sandwich_norm), and
  g4ops.sandwich_norm;
  gelu_tanh(g) * u fwd 16384 x 10240; MLP fwd at 1 / 4 / 64 / 4096 tokens; MLP fwd+bwd at 4096 tokens;
  per-call eager overhead at 1 token (norm and MLP) next to aten's F.rms_norm.
Every implementation is checked against an fp64 oracle before it is timed (a row that fails says WRONG).
Timing: CUDA events, median; L2 flushed between calls (triton.testing.do_bench) for the large rows; rows of at most
64 tokens are also timed as CUDA-graph replays (20 calls per graph), which shows GPU time without launch overhead.
GB/s counts each input read once and each output written once (weights included); TFLOP/s counts 2*M*N*K per GEMM.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import g4ops

HIDDEN, INTER, EPS = 2560, 10240, 1e-6
DT = torch.bfloat16
DEV = "cuda"


# ----------------------------------------------------------------------------------------------------------------
# timing


def _flush_buffer():
    return torch.empty(512 * 1024 * 1024 // 4, dtype=torch.int32, device=DEV)  # 512 MB > L2


_FLUSH = None
PRE_SLEEP_CYCLES = 2_000_000  # about 1 ms at the H200's 1.98 GHz


def time_events(fn, reps: int = 50, warmup: int = 5, flush: bool = True, grads=()) -> float:
    """Median microseconds of one call, with CUDA events; L2 flushed before each call."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = _flush_buffer()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        for g in grads:
            g.grad = None
        if flush:
            _FLUSH.zero_()
        # keep the GPU busy while the host enqueues fn, so the events time GPU work, not Python dispatch
        # (per-call host overhead has its own rows)
        torch.cuda._sleep(PRE_SLEEP_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]


def time_graph(fn, calls: int = 20, reps: int = 30) -> float:
    """Median microseconds per call of `calls` back-to-back calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def time_host(fn, calls: int = 300) -> float:
    """Wall-clock microseconds per call of eager back-to-back calls (launch + dispatch overhead, or GPU time if
    larger)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


# ----------------------------------------------------------------------------------------------------------------
# ceilings


def measure_ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = time_events(lambda: b.copy_(a), reps=30, flush=False)  # 1 GiB: the pre-sleep cannot hide anything here
    copy_gbs = 2 * n / (t * 1e-6) / 1e9
    m = 8192
    x = torch.randn(m, m, device=DEV, dtype=DT)
    y = torch.randn(m, m, device=DEV, dtype=DT)
    t_mm = time_events(lambda: torch.mm(x, y), reps=20, flush=False)
    tflops = 2 * m**3 / (t_mm * 1e-6) / 1e12
    del a, b, x, y
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": tflops, "copy_us_1GiB": t, "matmul_us_8192": t_mm}


# ----------------------------------------------------------------------------------------------------------------
# implementations


def liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except Exception as exc:  # not installed, or no triton
        print(f"[liger] not importable: {type(exc).__name__}: {exc}", flush=True)
        return None
    return types.SimpleNamespace(RMSNorm=LigerRMSNorm, GEGLUMLP=LigerGEGLUMLP, gelu_mul=LigerGELUMulFunction.apply)


def stock_norm(weight: torch.Tensor) -> torch.nn.Module:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    m = Gemma4RMSNorm(HIDDEN, eps=EPS).to(DEV)
    m.weight = torch.nn.Parameter(weight.detach().clone())
    return m


def norm_impls(weight: torch.Tensor, lk):
    stock = stock_norm(weight)
    impls = {"stock eager": stock, "stock compile": torch.compile(stock_norm(weight), dynamic=False)}
    if lk is not None:
        m = lk.RMSNorm(HIDDEN, eps=EPS, offset=0.0, casting_mode="gemma", init_fn="ones", in_place=False).to(DEV)
        m.weight = torch.nn.Parameter(weight.detach().clone())
        impls["liger"] = m
    impls["g4ops"] = _G4Norm(torch.nn.Parameter(weight.detach().clone()))
    return impls


class _G4Norm(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return g4ops.rms_norm(x, self.weight, EPS)


class _Sandwich(torch.nn.Module):
    """(s, y) = (residual + post(branch), pre(s)) with the given implementation: "stock" (Gemma4RMSNorm modules and
    a `+`), "g4ops-unfused" (g4ops.rms_norm twice) or "g4ops" (one g4ops.sandwich_norm)."""

    def __init__(self, kind: str, post_w: torch.Tensor, pre_w: torch.Tensor):
        super().__init__()
        self.kind = kind
        self.post, self.pre = stock_norm(post_w), stock_norm(pre_w)  # the weights live here for every kind

    def forward(self, branch, residual):
        if self.kind == "g4ops":
            return g4ops.sandwich_norm(branch, residual, self.post.weight, self.pre.weight, EPS)
        if self.kind == "g4ops-unfused":
            s = residual + g4ops.rms_norm(branch, self.post.weight, EPS)
            return s, g4ops.rms_norm(s, self.pre.weight, EPS)
        s = residual + self.post(branch)
        return s, self.pre(s)


def sandwich_impls(post_w, pre_w):
    return {
        "stock eager": _Sandwich("stock", post_w, pre_w),
        "stock compile": torch.compile(_Sandwich("stock", post_w, pre_w), dynamic=False),
        "g4ops unfused": _Sandwich("g4ops-unfused", post_w, pre_w),
        "g4ops": _Sandwich("g4ops", post_w, pre_w),
    }


class StockMLP(torch.nn.Module):
    """Gemma4TextMLP's forward: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, wg, wu, wd):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False, device=DEV, dtype=DT)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False, device=DEV, dtype=DT)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False, device=DEV, dtype=DT)
        with torch.no_grad():
            self.gate_proj.weight.copy_(wg)
            self.up_proj.weight.copy_(wu)
            self.down_proj.weight.copy_(wd)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class G4MLP(StockMLP):
    def forward(self, x):
        return g4ops.geglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def mlp_impls(wg, wu, wd, lk):
    impls = {"stock eager": StockMLP(wg, wu, wd), "stock compile": torch.compile(StockMLP(wg, wu, wd), dynamic=False)}
    if lk is not None:
        cfg = types.SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="gelu_pytorch_tanh")
        m = lk.GEGLUMLP(cfg).to(device=DEV, dtype=DT)
        with torch.no_grad():
            m.gate_proj.weight.copy_(wg)
            m.up_proj.weight.copy_(wu)
            m.down_proj.weight.copy_(wd)
        impls["liger"] = m
    impls["g4ops"] = G4MLP(wg, wu, wd)
    return impls


# ----------------------------------------------------------------------------------------------------------------
# oracle (fp64) and error


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.detach().double(), ref.detach().double()
    if not torch.isfinite(o).all():
        return math.inf
    return (torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r)).item()


def oracle_norm(x, w):
    x = x.double()
    return x * (x.square().mean(-1, keepdim=True) + EPS).rsqrt() * w.double()


def oracle_norm_grads(dy, x, w):
    x, w, dy = x.double(), w.double(), dy.double()
    r = (x.square().mean(-1, keepdim=True) + EPS).rsqrt()
    g = dy * w
    dx = r * g - r.pow(3) * x * (g * x).sum(-1, keepdim=True) / x.shape[-1]
    dw = (dy * x * r).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


def gelu64(g):
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g.pow(3))))


def oracle_mlp(x, wg, wu, wd):
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    return (gelu64(x @ wg.T) * (x @ wu.T)) @ wd.T


# ----------------------------------------------------------------------------------------------------------------
# the benchmark


class Table:
    """Collects rows; rewrites the JSON after every row so a run cut short still leaves its numbers."""

    def __init__(self, ceilings, json_path=None, env=None):
        self.rows = []
        self.ceil = ceilings
        self.json_path = json_path
        self.env = env

    def dump(self, targets=None):
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.json_path).write_text(json.dumps(
                {"env": self.env, "ceilings": self.ceil, "rows": self.rows, "targets": targets}, indent=1))

    def add(self, row, impl, us, *, bytes_=None, flops=None, err=None, ok=True, mode="events", note=""):
        entry = {"row": row, "impl": impl, "us": us, "mode": mode, "err_vs_fp64": err, "correct": ok, "note": note}
        if bytes_ is not None and us:
            gbs = bytes_ / (us * 1e-6) / 1e9
            entry.update(GBps=gbs, pct_copy=100 * gbs / self.ceil["copy_GBps"], bytes=bytes_)
        if flops is not None and us:
            tf = flops / (us * 1e-6) / 1e12
            entry.update(TFLOPs=tf, pct_matmul=100 * tf / self.ceil["bf16_matmul_TFLOPs"], flops=flops)
        self.rows.append(entry)
        print(self.fmt(entry), flush=True)
        self.dump()

    @staticmethod
    def fmt(e):
        rate = ""
        if "GBps" in e:
            rate = f"{e['GBps']:8.0f} GB/s {e['pct_copy']:5.1f}% copy"
        if "TFLOPs" in e:
            rate = f"{e['TFLOPs']:8.1f} TF/s {e['pct_matmul']:5.1f}% mm"
        err = "" if e["err_vs_fp64"] is None else f"err {e['err_vs_fp64']:.2e}"
        flag = "" if e["correct"] else "  WRONG"
        us = "-" if e["us"] is None else f"{e['us']:9.1f}"
        return f"{e['row']:<34} {e['impl']:<14} {e['mode']:<6} {us} us  {rate:<28} {err}{flag} {e['note']}"


def check(err: float, bound: float = 2e-2) -> bool:
    return math.isfinite(err) and err <= bound


def bench_norm_fwd(t: Table, lk, rows: int):
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=DT)
    w = (torch.rand(HIDDEN, device=DEV) + 0.5).to(DT)
    ref = oracle_norm(x, w)
    bytes_ = 2 * x.numel() * x.element_size() + w.numel() * w.element_size()
    for name, mod in norm_impls(w, lk).items():
        with torch.no_grad():
            out = mod(x)
            err = rel_err(out, ref)
            us = time_events(lambda: mod(x))
        t.add(f"rmsnorm fwd {rows}x{HIDDEN}", name, us, bytes_=bytes_, err=err, ok=check(err))


def bench_norm_fwd_bwd(t: Table, lk, rows: int):
    x = torch.randn(rows, HIDDEN, device=DEV, dtype=DT)
    dy = torch.randn_like(x)
    w = (torch.rand(HIDDEN, device=DEV) + 0.5).to(DT)
    ex, ew = oracle_norm_grads(dy, x, w)
    # floor: fwd reads x writes y; bwd reads x, dy, writes dx (+ weight once each way)
    bytes_ = 5 * x.numel() * x.element_size() + 2 * w.numel() * w.element_size()
    for name, mod in norm_impls(w, lk).items():
        xl = x.detach().clone().requires_grad_(True)

        def step():
            mod(xl).backward(dy)

        step()
        err = max(rel_err(xl.grad, ex), rel_err(mod.weight.grad, ew))
        us = time_events(step, grads=(xl, mod.weight))
        t.add(f"rmsnorm fwd+bwd {rows}x{HIDDEN}", name, us, bytes_=bytes_, err=err, ok=check(err))


def _sandwich_inputs(rows: int):
    branch, residual = (torch.randn(rows, HIDDEN, device=DEV, dtype=DT) for _ in range(2))
    post_w, pre_w = ((torch.rand(HIDDEN, device=DEV) + 0.5).to(DT) for _ in range(2))
    return branch, residual, post_w, pre_w


def bench_sandwich_fwd(t: Table, rows: int):
    branch, residual, post_w, pre_w = _sandwich_inputs(rows)
    ref_s = residual.double() + oracle_norm(branch, post_w)
    ref_y = oracle_norm(ref_s, pre_w)
    bytes_ = 4 * branch.numel() * branch.element_size() + 2 * post_w.numel() * post_w.element_size()
    for name, mod in sandwich_impls(post_w, pre_w).items():
        with torch.no_grad():
            s, y = mod(branch, residual)
            err = max(rel_err(s, ref_s), rel_err(y, ref_y))
            us = time_events(lambda: mod(branch, residual))
        t.add(f"sandwich fwd {rows}x{HIDDEN}", name, us, bytes_=bytes_, err=err, ok=check(err))


def bench_sandwich_fwd_bwd(t: Table, rows: int):
    branch, residual, post_w, pre_w = _sandwich_inputs(rows)
    grad_s, grad_y = torch.randn_like(branch), torch.randn_like(branch)
    # fp64 gradients by autograd through the fp64 formula
    b64, r64, wp64, wq64 = (v.double().requires_grad_() for v in (branch, residual, post_w, pre_w))
    s64 = r64 + oracle_norm(b64, wp64)
    torch.autograd.backward((s64, oracle_norm(s64, wq64)), (grad_s.double(), grad_y.double()))
    refs = (b64.grad, r64.grad, wp64.grad, wq64.grad)
    # floor: fwd reads branch, residual, writes s, y; bwd reads grad_s, grad_y, branch, s, writes two grads
    bytes_ = 10 * branch.numel() * branch.element_size() + 4 * post_w.numel() * post_w.element_size()
    for name, mod in sandwich_impls(post_w, pre_w).items():
        b, r = (v.detach().clone().requires_grad_(True) for v in (branch, residual))
        weights = (mod.post.weight, mod.pre.weight)  # (a compiled module forwards attribute reads to the original)

        def step():
            torch.autograd.backward(mod(b, r), (grad_s, grad_y))

        step()
        err = max(rel_err(g, ref) for g, ref in zip((b.grad, r.grad, *(w.grad for w in weights)), refs))
        us = time_events(step, grads=(b, r, *weights))
        t.add(f"sandwich fwd+bwd {rows}x{HIDDEN}", name, us, bytes_=bytes_, err=err, ok=check(err))


def bench_gelu_mul(t: Table, lk, rows: int):
    g = torch.randn(rows, INTER, device=DEV, dtype=DT)
    u = torch.randn(rows, INTER, device=DEV, dtype=DT)
    ref = gelu64(g.double()) * u.double()
    bytes_ = 3 * g.numel() * g.element_size()

    def stock(a, b):
        return F.gelu(a, approximate="tanh") * b

    impls = {"stock eager": stock, "stock compile": torch.compile(stock, dynamic=False)}
    if lk is not None:
        impls["liger"] = lk.gelu_mul
    impls["g4ops"] = torch.ops.g4ops.gelu_tanh_mul
    for name, fn in impls.items():
        with torch.no_grad():
            err = rel_err(fn(g, u), ref)
            us = time_events(lambda: fn(g, u))
        t.add(f"gelu_tanh*u fwd {rows}x{INTER}", name, us, bytes_=bytes_, err=err, ok=check(err))
    del g, u, ref


def bench_mlp_fwd(t: Table, impls, tokens: int):
    x = torch.randn(tokens, HIDDEN, device=DEV, dtype=DT)
    any_mod = impls["stock eager"]
    ref = oracle_mlp(x, any_mod.gate_proj.weight, any_mod.up_proj.weight, any_mod.down_proj.weight)
    wbytes = 3 * HIDDEN * INTER * 2
    bytes_ = wbytes + 2 * x.numel() * 2
    flops = 3 * 2 * tokens * HIDDEN * INTER
    for name, mod in impls.items():
        with torch.no_grad():
            err = rel_err(mod(x), ref)
            ok = check(err)
            if tokens <= 64:
                us = time_graph(lambda: mod(x))
                t.add(f"mlp fwd {tokens} tok", name, us, bytes_=bytes_, err=err, ok=ok, mode="graph")
                us = time_events(lambda: mod(x))
                t.add(f"mlp fwd {tokens} tok", name, us, bytes_=bytes_, err=err, ok=ok, mode="events")
            else:
                us = time_events(lambda: mod(x))
                t.add(f"mlp fwd {tokens} tok", name, us, flops=flops, err=err, ok=ok)


def bench_mlp_fwd_bwd(t: Table, impls, tokens: int):
    x = torch.randn(tokens, HIDDEN, device=DEV, dtype=DT)
    dy = torch.randn(tokens, HIDDEN, device=DEV, dtype=DT) * 0.1
    flops = 9 * 2 * tokens * HIDDEN * INTER  # 3 forward GEMMs + 6 backward GEMMs
    ref_grads = None
    for name, mod in impls.items():
        params = [mod.gate_proj.weight, mod.up_proj.weight, mod.down_proj.weight]
        for p in params:
            p.requires_grad_(True)
        xl = x.detach().clone().requires_grad_(True)

        def step():
            mod(xl).backward(dy)

        step()
        grads = [xl.grad] + [p.grad for p in params]
        if ref_grads is None:
            xd = x.double().requires_grad_(True)
            wd = [p.detach().double().requires_grad_(True) for p in params]
            out = oracle_mlp(xd, *wd)
            ref_grads = torch.autograd.grad(out, [xd, *wd], dy.double())
        err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        us = time_events(step, reps=30, grads=(xl, *params))
        t.add(f"mlp fwd+bwd {tokens} tok", name, us, flops=flops, err=err, ok=check(err))
        for p in params:
            p.grad = None
            p.requires_grad_(False)


def bench_overhead(t: Table, lk, mlp_impls_):
    x = torch.randn(1, 1, HIDDEN, device=DEV, dtype=DT)
    w = (torch.rand(HIDDEN, device=DEV) + 0.5).to(DT)
    impls = dict(norm_impls(w, lk))
    impls["aten F.rms_norm"] = lambda a: F.rms_norm(a, (HIDDEN,), w, EPS)
    with torch.no_grad():
        for name, fn in impls.items():
            fn(x)
            t.add("per-call eager, norm 1 tok", name, time_host(lambda: fn(x)), mode="host")
        for name, mod in mlp_impls_.items():
            t.add("per-call eager, mlp 1 tok", name, time_host(lambda: mod(x), calls=200), mode="host")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rows (smoke test)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    g4ops.build_kernels()
    lk = liger()

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "liger": None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
        import triton

        env["triton"] = triton.__version__
        import importlib.metadata as md

        env["liger"] = md.version("liger_kernel") if lk is not None else None
    except Exception:
        pass
    print(env, flush=True)
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    t = Table(ceil, args.json, env)

    bench_norm_fwd(t, lk, 16384)
    bench_norm_fwd(t, lk, 4096)
    bench_norm_fwd_bwd(t, lk, 16384)
    bench_sandwich_fwd(t, 16384)
    bench_sandwich_fwd_bwd(t, 16384)
    if not args.quick:
        bench_gelu_mul(t, lk, 16384)
    torch.cuda.empty_cache()
    wg = (torch.randn(INTER, HIDDEN, device=DEV) * HIDDEN**-0.5).to(DT)
    wu = (torch.randn(INTER, HIDDEN, device=DEV) * HIDDEN**-0.5).to(DT)
    wd = (torch.randn(HIDDEN, INTER, device=DEV) * INTER**-0.5).to(DT)
    impls = mlp_impls(wg, wu, wd, lk)
    for tokens in (1, 2, 4, 8, 64, 4096) if not args.quick else (1, 4096):
        bench_mlp_fwd(t, impls, tokens)
    bench_mlp_fwd_bwd(t, impls, 4096)
    bench_overhead(t, lk, impls)

    targets = summarize(t, ceil)
    t.dump(targets)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _find(t: Table, row: str, impl: str, mode: str | None = None):
    for e in t.rows:
        if e["row"] == row and e["impl"] == impl and (mode is None or e["mode"] == mode):
            return e
    return None


def summarize(t: Table, ceil: dict) -> list[dict]:
    """The issue's targets, each with the measured value and met / missed."""
    out = []
    copy = ceil["copy_GBps"]

    def add(name, value, target, met, unit):
        out.append({"target": name, "value": value, "goal": target, "met": met, "unit": unit})

    e = _find(t, f"rmsnorm fwd 16384x{HIDDEN}", "g4ops")
    if e:
        add("RMSNorm fwd 16384x2560 >= 85% of copy BW", e["pct_copy"], 85.0, e["pct_copy"] >= 85.0, "% of copy")
    e = _find(t, f"rmsnorm fwd+bwd 16384x{HIDDEN}", "g4ops")
    if e:
        floor_us = e["bytes"] / (copy * 1e9) * 1e6
        ratio = e["us"] / floor_us
        add("RMSNorm fwd+bwd 16384x2560 <= 1.4x bandwidth floor", ratio, 1.4, ratio <= 1.4, "x floor")
    e = _find(t, f"rmsnorm fwd 4096x{HIDDEN}", "g4ops")
    c = _find(t, f"rmsnorm fwd 4096x{HIDDEN}", "stock compile")
    if e and c:
        add("RMSNorm fwd 4096x2560 beats compile", e["us"] / c["us"], 1.0, e["us"] <= c["us"], "x compile time")
    e = _find(t, f"gelu_tanh*u fwd 16384x{INTER}", "g4ops")
    if e:
        add("gelu*u fwd 16384x10240 at the floor", e["pct_copy"], 85.0, e["pct_copy"] >= 85.0, "% of copy")
    e = _find(t, "mlp fwd 1 tok", "g4ops", "graph")
    if e:
        add("MLP fwd 1 token >= 85% of copy BW (graph replay)", e["pct_copy"], 85.0, e["pct_copy"] >= 85.0,
            "% of copy")
    e = _find(t, "mlp fwd 4096 tok", "g4ops")
    c = _find(t, "mlp fwd 4096 tok", "stock compile")
    if e and c:
        add("MLP fwd 4096 match or beat compile", e["us"] / c["us"], 1.0, e["us"] <= 1.02 * c["us"], "x compile time")
    e = _find(t, "mlp fwd+bwd 4096 tok", "g4ops")
    c = _find(t, "mlp fwd+bwd 4096 tok", "stock compile")
    if e and c:
        add("MLP fwd+bwd 4096 >= stock compile", e["us"] / c["us"], 1.0, e["us"] <= c["us"], "x compile time")
    print("\n=== summary (median us; % of ceilings measured in this run) ===")
    for e in t.rows:
        print(Table.fmt(e))
    print("\n=== targets ===")
    for o in out:
        print(f"{'MET   ' if o['met'] else 'MISSED'} {o['target']:<52} {o['value']:.3f} {o['unit']} (goal {o['goal']})")
    return out


if __name__ == "__main__":
    sys.exit(main())
