"""Multi-GPU finetuning on PyTorch's own FSDP2 (`fully_shard`): stock vs `g4ops.enable()`, eager and compiled.

    torchrun --nproc-per-node 2 bench/fsdp2.py --json $OUT/fsdp2.json                 # E4B-shaped, NCCL, 2 GPUs
    torchrun --nproc-per-node 2 bench/fsdp2.py --layers 12 --modes eager              # quicker
    python bench/fsdp2.py --device cpu --backend gloo --shape tiny-e4b                 # CPU smoke (spawns 2 procs)

One process per GPU. Random bf16 weights of the chosen shape (same seed on every rank), every decoder layer and then
the root sharded with `fully_shard`; with `--modes compile` each decoder layer is `torch.compile`d before sharding
(the torchtitan pattern; FSDP2's hooks stay eager). Each rank trains on its own 1 x `--seq` tokens (labels = inputs)
with AdamW. Reported per variant: tok/s per GPU (median step), peak memory per GPU (max over ranks), the first
losses (all-reduced mean over ranks). Checked: the losses of the first `--check-steps` AdamW steps equal a
one-process run of stock transformers on the same global batch (the unsharded model, before sharding, trained on
rank 0) within `--loss-rtol` (bf16). Every rank holds the same number of counted labels, so the mean of the ranks'
mean losses is the one-process mean loss.

NCCL environment variables (NCCL_NVLS_ENABLE and others) are left as the machine sets them.
Launched without torchrun (no RANK in the environment), the script spawns `--nproc` processes itself.
"""

from __future__ import annotations


import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import time
import traceback

import torch
import torch.distributed as dist

