"""AdamW step benchmark: one optimizer step over every parameter of a Gemma-4 model (default E4B at 42 layers: 7.463 B
bf16 parameters in 623 tensors, 278 of them under 10K elements, the largest two embeddings of 671 M and 2819 M
elements), torch.optim.AdamW(fused=True), torch.optim.AdamW(foreach=True) and g4ops.optim.AdamW (csrc/adamw.cu).

The parameter shapes come from the model built on the meta device (tied weights once); params and grads are random
(magnitudes uniform in [0.1, 1.1) times 0.02 and 0.01, random signs, no exact zeros), made on the device from one
seeded generator. Every optimizer has lr 1e-4, betas (0.9, 0.999), eps 1e-8 and weight decay 0.01 (nonzero, so the
decay is part of the timed work).

Correctness first, from the initial params and empty state: one torch-fused step and one g4ops step on copies, and
their params, exp_avg and exp_avg_sq compared element by element (how many differ, the max abs difference, the max
distance in ulps of the dtype). The two round differently (ATen's fused CUDA kernel evaluates the moments in fp64,
g4ops in fp32 from coefficients rounded once; csrc/adamw.cu), so a stored bf16 value may land 1 ulp apart: on the
H200 (2026-11-30, E4B) 0.68% of exp_avg_sq and no param or exp_avg. The g4ops row fails (and the script exits
non-zero at the end) if one differs by more than 1 ulp anywhere: params, exp_avg and exp_avg_sq on CUDA; params only
elsewhere, because torch's CPU fused kernel has arithmetic of its own (in fp32 on CPU, params were up to 2 ulp apart
on 17% of the elements and the check fails there). Which is closer to exact is tests/test_adamw.py's question
(against an fp64 oracle).
The check covers every tensor, in groups of at most as many elements as the largest tensor, so it needs six copies
of the largest tensor next to the params and grads (34 GB at E4B bf16).

Timing: the implementations run one after another on the same params and the same fixed grads, each with its own
fresh state, deleted (and the CUDA cache emptied) before the next, so the peak is params + grads + one optimizer's two
states (about 15 + 15 + 30 GB at E4B bf16). `--warmup` steps, then `--steps` steps timed one by one: on CUDA with
events after a synchronize (so host launch time counts where the GPU waits for it; `host_ms` is the time for step()
to return), elsewhere with time.perf_counter; the median is reported. The params drift step to step; the work does
not change.

Floor: a step reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq: 7 x element size
bytes per parameter (14 for bf16, 104 GB per E4B step). GB/s = those bytes / median time; the ceiling is the
device-to-device copy bandwidth measured in the same run (bench/kernel_bench.py measure_ceilings, CUDA only), and the
floor time is bytes / ceiling.

    python bench/adamw.py --json $OUT/adamw.json        # H200: 23 s once csrc/ is built
    python bench/adamw.py --device cpu --smoke          # tiny-e4b shapes on CPU: proves the script runs
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import g4ops.optim
from g4ops import models
from kernel_bench import measure_ceilings  # bench/kernel_bench.py: this script's own directory is on sys.path

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
IMPLS = {
    "torch-fused": lambda params: torch.optim.AdamW(params, fused=True, **HYPER),
    "torch-foreach": lambda params: torch.optim.AdamW(params, foreach=True, **HYPER),
    "g4ops": lambda params: g4ops.optim.AdamW(params, **HYPER),
}
REFERENCE, CANDIDATE = "torch-fused", "g4ops"
FIELDS = ("param", "exp_avg", "exp_avg_sq")
MAX_ULP = 1
COMPARE_CHUNK = 1 << 26  # elements compared at a time: bounds the float64 / int64 temporaries
SIGNED_INT = {2: torch.int16, 4: torch.int32}  # by element size


def param_shapes(shape: str, layers: int | None) -> list[tuple[str, torch.Size]]:
    import transformers

    cfg = models.text_config(shape, num_layers=layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return [(name, p.shape) for name, p in model.named_parameters()]


def nonzero_random(shape, scale, dtype, device, gen) -> torch.Tensor:
    """Magnitudes uniform in [0.1, 1.1) * scale with random signs: an exact zero would hide a skipped update."""
    x = torch.empty(shape, dtype=dtype, device=device).uniform_(0.1, 1.1, generator=gen)
    sign = torch.empty_like(x).random_(0, 2, generator=gen).mul_(2).sub_(1)
    return x.mul_(sign).mul_(scale)


def empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# correctness


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """The float's bits as an int64 that grows with the value (+0 and -0 both 0): two of them differ by the number of
    representable values between the floats, their distance in ulps."""
    bits = x.view(SIGNED_INT[x.element_size()]).long()
    return torch.where(bits < 0, torch.iinfo(SIGNED_INT[x.element_size()]).min - bits, bits)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    differ, max_abs, max_ulp = 0, 0.0, 0
    for start in range(0, a.numel(), COMPARE_CHUNK):
        x, y = a[start : start + COMPARE_CHUNK], b[start : start + COMPARE_CHUNK]
        differ += int((x != y).sum())
        max_abs = max(max_abs, float((x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max()))
        max_ulp = max(max_ulp, int((ordered_bits(x) - ordered_bits(y)).abs().max()))
    return dict(differ=differ, max_abs=max_abs, max_ulp=max_ulp)


def one_step(name: str, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """(param, exp_avg, exp_avg_sq) per tensor after one step of `name` on copies of `params`."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(copies, grads):
        p.grad = g
    opt = IMPLS[name](copies)
    opt.step()
    return [(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in copies]


def check_against_reference(params, grads, device: str) -> dict:
    """One REFERENCE and one CANDIDATE step from the same state, compared on every tensor; tensors go in groups of
    at most the largest tensor's element count, so the copies stay within six times the largest tensor."""
    budget = max(p.numel() for p in params)
    groups, current, size = [], [], 0
    for i, p in enumerate(params):
        if current and size + p.numel() > budget:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel()
    groups.append(current)
    totals = {f: dict(differ=0, max_abs=0.0, max_ulp=0) for f in FIELDS}
    for group in groups:
        ps, gs = [params[i] for i in group], [grads[i] for i in group]
        ref, out = one_step(REFERENCE, ps, gs), one_step(CANDIDATE, ps, gs)
        for ref_tensors, out_tensors in zip(ref, out):
            for field, r, o in zip(FIELDS, ref_tensors, out_tensors):
                c = compare(r, o)
                totals[field] = dict(differ=totals[field]["differ"] + c["differ"],
                                     max_abs=max(totals[field]["max_abs"], c["max_abs"]),
                                     max_ulp=max(totals[field]["max_ulp"], c["max_ulp"]))  # fmt: skip
        del ref, out
        empty_cache(device)
    numel = sum(p.numel() for p in params)
    for t in totals.values():
        t["differ_fraction"] = t["differ"] / numel
    gated = FIELDS if device.startswith("cuda") else ("param",)  # the docstring says why
    passed = all(totals[f]["max_ulp"] <= MAX_ULP for f in gated)
    return dict(reference=REFERENCE, groups=len(groups), gated=list(gated), passed=passed, **totals)


# ----------------------------------------------------------------------------------------------------------------
# timing


def time_steps(opt, warmup: int, steps: int, device: str) -> tuple[list[float], list[float]]:
    """Per-step milliseconds (CUDA events after a synchronize, or perf_counter off CUDA) and the host time for step()
    to return."""
    cuda = device.startswith("cuda")
    for _ in range(warmup):
        opt.step()
    times, host = [], []
    for _ in range(steps):
        if not cuda:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, host


def time_impl(name: str, params, args) -> dict:
    row = dict(impl=name)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    opt = None
    try:
        opt = IMPLS[name](params)
        times, host = time_steps(opt, args.warmup, args.steps, args.device)
        row.update(ms=statistics.median(times), host_ms=statistics.median(host), step_ms=times)
        if args.device.startswith("cuda"):
            row["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    except Exception as exc:  # e.g. fused=True where this torch has no fused kernel for the device
        row["error"] = f"{type(exc).__name__}: {exc}"
    if opt is not None:
        opt.state.clear()  # the next implementation starts from empty state, with this one's memory freed
    del opt
    empty_cache(args.device)
    return row


# ----------------------------------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import transformers

    env = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), torch=torch.__version__,
               transformers=transformers.__version__, python=platform.python_version(), device=device,
               device_name=platform.processor() or platform.machine())  # fmt: skip
    if device.startswith("cuda"):
        env.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   g4ops_kernels=g4ops.kernel_status()["library"])  # fmt: skip
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="e4b", choices=sorted(models.SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own, 42 for e4b)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny-e4b shapes, 1 warmup and 2 timed steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.layers, args.warmup, args.steps = "tiny-e4b", None, 1, 2
    dtype = DTYPES[args.dtype]
    cuda = args.device.startswith("cuda")
    if cuda:
        g4ops.build_kernels()  # a build failure stops here, not inside the first timed step
    env = environment(args.device)
    print(env, flush=True)
    ceilings = measure_ceilings() if cuda else None  # before the params exist: 2 GiB of copy buffers
    if ceilings:
        print(f"copy ceiling {ceilings['copy_GBps']:.0f} GB/s", flush=True)

    shapes = param_shapes(args.shape, args.layers)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    params = [torch.nn.Parameter(nonzero_random(s, 0.02, dtype, args.device, gen)) for _, s in shapes]
    for p in params:
        p.grad = nonzero_random(p.shape, 0.01, dtype, args.device, gen)
    numel = sum(p.numel() for p in params)
    step_bytes = numel * 7 * params[0].element_size()  # 4 reads + 3 writes per parameter
    model = dict(shape=args.shape, layers=models.text_config(args.shape, args.layers).num_hidden_layers,
                 dtype=args.dtype, tensors=len(params), parameters=numel,
                 tensors_under_10k=sum(p.numel() < 10_000 for p in params),
                 largest=sorted(p.numel() for p in params)[-2:], bytes_per_step=step_bytes)  # fmt: skip
    floor_ms = step_bytes / (ceilings["copy_GBps"] * 1e9) * 1e3 if ceilings else None
    print(model, f"floor {floor_ms:.2f} ms" if floor_ms else "", flush=True)

    try:
        check = check_against_reference(params, [p.grad for p in params], args.device)
    except Exception as exc:  # an implementation that cannot step has not been shown correct
        check = dict(reference=REFERENCE, passed=False, error=f"{type(exc).__name__}: {exc}")
    empty_cache(args.device)
    print("check:", check, flush=True)

    rows = []
    for name in IMPLS:
        row = time_impl(name, params, args)
        if "ms" in row:
            row["GBps"] = step_bytes / (row["ms"] * 1e-3) / 1e9
            row["pct_copy_ceiling"] = 100 * row["GBps"] / ceilings["copy_GBps"] if ceilings else None
        if name == CANDIDATE:
            row["check_passed"] = check["passed"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_ms"}), flush=True)
    fused_ms = rows[0].get("ms")
    for row in rows:
        row["x_vs_torch_fused"] = fused_ms / row["ms"] if fused_ms and "ms" in row else None

    floor = f", floor {floor_ms:.2f} ms at {ceilings['copy_GBps']:.0f} GB/s copy" if ceilings else ""
    print(f"\n{model['tensors']} tensors, {numel:,} params, {step_bytes / 1e9:.4g} GB per step{floor}")
    print(f"{'impl':<15}{'ms':>10}{'host ms':>10}{'GB/s':>9}{'% copy':>8}{'x fused':>9}  check")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<15}  error: {r['error'][:100]}")
            continue
        pct = f"{r['pct_copy_ceiling']:>8.1f}" if r["pct_copy_ceiling"] is not None else f"{'-':>8}"
        verdict = {True: "passed", False: "FAILED"}.get(r.get("check_passed"), "")
        print(f"{r['impl']:<15}{r['ms']:>10.3f}{r['host_ms']:>10.3f}{r['GBps']:>9.1f}{pct}"
              f"{r['x_vs_torch_fused'] or float('nan'):>9.2f}  {verdict}")  # fmt: skip
    if args.json:
        result = dict(env=env, args=vars(args), model=model, ceilings=ceilings, floor_ms=floor_ms, check=check,
                      rows=rows)  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not check["passed"]:
        raise SystemExit(f"g4ops.optim.AdamW does not match torch's fused AdamW: {check}")
    return rows


if __name__ == "__main__":
    main()
