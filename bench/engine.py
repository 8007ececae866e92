"""The BatchEngine without HTTP: is the server's throughput the engine's, or does the HTTP side cost it?

    python bench/engine.py --out $OUT/engine.json                       # E4B-shaped, 42 layers, CUDA
    python bench/engine.py --layers 2 --buckets 1,4 --concurrency 2 --prompt-tokens 16 --output-tokens 8   # quick
    python bench/engine.py --smoke --out /tmp/engine.json    # tiny-e4b on CPU, the load only: the script runs (CI)

On the serve benchmark's shape (bench/serve.py: `--prompt-tokens` random-token prompts, `--output-tokens` greedy new
tokens each, no stop tokens, `--rounds` requests per concurrent client), in one process:
  step      the captured decode step of each of `--buckets` (every row decoding at position `--position`, the KV
            cache filled with random values), replayed `--replays` times: ms per step (CUDA events) and the weight
            and KV bytes it must read against the copy bandwidth measured in the same run
  kernels   with `--profile`, torch.profiler's kernel table of the same step, run uncaptured (each kernel's time is
            the replay's; launch gaps are not)
  load      requests submitted straight to BatchEngine.submit at each `--concurrency` (a client thread keeps that
            many in flight): output tok/s over the level's wall time, TTFT and inter-token gaps (p50, p99) taken in
            the engine's callback, where the server's HTTP side starts

Set beside bench/serve.py's numbers at the same concurrency, the gap is what the HTTP side (the event loop, SSE,
the client) costs. Checked before any number: every request gets exactly `--output-tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from g4ops.engine.batch import BatchEngine, SamplingParams  # noqa: E402
from g4ops.models import build_model  # noqa: E402
from serve import percentile  # noqa: E402  (bench/serve.py: the serve benchmark's nearest-rank percentile)


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s (bytes read + written), on 1 GiB."""
    src = torch.randn(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 4 * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def step_bytes(engine: BatchEngine, b: int, position: int) -> int:
    """What one step over b rows at `position` must read: every weight once (tied lm_head counted once, the
    per-layer embedding table only at b rows) and each KV-reading layer's visible keys and values."""
    model, cache = engine.model, engine.cache
    config = model.config
    total = 0
    for name, param in model.named_parameters():
        if "embed_tokens_per_layer" in name:
            total += b * param.shape[1] * param.element_size()
        else:  # embed_tokens counts once: it is read whole as the tied lm_head
            total += param.numel() * param.element_size()
    kv_shared = getattr(config, "num_kv_shared_layers", 0)
    owners = config.num_hidden_layers - kv_shared
    for i, kind in enumerate(config.layer_types):
        if i >= owners:  # a KV-shared layer reads the last owner of its kind
            src = max(j for j in range(owners) if config.layer_types[j] == kind)
        else:
            src = i
        keys = cache.keys[src]
        seen = min(position + 1, keys.shape[2] - 1)
        total += 2 * b * keys.shape[1] * seen * keys.shape[3] * keys.element_size()
    return total


def time_steps(engine: BatchEngine, buckets: list[int], position: int, replays: int, profile: bool, top: int):
    from profile_steps import _kernel_table  # bench/ is on sys.path when this script runs

    mode = engine._mode([])  # greedy
    for keys, values in zip(engine.cache.keys.values(), engine.cache.values.values()):
        keys.normal_()
        values.normal_()
    bandwidth = copy_bandwidth()
    rows = {}
    for b in buckets:
        graph = engine._graph(b, mode)  # captured by warmup()
        engine.active[:b] = True
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(3):
            engine.position[:b] = position
            graph.replay()
            engine.position[:b] = position
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / replays)
        ms = statistics.median(times)
        nbytes = step_bytes(engine, b, position + replays // 2)
        row = dict(ms=ms, gb=nbytes / 1e9, floor_ms=nbytes / (bandwidth * 1e9) * 1e3, tok_s=b / ms * 1e3)
        if profile:
            engine.position[:b] = position
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    engine._run_step(b, mode)
                torch.cuda.synchronize()
            busy, launches, table = _kernel_table(prof, 4, top)
            row.update(gpu_busy_us=busy, launches=launches, kernels=table)
        rows[b] = row
        engine.active.zero_()
        engine.position.zero_()
        print(f"step b{b}: {ms:.3f} ms ({row['tok_s']:.0f} tok/s), reads {row['gb']:.2f} GB: floor "
              f"{row['floor_ms']:.3f} ms at {bandwidth:.0f} GB/s copy", flush=True)
    return dict(copy_gb_s=bandwidth, buckets=rows)


def load(engine: BatchEngine, concurrency: int, requests: int, prompt_tokens: int, output_tokens: int, vocab: int,
         seed: int, timeout: float) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    slots = threading.Semaphore(concurrency)
    finished = threading.Semaphore(0)
    records = []

    def submit(prompt):
        record = dict(start=time.perf_counter(), times=[], reason=None)
        records.append(record)

        def on_event(event):
            if event.token_id is not None:
                record["times"].append(time.perf_counter())
            if event.finish_reason is not None:
                record["reason"] = event.finish_reason
                slots.release()
                finished.release()

        engine.submit(prompt, SamplingParams(max_new_tokens=output_tokens, temperature=0.0), on_event)

    start = time.perf_counter()
    deadline = start + timeout
    for prompt in prompts:
        if not slots.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            raise RuntimeError(f"concurrency {concurrency}: no request finished within {timeout} s")
        submit(prompt)
    for _ in prompts:
        if not finished.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            raise RuntimeError(f"concurrency {concurrency}: requests still running after {timeout} s")
    wall = time.perf_counter() - start
    wrong = [len(r["times"]) for r in records if len(r["times"]) != output_tokens or r["reason"] != "length"]
    if wrong:
        raise RuntimeError(f"concurrency {concurrency}: token counts {wrong[:4]} != {output_tokens}")
    ttft = [r["times"][0] - r["start"] for r in records]
    itl = [b - a for r in records for a, b in zip(r["times"], r["times"][1:])]

    def ms(values):
        return {"p50": percentile(values, 50) * 1e3, "p99": percentile(values, 99) * 1e3}

    return dict(concurrency=concurrency, requests=requests, wall_s=wall,
                output_tok_s=requests * output_tokens / wall, ttft_ms=ms(ttft), itl_ms=ms(itl))  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--buckets", default="1,16,64", help="step: batch buckets to time")
    ap.add_argument("--position", type=int, default=640, help="step: every row's position")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="step: torch.profiler's kernel table too")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--concurrency", default="16,64", help="load: comma-separated levels ('' for none)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="as `g4ops serve`'s default")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="load: seconds per level")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny-e4b in fp32 on CPU, uncompiled, small load, no step timing (CUDA graphs)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.smoke:
        args.max_batch, args.concurrency, args.prompt_tokens, args.output_tokens = 4, "1,4", 12, 6
        args.no_compile, buckets = True, []
    elif not torch.cuda.is_available():
        print("bench/engine.py times CUDA graphs: it needs a GPU (--smoke runs the load on CPU)", file=sys.stderr)
        return 1
    else:
        buckets = [int(b) for b in args.buckets.split(",") if b]
    max_context = max(args.prompt_tokens + args.output_tokens, args.position + args.replays + 2)
    if args.smoke:
        model = build_model("tiny-e4b", seed=args.seed)
    else:
        model = build_model("e4b", num_layers=args.layers, dtype=torch.bfloat16, device="cuda", seed=args.seed)
    engine = BatchEngine(model, max_batch=args.max_batch, max_context=max_context, max_waiting=4096,
                         prefill_chunk=args.prefill_chunk, compile=not args.no_compile)  # fmt: skip
    t0 = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    print(f"warmup (compile, capture every bucket and prefill shape): {warmup_s:.1f} s", flush=True)
    result = dict(config=vars(args), max_context=max_context, warmup_s=warmup_s,
                  environment=dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   device=torch.cuda.get_device_name() if buckets else "cpu", torch=torch.__version__,
                                   python=platform.python_version()))  # fmt: skip
    if buckets:
        with torch.no_grad():
            result["step"] = time_steps(engine, buckets, args.position, args.replays, args.profile, args.top)
    engine.start()
    levels = []
    try:
        for c in [int(c) for c in args.concurrency.split(",") if c]:
            load(engine, c, c, args.prompt_tokens, 4, model.config.vocab_size, args.seed, args.timeout)  # warm-up
            row = load(engine, c, c * args.rounds, args.prompt_tokens, args.output_tokens, model.config.vocab_size,
                       args.seed, args.timeout)  # fmt: skip
            levels.append(row)
            print(f"load c{c}: {row['output_tok_s']:.1f} tok/s, TTFT p50/p99 {row['ttft_ms']['p50']:.1f}/"
                  f"{row['ttft_ms']['p99']:.1f} ms, ITL p50/p99 {row['itl_ms']['p50']:.2f}/{row['itl_ms']['p99']:.2f}"
                  f" ms", flush=True)  # fmt: skip
    finally:
        engine.shutdown(30)
    result["load"] = levels
    for b, row in result.get("step", {}).get("buckets", {}).items():
        for name, count, us in row.get("kernels", []):
            print(f"  b{b} {us:9.1f} us x{count:5.1f}  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
