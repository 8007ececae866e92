"""Host time a compiled training step pays before its first kernel: Dynamo's guard check, timed directly.

Every call of a `torch.compile`d model first evaluates the guards of its cached graph (are the modules, their
attributes and the inputs still what was traced?). A synced step exposes that time; back-to-back steps hide it under
the previous step's kernels. This script compiles one forward + backward of an E4B-shaped or tiny model per variant
(stock; g4ops with `enable(model, attention=True)`), then calls the cached graph's guard manager on the forward's own
arguments many times: no profiler in the loop, whose per-event cost inflates the number (torch.profiler's
"TorchDynamo Cache Lookup" read 9.0 ms for a 42-layer LoRA step whose check this timing put at 2.3-3.1 ms, CPU,
2026-12-05).
It also counts the guards by type, and the "not hasattr" guards on modules (each runs nn.Module.__getattr__ and
raises on every check).

    python bench/guard_time.py --layers 42 --lora 16 --backend eager --json guards.json   # CPU, ~3 min
    python bench/guard_time.py --device cuda --shape e4b --layers 42 --lora 16                  # the H200's host

Each variant runs in its own process (`_in_own_process` says why). Times are the minimum over `--repeats` rounds of
`--calls` checks (the least disturbed round: on a shared 2-core machine medians drift).

`--backend memo` times the whole of that host work, not the guards alone: its compiled graphs run once and then
return their first outputs, so a forward call costs only what surrounds the graph (the guards, the compiled frame
gathering the graph's inputs, AOTAutograd's runtime wrappers). `before_graph_ms` is the part before the graph is
entered: under `reduce-overhead` the GPU idles through it, plus the CUDA-graph tree's own checks, in a synced step.

    python bench/guard_time.py --layers 42 --lora 16 --backend memo --json host.json   # LoRA against ...
    python bench/guard_time.py --layers 42 --lora 0 --backend memo                      # ... the full finetune

These backends are not Inductor with CUDA graphs, so g4ops' LoRA traces its math into the graph (the default-mode
path); `--graphed 1` makes it take the path of the graphed headline step (the ops, with split products), whose
guards differ: fewer (2 layers, r=16, CPU, torch 2.13, 2026-12-07: stock 2674 guards; g4ops 3376 with the math
traced, 2881 with the ops).
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import g4ops
from g4ops.models import build_model

SETUP = ("shape", "layers", "lora", "seq", "dtype", "device", "backend", "graphed")


def _model(args, variant: str):
    model = build_model(args.shape, num_layers=args.layers, dtype=getattr(torch, args.dtype), device=args.device)
    model.train()
    if variant == "g4ops":
        g4ops.enable(model, attention=True)
    if args.lora:
        from e2e import lora_model  # bench/ is on sys.path when this script runs

        model = lora_model(model, args.lora)
        if variant == "g4ops":
            g4ops.enable(model)  # after peft: its attention projections' LoRA layers exist now
    return model


def _memo_backend(seen: dict):
    """The `--backend memo` compiler: AOTAutograd's forward and backward graphs that compute once and then return
    their first outputs, stamping `seen["entered"]` when a forward graph is entered and counting graph inputs."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def compiler(gm, example_inputs, forward: bool):
        seen["forward_graph_inputs" if forward else "backward_graph_inputs"] = len(example_inputs)
        first = []

        def run(args):
            if forward:
                seen["entered"] = time.perf_counter()
            if not first:
                first.append(gm(*args))
            args.clear()  # AOTAutograd's boxed calling convention: the callee frees its inputs
            return first[0]

        run._boxed_call = True
        return run

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, x: compiler(g, x, True),
                                     bw_compiler=lambda g, x: compiler(g, x, False))  # fmt: skip

    return backend


def _forward_call_times(args, compiled, batch, seen) -> dict:
    """Per forward call of the memo-compiled model: host time before its graph is entered and in all (ms), the
    minimum over rounds (as for the guards)."""
    before, whole = [], []
    for _ in range(args.calls):  # warm-up
        compiled(**batch)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.repeats):
            round_before = round_whole = 0.0
            for _ in range(args.calls):
                start = time.perf_counter()
                compiled(**batch)
                end = time.perf_counter()
                round_before += seen["entered"] - start
                round_whole += end - start
            before.append(round_before / args.calls * 1e3)
            whole.append(round_whole / args.calls * 1e3)
    finally:
        gc.enable()
    return dict(before_graph_ms=min(before), forward_call_ms=min(whole),
                forward_graph_inputs=seen["forward_graph_inputs"], backward_graph_inputs=seen["backward_graph_inputs"])


def _missing_text(missing: dict | None) -> str:
    if missing is None:
        return "not read (this torch's guard entries do not name the attribute)"
    return str(missing) if missing else "none"


