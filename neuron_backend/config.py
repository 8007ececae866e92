"""The model facts the Neuron lowering needs, read once from an HF Gemma-4 text config.

`TextConfig` is a plain frozen dataclass: nothing in model.py, loader.py or compile.py touches an HF config object,
so the lowering does not care which transformers 5.x produced the config (5.24 keeps per-layer head dims in
`per_layer_config`; older 5.x kept `global_head_dim` as a field) and the XLA proxy can run without transformers.

`BuildSettings` holds the choices of one compiled artifact: TP degree, batch, KV length and prefill buckets.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "proportional" (Gemma-4 full layers)
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer (sliding: head_dim, full: global_head_dim)
    kv_heads: tuple[int, ...]  # per layer
    intermediate_sizes: tuple[int, ...]  # per layer (E2B doubles it on KV-shared layers)
    k_eq_v: tuple[bool, ...]  # per layer: value projection is the key projection (26B/31B full layers)
    sliding_window: int
    rope: dict  # layer type -> RopeConfig
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    ple_dim: int = 0  # hidden_size_per_layer_input; 0 = no per-layer embeddings
    ple_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    tie_word_embeddings: bool = True
    pad_token_id: int = 0

    # -- derived facts ------------------------------------------------------------------------------------------
    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_kv_owner(self, layer: int) -> bool:
        return layer < self.first_kv_shared_layer

    @property
    def kv_owner_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_kv_owner(i))

    @property
    def kv_producer(self) -> tuple[int, ...]:
        """Layer whose K/V each layer attends with: itself for owners, the last owner of its type for shared ones.

        This is transformers' `kv_sharing_modes` ("store" on the last non-shared layer of each type, "reuse" after
        `first_kv_shared_layer`), written out so it does not depend on the installed version having that property.
        """
        last_owner: dict[str, int] = {}
        for i in range(self.first_kv_shared_layer):
            last_owner[self.layer_types[i]] = i
        out = []
        for i, t in enumerate(self.layer_types):
            if self.is_kv_owner(i):
                out.append(i)
            elif t not in last_owner:
                raise ValueError(f"layer {i} ({t}) reuses KV but no earlier layer of that type owns any")
            else:
                out.append(last_owner[t])
        return tuple(out)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["rope"] = {k: dataclasses.asdict(v) for k, v in self.rope.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "TextConfig":
        d = json.loads(text)
        d["rope"] = {k: RopeConfig(**v) for k, v in d["rope"].items()}
        for k in ("layer_types", "head_dims", "kv_heads", "intermediate_sizes", "k_eq_v"):
            d[k] = tuple(d[k])
        return cls(**d)


def _get(config, name, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def _per_layer(config, layer: int, name: str):
    """transformers >= 5.24 resolves per-layer overrides in `config.per_layer_config[i]`; None when absent."""
    plc = getattr(config, "per_layer_config", None)
    if plc is None:
        return None
    try:
        return getattr(plc[layer], name, None)
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _rope_from_hf(params: dict | None, fallback_theta: float) -> RopeConfig:
    params = dict(params or {})
    return RopeConfig(
        theta=float(params.get("rope_theta", fallback_theta)),
        rope_type=params.get("rope_type", "default"),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        factor=float(params.get("factor", 1.0)),
    )


def from_hf_config(config) -> TextConfig:
    """Read an HF `Gemma4TextConfig` (or a multimodal `Gemma4Config`, whose text part is used)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if _get(config, "enable_moe_block", False):
        raise NotImplementedError("neuron_backend: Gemma-4 MoE decoders (enable_moe_block=True) are not supported")
    if _get(config, "use_bidirectional_attention", None) == "all":
        raise NotImplementedError("neuron_backend: bidirectional (non-causal) Gemma-4 configs are not supported")

    n = config.num_hidden_layers
    layer_types = tuple(config.layer_types)
    k_eq_v_flag = bool(_get(config, "attention_k_eq_v", False))
    global_head_dim = _get(config, "global_head_dim", None)
    global_kv = _get(config, "num_global_key_value_heads", None)
    shared = int(_get(config, "num_kv_shared_layers", 0))
    double_wide = bool(_get(config, "use_double_wide_mlp", False))

    head_dims, kv_heads, inter, k_eq_v = [], [], [], []
    for i, t in enumerate(layer_types):
        hd = _per_layer(config, i, "head_dim")
        if hd is None:
            hd = global_head_dim if (t == FULL and global_head_dim) else config.head_dim
        kvh = _per_layer(config, i, "num_key_value_heads")
        if kvh is None:
            kvh = global_kv if (t == FULL and k_eq_v_flag and global_kv) else config.num_key_value_heads
        head_dims.append(int(hd))
        kv_heads.append(int(kvh))
        is_shared = i >= n - shared
        inter.append(int(config.intermediate_size) * (2 if (double_wide and is_shared) else 1))
        k_eq_v.append(k_eq_v_flag and t == FULL)

    rope_params = _get(config, "rope_parameters", {}) or {}
    rope = {
        SLIDING: _rope_from_hf(rope_params.get(SLIDING), 10_000.0),
        FULL: _rope_from_hf(rope_params.get(FULL), 1_000_000.0),
    }
    ple_dim = int(_get(config, "hidden_size_per_layer_input", 0) or 0)
    cfg = TextConfig(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        num_layers=n,
        num_heads=int(config.num_attention_heads),
        layer_types=layer_types,
        head_dims=tuple(head_dims),
        kv_heads=tuple(kv_heads),
        intermediate_sizes=tuple(inter),
        k_eq_v=tuple(k_eq_v),
        sliding_window=int(config.sliding_window),
        rope=rope,
        rms_norm_eps=float(config.rms_norm_eps),
        final_logit_softcapping=_get(config, "final_logit_softcapping", None),
        ple_dim=ple_dim,
        ple_vocab_size=int(_get(config, "vocab_size_per_layer_input", 0) or 0) if ple_dim else 0,
        num_kv_shared_layers=shared,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", True)),
        pad_token_id=int(_get(config, "pad_token_id", 0) or 0),
    )
    # Cross-check our sharing map against the installed transformers' own, where it has one.
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        ours = ["reuse" if not cfg.is_kv_owner(i) else None for i in range(n)]
        theirs = [m if m == "reuse" else None for m in modes]
        if ours != theirs:
            raise ValueError(f"neuron_backend: KV sharing map {ours} disagrees with transformers' {list(modes)}")
    return cfg


