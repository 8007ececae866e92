"""Greedy generation over the static buckets, for any backend that runs one bucket per call.

`step(input_ids [B, T], start_pos [B], n_valid [B], ple_tokens [B, T, L, P] | None)` returns the next token [B]
(or (token, logits)). It is the CPU module, a TP rank over gloo, or the compiled Neuron model: the KV cache lives
inside it (device buffers), so only token ids and the host-side PLE rows cross the host boundary per step.

Prefill: the prompt is cut into chunks of the largest bucket, the last chunk is padded up to the smallest bucket
that holds it. Decode: one token per call at T = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import BuildSettings


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, max_new_tokens] int64
    logits: list[torch.Tensor] | None  # per generated token [B, V] fp32, when the step returns them
    prefill_calls: list[tuple[int, int]]  # (bucket, valid rows) of each prefill call


def _split(out):
    if isinstance(out, (tuple, list)):
        return out[0], (out[1] if len(out) > 1 else None)
    return out, None


def greedy_generate(
    step: Callable,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    settings: BuildSettings,
    ple: Callable | None = None,
    pad_token_id: int = 0,
) -> GenerationResult:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != settings.batch:
        raise ValueError(f"prompt_ids must be [batch={settings.batch}, N], got {list(prompt_ids.shape)}")
    b, n = prompt_ids.shape
    total = n + max_new_tokens - 1  # the last generated token is never written to the cache
    if n < 1 or total > settings.max_seq:
        raise ValueError(f"prompt {n} + {max_new_tokens} new tokens needs {total} KV slots; max_seq is "
                         f"{settings.max_seq} (rebuild with a larger max_seq)")  # fmt: skip

    def call(ids, start, valid):
        s = torch.full((b,), start, dtype=torch.int64)
        v = torch.full((b,), valid, dtype=torch.int64)
        with torch.no_grad():
            return _split(step(ids, s, v, ple(ids) if ple is not None else None))

    calls, pos, out = [], 0, None
    while pos < n:
        valid = min(n - pos, max(settings.prefill_buckets))
        bucket = settings.bucket_for(valid)
        chunk = torch.full((b, bucket), pad_token_id, dtype=torch.int64)
        chunk[:, :valid] = prompt_ids[:, pos : pos + valid]
        out = call(chunk, pos, valid)
        calls.append((bucket, valid))
        pos += valid

    tokens, logits = [out[0]], ([out[1]] if out[1] is not None else None)
    for _ in range(max_new_tokens - 1):
        out = call(tokens[-1][:, None], pos, 1)
        pos += 1
        tokens.append(out[0])
        if logits is not None:
            logits.append(out[1])
    return GenerationResult(torch.stack(tokens, dim=1), logits, calls)


def module_step(model) -> Callable:
    """The step function of an in-process NeuronGemma4ForCausalLM (kv_mode="buffers")."""

    def step(ids, start, valid, ple_tokens):
        return model(ids, start, valid, ple_tokens)

    return step


def aliased_step(model) -> Callable:
    """The step function of a kv_mode="aliased_outputs" module (the form NxD traces), run in process: the KV outputs
    are written back into the KV parameters, as the Neuron runtime does with aliased outputs."""
    n_kv = len(model.kv_names)

    def step(ids, start, valid, ple_tokens):
        out = model(ids, start, valid, ple_tokens)
        with torch.no_grad():
            for state, new in zip(model.kv_tensors(), out[len(out) - n_kv :]):
                state.copy_(new)
        kept = out[: len(out) - n_kv]
        return kept[0] if len(kept) == 1 else kept

    return step
