"""A Neuron-shaped Gemma-4 text decoder: static shapes, one rank's shard, KV cache in fixed device buffers.

One module serves every bucket. A call processes a chunk of T tokens (T = a prefill bucket, or 1 for decode) of B
sequences, each starting at its own position:

    forward(input_ids [B, T] int64, start_pos [B] int64, n_valid [B] int64, ple_tokens [B, T, L, P] | None
            [, temperature, top_k, top_p, min_p, seed, counter: [B] each, when settings.sample_cap > 0])
        -> next token [B] int64                                   (kv_mode="buffers": KV updated in place)
        -> (next token, logits [B, V] fp32)                       (settings.return_logits)
        -> (next token, [logits,] *new KV buffers)                (kv_mode="aliased_outputs", for NxD aliasing)

Rows t >= n_valid of the chunk are padding: they never reach the KV cache and never feed the next token, which
comes from row n_valid - 1 (greedy: a distributed argmax; with the sampling inputs, rows with temperature > 0
draw vocab-parallel, sampling.py). A row with n_valid = 0 is idle: its KV is untouched, its token meaningless, so
rows at different positions, and rows with nothing to do, share one call. The math follows transformers'
modeling_gemma4.py (Gemma4TextModel / DecoderLayer / Attention): norms via g4ops.rms_norm, attention scaling 1.0
(q/k norms replace 1/sqrt(d)), v_norm without weight, RoPE with per-type frequencies (proportional RoPE on full
layers), the per-layer-embedding (PLE) residual, `layer_scalar`, softcapped fp32 logits and a greedy argmax in
fp32.

KV cache: one K and one V buffer [B, kv_heads_local, S, head_dim] per KV-owning layer (the first
`num_layers - num_kv_shared_layers`; the others read their producer's K/V exactly as transformers' shared_kv_states
does). Full layers keep S = max_seq slots, slot = position. Sliding layers keep a ring of R = min(window, max_seq)
slots, slot = position mod R: sized to the window, not the context. Writes are trace-safe: no data-dependent
shapes, no scatter with duplicate indices. Decode (T = 1) scatters each row's new K/V into its one slot, in place
(torch.scatter at the row's position, as NxD Inference's KV cache manager does; an idle row writes back what the
slot holds). A prefill chunk rewrites every slot as `where(slot_is_written, gathered_new, old)`, the seed's
one-hot write generalised to chunks and rings (a chunk longer than the ring writes only its last R valid tokens).

The per-layer token embedding table (262144 x 42 x 256 in E4B, 5.6 GB in bf16) stays on the host: `PLETokenEmbedding`
looks up the B*T rows (21 KB per token) and passes them in; everything after the lookup runs on device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import g4ops

from .collectives import Collectives, SingleRank
from .config import FULL, BuildSettings, TextConfig, divide, inv_freq, padded_vocab
from .sampling import SAMPLING_INPUTS
from .parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead

KV_MODES = ("buffers", "aliased_outputs")


# ---------------------------------------------------------------------------------------------------------------
# Head layout per rank


def kv_shape(num_heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """(kv heads held, queries per kv head) of every rank's attention shard: the same on all ranks.

    q heads are split contiguously (num_heads / tp per rank). The kv heads a rank holds are exactly those its q
    heads use, so `num_key_value_groups` keeps its meaning: with tp | kv_heads that is a plain shard (E4B at TP=2:
    4 q + 1 kv per rank); with more ranks than kv heads each rank holds the one kv head its q heads share
    (replicated across those ranks). Shuffling that mapping is the seed's "4-vs-8 repeat_kv" bug.
    """
    q_local = divide(num_heads, tp, "num_attention_heads")
    groups = divide(num_heads, kv_heads, "num_attention_heads / num_key_value_heads")
    if q_local % groups == 0:
        kv_local = q_local // groups
    elif groups % q_local == 0:
        kv_local = 1
    else:
        raise ValueError(f"neuron_backend: {q_local} q heads per rank cannot map onto whole kv groups of {groups}")
    return kv_local, q_local // kv_local


def kv_layout(num_heads: int, kv_heads: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(first kv head, kv heads held, queries per kv head) of `rank`'s attention shard (the loader's cut)."""
    kv_local, n_rep = kv_shape(num_heads, kv_heads, tp)
    groups = num_heads // kv_heads
    return (rank * divide(num_heads, tp, "num_attention_heads")) // groups, kv_local, n_rep


