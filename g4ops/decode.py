"""Greedy decoding with the whole decode step in one CUDA graph: `GreedyDecoder(model).generate(input_ids, n)`.

Why: a profile of `generate(cache_implementation="static")` on an H200
(bench/results/2026-11-29-h200-decode-and-profile.md) shows the GPU busy for 1.77 ms of each 3.6 ms step at batch 1
and 12 layers. The compiled forward is CUDA-graphed, but the
Python around it (input preparation, logits processors, stopping criteria, a host sync per token) is not. Here one
replay runs the whole step on the device: transformers' own Gemma-4 modules (so `g4ops.enable()` patches apply),
the softcapped logits, the argmax, the KV write and the position advance. The host only replays, and reads the
tokens back once every `sync_every` steps to stop at EOS.

The KV cache (`GraphKVCache`) is ours, not transformers' StaticCache: its writes take the position from a device
tensor, so a replayed step writes the right slot. Full-attention layers keep `max_length` slots (slot = position);
sliding layers keep a ring of `sliding_window` slots (slot = position mod window), which holds exactly the keys a
query may see (p - window < key <= p). The masks over the slots are built on the device from the same position.
KV-shared layers read their producer's buffers through transformers' `shared_kv_states`, as in stock.

Attention in the step is `g4ops.decode_attention` (while the decoder traces or runs a step, its model's Gemma-4
text configs name the "g4ops_graph_decode" attention implementation; prefill keeps the model's own): one pass over
the slots, the query heads of a KV head sharing its reads, split over the slots across the GPU. Stock's sdpa path
repeats K/V per query head and runs one thread block per head: on the H200 it took 16 us per sliding layer and
56 us per full layer, where a whole layer's step takes about 140 us (bench/results/2026-11-30-h200-session6-decode.md).

Exactness: the modules and dtypes are stock's, so the logits equal stock's up to attention's rounding: the order in
which it sums over the cached keys (the ring is not in position order, and masked slots differ in number), and
decode_attention keeps the probabilities in fp32 where some of stock's SDPA kernels round them to 16 bits. The argmax is taken
on the fp32 copy of the logits, as `generate` does. Prompts of different lengths come left-padded, as for stock.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from . import ops
from .models import FULL

DECODE_ATTENTION = "g4ops_graph_decode"  # the attention implementation name the step's configs carry


def decode_step_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """AttentionInterface entry for the decode step: query [B, Hq, 1, D] over the cache buffers key/value
    [B, Hkv, slots, D] under the step's bool mask [B, 1, 1, slots] -> ([B, 1, Hq, D], None)."""
    if query.shape[2] != 1 or not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise RuntimeError(f"{DECODE_ATTENTION} attention serves GreedyDecoder's decode step only (one query token "
                           f"and the cache's bool mask), got query {list(query.shape)}")  # fmt: skip
    if dropout or kwargs.get("softcap") is not None:
        raise RuntimeError(f"{DECODE_ATTENTION} attention has no dropout or logit softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ops.decode_attention(query, key, value, attention_mask, scale).transpose(1, 2), None


def _register_decode_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_step_attention)


def _text_attentions(model) -> list:
    """The model's Gemma-4 text attention modules (what the cache holds K/V for and the step switches)."""
    return [m for m in model.modules() if hasattr(m, "is_kv_shared_layer") and hasattr(m, "k_proj")]


