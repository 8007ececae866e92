"""Where does the time go? torch.profiler over E4B-shaped decode steps and training steps, stock vs g4ops.

Prints, per case: wall time per step (steps back to back; and the median of steps each synced, as bench/e2e.py
times them), GPU busy time per step (sum of kernel times), kernel launches per step, and the top kernels by total
time. Wall (timed without the profiler) >> GPU busy means the host (Python, launches, syncs) is the bottleneck;
synced wall >> wall means host work before a step's first kernel, which back-to-back steps hide. Each case also
counts the host-device syncs of one step (torch.cuda's sync debug mode) and Dynamo's graph breaks and frames, which
tell those causes apart: on an H100 a 6-layer LoRA step with the ops called in the default compile mode had neither,
so its 63 ms against 29 ms of GPU work were the ops' per-call host cost (bench/results/2026-12-06-h100-session37.md).

    python bench/profile_steps.py --layers 12 --parts decode,train --json $OUT/profile.json
    python bench/profile_steps.py --layers 12 --parts graph --batches 1,4   # g4ops.engine.decoder.Decoder's step
    python bench/profile_steps.py --layers 42 --parts train --lora 16 --attention --train-modes compiled
                                  # a LoRA finetune step: is it host-bound (wall >> GPU busy)?
    python bench/profile_steps.py --layers 4 --parts train --lora 16 --attention --layout packed
    python bench/profile_steps.py --layers 6 --parts train --lora 16 --attention --layout packed --sliding flex-masked
    python bench/profile_steps.py --layers 6 --parts train --lora 16 --attention --train-modes compiled \
                                  --variants g4ops --lora-attention peft     # attention projections on peft

`graph`: the compiled step of the CUDA-graphed decoder. Its wall time per token is measured on graph replays
(`generate`, no profiler); the kernel table comes from the same compiled step run without the graph, so it lists
every kernel a replay runs (their GPU times are the same; launch gaps are not).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from torch._dynamo.utils import counters

import g4ops
# bench/ is on sys.path when this script runs
from e2e import (TimingTurns, add_sliding_arg, add_timing_turns_args, check_sliding_arg, lora_model, timing_turns,
                 train_batch, use_sliding)
from g4ops.models import build_model


def _kernel_table(prof, steps: int, top: int):
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy_us = sum(e.self_device_time_total for e in events) / steps
    launches = sum(e.count for e in events) / steps
    rows = [(e.key[:90], e.count / steps, e.self_device_time_total / steps) for e in events[:top]]
    return busy_us, launches, rows


def _op_table(prof, top: int):
    """The ATen ops whose kernels took the most GPU time, with their input shapes: which op launched a kernel of the
    kernel table (a vocabulary-sized fill or add names its [262144, ...] operand here). Needs CPU activity, so a
    CUDA-graph replay (reduce-overhead) shows no ops: profile the default compile mode for this."""
    events = [e for e in prof.key_averages(group_by_input_shape=True)
              if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")
              and e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [(e.key, str(e.input_shapes)[:120], e.count, e.self_device_time_total) for e in events[:top]]


def _syncs(fn) -> list:
    """The host-device syncs one step makes (torch.cuda's sync debug mode warns at each): each stalls the host until
    the GPU has caught up, so a step with syncs per layer is neither host- nor GPU-bound but their sum."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno} {str(w.message)[:120]}" for w in caught
            if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]  # fmt: skip


def _dynamo_counters() -> dict:
    """Graph breaks and compiled frames since the case began (`_profile` clears the counters): a break per layer
    puts Python between every layer's graphs on every step."""
    return dict(graph_breaks={k[:120]: v for k, v in counters["graph_break"].items()},
                frames=dict(counters["frames"]), recompiles=dict(counters.get("recompiles", {})))


