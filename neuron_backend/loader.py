"""Sharded loader: HF Gemma-4 state dict -> one rank's NeuronGemma4ForCausalLM state dict (+ the host PLE table).

Every key of the HF state dict is accounted for, persistent buffers such as `layer_scalar` included (the seed's
ModelBuilder loader moved parameters only, so every layer over-scaled ~16x). A key the mapping does not consume
is an error, and so is a key it needs but does not find; the result is then loaded with strict=True, which checks
the other direction (every parameter and persistent buffer of the rank module is filled).

The only keys consumed without use are the k/v projections and k_norm of KV-shared layers, which some checkpoints
carry and transformers itself ignores on load (`_keys_to_ignore_on_load_unexpected`); they are listed in the report.
Multimodal checkpoints: pass them through `text_state_dict` first, which strips `model.language_model.` and drops
the vision/audio towers by name. `load_hf_checkpoint` reads a checkpoint directory of either class
(Gemma4ForCausalLM, or Gemma4ForConditionalGeneration as google/gemma-4-E4B-it is) that way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import BuildSettings, TextConfig, divide, padded_vocab
from .model import kv_layout

_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


class StateDictError(ValueError):
    """The HF state dict does not match the config: missing keys, left-over keys, or wrong shapes."""


@dataclass
class LoadReport:
    consumed: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # KV-shared layers' unused k/v weights


def text_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Gemma4ForConditionalGeneration state dict -> the Gemma4ForCausalLM key layout (towers dropped by name)."""
    out = {}
    for k, v in sd.items():
        if k.startswith(_TOWER_PREFIXES):
            continue
        out[k.replace("model.language_model.", "model.", 1)] = v
    return out


def _prefix(sd) -> str:
    if "model.embed_tokens.weight" in sd:
        return "model."
    if "embed_tokens.weight" in sd:
        return ""
    raise StateDictError(
        "no embed_tokens.weight (or model.embed_tokens.weight) in the state dict: not a Gemma-4 text model; "
        "for a multimodal checkpoint use neuron_backend.loader.text_state_dict first"
    )


class _Taker:
    def __init__(self, sd, prefix, dtype):
        self.sd, self.prefix, self.dtype = sd, prefix, dtype
        self.used: set[str] = set()
        self.missing: list[str] = []

    def __call__(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        key = self.prefix + name
        if key not in self.sd:
            self.missing.append(key)
            return None
        t = self.sd[key]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise StateDictError(f"{key}: expected shape {list(shape)}, got {list(t.shape)}")
        self.used.add(key)
        return t.detach().to(self.dtype)


def _rows(t, start, size):
    return t.narrow(0, start, size).contiguous()


def _cols(t, start, size):
    return t.narrow(1, start, size).contiguous()


def shard_state_dict(
    hf_sd: dict[str, torch.Tensor], cfg: TextConfig, settings: BuildSettings, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], LoadReport]:
    """-> (state dict of rank `rank`'s NeuronGemma4ForCausalLM, state dict of PLETokenEmbedding, report)."""
    tp, dt = settings.tp, settings.dtype
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    take = _Taker(hf_sd, _prefix(hf_sd), dt)
    H, L = cfg.hidden_size, cfg.num_layers
    out: dict[str, torch.Tensor] = {}
    report = LoadReport()

    # Vocab-parallel embedding (rows padded to a multiple of tp with zeros; padded logits are masked to -inf).
    vp = padded_vocab(cfg.vocab_size, tp)
    vl = vp // tp

    def vocab_shard(t):
        if t is None:
            return None
        if vp != cfg.vocab_size:
            t = torch.cat([t, t.new_zeros(vp - cfg.vocab_size, t.shape[1])])
        return _rows(t, rank * vl, vl)

    embed = take("embed_tokens.weight", (cfg.vocab_size, H))
    out["embed_tokens.weight"] = vocab_shard(embed)
    out["embed_tokens.vocab_start"] = torch.tensor(rank * vl, dtype=torch.int64)
    head_key = "lm_head.weight"  # lives beside `model.` in Gemma4ForCausalLM
    head_full = None
    if head_key in hf_sd:
        head_full = hf_sd[head_key].detach().to(dt)
        take.used.add(head_key)
    if cfg.tie_word_embeddings:
        if head_full is not None and embed is not None and not torch.equal(head_full, embed):
            raise StateDictError("lm_head.weight differs from embed_tokens.weight but the config ties them")
    else:
        if head_full is None:
            take.missing.append(head_key)
        else:
            out["lm_head.weight"] = vocab_shard(head_full)
            out["lm_head.vocab_start"] = torch.tensor(rank * vl, dtype=torch.int64)

    if cfg.ple_dim:
        out["per_layer_model_projection"] = take("per_layer_model_projection.weight", (L * cfg.ple_dim, H))
        out["per_layer_projection_norm"] = take("per_layer_projection_norm.weight", (cfg.ple_dim,))
        ple_table = take("embed_tokens_per_layer.weight", (cfg.ple_vocab_size, L * cfg.ple_dim))
        host = {"weight": ple_table}
    else:
        host = {}
    out["norm"] = take("norm.weight", (H,))

    for i in range(L):
        src, dst = f"layers.{i}.", f"layers.{i}."
        d, nkv = cfg.head_dims[i], cfg.kv_heads[i]
        q_local = divide(cfg.num_heads, tp, "num_attention_heads")
        kv_first, kv_local, _ = kv_layout(cfg.num_heads, nkv, tp, rank)
        a_src, a_dst = src + "self_attn.", dst + "self_attn."

        q = take(a_src + "q_proj.weight", (cfg.num_heads * d, H))
        out[a_dst + "q_proj.weight"] = None if q is None else _rows(q, rank * q_local * d, q_local * d)
        out[a_dst + "q_norm"] = take(a_src + "q_norm.weight", (d,))
        o = take(a_src + "o_proj.weight", (H, cfg.num_heads * d))
        out[a_dst + "o_proj.weight"] = None if o is None else _cols(o, rank * q_local * d, q_local * d)
        kv_names = ["k_proj"] + ([] if cfg.k_eq_v[i] else ["v_proj"])
        if cfg.is_kv_owner(i):
            for name in kv_names:
                w = take(a_src + f"{name}.weight", (nkv * d, H))
                out[a_dst + f"{name}.weight"] = None if w is None else _rows(w, kv_first * d, kv_local * d)
            out[a_dst + "k_norm"] = take(a_src + "k_norm.weight", (d,))
        else:  # transformers drops these on load too; consume them by name so nothing else slips through
            for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
                key = take.prefix + a_src + name
                if key in hf_sd:
                    take.used.add(key)
                    report.ignored.append(key)

        inter = cfg.intermediate_sizes[i]
        il = divide(inter, tp, f"intermediate_size of layer {i}")
        for name in ("gate_proj", "up_proj"):
            w = take(src + f"mlp.{name}.weight", (inter, H))
            out[dst + f"mlp.{name}.weight"] = None if w is None else _rows(w, rank * il, il)
        w = take(src + "mlp.down_proj.weight", (H, inter))
        out[dst + "mlp.down_proj.weight"] = None if w is None else _cols(w, rank * il, il)

        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            out[dst + name] = take(src + f"{name}.weight", (H,))
        out[dst + "layer_scalar"] = take(src + "layer_scalar", (1,))
        if cfg.ple_dim:
            out[dst + "per_layer_input_gate"] = take(src + "per_layer_input_gate.weight", (cfg.ple_dim, H))
            out[dst + "per_layer_projection"] = take(src + "per_layer_projection.weight", (H, cfg.ple_dim))
            out[dst + "post_per_layer_input_norm"] = take(src + "post_per_layer_input_norm.weight", (H,))

    left_over = sorted(set(hf_sd) - take.used)
    if take.missing or left_over:
        lines = []
        if take.missing:
            lines.append(f"missing {len(take.missing)} key(s): {take.missing[:12]}")
        if left_over:
            lines.append(f"{len(left_over)} key(s) not consumed by the Neuron mapping: {left_over[:12]}")
        raise StateDictError("neuron_backend loader refused the state dict: " + "; ".join(lines))
    report.consumed = sorted(take.used)
    return out, host, report