class GraphKVCache:
    """The KV cache of one decoder: per KV-owning layer, K and V buffers [B, kv_heads, slots, head_dim]."""

    def __init__(self, model, batch: int, max_length: int, position: torch.Tensor):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        param = next(model.parameters())
        self.max_length = max_length
        self.sliding_window = config.sliding_window
        self.window = min(self.sliding_window, max_length)
        self.position = position  # [1] int64, the position of the token being decoded (shared with the decoder)
        self.pad = torch.zeros(batch, 1, dtype=torch.long, device=param.device)  # left-padding slots per row
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._slots: dict[int, int] = {}
        # shapes from the attention modules themselves (per-layer head dims differ between config versions)
        for attn in _text_attentions(model):
            if attn.is_kv_shared_layer:
                continue
            i = attn.layer_idx
            slots = max_length if config.layer_types[i] == FULL else self.window
            shape = (batch, attn.k_proj.out_features // attn.head_dim, slots, attn.head_dim)
            self.keys[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self.values[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self._slots[i] = slots
        if not self.keys:
            raise TypeError(f"GraphKVCache: no Gemma-4 attention layers found in {type(model).__name__}")

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks only when no position_ids are given
        raise RuntimeError("GraphKVCache: pass position_ids; the length lives on the device")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the chunk's K/V at its positions; return what the chunk attends over."""
        keys, values, slots = self.keys[layer_idx], self.values[layer_idx], self._slots[layer_idx]
        if tuple(keys.shape[-1:]) != tuple(key_states.shape[-1:]) or keys.shape[1] != key_states.shape[1]:
            raise ValueError(f"GraphKVCache: layer {layer_idx} got K/V {list(key_states.shape)} but holds "
                             f"{list(keys.shape)}; the model's config does not match the cache")  # fmt: skip
        n = key_states.shape[2]
        if n == 1:  # decode: one slot, then attend over the whole buffer under the decode mask
            slot = self.position if slots == self.max_length else torch.remainder(self.position, slots)
            keys.index_copy_(2, slot, key_states)
            values.index_copy_(2, slot, value_states)
            return keys, values
        # prefill from position 0 (not graphed): store the last `slots` tokens, attend over the chunk itself
        keep = min(n, slots)
        positions = torch.arange(n - keep, n, device=keys.device)
        keys.index_copy_(2, torch.remainder(positions, slots), key_states[:, :, n - keep :])
        values.index_copy_(2, torch.remainder(positions, slots), value_states[:, :, n - keep :])
        return key_states, value_states

    def decode_masks(self) -> dict[str, torch.Tensor]:
        """{layer type: bool mask [B, 1, 1, slots]} for the token at `self.position` (already written). Positions
        count cache slots, left padding included, as transformers' static cache does; padding slots are masked."""
        p = self.position
        dev = p.device
        full_pos = torch.arange(self.max_length, device=dev)[None, :]
        ring = torch.arange(self.window, device=dev)
        ring_pos = (p - torch.remainder(p - ring, self.window))[None, :]  # the position each ring slot holds
        return {
            FULL: ((full_pos <= p) & (full_pos >= self.pad))[:, None, None, :],
            "sliding_attention": (ring_pos >= self.pad)[:, None, None, :],
        }

    def prefill_masks(self, n: int) -> dict[str, torch.Tensor]:
        dev = self.pad.device
        q = torch.arange(n, device=dev)[None, :, None]
        k = torch.arange(n, device=dev)[None, None, :]
        real_key = k >= self.pad[:, :, None]  # [B, 1, n]
        # a padding query sees only itself: its output is never used, but it must stay finite (it becomes K/V)
        causal = ((k <= q) & real_key) | ((k == q) & (q < self.pad[:, :, None]))
        return {FULL: causal[:, None], "sliding_attention": (causal & (k > q - self.sliding_window))[:, None]}


class GreedyDecoder:
    """Greedy decoding of a Gemma-4 causal LM with the decode step captured once as a CUDA graph.

    decoder = GreedyDecoder(model, batch_size=1, max_length=2048)
    tokens = decoder.generate(input_ids, max_new_tokens=256)   # [B, prompt + generated], like model.generate

    `model`: a transformers Gemma4ForCausalLM (or Gemma4ForConditionalGeneration, text only). On CUDA the step is
    captured at the first `generate` (`cuda_graph=False` runs it eagerly, as on other devices). With
    `compile=True` the step is compiled by torch.compile first (fewer, fused kernels; costs compile time).
    `suppress_tokens`: ids never chosen (as generate's `suppress_tokens`). `generate(..., min_new_tokens=k)` keeps
    the EOS ids from being chosen for the first k new tokens, as generate's `min_new_tokens` does.
    `decode_attention=False` keeps the model's own attention implementation in the step (for comparison).
    """

    def __init__(self, model, batch_size: int = 1, max_length: int = 2048, compile: bool = False,
                 cuda_graph: bool | None = None, sync_every: int = 32, suppress_tokens=None,
                 decode_attention: bool = True):  # fmt: skip
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"GreedyDecoder: batch_size must be >= 1 and max_length >= 2, got {batch_size}, "
                             f"{max_length}")  # fmt: skip
        param = next(model.parameters())
        self.model = model
        self.batch, self.max_length, self.sync_every = batch_size, max_length, max(1, sync_every)
        self.device = param.device
        self.use_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"GreedyDecoder: cuda_graph=True needs the model on a CUDA device, not {self.device}")
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.cache = GraphKVCache(model, batch_size, max_length, self.position)
        self.next_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.out = torch.zeros(batch_size, max_length, dtype=torch.long, device=self.device)
        self.suppress = torch.tensor(_as_list(suppress_tokens), dtype=torch.long, device=self.device)
        # per call, read by the captured step: EOS ids (padded by repetition) and how long they stay suppressed
        self.hold_ids = torch.zeros(_MAX_EOS_IDS, dtype=torch.long, device=self.device)
        self.hold_until = torch.zeros(1, dtype=torch.long, device=self.device)  # in new tokens
        self.prompt_len = torch.zeros(1, dtype=torch.long, device=self.device)
        self.step_fn = torch.compile(self._step, fullgraph=True) if compile else self._step
        self.graph = None
        # the text attention configs the step switches to DECODE_ATTENTION (usually one shared text config)
        self._attention_configs = []
        if decode_attention:
            _register_decode_attention()
            for attn in _text_attentions(model):
                config = getattr(attn, "config", None)
                if config is not None and all(config is not c for c in self._attention_configs):
                    self._attention_configs.append(config)

    @contextlib.contextmanager
    def _step_attention(self):
        """The step's attention implementation, only while the step is traced, captured or run eagerly."""
        before = [c._attn_implementation for c in self._attention_configs]
        for c in self._attention_configs:
            c._attn_implementation = DECODE_ATTENTION
        try:
            yield
        finally:
            for c, name in zip(self._attention_configs, before):
                c._attn_implementation = name

    def run_step(self):
        """One decode step, not replayed from the graph (what the graph holds, run eagerly or compiled)."""
        with self._step_attention():
            self.step_fn()

    # -- the step -------------------------------------------------------------------------------------------------
    def _logits_to_next(self, logits: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """`generated`: new tokens before this one ([1] device tensor)."""
        last = logits[:, -1].float()  # as generate: fp32 copy of the last position, then the first maximum
        if self.suppress.numel():
            last = last.index_fill(-1, self.suppress, float("-inf"))
        held = last.index_fill(-1, self.hold_ids, float("-inf"))
        return torch.where(generated < self.hold_until, held, last).argmax(dim=-1)

    def _step(self):
        """Decode the token in `next_ids` at `position`; leaves the next token in `next_ids` and in `out`."""
        position_ids = self.position.view(1, 1) - self.cache.pad  # RoPE positions skip the left padding
        logits = self.model(
            input_ids=self.next_ids, attention_mask=self.cache.decode_masks(), position_ids=position_ids,
            past_key_values=self.cache, use_cache=True, logits_to_keep=1,
        ).logits  # fmt: skip
        nxt = self._logits_to_next(logits, self.position + 1 - self.prompt_len)
        self.position.add_(1)
        self.out.index_copy_(1, self.position, nxt[:, None])
        self.next_ids.copy_(nxt[:, None])

    def _capture(self):
        """Warm up on a side stream (compilation, cuBLAS handles, lazy kernel loads), then record one step. The
        warm-up and the capture really run the step on whatever state there is; that is harmless, because prefill
        rewrites the state and a step writes a KV slot before any mask exposes it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.run_step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), self._step_attention():
            self.step_fn()

    # -- generation -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Run the prompt from position 0 and leave its greedy next token in `next_ids` (and `out`).
        `attention_mask` [B, prompt]: 0 marks left padding (as a tokenizer with padding_side="left" makes)."""
        b, n = input_ids.shape
        pad = torch.zeros(b, dtype=torch.long, device=self.device)
        if attention_mask is not None:
            mask = attention_mask.to(self.device).bool()
            pad = n - mask.sum(dim=1)
            if attention_mask.shape != input_ids.shape or not torch.equal(
                    mask, torch.arange(n, device=self.device)[None, :] >= pad[:, None]):  # fmt: skip
                raise ValueError("GreedyDecoder: attention_mask must be [batch, prompt] with zeros only as left "
                                 "padding (use padding_side='left')")  # fmt: skip
            if bool((pad >= n).any()):
                raise ValueError("GreedyDecoder: a prompt in the batch is all padding")
        self.cache.pad.copy_(pad[:, None])
        position_ids = (torch.arange(n, device=self.device)[None, :] - pad[:, None]).clamp(min=0)
        logits = self.model(
            input_ids=input_ids, attention_mask=self.cache.prefill_masks(n), position_ids=position_ids,
            past_key_values=self.cache, use_cache=True, logits_to_keep=1,
        ).logits  # fmt: skip
        nxt = self._logits_to_next(logits, torch.zeros_like(self.prompt_len))
        self.out[:, :n] = input_ids
        self.out[:, n] = nxt
        self.next_ids.copy_(nxt[:, None])
        self.position.fill_(n)
        self.prompt_len.fill_(n)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, pad_token_id: int = 0,
                 attention_mask: torch.Tensor | None = None, min_new_tokens: int = 0):  # fmt: skip
        """-> [B, prompt + generated] token ids. Rows that produced an EOS are padded with `pad_token_id` after it,
        and generation stops once every row has one, as `model.generate` does for greedy search. Prompts of
        different lengths come left-padded, with their `attention_mask`."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"GreedyDecoder: input_ids must be [batch={self.batch}, prompt], "
                             f"got {list(input_ids.shape)}")  # fmt: skip
        n = input_ids.shape[1]
        if n < 1 or max_new_tokens < 1 or n + max_new_tokens > self.max_length:
            raise ValueError(f"GreedyDecoder: prompt {n} + {max_new_tokens} new tokens must fit max_length "
                             f"{self.max_length} (and both be >= 1)")  # fmt: skip
        input_ids = input_ids.to(self.device)
        eos_ids = sorted(set(_as_list(eos_token_id)))
        if len(eos_ids) > _MAX_EOS_IDS:
            raise ValueError(f"GreedyDecoder: at most {_MAX_EOS_IDS} EOS ids, got {len(eos_ids)}")
        eos = torch.tensor(eos_ids, dtype=torch.long, device=self.device)
        if eos_ids:
            self.hold_ids.copy_(torch.tensor([eos_ids[i % len(eos_ids)] for i in range(_MAX_EOS_IDS)]))
        self.hold_until.fill_(min_new_tokens if eos_ids else 0)
        if self.use_graph and self.graph is None:
            self._capture()
        self.prefill(input_ids, attention_mask)
        run = self.graph.replay if self.graph is not None else self.run_step
        done = 1
        while done < max_new_tokens:
            steps = min(self.sync_every, max_new_tokens - done)
            for _ in range(steps):
                run()
            done += steps
            if eos.numel() and bool(torch.isin(self.out[:, n : n + done], eos).any(dim=1).all()):
                break
        return _pad_after_eos(self.out[:, : n + done].clone(), n, eos, pad_token_id)


_MAX_EOS_IDS = 8  # the EOS ids min_new_tokens holds back live in a fixed-size buffer (the graph's shapes are fixed)


def _as_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        return [int(t) for t in eos_token_id.flatten()]
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]


def _pad_after_eos(tokens: torch.Tensor, prompt_len: int, eos: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Greedy search's output: after a row's first EOS, pad; trim to the step where the last row finished."""
    if not eos.numel():
        return tokens
    new = tokens[:, prompt_len:]
    is_eos = torch.isin(new, eos)
    after = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    new.masked_fill_(after, pad_token_id)
    finished = is_eos.any(dim=1)
    if bool(finished.all()):
        last = int(is_eos.float().argmax(dim=1).max())  # the latest first-EOS over the rows
        tokens = tokens[:, : prompt_len + last + 1]
    return tokens


# ----------------------------------------------------------------------------------------------------------------
# Routing `model.generate(...)` here (installed by g4ops.enable()): only calls whose result this decoder reproduces
# exactly go through it; everything else runs transformers' own generate untouched.

ROUTED_DEVICES = ("cuda",)  # where the graph pays off; the tests add "cpu" to exercise the routing itself
_STOCK_GENERATE = "_g4ops_stock_generate"  # attribute of the wrapper: the generate it wraps
# How each GenerationConfig field of the merged config decides a call's routing (any field not named here must be
# unset: None or the fresh default). Handled: the decoder reproduces it. Ignored: no effect on greedy search.
_HANDLED_FIELDS = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id", "bos_token_id",
    "cache_implementation", "compile_config", "disable_compile", "suppress_tokens",
}  # fmt: skip
_IGNORED_FIELDS = {
    "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "early_stopping",
    "length_penalty", "diversity_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "transformers_version",
    "_from_model_config", "renormalize_logits",
}  # fmt: skip
_NEUTRAL_VALUES = {  # fields that must hold a value that changes nothing
    "do_sample": (False,), "num_beams": (1,), "num_beam_groups": (1,), "num_return_sequences": (1,),
    "use_cache": (True,), "repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,), "remove_invalid_values": (False,),
    "return_dict_in_generate": (False,), "output_scores": (False,), "output_logits": (False,),
    "output_attentions": (False,), "output_hidden_states": (False,),
}  # fmt: skip
_BUCKET = 256  # decoders are sized in multiples of this, so nearby lengths reuse one captured graph
_models_with_decoder: weakref.WeakSet = weakref.WeakSet()


