"""Tensor parallelism on CPU: one process per rank over gloo (torch.multiprocessing spawn, free port).

Each rank builds its own shard from the full HF state dict with the same loader the Neuron path uses, runs the
same greedy loop, and reports its tokens (identical on every rank: the argmax is distributed) and, when asked,
the gathered fp32 logits.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .collectives import GlooCollectives
from .config import BuildSettings, TextConfig
from .generate import greedy_generate, module_step
from .loader import build_rank_model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, hf_sd, cfg, settings, prompt, max_new, queue):
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        comm = GlooCollectives()
        model, ple, report = build_rank_model(hf_sd, cfg, settings, rank=rank, comm=comm)
        res = greedy_generate(module_step(model), prompt, max_new, settings, ple, cfg.pad_token_id)
        logits = torch.stack(res.logits, dim=1) if res.logits is not None else None
        # numpy pickles by value: torch tensors would travel as shared-memory handles that die with this process
        logits = logits.numpy() if logits is not None else None
        queue.put((rank, res.tokens.numpy(), logits, model.kv_names, len(report.consumed)))
    except BaseException as e:  # report instead of hanging the parent
        queue.put((rank, e, None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def run_tp_generate(
    hf_sd: dict[str, torch.Tensor],
    cfg: TextConfig,
    settings: BuildSettings,
    prompt: torch.Tensor,
    max_new_tokens: int,
) -> list[dict]:
    """Greedy-generate with settings.tp CPU ranks; -> per rank {tokens, logits, kv_names, consumed_keys}."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    hf_sd = {k: v.detach().contiguous() for k, v in hf_sd.items()}
    procs = mp.start_processes(
        _worker,
        args=(settings.tp, port, hf_sd, cfg, settings, prompt, max_new_tokens, queue),
        nprocs=settings.tp,
        join=False,
        start_method="spawn",
    )
    # Drain the queue while the ranks run: a result larger than the pipe buffer blocks its sender until read.
    results = [None] * settings.tp
    done = False
    while not done or not queue.empty():
        if queue.empty():
            done = procs.join(timeout=0.05)  # raises if a rank failed
            continue
        rank, tokens, logits, kv_names, consumed = queue.get()
        if isinstance(tokens, BaseException):
            raise RuntimeError(f"TP rank {rank} failed") from tokens
        logits = torch.from_numpy(logits) if logits is not None else None
        results[rank] = dict(tokens=torch.from_numpy(tokens), logits=logits, kv_names=kv_names, consumed_keys=consumed)
    if any(r is None for r in results):
        raise RuntimeError("a TP rank exited without a result")
    return results
