"""torch.export of each bucket: the hygiene the Neuron trace relies on, checkable without the Neuron SDK.

For every bucket (each prefill size and decode at T = 1) the model must export as one graph, and after
`run_decompositions()` the buffers the graph mutates must be exactly the KV buffers: no other state changes, and
every KV buffer is written (so each can be declared an aliased input/output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import NeuronGemma4ForCausalLM


def example_inputs(model: NeuronGemma4ForCausalLM, tokens: int) -> tuple:
    """(input_ids, start_pos, n_valid[, ple_tokens][, *sampling inputs]) for a chunk of `tokens` rows (all valid;
    ple_tokens None without PLE when sampling inputs follow)."""
    cfg, s = model.cfg, model.settings
    b = s.batch
    args = (
        torch.zeros(b, tokens, dtype=torch.int64),
        torch.zeros(b, dtype=torch.int64),
        torch.full((b,), tokens, dtype=torch.int64),
    )
    if cfg.ple_dim or s.sample_cap:
        args += (torch.zeros(b, tokens, cfg.num_layers, cfg.ple_dim, dtype=s.dtype) if cfg.ple_dim else None,)
    if s.sample_cap:  # sampling.SAMPLING_INPUTS: temperature, top_k, top_p, min_p, seed, counter
        args += (torch.ones(b), torch.full((b,), s.sample_cap, dtype=torch.int64), torch.ones(b), torch.zeros(b),
                 torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64))  # fmt: skip
    return args


def bucket_sizes(model: NeuronGemma4ForCausalLM) -> dict[str, int]:
    sizes = {f"prefill_{t}": t for t in sorted(model.settings.prefill_buckets)}
    sizes["decode"] = 1
    return sizes


@dataclass
class BucketExport:
    name: str
    tokens: int
    program: torch.export.ExportedProgram
    mutated_buffers: list[str]
    graph_breaks: int | None


def count_graph_breaks(model, args) -> int:
    import torch._dynamo

    torch._dynamo.reset()
    return torch._dynamo.explain(model)(*args).graph_break_count


def export_buckets(model: NeuronGemma4ForCausalLM, check_graph_breaks: bool = True) -> list[BucketExport]:
    if model.kv_mode != "buffers":
        raise ValueError("export_buckets wants kv_mode='buffers' (the in-place KV write is what it checks)")
    out = []
    for name, t in bucket_sizes(model).items():
        args = example_inputs(model, t)
        breaks = count_graph_breaks(model, args) if check_graph_breaks else None
        ep = torch.export.export(model, args, strict=False).run_decompositions()
        mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
        out.append(BucketExport(name, t, ep, mutated, breaks))
    return out