def _profile(fn, steps: int, top: int, host_top: int = 0, op_top: int = 0, turns: TimingTurns | None = None):
    """Wall time per step from unprofiled steps (the CPU-side profiler inflates host-bound steps 2-3x), the kernel
    table from CUDA-only profiling, with `host_top` the Python functions with the most own time (cProfile), and with
    `op_top` the ATen ops with the most GPU time, by input shape (one step profiled with CPU activity). With `turns`,
    the timed steps wait for this process's turn (processes side by side compile together and time alone)."""
    counters.clear()  # torch._dynamo.reset() keeps them: this case's graph breaks and frames only
    fn()  # warm-up (compilation, autotuning, CUDA-graph recording)
    fn()
    torch.cuda.synchronize()
    result = {}
    if turns is not None:
        turns.take(result)
    phases = getattr(fn, "phases", None)  # host time of each phase of the synced steps: which one the GPU waits for
    if phases is not None:
        phases.clear()
    synced = []  # a sync around each step, as bench/e2e.py times it: host work before the first kernel shows too
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - start)
    if phases is not None:
        result["phases_us"] = {name: sorted(times)[len(times) // 2] * 1e6 for name, times in phases.items()}
    # back to back after the synced steps, as bench/e2e.py orders them: timed first, right after the warm-up, three
    # graphed 42-layer LoRA steps read 930 ms each on an H100, and the synced ones after them 119 ms (2026-12-07)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    busy_us, launches, rows = _kernel_table(prof, steps, top)
    result.update(wall_us=wall_us, wall_synced_us=sorted(synced)[steps // 2] * 1e6,
                  synced_steps_us=[round(t * 1e6) for t in synced], gpu_busy_us=busy_us,
                  launches=launches, top=rows, syncs=_syncs(fn), dynamo=_dynamo_counters())
    if op_top:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            fn()
            torch.cuda.synchronize()
        result["op_top"] = _op_table(prof, op_top)
    if host_top:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        fn()
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, _)
        own = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:host_top]
        result["host_top"] = [(f"{name} {file.rsplit('/', 2)[-1]}:{line}", calls, own_s * 1e6, cum_s * 1e6)
                              for (file, line, name), (calls, _, own_s, cum_s, _) in own]  # fmt: skip
    return result


def decode_case(model, batch: int, new_tokens: int):
    from transformers import GenerationConfig

    prompt = torch.randint(3, model.config.vocab_size, (batch, 16), device="cuda")
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=0, eos_token_id=1)

    def step():
        with torch.no_grad():
            model.generate(prompt, generation_config=config)

    return step


def graph_decode_case(model, batch: int, new_tokens: int, top: int) -> dict:
    from g4ops.engine.decoder import GreedyDecoder

    prompt = torch.randint(3, model.config.vocab_size, (batch, 16), device="cuda")
    decoder = GreedyDecoder(model, batch_size=batch, max_length=16 + new_tokens, compile=True)
    decoder.generate(prompt, new_tokens)  # compile + capture + one full run
    torch.cuda.synchronize()
    start = time.perf_counter()
    decoder.generate(prompt, new_tokens)
    torch.cuda.synchronize()
    replay_us = (time.perf_counter() - start) * 1e6 / new_tokens
    decoder.prefill(prompt)
    steps = min(16, new_tokens - 1)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.run_step()
        torch.cuda.synchronize()
    busy_us, launches, rows = _kernel_table(prof, steps, top)
    return dict(wall_us=replay_us, gpu_busy_us=busy_us, launches=launches, top=rows)