def inv_freq(cfg: TextConfig, layer_type: str) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2], fp32, as transformers computes them for that layer type.

    default:       1 / theta^(2i/d) for every pair.
    proportional:  the first `partial_rotary_factor * d / 2` pairs rotate with exponents over the *full* head dim,
                   the rest get frequency 0 (cos=1, sin=0: not rotated), so the encoding keeps the head dim.
    """
    rope = cfg.rope[layer_type]
    d = next(hd for hd, t in zip(cfg.head_dims, cfg.layer_types) if t == layer_type)
    if rope.rope_type == "default":
        freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    elif rope.rope_type == "proportional":
        angles = int(rope.partial_rotary_factor * d // 2)
        rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / d))
        freq = torch.cat([rotated, torch.zeros(d // 2 - angles, dtype=torch.float32)])
    else:
        raise NotImplementedError(f"neuron_backend: rope_type {rope.rope_type!r} is not supported")
    return freq / rope.factor


@dataclass(frozen=True)
class BuildSettings:
    """Static shapes of one compiled model: every bucket shares the weights and the KV buffers."""

    tp: int = 1
    batch: int = 1
    max_seq: int = 512  # KV length of full-attention layers (sliding layers keep min(window, max_seq))
    prefill_buckets: tuple[int, ...] = (128,)
    dtype: torch.dtype = torch.float32
    return_logits: bool = False  # also return gathered fp32 logits (checks; costs an all-gather of the vocab)
    # > 0: every bucket also takes the per-row sampling inputs (sampling.SAMPLING_INPUTS) and samples from each
    # rank's top `sample_cap` logits (requests need top_k <= sample_cap); 0: greedy-only buckets
    sample_cap: int = 0

    def __post_init__(self):
        if self.tp < 1 or self.batch < 1 or self.max_seq < 1:
            raise ValueError(f"BuildSettings: tp, batch and max_seq must be >= 1, got {self}")
        if self.sample_cap < 0:
            raise ValueError(f"BuildSettings: sample_cap must be >= 0, got {self.sample_cap}")
        if not self.prefill_buckets or any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"BuildSettings: prefill_buckets must be positive sizes, got {self.prefill_buckets}")

    def kv_len(self, cfg: TextConfig, layer: int) -> int:
        if cfg.layer_types[layer] == SLIDING:
            return min(cfg.sliding_window, self.max_seq)
        return self.max_seq

    def bucket_for(self, n_tokens: int) -> int:
        """Smallest prefill bucket that holds n_tokens; longer prompts are prefilled in chunks of the largest."""
        fits = [b for b in sorted(self.prefill_buckets) if b >= n_tokens]
        return fits[0] if fits else max(self.prefill_buckets)


def divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"neuron_backend: {what} ({a}) is not divisible by the TP degree ({b})")
    return a // b


def padded_vocab(vocab: int, tp: int) -> int:
    return int(math.ceil(vocab / tp) * tp)


__all__ = [
    "SLIDING",
    "FULL",
    "RopeConfig",
    "TextConfig",
    "BuildSettings",
    "from_hf_config",
    "inv_freq",
    "divide",
    "padded_vocab",
]
