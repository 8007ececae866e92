"""Tensor parallelism on CPU: one process per rank over gloo (torch.multiprocessing spawn, free port).

Each rank cuts its own shard from the full HF state dict with the same loader the Neuron path uses, runs the same
greedy loop, and reports its tokens (identical on every rank: the argmax is distributed) and, when asked, the
gathered fp32 logits. Two ways to build the module a rank runs (`builds`):

    "per_rank"  each rank builds its module knowing its rank (build_rank_model with rank=r, collectives that say r)
    "rank0"     every rank builds the module exactly as rank 0 does, in the form NxD traces (compile.neuron_module:
                KV as aliased-output parameters, persistent buffers promoted to weights) behind collectives whose
                `rank` reads 0 (and torch.distributed.get_rank() returns 0 while it runs), then loads its own shard.
                NxD traces one graph as rank 0 and runs it on every core with that core's weights; a rank-dependent
                Python value in the module is rank 0's on every core, and this build shows it on CPU.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .collectives import GlooCollectives, RankZeroView
from .config import BuildSettings, TextConfig
from .generate import aliased_step, greedy_generate, module_step
from .loader import build_rank_model

BUILDS = ("per_rank", "rank0")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank0_built(hf_sd, cfg, settings, rank):
    """(module, its step function, host PLE module): the rank-0-built module holding `rank`'s shard."""
    from .compile import neuron_module, rank_weights
    from .model import PLETokenEmbedding

    model = neuron_module(cfg, settings, RankZeroView(GlooCollectives()))
    weights, host = rank_weights(hf_sd, cfg, settings, rank)
    weights.update({n: torch.zeros_like(t) for n, t in zip(model.kv_names, model.kv_tensors())})
    model.load_state_dict(weights, strict=True)
    ple = None
    if cfg.ple_dim:
        ple = PLETokenEmbedding(cfg, settings.dtype)
        ple.load_state_dict(host, strict=True)
    return model, aliased_step(model), ple


def _run(build, rank, hf_sd, cfg, settings, prompt, max_new):
    if build == "per_rank":
        model, ple, report = build_rank_model(hf_sd, cfg, settings, rank=rank, comm=GlooCollectives())
        res = greedy_generate(module_step(model), prompt, max_new, settings, ple, cfg.pad_token_id)
        return res, model.kv_names, len(report.consumed)
    model, step, ple = _rank0_built(hf_sd, cfg, settings, rank)
    real_get_rank = dist.get_rank
    dist.get_rank = lambda group=None: 0  # Python asking torch.distributed sees rank 0 too, as in the trace
    try:
        res = greedy_generate(step, prompt, max_new, settings, ple, cfg.pad_token_id)
    finally:
        dist.get_rank = real_get_rank
    return res, model.kv_names, None


def _worker(rank, world, port, hf_sd, cfg, settings, prompt, max_new, builds, setup, queue):
    torch.set_num_threads(1)  # ranks share the machine's cores
    if setup is not None:
        setup()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for build in builds:
            res, kv_names, consumed = _run(build, rank, hf_sd, cfg, settings, prompt, max_new)
            logits = torch.stack(res.logits, dim=1) if res.logits is not None else None
            # numpy pickles by value: torch tensors would travel as shared-memory handles that die with this process
            logits = logits.numpy() if logits is not None else None
            queue.put((build, rank, res.tokens.numpy(), logits, kv_names, consumed))
    except BaseException as e:  # report instead of hanging the parent
        queue.put((None, rank, e, None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def run_tp(
    hf_sd: dict[str, torch.Tensor],
    cfg: TextConfig,
    settings: BuildSettings,
    prompt: torch.Tensor,
    max_new_tokens: int,
    builds: tuple[str, ...] = ("per_rank",),
    setup: Callable[[], None] | None = None,
) -> dict[str, list[dict]]:
    """Greedy-generate with settings.tp CPU ranks, once per build (see the module docstring), in one set of processes.

    `setup` (a picklable, module-level function) runs first in every rank process: a test's way into the ranks.
    -> {build: per rank {tokens, logits, kv_names, consumed_keys}}.
    """
    if not builds or any(b not in BUILDS for b in builds):
        raise ValueError(f"builds must be a non-empty subset of {BUILDS}, got {builds}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    hf_sd = {k: v.detach().contiguous() for k, v in hf_sd.items()}
    procs = mp.start_processes(
        _worker,
        args=(settings.tp, port, hf_sd, cfg, settings, prompt, max_new_tokens, tuple(builds), setup, queue),
        nprocs=settings.tp,
        join=False,
        start_method="spawn",
    )
    # Drain the queue while the ranks run: a result larger than the pipe buffer blocks its sender until read.
    results = {b: [None] * settings.tp for b in builds}
    done = False
    while not done or not queue.empty():
        if queue.empty():
            done = procs.join(timeout=0.05)  # raises if a rank failed
            continue
        build, rank, tokens, logits, kv_names, consumed = queue.get()
        if isinstance(tokens, BaseException):
            raise RuntimeError(f"TP rank {rank} failed") from tokens
        logits = torch.from_numpy(logits) if logits is not None else None
        results[build][rank] = dict(
            tokens=torch.from_numpy(tokens), logits=logits, kv_names=kv_names, consumed_keys=consumed
        )
    if any(r is None for ranks in results.values() for r in ranks):
        raise RuntimeError("a TP rank exited without a result")
    return results


def run_tp_generate(
    hf_sd: dict[str, torch.Tensor],
    cfg: TextConfig,
    settings: BuildSettings,
    prompt: torch.Tensor,
    max_new_tokens: int,
) -> list[dict]:
    """Greedy-generate with settings.tp CPU ranks, each building its own module; -> per rank {tokens, logits,
    kv_names, consumed_keys}."""
    return run_tp(hf_sd, cfg, settings, prompt, max_new_tokens)["per_rank"]