def measure(args, variant: str) -> dict:
    if args.graphed:  # the LoRA ops' choice under a compile that replays CUDA graphs, whatever this backend is
        from g4ops.ops import lora

        lora._outer_compile_replays_graphs = lambda: True
    model = _model(args, variant)
    ids = torch.randint(3, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids.to(args.device), labels=ids.to(args.device))
    kinds, missing = collections.Counter(), collections.Counter()
    unread = []  # HASATTR guards whose module and attribute this torch's entries do not give

    def record(entries):
        for e in entries:
            kinds[e.guard_type] += 1
            if e.guard_type == "HASATTR":
                # torch 2.13's entry holds the module tested and binds the attribute's name into the guard's
                # builder (a partial); torch 2.11's holds the attribute's own value (none when it is missing)
                attr = (getattr(e.orig_guard.create_fn, "keywords", None) or {}).get("attr")
                if attr is None:
                    unread.append(e.name)
                elif e.has_value and isinstance(e.value, torch.nn.Module) and not hasattr(e.value, attr):
                    missing[f"{type(e.value).__name__}.{attr}"] += 1
        return [True] * len(entries)

    torch._dynamo.reset()
    seen = {}
    backend = _memo_backend(seen) if args.backend == "memo" else args.backend
    compiled = torch.compile(model, backend=backend, options={"guard_filter_fn": record})
    start = time.perf_counter()
    compiled(**batch).loss.backward()
    compile_s = time.perf_counter() - start

    # the frame torch.compile(model) caches: what `model.forward` calls (g4ops may patch it on the instance), and
    # its own code, which for a decorated forward is the decorator's wrapper (not the signature it wraps)
    forward = model.forward.__func__
    bound = inspect.signature(forward, follow_wrapped=False).bind(model, **batch)
    bound.apply_defaults()
    f_locals = dict(bound.arguments)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(forward.__code__)
    if len(entries) != 1:
        raise RuntimeError(f"{variant}: expected one compiled graph of {forward.__qualname__}, found {len(entries)}")
    guards = entries[0].guard_manager
    # a wrapper's frame also sees its closure (the function it wraps), and Dynamo guards on it
    f_locals.update(zip(forward.__code__.co_freevars, (cell.cell_contents for cell in forward.__closure__ or ())))
    if not guards.check(f_locals):
        reasons = guards.check_verbose(f_locals).verbose_code_parts
        raise RuntimeError(f"{variant}: the guards reject the step's own arguments (rebuilt wrongly?): {reasons}")
    for _ in range(args.calls):  # warm-up
        guards.check(f_locals)
    rounds = []
    gc.collect()
    gc.disable()  # a collection inside a round would be charged to whichever check it interrupted
    try:
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.calls):
                guards.check(f_locals)
            rounds.append((time.perf_counter() - start) / args.calls * 1e3)
    finally:
        gc.enable()
    row = dict(variant=variant, guard_check_ms=min(rounds), guard_check_median_ms=sorted(rounds)[len(rounds) // 2],
               guards=sum(kinds.values()), guard_types=dict(kinds.most_common()),
               missing_attribute_guards_on_modules=None if unread else dict(missing),  # None: not read here
               first_step_s=compile_s, parameters=sum(1 for _ in model.parameters()))  # fmt: skip
    if args.backend == "memo":
        row.update(_forward_call_times(args, compiled, batch, seen))
    return row


def _in_own_process(args, variant: str) -> dict:
    """`measure` for one variant in a fresh process: measured one after the other in one process, the second
    variant's check read up to 4x slower in some runs, whichever variant came second (CPU, 2026-12-05)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, __file__, "--variants", variant, "--row-out", out]
        for name in SETUP + ("calls", "repeats"):
            command += [f"--{name}", str(getattr(args, name))]
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny-e4b", help="g4ops.models shape (e4b, tiny-e4b, ...)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--lora", type=int, default=16, help="peft LoRA rank on every projection (0: full finetune)")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the same Dynamo guards, "
                    "no kernels compiled; memo: also the forward call's whole host time, graphs replaying their first "
                    "outputs)")  # fmt: skip
    ap.add_argument("--graphed", type=int, choices=[0, 1], default=0,
                    help="1: g4ops' LoRA takes the path of a compile that replays CUDA graphs (mode='reduce-overhead' "
                    "on CUDA: the ops with split products, not the traced math), as the graphed headline step does")
    ap.add_argument("--variants", default="stock,g4ops")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--row-out", help=argparse.SUPPRESS)  # internal: one variant's row, from its own process
    args = ap.parse_args()
    if args.row_out:
        with open(args.row_out, "w") as f:
            json.dump(measure(args, args.variants), f)
        return
    rows = []
    for variant in args.variants.split(","):
        row = _in_own_process(args, variant)
        rows.append(row)
        print(f"{variant}: guard check {row['guard_check_ms']:.3f} ms (median {row['guard_check_median_ms']:.3f}), "
              f"{row['guards']} guards, missing-attribute guards on modules: "
              f"{_missing_text(row['missing_attribute_guards_on_modules'])}", flush=True)  # fmt: skip
        if "forward_call_ms" in row:
            print(f"{variant}: forward call {row['forward_call_ms']:.3f} ms of host time, "
                  f"{row['before_graph_ms']:.3f} ms of it before the graph; graph inputs: "
                  f"{row['forward_graph_inputs']} forward, {row['backward_graph_inputs']} backward", flush=True)
    if args.json:
        setup = {k: getattr(args, k) for k in SETUP}
        meta = dict(setup, torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
        with open(args.json, "w") as f:
            json.dump({"setup": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