def train_case(model, batch: dict, compiled: bool, compile_mode: str = "default"):
    """One training step; `step.phases` collects each phase's host time (forward call, backward call, zero_grad; the
    GPU runs on meanwhile). In a synced step the GPU idles until the forward's first kernel, so a forward call whose
    host time is far above its replay's launch cost names the work that synced steps pay and back-to-back hide."""
    fwd = torch.compile(model, mode=compile_mode) if compiled else model
    graphed = compiled and compile_mode == "reduce-overhead"
    phases: dict[str, list] = {}

    def step():
        t0 = time.perf_counter()
        if graphed:  # a new iteration for Inductor's CUDA graph trees (bench/e2e.py does the same)
            torch.compiler.cudagraph_mark_step_begin()
        loss = fwd(**batch).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for name, seconds in (("forward call", t1 - t0), ("backward call", t2 - t1), ("zero_grad", t3 - t2)):
            phases.setdefault(name, []).append(seconds)

    step.phases = phases
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--parts", default="decode,train")
    parser.add_argument("--tokens", default="2048", help="training lengths, comma separated")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per profiled generate() call")
    parser.add_argument("--batches", default="1", help="graph: decode batch sizes, comma separated")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--variants", default="stock,g4ops")
    parser.add_argument("--train-modes", default="eager,compiled", help="train: eager, compiled or both")
    parser.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead"],
                        help="train, compiled: torch.compile mode (reduce-overhead: the step replays CUDA graphs)")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train: peft LoRA of rank R on every projection (bench/e2e.py's setup), both variants")
    parser.add_argument("--attention", action="store_true", help="g4ops variant: enable(model, attention=True)")
    parser.add_argument("--lora-attention", choices=["g4ops", "peft"], default="g4ops",
                        help="with --lora, g4ops variant: attention projections on g4ops.lora_linear or peft's forward")
    add_sliding_arg(parser)
    parser.add_argument("--layout", choices=["single", "padded", "packed"], default="single",
                        help="train: bench/e2e.py's batch layouts (padded, packed: 4 sequences in --tokens)")
    parser.add_argument("--host-top", type=int, default=0, metavar="N",
                        help="train: also the N Python functions with the most own time in one step (cProfile)")
    parser.add_argument("--op-top", type=int, default=0, metavar="N",
                        help="train: also the N ATen ops with the most GPU time in one step, by input shape "
                             "(no ops under --compile-mode reduce-overhead: graph replays run no ATen ops)")
    add_timing_turns_args(parser)
    parser.add_argument("--json")
    args = parser.parse_args()
    check_sliding_arg(parser, args.sliding)
    turns = timing_turns(args)
    parts = set(args.parts.split(","))
    results = {}
    for variant in args.variants.split(","):
        model = build_model("e4b", num_layers=args.layers, dtype=torch.bfloat16, device="cuda")
        patches = None
        if variant == "g4ops":
            patches = g4ops.enable(model, attention=True) if args.attention else g4ops.enable()
            use_sliding(args.sliding, args.flex_options)
        if "decode" in parts:
            torch._dynamo.reset()
            r = _profile(decode_case(model, 1, args.new_tokens), steps=2, top=args.top)
            for k in ("wall_us", "wall_synced_us", "gpu_busy_us", "launches"):
                r[k] /= args.new_tokens  # per generated token
            results[f"{variant} decode b1 (per token)"] = r
        if "graph" in parts:
            for batch in map(int, args.batches.split(",")):
                torch._dynamo.reset()
                results[f"{variant} graph decoder b{batch} (per token)"] = graph_decode_case(
                    model, batch, args.new_tokens, args.top)
        if "train" in parts:
            trained = model
            if args.lora:
                trained = lora_model(model, args.lora)
                if variant == "g4ops" and args.lora_attention == "g4ops":
                    g4ops.enable(trained)  # after peft: routes the attention projections to g4ops.lora_linear
            trained.train()
            lora = f" lora r{args.lora}" if args.lora else ""
            batch_args = argparse.Namespace(layout=args.layout, model=None, shape="e4b", seed=0, device="cuda")
            for tokens in map(int, args.tokens.split(",")):
                batch, _ = train_batch(batch_args, tokens)
                for mode in args.train_modes.split(","):
                    torch._dynamo.reset()
                    r = _profile(train_case(trained, batch, mode == "compiled", args.compile_mode), steps=3,
                                 top=args.top, host_top=args.host_top, op_top=args.op_top, turns=turns)
                    results[f"{variant}{lora} train {tokens} {args.layout} {mode}"] = r
            trained.eval()
            del trained
        del model
        torch.cuda.empty_cache()
        if patches is not None:
            patches.__exit__(None, None, None)
    for name, r in results.items():
        synced = f" ({r['wall_synced_us']:.0f} synced)" if "wall_synced_us" in r else ""
        print(f"\n== {name}: wall {r['wall_us']:.0f} us{synced}, GPU busy {r['gpu_busy_us']:.0f} us, "
              f"{r['launches']:.0f} kernel launches, {len(r['syncs'])} host syncs in a step, "
              f"{sum(r['dynamo']['graph_breaks'].values())} graph breaks, frames {r['dynamo']['frames']}")
        if "phases_us" in r:
            print("   host time of a synced step's phases: "
                  + ", ".join(f"{name} {us:.0f} us" for name, us in r["phases_us"].items()))
        for message in sorted(set(r["syncs"]))[:5]:
            print(f"   sync: {message}")
        for key, count, us in r["top"]:
            print(f"   {us:9.1f} us  x{count:6.1f}  {key}")
        for key, calls, own_us, cum_us in r.get("host_top", []):
            print(f"   host {own_us:9.0f} us own {cum_us:9.0f} us cum  x{calls:5d}  {key}")
        for key, shapes, count, us in r.get("op_top", []):
            print(f"   op {us:9.1f} us  x{count:4d}  {key} {shapes}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(layers=args.layers, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
