"""Compiled artifacts reused across processes: for each variant (stock, g4ops) and path, run the same compiled work in
two fresh processes that share one empty `TORCHINDUCTOR_CACHE_DIR` and differ in `PYTHONHASHSEED` (0, then 1: they
iterate Gemma-4's set of layer-type strings in opposite orders), and report each process's seconds to the end of
the work, the compile-cache counters (Inductor FX-graph cache, AOTAutograd cache) and whether both computed the same
result.

    python bench/compile_cache.py --layers 42 --json $OUT/compile_cache.json     # CUDA, E4B-shaped
    python bench/compile_cache.py --device cpu --shape tiny-e4b --paths train    # CPU, about 3 minutes

Paths (`--paths`):
  train     `torch.compile(model)`, forward + backward with labels at 1 x `--seq` tokens (g4ops: `enable(model,
            attention=True)`, the finetune setup of bench/e2e.py)
  generate  `model.generate(..., cache_implementation="static")` of `--new-tokens` greedy tokens (transformers
            compiles the decode step; g4ops: `enable(decode=False)`, so the call stays on that path)
  decoder   `g4ops.engine.decoder.Decoder(model, compile=True)` (g4ops only; its CUDA graph is captured after compile)

Seconds run from the model's construction to the end of the work (compilation included), not from process start.
Why two hash seeds: stock transformers builds its rotary tables in set order, so about half of all new processes
trace a different graph and miss both caches; g4ops.enable() iterates the set sorted
(bench/results/2026-11-29-cpu-compile-cache-reuse.md). tests/test_compile_cache.py runs this script's train and
decoder paths and checks its counters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PATHS = ("train", "generate", "decoder")
VARIANTS = ("stock", "g4ops")
HASH_SEEDS = (0, 1)


def child(args) -> None:
    """One process: build, enable, compile and run one path; write the report and the result tensors to args.out."""
    import torch
    from torch._dynamo.utils import counters

    import g4ops
    from g4ops.models import build_model

    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny GEMMs: threads only add barrier waits
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    out = Path(args.out)
    start = time.perf_counter()
    model = build_model(args.shape, num_layers=args.layers, dtype=dtype, device=args.device)
    stock_order = list(set(model.config.layer_types))  # what stock iterates: this process's hash-seed order
    g4ops_on = args.variant == "g4ops"
    gen = torch.Generator().manual_seed(0)
    if args.path == "train":
        model.train()
        if g4ops_on:
            g4ops.enable(model, attention=True)
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq), generator=gen).to(args.device)
        loss = torch.compile(model)(input_ids=ids, labels=ids).loss
        loss.backward()
        result = {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    else:
        prompt = torch.randint(3, model.config.vocab_size, (1, 8), generator=gen).to(args.device)
        if args.path == "generate":
            from transformers.generation import CompileConfig

            if g4ops_on:
                g4ops.enable(decode=False)
            config = CompileConfig(fullgraph=True)
            config._compile_all_devices = args.device == "cpu"  # transformers compiles by itself only on GPUs
            tokens = model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                    do_sample=False, cache_implementation="static", compile_config=config,
                                    pad_token_id=0)  # fmt: skip
        else:
            from g4ops.engine.decoder import GreedyDecoder

            if not g4ops_on:
                raise SystemExit("the decoder path is g4ops' own: run it with --variant g4ops")
            g4ops.enable(decode=False)
            decoder = GreedyDecoder(model, batch_size=1, max_length=8 + args.new_tokens, compile=True)
            tokens = decoder.generate(prompt, args.new_tokens, min_new_tokens=args.new_tokens)
        result = {"tokens": tokens}
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    torch.save({k: v.cpu() for k, v in result.items()}, out / "result.pt")
    report = dict(seconds=seconds, stock_layer_type_order=stock_order, inductor=dict(counters["inductor"]),
                  aot_autograd=dict(counters["aot_autograd"]))  # fmt: skip
    (out / "report.json").write_text(json.dumps(report))


def run_child(args, variant: str, path: str, cache: Path, out: Path, hash_seed: int) -> dict:
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--path", path, "--out", str(out),
           "--device", args.device, "--shape", args.shape, "--seq", str(args.seq),
           "--new-tokens", str(args.new_tokens)]  # fmt: skip
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONHASHSEED=str(hash_seed),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads((out / "report.json").read_text())


def cache_summary(report: dict) -> dict:
    counts = {**report.get("inductor", {}), **report.get("aot_autograd", {})}
    return {k: v for k, v in counts.items() if "cache" in k}


def measure(args, variant: str, path: str, workdir: Path) -> dict:
    import torch

    cache = workdir / f"{variant}-{path}-cache"
    runs = [run_child(args, variant, path, cache, workdir / f"{variant}-{path}-{seed}", seed) for seed in HASH_SEEDS]
    row = dict(variant=variant, path=path)
    for name, report in zip(("first", "second"), runs):
        if "error" in report:
            row[f"{name}_error"] = report["error"]
            continue
        row[f"{name}_s"] = report["seconds"]
        row[f"{name}_caches"] = cache_summary(report)
        row[f"{name}_layer_type_order"] = report["stock_layer_type_order"]
    if not any(k.endswith("_error") for k in row):
        a, b = (torch.load(workdir / f"{variant}-{path}-{seed}" / "result.pt") for seed in HASH_SEEDS)
        row["same_result"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        row["second_over_first"] = row["second_s"] / row["first_s"]
    print(json.dumps(row), flush=True)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--shape", default="e4b", help="g4ops.models.SHAPES key")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seq", type=int, default=2048, help="train: tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="generate, decoder: greedy tokens")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    ap.add_argument("--json", default=None)
    # one process of the measurement (what the parent runs)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.paths = [p for p in args.paths.split(",") if p]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [p for p in args.paths if p not in PATHS] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown paths or variants {bad}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.paths:
            for variant in args.variants:
                if path == "decoder" and variant == "stock":
                    continue  # g4ops' own decoder has no stock counterpart
                rows.append(measure(args, variant, path, Path(tmp)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