# ---------------------------------------------------------------------------------------------------------------
# RoPE (transformers' Gemma4TextRotaryEmbedding + apply_rotary_pos_emb)


def rope_cos_sin(freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """freq [D/2] fp32, pos [B, T] int64 -> cos, sin [B, T, D] in dtype (computed in fp32 like transformers)."""
    freqs = pos[..., None].float() * freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):  # x [B, T, heads, D]; cos/sin [B, T, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (_rotate_half(x) * sin)


# ---------------------------------------------------------------------------------------------------------------
# KV plans: which slots a chunk writes, and which keys each query may see. Computed once per layer type per call.


def _gather_seq(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D], idx [B, S] -> [B, h, S, D] with out[:, :, s] = x[:, :, idx[:, s]]."""
    b, h, _, d = x.shape
    return x.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))


class _KVPlan:
    """Slot writes and the attention mask of one layer type for one chunk.

    full (S slots, slot = position):  chunk token t goes to slot start + t;  keys = the updated buffer.
    sliding (ring of R slots):        keys = [old ring (R) | this chunk (T)];  the ring then takes, per slot j, the
                                      last valid chunk token whose position is j mod R (if any).
    A query at position q sees keys with position p, p <= q (and p > q - window on sliding layers), p written.
    """

    def __init__(self, kind, slots, window, pos, start, n_valid, tok_valid):
        b, t = pos.shape
        dev = pos.device
        slot = torch.arange(slots, device=dev)[None, :]  # [1, S]
        self.kind = kind
        if kind == FULL:
            src = slot - start[:, None]  # chunk row that lands in each slot  [B, S]
            self.write = (src >= 0) & (src < n_valid[:, None])
            self.src = src.clamp(0, t - 1)
            key_pos = slot.expand(b, slots)
            key_ok = key_pos < (start + n_valid)[:, None]
            mask = key_ok[:, None, :] & (key_pos[:, None, :] <= pos[:, :, None])
        else:
            last = (start - 1)[:, None]
            old_pos = last - torch.remainder(last - slot, slots)  # position held by each ring slot  [B, R]
            end = (start + n_valid - 1)[:, None]
            src = (n_valid - 1)[:, None] - torch.remainder(end - slot, slots)  # latest chunk row for slot j
            self.write = src >= 0
            self.src = src.clamp(0, t - 1)
            key_pos = torch.cat([old_pos, pos], dim=1)  # [B, R + T]
            key_ok = torch.cat([old_pos >= 0, tok_valid], dim=1)
            qp, kp = pos[:, :, None], key_pos[:, None, :]
            mask = key_ok[:, None, :] & (kp <= qp) & (kp > qp - window)
        self.mask = mask[:, None]  # [B, 1, T, keys]

    def update(self, cache_k, cache_v, k_new, v_new, in_place=False):
        """-> (keys, values) to attend over, (new K buffer, new V buffer). (`in_place` is _DecodePlan's: a chunk's
        new buffers are always new tensors, copied into the buffers at the end of forward.)"""
        w = self.write[:, None, :, None]
        new_k = torch.where(w, _gather_seq(k_new, self.src), cache_k)
        new_v = torch.where(w, _gather_seq(v_new, self.src), cache_v)
        if self.kind == FULL:
            return (new_k, new_v), (new_k, new_v)
        return (torch.cat([cache_k, k_new], dim=2), torch.cat([cache_v, v_new], dim=2)), (new_k, new_v)


class _DecodePlan:
    """The decode step (T = 1): each row's new K/V row is scattered into its slot, as NxD Inference's KV cache
    manager writes token generation (torch.scatter at the row's position), instead of rewriting every slot.

    Row b writes slot start_b (full) or start_b mod R (ring); a row with n_valid = 0 (idle in this step) writes
    back the value its slot already holds, so the scatter has one index per row and never a duplicate. Keys are
    the updated buffer on both layer types: after the write a ring of R = min(window, max_seq) slots holds exactly
    the positions the query may see (slot j holds p - ((p - j) mod R), masked while that is negative: stale slots
    of an earlier sequence stay invisible until overwritten).
    """

    def __init__(self, kind, slots, window, pos, start, n_valid):
        b = pos.shape[0]
        slot = torch.arange(slots, device=pos.device)[None, :]  # [1, S]
        self.kind, self.valid = kind, (n_valid > 0)[:, None, None, None]
        q = pos  # [B, 1]
        if kind == FULL:
            self.slot = start
            key_pos = slot.expand(b, slots)
            key_ok = key_pos < (start + n_valid)[:, None]
        else:
            self.slot = torch.remainder(start, slots)
            last = (start + n_valid - 1)[:, None]
            key_pos = last - torch.remainder(last - slot, slots)
            key_ok = (key_pos >= 0) & (key_pos > q - window)
        self.mask = (key_ok & (key_pos <= q))[:, None, None, :]  # [B, 1, 1, S]

    def update(self, cache_k, cache_v, k_new, v_new, in_place=False):
        b, h, _, d = k_new.shape
        idx = self.slot[:, None, None, None].expand(b, h, 1, d)
        out = []
        for cache, new in ((cache_k, k_new), (cache_v, v_new)):
            row = torch.where(self.valid, new, cache.gather(2, idx))
            out.append(cache.scatter_(2, idx, row) if in_place else cache.scatter(2, idx, row))
        return tuple(out), tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# Layers


def _norm_weight(dim: int, dtype) -> nn.Parameter:
    return nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, settings: BuildSettings, comm: Collectives):
        super().__init__()
        dt, hidden = settings.dtype, cfg.hidden_size
        self.layer_type = cfg.layer_types[layer]
        self.head_dim = d = cfg.head_dims[layer]
        self.owner = cfg.is_kv_owner(layer)
        self.k_eq_v = cfg.k_eq_v[layer]
        self.eps = cfg.rms_norm_eps
        self.kv_local, self.n_rep = kv_shape(cfg.num_heads, cfg.kv_heads[layer], settings.tp)
        self.q_local = self.kv_local * self.n_rep
        self.q_proj = ColumnParallelLinear(hidden, self.q_local * d, dt)
        self.q_norm = _norm_weight(d, dt)
        if self.owner:
            self.k_proj = ColumnParallelLinear(hidden, self.kv_local * d, dt)
            if not self.k_eq_v:
                self.v_proj = ColumnParallelLinear(hidden, self.kv_local * d, dt)
            self.k_norm = _norm_weight(d, dt)
        self.o_proj = RowParallelLinear(self.q_local * d, hidden, dt, comm)
        self.kv_in_place = False  # set by the model: kv_mode "buffers" scatters straight into the buffers

    def forward(self, x, cos, sin, plan: _KVPlan, cache, shared):
        """x [B, T, H] -> out [B, T, H], new (K, V) buffers (owners) or None, (keys, values) for consumers."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, self.q_local, d)
        q = apply_rope(g4ops.rms_norm(q, self.q_norm, self.eps), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        new_cache = None
        if self.owner:
            k_raw = self.k_proj(x).view(b, t, self.kv_local, d)
            v = k_raw if self.k_eq_v else self.v_proj(x).view(b, t, self.kv_local, d)
            k = apply_rope(g4ops.rms_norm(k_raw, self.k_norm, self.eps), cos, sin).transpose(1, 2)
            v = g4ops.rms_norm(v, None, self.eps).transpose(1, 2)  # [B, Hkv, T, D]
            kv, new_cache = plan.update(cache[0], cache[1], k, v, in_place=self.kv_in_place)
        else:
            kv = shared
        keys, values = kv
        if self.n_rep > 1:  # transformers' repeat_kv: query head h reads kv head h // n_rep
            keys = keys[:, :, None].expand(-1, -1, self.n_rep, -1, -1).reshape(b, self.q_local, -1, d)
            values = values[:, :, None].expand(-1, -1, self.n_rep, -1, -1).reshape(b, self.q_local, -1, d)
        scores = torch.matmul(q, keys.transpose(2, 3)).float()  # scaling 1.0; softmax in fp32
        scores = scores.masked_fill(~plan.mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(b, t, self.q_local * d)
        return self.o_proj(out), new_cache, kv


class MLP(nn.Module):
    """GeGLU MLP, column-parallel gate/up and row-parallel down.

    gelu(x Wg_r) * (x Wu_r) is elementwise per intermediate column, so g4ops.geglu_mlp on the rank's shards
    (Wg_r, Wu_r [I/tp, H], Wd_r [H, I/tp]) is exactly the rank's partial sum of the down projection; the partial
    sums are all-reduced in fp32.
    """

    def __init__(self, hidden: int, inter_local: int, dtype, comm: Collectives):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter_local, dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter_local, dtype)
        self.down_proj = RowParallelLinear(inter_local, hidden, dtype, comm)

    def forward(self, x):
        partial = g4ops.geglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj.comm.all_reduce_fp32(partial)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, settings: BuildSettings, comm: Collectives):
        super().__init__()
        dt, hidden = settings.dtype, cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer, settings, comm)
        inter_local = divide(cfg.intermediate_sizes[layer], settings.tp, f"intermediate_size of layer {layer}")
        self.mlp = MLP(hidden, inter_local, dt, comm)
        self.input_layernorm = _norm_weight(hidden, dt)
        self.post_attention_layernorm = _norm_weight(hidden, dt)
        self.pre_feedforward_layernorm = _norm_weight(hidden, dt)
        self.post_feedforward_layernorm = _norm_weight(hidden, dt)
        # A persistent buffer in transformers too: every loader must carry it (the seed's 16x over-scale bug).
        self.register_buffer("layer_scalar", torch.ones(1, dtype=dt))
        self.ple = cfg.ple_dim > 0
        if self.ple:  # small (H x P): replicated on every rank, no collective
            self.per_layer_input_gate = nn.Parameter(torch.empty(cfg.ple_dim, hidden, dtype=dt), requires_grad=False)
            self.per_layer_projection = nn.Parameter(torch.empty(hidden, cfg.ple_dim, dtype=dt), requires_grad=False)
            self.post_per_layer_input_norm = _norm_weight(hidden, dt)

    def forward(self, h, ple_input, cos, sin, plan, cache, shared):
        norm = lambda x, w: g4ops.rms_norm(x, w, self.eps)  # noqa: E731
        attn, new_cache, kv = self.self_attn(norm(h, self.input_layernorm), cos, sin, plan, cache, shared)
        h = h + norm(attn, self.post_attention_layernorm)
        h = h + norm(self.mlp(norm(h, self.pre_feedforward_layernorm)), self.post_feedforward_layernorm)
        if self.ple:
            g = F.gelu(F.linear(h, self.per_layer_input_gate), approximate="tanh") * ple_input
            h = h + norm(F.linear(g, self.per_layer_projection), self.post_per_layer_input_norm)
        return h * self.layer_scalar, new_cache, kv