def release_decoders() -> None:
    """Drop the decoders (KV cache, captured graph) that routed generate calls left on models."""
    for model in list(_models_with_decoder):
        vars(model).pop("_g4ops_decoder", None)
    _models_with_decoder.clear()


def make_generate(stock_generate):
    """A `generate` that sends eligible greedy static-cache calls to a GreedyDecoder kept on the model."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        plan = _routable(self, inputs, generation_config, kwargs)
        if plan is None:
            return stock_generate(self, inputs, generation_config, **kwargs)
        ids, mask, new_tokens, min_new, suppress, eos, pad, compile_step = plan
        max_length = -(-(ids.shape[1] + new_tokens) // _BUCKET) * _BUCKET
        key = (ids.shape[0], max_length, compile_step, tuple(suppress))
        decoder = vars(self).get("_g4ops_decoder")
        if decoder is None or decoder[0] != key:  # one decoder per model, like stock's one static cache
            decoder = (key, GreedyDecoder(self, batch_size=ids.shape[0], max_length=max_length,
                                          compile=compile_step, suppress_tokens=suppress))  # fmt: skip
            vars(self)["_g4ops_decoder"] = decoder
            _models_with_decoder.add(self)
        return decoder[1].generate(ids, new_tokens, eos_token_id=eos, pad_token_id=pad, attention_mask=mask,
                                   min_new_tokens=min_new)

    setattr(generate, _STOCK_GENERATE, stock_generate)
    generate.__doc__ = stock_generate.__doc__
    return generate


def _is_absent(name: str, value, config_fields) -> bool:
    """An argument that is not a generation setting, given its "nothing" value (`streamer=None`, an empty
    `logits_processor`, `synced_gpus=False`): stock generate treats it as not given, and so do we."""
    if hasattr(config_fields, name):
        return False  # a GenerationConfig field: even None overrides the model's default
    return value is None or value is False or (isinstance(value, (list, tuple)) and not value)


def _routable(model, inputs, generation_config, kwargs):
    """(input_ids, attention_mask, new tokens, min new tokens, suppressed ids, eos ids, pad id, compile) when the
    call is greedy search with a static cache over left-padded (or unpadded) prompts and nothing this decoder does
    not reproduce; else None."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.dtype == torch.long and ids.numel()
            and ids.device.type in ROUTED_DEVICES):  # fmt: skip
        return None
    config_fields = generation_config or model.generation_config
    extra = {k: v for k, v in kwargs.items()
             if k not in ("input_ids", "attention_mask") and not _is_absent(k, v, config_fields)}  # fmt: skip
    if any(not hasattr(config_fields, k) for k in extra):
        return None  # a model input, streamer, logits processor, assistant, ...: not ours
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.shape != ids.shape:
            return None
        pad = ids.shape[1] - mask.bool().sum(dim=1)
        left = torch.arange(ids.shape[1], device=mask.device)[None, :] >= pad[:, None]
        if not torch.equal(mask.bool(), left) or bool((pad >= ids.shape[1]).any()):
            return None  # right or inner padding, or an empty prompt
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **extra)
    except Exception:  # noqa: BLE001 - whatever stock would say about the call, let stock say it
        return None
    if model_kwargs or config.cache_implementation != "static":
        return None
    default = type(config)()
    for name, value in config.to_dict().items():
        if name in _HANDLED_FIELDS or name in _IGNORED_FIELDS or value is None:
            continue
        if name in _NEUTRAL_VALUES:
            if value not in _NEUTRAL_VALUES[name]:
                return None
        elif value != getattr(default, name, None):
            return None  # a logits processor, stopping criterion or output option the decoder does not have
    prompt = ids.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 0) - prompt
    min_new = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt)
    eos = _as_list(config.eos_token_id)
    if new < 1:
        return None
    if len(set(eos)) > _MAX_EOS_IDS:
        return None
    suppress = sorted(set(_as_list(config.suppress_tokens)))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    return ids, mask, new, min_new, suppress, eos, pad, not config.disable_compile