import g4ops
from g4ops.models import build_model, text_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="nccl on CUDA, gloo on CPU (default)")
    ap.add_argument("--shape", default="e4b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--seq", type=int, default=4096, help="tokens per GPU (batch 1)")
    ap.add_argument("--variants", default="stock,g4ops")
    ap.add_argument("--modes", default=None, help="eager,compile (default both on CUDA, eager on CPU)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--loss-rtol", type=float, default=1e-2, help="bf16 tolerance on each checked step's loss")
    ap.add_argument("--check-steps", type=int, default=3, help="steps whose loss is checked against one process")
    ap.add_argument("--nproc", type=int, default=None, help="processes to spawn when not under torchrun")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu and args.seq == 4096 and args.shape.startswith("tiny"):
        args.seq = 64
    args.backend = args.backend or ("gloo" if cpu else "nccl")
    args.modes = [m for m in (args.modes or ("eager" if cpu else "eager,compile")).split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    if args.nproc is None:
        args.nproc = 2 if cpu else max(torch.cuda.device_count(), 1)
    if cpu:
        args.warmup_steps, args.steps = min(args.warmup_steps, 1), min(args.steps, 2)
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def g4ops_on(enabled):
    if enabled:
        g4ops.enable()
    try:
        yield
    finally:
        if enabled:
            g4ops.disable()
        torch._dynamo.reset()


def global_batch(args, world):
    gen = torch.Generator().manual_seed(args.seed + 1234)
    vocab = text_config(args.shape).vocab_size
    return torch.randint(3, vocab, (world, args.seq), generator=gen)


def build(args, device):
    torch.manual_seed(args.seed)
    return build_model(args.shape, num_layers=args.layers, dtype=DTYPES[args.dtype], device=device, seed=args.seed)


def reference_losses(args, device, ids):
    """One process, stock transformers, the unsharded model, the whole global batch, `--check-steps` AdamW steps:
    the loss of each step. Sequences go through one at a time (the stock logits of only one exist at once), each
    loss divided by the number of sequences, so the accumulated gradient is the mean that FSDP2's reduce-scatter
    forms; equal label counts make the mean of the sequence means the batch mean."""
    model = build(args, device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for _ in range(args.check_steps):
        total = torch.zeros((), device=device)
        for row in ids:
            loss = model(input_ids=row[None].to(device), labels=row[None].to(device)).loss.float() / len(ids)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    del model, opt
    return torch.stack(losses)


def run_variant(args, rank, world, device, variant, mode, my_ids, ref):
    from torch.distributed.fsdp import fully_shard

    row = dict(variant=variant, mode=mode, world=world, seq=args.seq)
    try:
        with g4ops_on(variant == "g4ops"):
            model = build(args, device).train()
            if mode == "compile":
                # Each layer compiles its own graphs (they differ in layer_idx, type and KV sharing): dynamo's
                # default recompile limit of 8 left part of 42 layers eager in the 2026-11-29 runs.
                limit = torch._dynamo.config.recompile_limit
                torch._dynamo.config.recompile_limit = max(limit, 2 * len(model.model.layers))
            for layer in model.model.layers:
                if mode == "compile":
                    layer.compile()
                fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

            def step():
                loss = model(input_ids=my_ids, labels=my_ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach().float()

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            losses = []
            t = time.perf_counter()
            losses.append(step())
            sync(device)
            row["first_step_s"] = time.perf_counter() - t
            for _ in range(args.warmup_steps - 1):
                losses.append(step())
            times = []
            for _ in range(args.steps):
                sync(device)
                t = time.perf_counter()
                losses.append(step())
                sync(device)
                times.append(time.perf_counter() - t)
            loss_t = torch.stack(losses).to(device)
            dist.all_reduce(loss_t)
            loss_t /= world
            step_s = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            peak = torch.tensor(
                [torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0],
                dtype=torch.float64, device=device,
            )
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            row.update(
                losses=[float(x) for x in loss_t], step_s=float(step_s), tok_s_per_gpu=args.seq / float(step_s),
                peak_gib_per_gpu=float(peak) if device.type == "cuda" else None,
            )
            checked = ref.tolist()[: len(row["losses"])]
            row["first_loss_vs_1proc"] = row["losses"][0] - checked[0]
            row["max_rel_loss_diff_vs_1proc"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], checked))
            row["losses_ok"] = row["max_rel_loss_diff_vs_1proc"] <= args.loss_rtol
            del model, opt
    except Exception as exc:  # noqa: BLE001 - report and go on
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        row["error"] = "OOM" if oom else f"{type(exc).__name__}: {exc}"
        if not oom:
            traceback.print_exc()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return row


def run(rank, world, args, port=None):
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if args.device == "cpu":
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    try:
        ids = global_batch(args, world)
        ref = torch.zeros(args.check_steps, device=device)
        if rank == 0:
            ref = reference_losses(args, device, ids).to(device)
        dist.broadcast(ref, 0)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        my_ids = ids[rank:rank + 1].to(device)
        rows = []
        for mode in args.modes:
            for variant in args.variants:
                row = run_variant(args, rank, world, device, variant, mode, my_ids, ref)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
        if rank == 0:
            by = {(r["variant"], r["mode"]): r for r in rows}
            for (variant, mode), r in by.items():
                base = by.get(("stock", mode))
                if variant != "stock" and base and "tok_s_per_gpu" in r and "tok_s_per_gpu" in base:
                    r["speedup_vs_stock"] = r["tok_s_per_gpu"] / base["tok_s_per_gpu"]
            result = dict(
                meta=dict(
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), torch=torch.__version__,
                    world=world, backend=args.backend, device=str(device),
                    gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
                    args={k: v for k, v in vars(args).items()},
                ),
                reference_losses_1proc=ref.tolist(),
                rows=rows,
            )
            print_table(result)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1, default=str)
    finally:
        dist.destroy_process_group()


def print_table(result):
    ref = ", ".join(f"{x:.5f}" for x in result["reference_losses_1proc"])
    print(f"\n== FSDP2, {result['meta']['world']} x {result['meta']['device'].split(':')[0]}, 1-process reference "
          f"losses of the first steps: {ref} ==")
    print(f"{'variant':<8}{'mode':<9}{'tok/s/GPU':>11}{'x stock':>9}{'peak GiB/GPU':>14}{'first loss':>12}  losses ok")
    for r in result["rows"]:
        tok = r.get("tok_s_per_gpu")
        peak = r.get("peak_gib_per_gpu")
        sp = r.get("speedup_vs_stock")
        first = r["losses"][0] if r.get("losses") else None
        print(f"{r['variant']:<8}{r['mode']:<9}{(f'{tok:.1f}' if tok else '-'):>11}{(f'{sp:.3f}' if sp else '-'):>9}"
              f"{(f'{peak:.2f}' if peak else '-'):>14}{(f'{first:.5f}' if first is not None else '-'):>12}  "
              f"{r.get('losses_ok', '-')} {r.get('error', '')}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run, args=(args.nproc, args, _free_port()), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