# ---------------------------------------------------------------------------------------------------------------
# The model


class NeuronGemma4ForCausalLM(nn.Module):
    """One TP rank of a Gemma-4 text decoder with a static, device-resident KV cache. See the module docstring.

    The module never learns its rank: every Python attribute is the same on all ranks, and whatever differs between
    ranks (the shard's weights, the first vocab id of the shard) is a tensor the loader fills. NxD traces the module
    once and runs that one graph on every NeuronCore with each core's weights, so a rank baked into Python would be
    rank 0's everywhere (`python -m neuron_backend check` runs the rank-0-built module on every rank to catch it).
    """

    def __init__(
        self,
        cfg: TextConfig,
        settings: BuildSettings,
        comm: Collectives | None = None,
        kv_mode: str = "buffers",
    ):
        super().__init__()
        comm = comm or SingleRank()
        if comm.world_size != settings.tp:
            raise ValueError(f"collectives span {comm.world_size} ranks but settings.tp is {settings.tp}")
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
        self.cfg, self.settings, self.comm, self.kv_mode = cfg, settings, comm, kv_mode
        dt, hidden, tp = settings.dtype, cfg.hidden_size, settings.tp
        vocab_local = padded_vocab(cfg.vocab_size, tp) // tp

        self.embed_tokens = VocabParallelEmbedding(vocab_local, hidden, dt, comm)
        # transformers rounds sqrt(H) to the weight dtype before multiplying (55.4256 -> 55.5 in bf16)
        self.register_buffer("embed_scale", torch.tensor(hidden**0.5).to(dt), persistent=False)
        if cfg.ple_dim:
            self.per_layer_model_projection = nn.Parameter(
                torch.empty(cfg.num_layers * cfg.ple_dim, hidden, dtype=dt), requires_grad=False
            )
            self.per_layer_projection_norm = _norm_weight(cfg.ple_dim, dt)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, settings, comm) for i in range(cfg.num_layers))
        self.norm = _norm_weight(hidden, dt)
        self.lm_head = VocabParallelLMHead(
            self.embed_tokens if cfg.tie_word_embeddings else None,
            vocab_local, hidden, cfg.vocab_size, cfg.final_logit_softcapping, dt, comm,
        )  # fmt: skip
        for t in sorted(set(cfg.layer_types)):
            self.register_buffer(f"inv_freq_{t}", inv_freq(cfg, t), persistent=False)

        # KV buffers, one K and one V per KV-owning layer: [B, kv_heads_local, slots, head_dim]
        self.kv_names: list[str] = []
        for i in cfg.kv_owner_layers:
            shape = (settings.batch, self.layers[i].self_attn.kv_local, settings.kv_len(cfg, i), cfg.head_dims[i])
            for kind in ("k", "v"):
                name = f"{kind}_cache_{i}"
                if kv_mode == "buffers":
                    self.register_buffer(name, torch.zeros(shape, dtype=dt), persistent=False)
                else:  # NxD aliases module parameters to graph outputs (its StateInitializer zero-fills them)
                    self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dt), requires_grad=False))
                self.kv_names.append(name)
        for layer in self.layers:
            layer.self_attn.kv_in_place = kv_mode == "buffers"

    # -- helpers ------------------------------------------------------------------------------------------------
    def kv_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.kv_names]

    def reset_cache(self) -> None:
        with torch.no_grad():
            for t in self.kv_tensors():
                t.zero_()

    def _per_layer_inputs(self, embeds, ple_tokens):
        """transformers' project_per_layer_inputs: [B, T, H] (+ host lookup [B, T, L, P]) -> [B, T, L, P]."""
        cfg = self.cfg
        proj = F.linear(embeds, self.per_layer_model_projection) * (cfg.hidden_size**-0.5)
        proj = proj.reshape(*embeds.shape[:-1], cfg.num_layers, cfg.ple_dim)
        proj = g4ops.rms_norm(proj, self.per_layer_projection_norm, cfg.rms_norm_eps)
        return (proj + ple_tokens) * (2.0**-0.5)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, input_ids, start_pos, n_valid, ple_tokens=None, temperature=None, top_k=None, top_p=None,
                min_p=None, seed=None, counter=None):
        """Sampling inputs (sampling.SAMPLING_INPUTS, each [B]; settings.sample_cap > 0): temperature fp32 (<= 0:
        greedy row), top_k int64 (0: off, else <= sample_cap), top_p (1: off), min_p fp32 (0: off), seed and
        counter int64 (the row's noise key: its seed and the index of the token it generates)."""
        cfg, settings = self.cfg, self.settings
        sampling = (temperature, top_k, top_p, min_p, seed, counter)
        if settings.sample_cap and any(x is None for x in sampling):
            raise ValueError(f"settings.sample_cap is {settings.sample_cap}: forward needs every sampling input "
                             f"({', '.join(n for n, x in zip(SAMPLING_INPUTS, sampling) if x is None)} missing)")
        if not settings.sample_cap and any(x is not None for x in sampling):
            raise ValueError("sampling inputs given, but the module was built with settings.sample_cap = 0")
        b, t = input_ids.shape
        dev = input_ids.device
        rows = torch.arange(t, device=dev)
        pos = start_pos[:, None] + rows[None, :]  # [B, T]
        tok_valid = rows[None, :] < n_valid[:, None]

        h = self.embed_tokens(input_ids) * self.embed_scale  # [B, T, H]
        ple = self._per_layer_inputs(h, ple_tokens) if cfg.ple_dim else None

        rope, plans = {}, {}
        for lt in sorted(set(cfg.layer_types)):
            rope[lt] = rope_cos_sin(getattr(self, f"inv_freq_{lt}"), pos, h.dtype)
            first = cfg.layer_types.index(lt)
            slots = settings.kv_len(cfg, first)
            if t == 1:  # decode: a scatter of one row per sequence
                plans[lt] = _DecodePlan(lt, slots, cfg.sliding_window, pos, start_pos, n_valid)
            else:
                plans[lt] = _KVPlan(lt, slots, cfg.sliding_window, pos, start_pos, n_valid, tok_valid)

        new_kv: list[torch.Tensor] = []
        shared: dict[int, tuple] = {}
        for i, layer in enumerate(self.layers):
            lt = cfg.layer_types[i]
            producer = cfg.kv_producer[i]
            cache = (getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")) if producer == i else None
            ple_i = ple[:, :, i, :] if ple is not None else None
            h, new_cache, kv = layer(h, ple_i, *rope[lt], plans[lt], cache, shared.get(producer))
            if producer == i:
                shared[i] = kv
                new_kv.extend(new_cache)

        h = g4ops.rms_norm(h, self.norm, cfg.rms_norm_eps)
        last = h.gather(1, (n_valid - 1).clamp(min=0)[:, None, None].expand(b, 1, h.shape[-1])).squeeze(1)
        tokens, logits = self.lm_head(last, return_logits=settings.return_logits,
                                      sampling=sampling if settings.sample_cap else None, cap=settings.sample_cap)
        outputs = (tokens,) if logits is None else (tokens, logits)

        if self.kv_mode == "aliased_outputs":
            return (*outputs, *new_kv)
        with torch.no_grad():  # the trace-safe in-place write: buffers_to_mutate in torch.export, aliased on XLA
            for buf, new in zip(self.kv_tensors(), new_kv):
                if new is not buf:  # decode scattered into the buffer already
                    buf.copy_(new)
        return outputs[0] if len(outputs) == 1 else outputs

    def io_aliases(self) -> dict:
        """{KV parameter: output index} for torch_neuronx / NxD (kv_mode="aliased_outputs")."""
        first = 2 if self.settings.return_logits else 1
        return {p: first + j for j, p in enumerate(self.kv_tensors())}


class PLETokenEmbedding(nn.Module):
    """Host half of the per-layer embeddings: the token-identity lookup, scaled by sqrt(P) in the weight dtype."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(
            torch.empty(cfg.ple_vocab_size, cfg.num_layers * cfg.ple_dim, dtype=dtype), requires_grad=False
        )
        self.register_buffer("scale", torch.tensor(cfg.ple_dim**0.5).to(dtype), persistent=False)

    def forward(self, ids):  # [B, T] -> [B, T, L, P]
        rows = F.embedding(ids, self.weight) * self.scale
        return rows.reshape(*ids.shape, self.cfg.num_layers, self.cfg.ple_dim)
