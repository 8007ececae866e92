"""Host time of one LoRA call, forward and backward: peft's layers against the g4ops ops an eager step calls.

An eager LoRA step (HF Trainer's default: no torch.compile) calls `g4ops::lora_geglu_mlp` for each MLP, forward and
backward; each call pays the op's dispatch, its input checks and, on CUDA, its inner torch.compile call
(`G4OPS_LORA_COMPILE=0` runs the math eagerly instead). It called `g4ops::lora_linear` for each of q/k/v/o_proj too,
until these rows showed the op's per-call cost there (g4ops.hf.peft_lora.EAGER_LINEAR_VIA_OP: eager projections now run
peft's forward); the q_proj row here still times the op (this script turns the switch on). At the tiny shape timed
here the GPU work is microseconds, so the time per call is the host's. Times 42 layers' worth of calls against an
E4B step's GPU time (`bench/profile_steps.py --train-modes eager`) to see whether the eager step is host-bound.

    python bench/lora_host.py --device cuda --json $OUT/lora-host.json
    G4OPS_LORA_COMPILE=0 python bench/lora_host.py --device cuda --json $OUT/lora-host-inner-eager.json

Each row: the case (`q_proj` or `mlp`), the implementation (`peft` or `g4ops`, g4ops routed by `g4ops.enable()`
after peft wrapped the model, as bench/e2e.py does) and the best time per call over `--rounds` rounds of `--calls`.
The g4ops rows record that the call took g4ops' path (`g4ops.hf.peft_lora.runs_lora_linear`, `fallback_reason`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path

import torch

import g4ops
# bench/ is on sys.path when this script runs
from e2e import DTYPES, g4ops_switches, lora_model
from g4ops.models import build_model


def lora_layer(args, use_g4ops: bool):
    """Layer 0 of a one-layer tiny Gemma-4 with peft LoRA on every projection (as bench/e2e.py sets it up), in
    training mode."""
    model = build_model(args.shape, num_layers=1, dtype=args.dtype, device=args.device)
    model = lora_model(model, args.rank).train()
    if use_g4ops:
        g4ops.enable(model)  # after peft: routes the attention projections to g4ops.lora_linear
    return model.base_model.model.model.layers[0]


def best_us_per_call(args, call) -> float:
    """The best of `--rounds` rounds of `--calls` calls (after warm-up calls, which compile what the op compiles)."""
    for _ in range(args.warmup):
        call()
    best = float("inf")
    for _ in range(args.rounds):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / args.calls * 1e6)
    return best


def measure(args) -> list[dict]:
    g4ops.hf.peft_lora.EAGER_LINEAR_VIA_OP = True  # the q_proj row times the op (module docstring)
    rows = []
    for impl in ("peft", "g4ops"):
        with g4ops.enable() if impl == "g4ops" else contextlib.nullcontext():
            layer = lora_layer(args, impl == "g4ops")
            hidden = layer.mlp.gate_proj.get_base_layer().in_features
            gen = torch.Generator(device=args.device).manual_seed(0)
            x = torch.randn(1, args.tokens, hidden, device=args.device, dtype=args.dtype, generator=gen)
            x.requires_grad_(True)
            cases = {"q_proj": layer.self_attn.q_proj, "mlp": layer.mlp}
            for case, module in cases.items():
                row = dict(case=case, impl=impl, tokens=args.tokens, rank=args.rank)
                if impl == "g4ops":
                    row["g4ops_path"] = (g4ops.hf.peft_lora.runs_lora_linear(module) if case == "q_proj"
                                         else g4ops.hf.peft_lora.fallback_reason(module) is None)  # fmt: skip
                row["us_per_call"] = best_us_per_call(args, lambda m=module: m(x).sum().backward())
                rows.append(row)
                print("  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="tiny-e4b",
                    help="g4ops.models.SHAPES key (tiny: the time is the host's, not the GPU's)")  # fmt: skip
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads on CPU (1: the host's own cost)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    args.dtype = DTYPES[args.dtype or ("bf16" if on_cuda else "fp32")]
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = measure(args)
    meta = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch=torch.__version__,
                python=platform.python_version(), device=args.device, dtype=str(args.dtype),
                g4ops_env=g4ops_switches(),
                device_name=torch.cuda.get_device_name(args.device) if on_cuda else platform.processor() or "cpu")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