def build_rank_model(hf_sd, cfg: TextConfig, settings: BuildSettings, rank: int = 0, comm=None, kv_mode="buffers"):
    """-> (rank model in eval mode, host PLETokenEmbedding or None, LoadReport). The module is the same on every
    rank; `rank` picks the shard of the weights loaded into it."""
    from .model import NeuronGemma4ForCausalLM, PLETokenEmbedding

    model = NeuronGemma4ForCausalLM(cfg, settings, comm, kv_mode)
    ple = PLETokenEmbedding(cfg, settings.dtype) if cfg.ple_dim else None
    rank_sd, host_sd, report = shard_state_dict(hf_sd, cfg, settings, rank)
    if kv_mode == "aliased_outputs":  # KV parameters start empty; NxD zero-fills them on device as states
        rank_sd.update({n: torch.zeros_like(t) for n, t in zip(model.kv_names, model.kv_tensors())})
    model.load_state_dict(rank_sd, strict=True)
    if ple is not None:
        ple.load_state_dict(host_sd, strict=True)
    return model.eval(), ple, report


def build_from_hf_model(hf_model, settings: BuildSettings, rank: int = 0, comm=None, kv_mode="buffers"):
    """(rank model, host PLE module, report) straight from an HF Gemma4ForCausalLM (or multimodal) model."""
    return build_rank_model(
        text_state_dict(hf_model.state_dict()), _text_config(hf_model.config, hf_model), settings, rank, comm, kv_mode
    )


def load_hf_checkpoint(path, dtype: torch.dtype) -> tuple[TextConfig, dict[str, torch.Tensor]]:
    """(TextConfig, text state dict in the Gemma4ForCausalLM layout) from a local HF checkpoint directory
    (safetensors) of either Gemma-4 class; never downloads."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from g4ops.models import checkpoint_dir

    path = checkpoint_dir(path)
    cfg = _text_config(AutoConfig.from_pretrained(path, local_files_only=True), path)
    sd = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        sd.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    if not sd:
        raise FileNotFoundError(f"model directory {path!r} has no *.safetensors weights")
    return cfg, text_state_dict(sd)


def _text_config(hf_config, ids_source) -> TextConfig:
    """`from_hf_config`, with the pad id read as generate() reads it (g4ops.models.special_tokens: the generation
    config first) from `ids_source`, a model or checkpoint directory."""
    from dataclasses import replace

    from g4ops.models import special_tokens

    from .config import from_hf_config

    return replace(from_hf_config(hf_config), pad_token_id=special_tokens(ids_source).pad_token_id)
