"""Compile driver for Inferentia2 / Trainium: torch-neuronx + neuronx-distributed (NxD) ModelBuilder.

One ModelBuilder holds every bucket (each prefill size and decode) of one resident model: the buckets share the
sharded weights, and the KV buffers are NxD *states* (module parameters declared in `input_output_aliases`, each
aliased to the forward output that carries its new value), so the cache is allocated once on each NeuronCore,
zero-filled there, updated in place by every bucket and never copied to the host. (NxD keeps one buffer per state
name, and every bucket's module names its KV parameters `k_cache_{i}` / `v_cache_{i}`: that is what makes prefill
and decode share the cache, as NxDI's context-encoding and token-generation models do.)

    weights   per rank, cut by loader.shard_state_dict and handed to `nxd_model.initialize` (no NxD sharding
              metadata needed: our layers already hold shards). Persistent buffers (layer_scalar, vocab_start)
              are promoted to parameters before tracing so they are weights too, not constants baked from
              rank 0's module (the seed's layer_scalar bug, in its ModelBuilder form).
    compiler  --auto-cast=none (keep our fp32 softmax / norms / logits), transformer model type, -O1.
    artifact  model.pt (torch.jit, every bucket's NEFF), weights/tp{r}.safetensors, ple.safetensors (host PLE
              table), config.json; `load_compiled` puts it back on the NeuronCores.

Requires an inf2 / trn1 instance with the Neuron driver, torch-neuronx and neuronx-distributed installed (they come
from AWS's own pip index, built for torch 2.9 only). Without them every entry point raises NeuronUnavailable.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import nn

from .collectives import XlaCollectives
from .config import BuildSettings, TextConfig
from .export import bucket_sizes, example_inputs
from .loader import shard_state_dict
from .model import NeuronGemma4ForCausalLM, PLETokenEmbedding

COMPILER_ARGS = "--auto-cast=none --model-type=transformer --enable-saturate-infinity -O1"

INSTALL_HINT = (
    "neuron_backend needs torch-neuronx and neuronx-distributed to compile or run on Inferentia2/Trainium. "
    "They are not on PyPI: on an inf2/trn1 instance with the Neuron driver (a Neuron DLAMI has both), install "
    "them from AWS's Neuron pip repository into a Python with torch 2.9, e.g. "
    "`pip install torch-neuronx neuronx-distributed neuronx-cc --extra-index-url <Neuron pip repository URL "
    "from the Neuron SDK setup guide>`. Everything else in neuron_backend runs on CPU without them "
    "(`python -m neuron_backend check --tp 2`)."
)


class NeuronUnavailable(RuntimeError):
    pass


def require_neuron():
    """-> (torch_neuronx, neuronx_distributed), or NeuronUnavailable saying what to install."""
    try:
        import neuronx_distributed
        import torch_neuronx
    except ImportError as e:
        raise NeuronUnavailable(f"{INSTALL_HINT} (import failed: {e})") from e
    return torch_neuronx, neuronx_distributed


def promote_persistent_buffers(module: nn.Module) -> list[str]:
    """Turn every persistent buffer into a frozen parameter (same state-dict key); -> the promoted names."""
    promoted = []
    for prefix, mod in module.named_modules():
        for name in list(mod._buffers):
            if name in mod._non_persistent_buffers_set or mod._buffers[name] is None:
                continue
            t = mod._buffers.pop(name)
            mod.register_parameter(name, nn.Parameter(t, requires_grad=False))
            promoted.append(f"{prefix}.{name}" if prefix else name)
    return promoted


def neuron_module(cfg: TextConfig, settings: BuildSettings, comm) -> NeuronGemma4ForCausalLM:
    """The module NxD traces: KV as aliased-output parameters, persistent buffers promoted to weights."""
    model = NeuronGemma4ForCausalLM(cfg, settings, comm, kv_mode="aliased_outputs").eval()
    promote_persistent_buffers(model)
    return model


def rank_weights(hf_sd, cfg: TextConfig, settings: BuildSettings, rank: int) -> tuple[dict, dict]:
    """(device weights of `rank` without the KV states, host PLE weights)."""
    rank_sd, host_sd, _ = shard_state_dict(hf_sd, cfg, settings, rank)
    return {k: v.contiguous() for k, v in rank_sd.items()}, host_sd


def compile_model(
    hf_sd: dict[str, torch.Tensor],
    cfg: TextConfig,
    settings: BuildSettings,
    out_dir: str | os.PathLike,
    compiler_workdir: str | os.PathLike | None = None,
    compiler_args: str = COMPILER_ARGS,
) -> Path:
    """Trace every bucket for every rank with ModelBuilder, compile, and save the artifact to out_dir."""
    require_neuron()
    from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    from safetensors.torch import save_file

    out = Path(out_dir)
    (out / "weights").mkdir(parents=True, exist_ok=True)
    # Cut the shards first: a bad checkpoint fails here, before minutes of compilation.
    shards = [rank_weights(hf_sd, cfg, settings, r) for r in range(settings.tp)]

    class BucketInstance(BaseModelInstance):
        def __init__(self):
            super().__init__(module_cls=None, input_output_aliases={})

        def load_module(self):  # runs inside ModelBuilder's (mocked) NxD parallel state
            self.module = neuron_module(cfg, settings, XlaCollectives.from_neuronx_distributed())

        def get(self, bucket_rank, **kwargs):
            return self.module, self.module.io_aliases()

    with torch.device("meta"):  # shapes and names only: no E4B-sized allocation
        probe = NeuronGemma4ForCausalLM(cfg, settings, _ShapeOnly(settings.tp), kv_mode="aliased_outputs")
    builder = ModelBuilder(
        router=None,
        tp_degree=settings.tp,
        checkpoint_loader=lambda: {},  # weights come pre-sharded, see load_compiled
        compiler_workdir=str(compiler_workdir or out / "compiler_workdir"),
    )
    for name, tokens in bucket_sizes(probe).items():
        builder.add(
            key=name,
            model_instance=BucketInstance(),
            example_inputs=[example_inputs(probe, tokens)],
            compiler_args=compiler_args,
        )
    traced = builder.trace(initialize_model_weights=False)
    torch.jit.save(traced, str(out / "model.pt"))

    kv = set(probe.kv_names)
    for r, (dev_sd, host_sd) in enumerate(shards):
        save_file({k: v for k, v in dev_sd.items() if k not in kv}, str(out / "weights" / f"tp{r}.safetensors"))
    if shards[0][1]:
        save_file(shards[0][1], str(out / "ple.safetensors"))
    settings_json = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    settings_json["dtype"] = str(settings.dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps({"text_config": json.loads(cfg.to_json()), "settings": settings_json}))
    return out


class _ShapeOnly:
    """Collectives stand-in for building a shape probe outside any process group (never called)."""

    def __init__(self, world_size):
        self.world_size, self.rank = world_size, 0


def load_artifact_config(artifact_dir) -> tuple[TextConfig, BuildSettings]:
    meta = json.loads((Path(artifact_dir) / "config.json").read_text())
    cfg = TextConfig.from_json(json.dumps(meta["text_config"]))
    s = dict(meta["settings"])
    s["dtype"] = getattr(torch, s["dtype"])
    s["prefill_buckets"] = tuple(s["prefill_buckets"])
    return cfg, BuildSettings(**s)


class CompiledModel:
    """A loaded artifact: `step` runs one bucket on the NeuronCores (KV stays there), `ple` is the host lookup.

    A new sequence needs no cache reset: it starts again at position 0, and slots holding older positions are
    masked out until they are overwritten (see model._KVPlan).
    """

    def __init__(self, artifact_dir):
        require_neuron()
        from safetensors.torch import load_file

        d = Path(artifact_dir)
        self.cfg, self.settings = load_artifact_config(d)
        self.traced = torch.jit.load(str(d / "model.pt"))
        weights = [load_file(str(d / "weights" / f"tp{r}.safetensors")) for r in range(self.settings.tp)]
        try:
            self.traced.nxd_model.initialize(weights, torch.tensor([0], dtype=torch.int32))
        except RuntimeError:  # NxD releases before start_rank_id took the rank tensor
            self.traced.nxd_model.initialize(weights)
        self.ple = None
        if self.cfg.ple_dim:
            self.ple = PLETokenEmbedding(self.cfg, self.settings.dtype)
            self.ple.load_state_dict(load_file(str(d / "ple.safetensors")), strict=True)

    def step(self, ids, start, valid, ple_tokens, *sampling):
        """One bucket; `sampling`: the sampling inputs (sampling.SAMPLING_INPUTS) of a sample_cap > 0 artifact."""
        args = (ids, start, valid) + ((ple_tokens,) if ple_tokens is not None else ()) + tuple(sampling)
        out = self.traced(*args)
        return out[0] if isinstance(out, (list, tuple)) and not self.settings.return_logits else out
