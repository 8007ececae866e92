"""Continuous batching for Gemma-4: `BatchEngine(model).start()`, then `submit(prompt_ids, params, on_event)` from
any thread; requests join a running batch at the next step and leave it when they finish.

The KV cache (`SlotKVCache`) has `max_batch` rows; a request holds one row from admission to its end. Each row has
its own position, KV and sampling settings, all [max_batch] device tensors, so rows at different positions share one
decode step. Full-attention layers keep `max_context` slots per row (slot = position); sliding layers a ring of
`sliding_window` slots (slot = position mod window), as engine.cache.GraphKVCache. Every layer has one more slot,
the scratch slot: rows that are not decoding (free, or still in prefill) write their step's K/V there and see only
it, so the step never touches a prefilling row's cache and never computes on an empty mask.

One engine thread owns the device and loops: apply cancels, admit waiting requests into free rows, run one prefill
call, run one decode step over the decoding rows, emit the tokens. The prefill call holds at most `prefill_chunk`
tokens (padding counted), so a new prompt stalls the decoding rows for at most that much work: the next chunk of the
oldest prompt in prefill, plus the next chunks of younger ones while they fit, left-padded to one length (on an
H200 an eager 42-layer E4B call over 128 tokens takes 93 ms, nearly all of it launch overhead, so one call for
several prompts costs about what one costs). A chunk attends over its row's cached keys plus the chunk: full layers
write the chunk first and read slots [0, end); sliding layers read the ring as it was before the chunk,
concatenated with the chunk, and write the chunk's last `window` tokens afterwards (a chunk longer than the window
would otherwise overwrite keys its own first queries still see).

The decode step is one model call over the first `b` rows, `b` the smallest batch bucket (1, 2, 4, ..., max_batch)
covering every decoding row (a new request takes the lowest free row, so the active rows stay packed): input_ids and
position_ids [b, 1], per-row bool masks [b, 1, 1, slots] built on the device from the positions, the K/V write one
per-row index_put_ into each whole buffer, attention `g4ops.decode_attention`, then the softcapped logits in fp32
into the sampler. On CUDA each (bucket, sampling mode) is captured once as a CUDA graph (the first time a batch
needs it, or all of them in `warmup()`); elsewhere, or with `cuda_graph=False`, the same step runs eagerly. Modes:
all greedy (argmax only), sampling (with the smallest top-k cap of decoder.K_CAPS that bounds every sampling row's
top_k, as the Decoder), and sampling with some seeded rows (their noise from `seeded_exponential(seed,
generated-token index)`, so their tokens do not depend on the batch; the other rows draw from torch's generator).
`compile=True` compiles the step's model call with torch.compile (the sampler stays eager, so every mode shares it):
on an H200, one E4B request (42 layers, bf16) took 5.96 ms per token end to end instead of 11.6, and `warmup()` of 7
buckets x 2 modes 168 s instead of 3.5 s. `compile_prefill=True` (off by default, as the Decoder's: its GPU
first-call time is not measured yet) compiles the prefill call's model call too, with dynamic shapes
(decoder.compiled_prefill): two graphs for every chunk length and cached length, one for calls of one row and one
for several (size 1 is specialised; a 1-token chunk is padded to 2), both compiled by `warmup()`; a compiler failure
leaves the prefill eager with one warning. `pad_prefill` (default: on CUDA, unless the prefill is compiled): a
prefill call of whole prompts (each from its first token, in one chunk) is padded to the smallest batch bucket of
rows and the decoder.prefill_width of its longest prompt, and on CUDA replayed from a CUDA graph per (rows, width)
(decoder.PrefillGraphs; captured by `warmup()`, else at a shape's first use): the Decoder's 512-token prefill went
from 45.2 to 19.7 ms that way on the H200 (until session 15 only a lone prompt was padded; calls of several prompts,
up to 4 x 512 tokens in the server's 2048-token chunk at concurrency 64, ran eagerly). The host reads each step's
tokens back (each token is an event) while the device runs the next step: a row whose token ends it decodes one step
in vain, in its own slots, and that token is dropped.

Exactness: in fp32 a greedy request's tokens are its solo run's and stock `generate(do_sample=False)`'s, up to the
order attention sums over the keys (engine/decoder.py's note), and up to the batched matmuls' rounding for other rows in
the batch (a BLAS kernel may change with the batch size).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import threading
from typing import Callable

import torch

from ..models import FULL, SLIDING
from .cache import text_attentions
from .decoder import (K_CAPS, PREFILL_GRAPH_TOKENS, PREFILL_WIDTHS, PrefillGraphs, _register_decode_attention,
                      compiled_prefill, is_compiled, prefill_width, step_attention)
from .sampler import TIES_OVERFLOW, noise_at, sample

__all__ = ["BatchEngine", "EngineStats", "QueueFull", "SamplingParams", "SlotKVCache", "TokenEvent"]

log = logging.getLogger(__name__)

_SEED_LIMIT = 2**63  # seeds live in an int64 device tensor
_MIN_COMPILED_SIZE = 2  # the compiled prefill's chunk length and `end` are never 1 (each 1 would compile a graph)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int  # >= 1
    temperature: float = 1.0  # 0: greedy (as OpenAI's API); > 0 samples
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # reproducible sampling, independent of the batch neighbours
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one (finish_reason "stop")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int | None  # None only on a final event that carries no token
    finish_reason: str | None  # None while running; then "stop" | "length" | "cancelled" | "error"
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int  # requests holding a KV row (in prefill or decoding)
    waiting: int  # submitted, not yet admitted
    kv_slots_in_use: int  # KV rows held (= running)
    kv_slots_total: int  # max_batch
    generated_tokens: int = 0  # tokens emitted since the engine was made
    decode_steps: int = 0


class QueueFull(RuntimeError):
    """submit() while max_waiting requests already wait."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_request(prompt_ids, params, max_context: int, vocab_size: int) -> None:
    """Raise ValueError naming the first bad field of a request."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError("prompt_ids must be a non-empty list of token ids")
    bad = next((t for t in prompt_ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_ids: {bad!r} is not a token id in [0, {vocab_size})")
    if not _is_int(params.max_new_tokens) or params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {params.max_new_tokens!r}")
    if len(prompt_ids) + params.max_new_tokens > max_context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                         f"max_context {max_context}")  # fmt: skip
    if not _is_real(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature!r}")
    if not _is_int(params.top_k) or params.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {params.top_k!r}")
    if not _is_real(params.top_p) or not 0 <= params.top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {params.top_p!r}")
    if not _is_real(params.min_p) or not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p!r}")
    if params.seed is not None and (not _is_int(params.seed) or not 0 <= params.seed < _SEED_LIMIT):
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {params.seed!r}")
    stops = params.stop_token_ids
    if not isinstance(stops, (list, tuple)) or any(not _is_int(t) or not 0 <= t < vocab_size for t in stops):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {stops!r}")


# -- the KV cache -------------------------------------------------------------------------------------------------
class SlotKVCache:
    """Per KV-owning layer, K and V buffers [rows, kv_heads, slots + 1, head_dim]; the last slot is scratch."""

    def __init__(self, model, rows: int, max_context: int):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        param = next(model.parameters())
        self.rows, self.max_context = rows, max_context
        self.window = min(config.sliding_window, max_context)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.full: dict[int, bool] = {}  # layer -> slot = position (else the ring)
        for attn in text_attentions(model):
            if attn.is_kv_shared_layer:
                continue
            i = attn.layer_idx
            self.full[i] = config.layer_types[i] == FULL
            slots = (max_context if self.full[i] else self.window) + 1
            shape = (rows, attn.k_proj.out_features // attn.head_dim, slots, attn.head_dim)
            self.keys[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
            self.values[i] = torch.zeros(shape, dtype=param.dtype, device=param.device)
        if not self.keys:
            raise TypeError(f"SlotKVCache: no Gemma-4 attention layers found in {type(model).__name__}")

    def check(self, layer_idx: int, key_states: torch.Tensor) -> None:
        keys = self.keys[layer_idx]
        if keys.shape[1] != key_states.shape[1] or keys.shape[3] != key_states.shape[3]:
            raise ValueError(f"SlotKVCache: layer {layer_idx} got K/V {list(key_states.shape)} but holds "
                             f"{list(keys.shape)}; the model's config does not match the cache")  # fmt: skip


class _CacheCall:
    """What a model call gets as past_key_values: transformers calls update() per KV-owning layer."""

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks only when no position_ids are given
        raise RuntimeError("BatchEngine: the cache needs position_ids; positions live on the device")


class _DecodeCall(_CacheCall):
    """One decode step over rows [0, b): row r writes at its position's slot if it decodes, else at scratch."""

    def __init__(self, cache: SlotKVCache, b: int, position: torch.Tensor, active: torch.Tensor):
        self.cache, self.b = cache, b
        self.position, self.active = position, active  # [b] int64, [b] bool
        self.rows = torch.arange(b, device=position.device)
        self.slot = {
            True: torch.where(active, position, cache.max_context),
            False: torch.where(active, torch.remainder(position, cache.window), cache.window),
        }

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c = self.cache
        c.check(layer_idx, key_states)
        keys, values = c.keys[layer_idx], c.values[layer_idx]
        slot = self.slot[c.full[layer_idx]]
        # an index_put_ on the whole buffer, which Inductor writes in place: a scatter_ into its [:b] view compiled
        # to a copy of every slot of those b rows, per layer (3.0 of the 11.2 ms step at b = 64 on the H200)
        keys[self.rows, :, slot] = key_states[:, :, 0]
        values[self.rows, :, slot] = value_states[:, :, 0]
        return keys[: self.b], values[: self.b]

    def masks(self) -> dict[str, torch.Tensor]:
        """{layer type: bool [b, 1, 1, slots + 1]}: a decoding row sees its positions <= p; the others scratch only."""
        c, p, dev = self.cache, self.position[:, None], self.position.device
        active = self.active[:, None]
        full = torch.arange(c.max_context + 1, device=dev)[None, :]
        full = torch.where(active, (full <= p) & (full < c.max_context), full == c.max_context)
        ring = torch.arange(c.window + 1, device=dev)[None, :]
        held = p - torch.remainder(p - ring, c.window)  # the position ring slot s holds once p is written
        ring = torch.where(active, (held >= 0) & (ring < c.window), ring == c.window)
        return {FULL: full[:, None, None, :], SLIDING: ring[:, None, None, :]}


class _PrefillCall(_CacheCall):
    """One prefill call over k rows: row rows[i] gets the tokens at positions [starts[i], starts[i] + lens[i])
    (earlier positions already cached), left-padded to one length N, so every row's last token is the call's last
    position (logits_to_keep=1). A padding token writes to scratch and sees only itself (or slot 0: finite)."""

    def __init__(self, cache: SlotKVCache, rows: torch.Tensor, start: torch.Tensor, lens: torch.Tensor, n, end,
                 first: int | None = None):  # fmt: skip
        """rows, start, lens: [k] int64 device tensors; n: the padded length N; end: max(start + lens). In the
        compiled prefill n and end are marked dynamic sizes (SymInts), never values a graph would specialise on.
        `first`: the one row's index when k == 1 (eager only): views of the buffers, no gathers."""
        self.cache = cache
        dev = rows.device
        self.k, self.n, self.end = rows.shape[0], n, end  # full layers attend over slots [0, end)
        self.first = first
        self.rows = rows
        start = start[:, None]
        pad = n - lens[:, None]
        j = torch.arange(n, device=dev)[None, :]
        self.real = j >= pad  # [k, N]
        self.pos = start - pad + j  # the position of chunk token j (meaningless on padding)
        self.position_ids = torch.where(self.real, self.pos, 0)
        w = cache.window
        in_ring = j >= n - torch.clamp(n - pad, max=w)  # the last w real tokens
        self.slot = {True: torch.where(self.real, self.pos, cache.max_context),
                     False: torch.where(in_ring, torch.remainder(self.pos, w), w)}  # fmt: skip
        self.start = start

    def _rows(self, buffer: torch.Tensor, length: int) -> torch.Tensor:
        if self.first is not None:
            return buffer[self.first : self.first + 1, :, :length]
        return buffer[self.rows, :, :length]  # a copy of just these rows and slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        c = self.cache
        c.check(layer_idx, key_states)
        keys, values = c.keys[layer_idx], c.values[layer_idx]
        full = c.full[layer_idx]
        if not full:  # the ring before this chunk, then the chunk (cat copies, so the write below cannot reach it)
            seen_k = torch.cat([self._rows(keys, c.window), key_states], dim=2)
            seen_v = torch.cat([self._rows(values, c.window), value_states], dim=2)
        rows, slot = self.rows[:, None], self.slot[full]  # indexing [k, N] pairs: values [k, N, heads, dim]
        keys[rows, :, slot] = key_states.transpose(1, 2)
        values[rows, :, slot] = value_states.transpose(1, 2)
        if full:
            return self._rows(keys, self.end), self._rows(values, self.end)
        return seen_k, seen_v

    def masks(self) -> dict[str, torch.Tensor]:
        """{FULL: [k, 1, N, end], sliding: [k, 1, N, window + N]} bool, True = attend."""
        w, real = self.cache.window, self.real
        dev = self.pos.device
        q = self.pos[:, :, None]  # [k, N, 1] query positions
        alone = ~real[:, :, None]  # padding queries
        slots = torch.arange(self.end, device=dev)[None, None, :]
        full = torch.where(alone, slots == 0, slots <= q)
        ring = torch.arange(w, device=dev)[None, None, :]
        held = (self.start[:, :, None] - 1) - torch.remainder(self.start[:, :, None] - 1 - ring, w)  # before the chunk
        ring_seen = (held >= 0) & (held > q - w) & ~alone
        key = self.pos[:, None, :]  # [k, 1, N]
        j = torch.arange(self.n, device=dev)
        chunk_seen = torch.where(alone, j[None, None, :] == j[None, :, None],
                                 real[:, None, :] & (key <= q) & (key > q - w))  # fmt: skip
        # the ring is min(window, max_context) long: a longer window changes nothing below max_context
        sliding = torch.cat([ring_seen, chunk_seen], dim=2)
        return {FULL: full[:, None], SLIDING: sliding[:, None]}


# -- requests -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[TokenEvent], None]
    stops: frozenset
    row: int = -1
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # tokens emitted
    in_flight: int = 0  # launched decode steps holding a token of it not read back yet (0 or 1 between steps)


@dataclasses.dataclass
class _LaunchedStep:
    """A decode step launched and not read back: the requests it decodes, by row, and its tokens' copy."""

    rows: list[tuple[int, _Request]]
    tokens: torch.Tensor  # [b]: next_ids after the step (a pinned host buffer on CUDA)
    done: torch.cuda.Event | None  # recorded after the copy (CUDA)
    ties: torch.Tensor | None  # [1]: the sampler's ties_overflow after a sampling step (same buffer), else None


def _buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


class BatchEngine:
    """Continuous-batching generation over one Gemma-4 text model (see the module docstring).

    engine = BatchEngine(model, max_batch=16, max_context=2048); engine.start()
    rid = engine.submit(prompt_ids, SamplingParams(max_new_tokens=64, temperature=0), on_event)
    ...; engine.shutdown()

    `on_event(TokenEvent)` is called from the engine thread once per token, in order; the last call has a
    finish_reason. It must be cheap; if it raises, that request is cancelled. Without start(), `step()` runs one
    loop iteration in the caller's thread (tests, single-threaded drivers).
    """

    def __init__(self, model, max_batch: int = 16, max_context: int = 2048, max_waiting: int = 256,
                 prefill_chunk: int = 256, cuda_graph: bool | None = None, compile: bool = False,
                 compile_prefill: bool = False, pad_prefill: bool | None = None):  # fmt: skip
        for name, value, low in (("max_batch", max_batch, 1), ("max_context", max_context, 2),
                                 ("max_waiting", max_waiting, 0), ("prefill_chunk", prefill_chunk, 1)):  # fmt: skip
            if not _is_int(value) or value < low:
                raise ValueError(f"BatchEngine: {name} must be an int >= {low}, got {value!r}")
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.max_batch, self.max_context, self.max_waiting = max_batch, max_context, max_waiting
        self.prefill_chunk = prefill_chunk
        self.use_graph = self.device.type == "cuda" if cuda_graph is None else bool(cuda_graph)
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"BatchEngine: cuda_graph=True needs the model on a CUDA device, not {self.device}")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = config.vocab_size
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and max_context > limit:
            raise ValueError(f"BatchEngine: max_context {max_context} exceeds the model's max_position_embeddings "
                             f"{limit}")  # fmt: skip
        self.cache = SlotKVCache(model, max_batch, max_context)
        # transformers 5.24 renamed forward's past_key_values to cache (the old name warns on every call)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        dev, rows = self.device, max_batch
        self.next_ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)  # the token each row decodes next
        self.position = torch.zeros(rows, dtype=torch.long, device=dev)  # ... and its position
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)  # the row decodes in the step
        self.counter = torch.zeros(rows, dtype=torch.long, device=dev)  # tokens the row has generated
        self.temperature = torch.ones(rows, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=dev)
        self.top_p = torch.ones(rows, dtype=torch.float64, device=dev)  # fp64: 1 - top_p as Python computes it
        self.min_p = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=dev)
        self.seed = torch.zeros(rows, dtype=torch.long, device=dev)
        self.seeded = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.buckets = _buckets(max_batch)
        # compile=True compiles the step's model call, not the sampler, so the sampling modes share the compilation
        self._logits_fn = torch.compile(self._logits, fullgraph=True) if compile else self._logits
        # compile_prefill: the prefill's model call compiled with dynamic shapes, one graph for every chunk length,
        # row count and cached length (decoder.compiled_prefill): input_ids [k, N], rows [3, k], slots [end]
        self._prefill_fn = (compiled_prefill(self._prefill_logits, {0: (0, 1), 1: (1,), 2: (0,)}) if compile_prefill
                            else self._prefill_logits)  # fmt: skip
        self.pad_prefill = self.device.type == "cuda" and not compile_prefill if pad_prefill is None else pad_prefill
        self._prefill_graphs = PrefillGraphs(self._prefill_logits, "BatchEngine's prefill")  # one per width
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (bucket, mode) -> captured step
        self._pool = None  # one memory pool for every captured step (they never run at the same time)

        self._attention_configs = []  # the text configs the step switches to decode_attention
        _register_decode_attention()
        for attn in text_attentions(model):
            config_ = getattr(attn, "config", None)
            if config_ is not None and all(config_ is not c for c in self._attention_configs):
                self._attention_configs.append(config_)

        # shared with submit/cancel/stats (under _lock); the rest is the engine thread's
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._live: set[int] = set()  # ids submitted and not yet finished
        self._cancels: set[int] = set()
        self._held = 0  # rows held
        self._tokens = 0
        self._steps = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        # engine-thread state
        self._rows: list[_Request | None] = [None] * rows
        self._prefilling: collections.deque[_Request] = collections.deque()
        self._launched: _LaunchedStep | None = None
        # two host buffers the step's tokens are copied into, alternately: one step is read while the next runs
        # (pinned on CUDA, so the copy is asynchronous and an event says when it landed); the last entry holds the
        # sampler's ties_overflow after a sampling step, reported once (sampler.TIES_OVERFLOW)
        self._readback = [torch.empty(rows + 1, dtype=torch.long, pin_memory=self.device.type == "cuda")
                          for _ in range(2)]  # fmt: skip
        self.ties_overflow = torch.zeros(1, dtype=torch.long, device=self.device)
        self._ties_reported = False
        self._readback_done = [torch.cuda.Event() for _ in range(2)] if self.device.type == "cuda" else [None] * 2
        self._readback_turn = 0

    # -- the public, thread-safe side ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("BatchEngine: start() after shutdown()")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="g4ops-batch-engine", daemon=True)
            self._thread.start()

    def submit(self, prompt_ids, params: SamplingParams, on_event: Callable[[TokenEvent], None]) -> int:
        check_request(prompt_ids, params, self.max_context, self.vocab_size)
        if not callable(on_event):
            raise ValueError("on_event must be callable")
        req = _Request(0, [int(t) for t in prompt_ids], params, on_event, frozenset(params.stop_token_ids))
        with self._lock:
            if self._stopping:
                raise RuntimeError("BatchEngine: submit() after shutdown()")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"BatchEngine: {len(self._waiting)} requests already wait (max_waiting)")
            req.id = next(self._ids)
            self._waiting.append(req)
            self._live.add(req.id)
            self._wake.notify()
        return req.id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._live:
                self._cancels.add(request_id)
                self._wake.notify()

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(running=self._held, waiting=len(self._waiting), kv_slots_in_use=self._held,
                               kv_slots_total=self.max_batch, generated_tokens=self._tokens,
                               decode_steps=self._steps)  # fmt: skip

    def warmup(self, params=()) -> None:
        """Before start(): capture (with compile=True, compile first) the decode step of every batch bucket for
        greedy decoding and for the sampling mode each of `params` (SamplingParams) runs in alone, capture the
        prefill of every padded width (pad_prefill) and compile the prefill graphs of one row and of several.
        Otherwise each is made the first time a batch needs it, stalling that step (compiling E4B takes tens of
        seconds)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                raise RuntimeError("BatchEngine: warmup() goes before start()")
        modes = {self._mode([])} | {self._mode([_Request(0, [], p, None, frozenset())]) for p in params}
        with torch.no_grad():
            self._warm_prefill()
            for mode in sorted(modes, key=repr):
                for b in self.buckets:
                    if self.use_graph:
                        self._graph(b, mode)
                    else:
                        with self._rows_off():
                            self._warm_step(b, mode)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting requests, end every request in flight with "cancelled", join the engine thread."""
        with self._lock:
            self._stopping = True
            thread = self._thread
            self._wake.notify()
        if thread is None:
            self._cancel_everything()  # never started: nothing else touches the state
        elif thread is not threading.current_thread():
            thread.join(timeout)

    # -- the loop -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._lock:
                while not self._stopping and not (self._waiting or self._cancels or self._busy()):
                    self._wake.wait()
                if self._stopping:
                    break
            self.step()
        self._cancel_everything()

    def _busy(self) -> bool:
        return self._held > 0

    @torch.no_grad()
    def step(self) -> bool:
        """One loop iteration: cancels, admissions, one prefill call, one decode step. -> whether work was done."""
        try:
            self._apply_cancels()
            self._admit()
            worked = False
            if self._prefilling:
                self._prefill()
                worked = True
            if self._launched is not None or any(self._decodes(r) for r in self._rows):
                self._decode()
                worked = True
            return worked
        except Exception as e:  # noqa: BLE001 - a bug outside the model calls: fail what is in flight, keep going
            log.exception("BatchEngine: loop iteration failed")
            for req in [r for r in self._rows if r is not None]:
                self._finish(req, None, "error", f"{type(e).__name__}: {e}")
            return True

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            waiting = [r for r in self._waiting if r.id in cancels]
            for req in waiting:
                self._waiting.remove(req)
        for req in waiting:
            self._end_unadmitted(req, "cancelled")
        for req in [r for r in self._rows if r is not None and r.id in cancels]:
            self._finish(req, None, "cancelled")

    def _admit(self) -> None:
        while True:
            row = next((i for i, r in enumerate(self._rows) if r is None), None)
            with self._lock:
                if row is None or not self._waiting:
                    return
                req = self._waiting.popleft()
                self._held += 1
            req.row = row
            self._rows[row] = req
            self._assign_row(row, req.params)
            self._prefilling.append(req)

    def _assign_row(self, row: int, p: SamplingParams) -> None:
        """Set a newly admitted request's per-row step inputs (its sampling settings)."""
        greedy = p.temperature == 0
        self.temperature[row] = p.temperature if not greedy else 1.0
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.greedy[row] = greedy
        self.seed[row] = p.seed if p.seed is not None else 0
        self.seeded[row] = p.seed is not None
        self.counter[row] = 0

    def _prefill(self) -> None:
        """One prefill call over the oldest prompts in prefill: each contributes its next chunk (at most
        prefill_chunk tokens), left-padded to the longest; as many prompts as fit in prefill_chunk padded tokens
        (the oldest always goes)."""
        batch, width = [], 0
        for req in self._prefilling:
            n = min(self.prefill_chunk, len(req.prompt) - req.prefilled)
            if batch and (len(batch) + 1) * max(width, n) > self.prefill_chunk:
                break
            batch.append((req, n))
            width = max(width, n)
        end = max(r.prefilled + n for r, n in batch)
        padded = self._padded_shape(batch)
        if padded is not None:
            width = end = padded[1]  # full layers read slots [0, width): those past the prompts are masked
        elif is_compiled(self._prefill_fn, self._prefill_logits):
            # a size of 1 would compile a graph of its own (size 1 is specialised): a 1-token chunk gets one
            # more padding token (it writes to scratch), end = 1 reads one more, masked, slot
            width, end = max(width, _MIN_COMPILED_SIZE), max(end, _MIN_COMPILED_SIZE)
        try:
            ids = [[0] * (width - n) + req.prompt[req.prefilled : req.prefilled + n] for req, n in batch]
            rows = [[r.row for r, _ in batch], [r.prefilled for r, _ in batch], [n for _, n in batch]]
            # padding rows up to the captured row count: no real token, so they write only scratch slots
            filler = 0 if padded is None else padded[0] - len(batch)
            ids += [[0] * width] * filler
            rows = [rows[0] + [rows[0][0]] * filler, rows[1] + [0] * filler, rows[2] + [0] * filler]
            logits = self._run_prefill(torch.tensor(ids, dtype=torch.long, device=self.device),
                                       torch.tensor(rows, dtype=torch.long, device=self.device), end,
                                       rows[0][0] if len(batch) == 1 else None, graphed=padded is not None)  # fmt: skip
            first = {}
            for i, (req, n) in enumerate(batch):
                req.prefilled += n
                if req.prefilled == len(req.prompt):
                    row = slice(req.row, req.row + 1)
                    first[i] = self._choose(logits[i : i + 1], row, self._mode([req]), self.counter[row])
            first = {i: int(t[0]) for i, t in first.items()}  # one sync per finished prompt
        except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
            log.exception("BatchEngine: prefill of requests %s failed", [r.id for r, _ in batch])
            for req, _ in batch:
                self._finish(req, None, "error", f"{type(e).__name__}: {e}")
            return
        for i, token in first.items():
            req = batch[i][0]
            self._prefilling.remove(req)
            r = req.row
            self.next_ids[r, 0] = token
            self.position[r] = len(req.prompt)
            self.counter[r] = 1
            self._emit_token(req, token, activate=True)

    def _prefill_logits(self, input_ids: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        first: int | None = None):  # fmt: skip
        """The prefill call's model call (compiled by decoder.compiled_prefill, without `first`): input_ids [k, N]
        left-padded, rows [3, k] (each row's KV row, cached length and chunk length), slots [end] (any values: its
        size is end = max(cached + chunk), a marked dynamic size, not an int a graph would specialise on) -> fp32
        logits [k, V] of the last position. `first`: the KV row of a 1-row call, eager only."""
        call = _PrefillCall(self.cache, rows[0], rows[1], rows[2], input_ids.shape[1], slots.shape[0], first)
        return self.model(
            input_ids=input_ids, attention_mask=call.masks(), position_ids=call.position_ids,
            **{self._cache_kw: call}, use_cache=True, logits_to_keep=1,
        ).logits[:, -1].float()  # fmt: skip

    def _warm_prefill(self) -> None:
        """Capture the prefill graph of every (row count, width) whole prompts can be padded to (pad_prefill on
        CUDA); compile the prefill graphs of a 1-row call and of a several-row call (size 1 is specialised; chunk
        lengths and `end` are kept >= 2). Both on calls whose tokens are all padding: those write only the scratch
        slots. These are every graph the prefill needs."""
        if self.pad_prefill and self.use_graph:
            for k, width in self._padded_shapes():
                meta = torch.zeros(3, k, dtype=torch.long, device=self.device)  # row 0, nothing cached, no token
                self._run_prefill(torch.zeros(k, width, dtype=torch.long, device=self.device), meta, width,
                                  graphed=True)  # fmt: skip
        if not is_compiled(self._prefill_fn, self._prefill_logits):
            return
        # a typical chunk: inductor picks kernel configs from the sizes it first sees
        width = max(_MIN_COMPILED_SIZE, min(256, self.prefill_chunk, self.max_context))
        for k in sorted({1, min(2, self.max_batch)}):
            meta = torch.tensor([list(range(k)), [0] * k, [0] * k], dtype=torch.long, device=self.device)
            self._run_prefill(torch.zeros(k, width, dtype=torch.long, device=self.device), meta, width)

    def _padded_shapes(self) -> list[tuple[int, int]]:
        """Every (row count, width) a prefill call can be padded to: a batch bucket of rows times a prefill width,
        within one chunk (the stall bound), the context and PREFILL_GRAPH_TOKENS."""
        limit = min(self.prefill_chunk, PREFILL_GRAPH_TOKENS)
        return [(k, w) for k in self.buckets for w in PREFILL_WIDTHS if k * w <= limit and w <= self.max_context]

    def _padded_shape(self, batch) -> tuple[int, int] | None:
        """With pad_prefill, the (row count, width) a prefill call is padded to when it holds whole prompts (each
        from its first token, in one chunk): the smallest batch bucket holding them, and the prefill width of the
        longest (one captured prefill serves every call up to its shape; padding rows hold no real token). None
        otherwise (a later chunk, or a shape past the chunk, the context or PREFILL_GRAPH_TOKENS)."""
        if not self.pad_prefill or any(req.prefilled or n != len(req.prompt) for req, n in batch):
            return None
        k = next((b for b in self.buckets if b >= len(batch)), None)
        if k is None:
            return None
        shape = (k, prefill_width(max(n for _, n in batch), k))
        return shape if shape in self._padded_shapes() else None

    def _run_prefill(self, input_ids: torch.Tensor, rows: torch.Tensor, end: int, first: int | None = None,
                     graphed: bool = False):  # fmt: skip
        slots = torch.empty(end, dtype=torch.bool, device=self.device)  # only its size is read
        if graphed and self.use_graph:
            return self._prefill_graphs(tuple(input_ids.shape), input_ids, rows, slots)  # no `first`: gathers
        if is_compiled(self._prefill_fn, self._prefill_logits):
            try:
                return self._prefill_fn(input_ids, rows, slots)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager prefill still works
                if isinstance(exc, torch.OutOfMemoryError):
                    raise
                # a compiler error raises while tracing or building, before the graph runs: the cache is untouched,
                # so the eager call below reads the ring as it was before this chunk
                log.warning("BatchEngine: compiling the prefill failed; prefill runs eagerly (slower): %s: %s",
                            type(exc).__name__, exc)  # fmt: skip
                self._prefill_fn = self._prefill_logits
        return self._prefill_logits(input_ids, rows, slots, first)

    @staticmethod
    def _mode(reqs) -> tuple:
        """Which captured step runs: (some row samples, some sampling row is seeded, k_cap). k_cap: the smallest of
        K_CAPS bounding every sampling row's top_k (top-k's threshold from a topk, not a sort of the vocabulary)."""
        sampled = [r.params for r in reqs if r.params.temperature != 0]
        if not sampled:
            return False, False, None
        k_cap = next((c for c in K_CAPS if all(0 < p.top_k <= c for p in sampled)), None)
        return True, any(p.seed is not None for p in sampled), k_cap

    @staticmethod
    def _decodes(req: _Request | None) -> bool:
        """Whether the next step decodes this row: prefilled, and its token in flight (if any) not its last by length
        (that row would write past its request's slots; a row whose in-flight token turns out to end it decodes one
        step in vain, inside its own slots)."""
        return (req is not None and req.prefilled == len(req.prompt)
                and req.generated + req.in_flight < req.params.max_new_tokens)  # fmt: skip

    def _decode(self) -> None:
        """Launch the next decode step, then emit the tokens of the one launched before: the host reads one step
        back while the device runs the next, so what the host does between steps (emitting tokens, admitting,
        this loop) does not leave the GPU idle."""
        previous, self._launched = self._launched, None
        rows = [i for i, r in enumerate(self._rows) if self._decodes(r)]
        if rows:
            self._launch(rows)
        if previous is not None:
            self._emit_step(previous)

    def _launch(self, rows: list[int]) -> None:
        b = next(k for k in self.buckets if k > rows[-1])
        mode = self._mode([self._rows[i] for i in rows])
        graph = None
        if self.use_graph:
            try:
                graph = self._graph(b, mode)
            except Exception:  # noqa: BLE001 - e.g. a patched module that syncs: eager still serves
                log.exception("BatchEngine: capturing the decode step failed; it runs eagerly from now on")
                self.use_graph = False
        try:
            if graph is not None:
                graph.replay()
            else:
                self._run_step(b, mode)
            turn, self._readback_turn = self._readback_turn, self._readback_turn ^ 1
            tokens, done = self._readback[turn][:b], self._readback_done[turn]
            tokens.copy_(self.next_ids[:b, 0], non_blocking=done is not None)
            ties = self._readback[turn][-1:] if mode[0] and mode[2] is not None else None
            if ties is not None:
                ties.copy_(self.ties_overflow, non_blocking=done is not None)
            if done is not None:
                done.record()
        except Exception as e:  # noqa: BLE001 - the step's rows fail; the engine stays up
            log.exception("BatchEngine: decode step failed")
            for i in rows:
                self._finish(self._rows[i], None, "error", f"{type(e).__name__}: {e}")
            return
        with self._lock:
            self._steps += 1
        for i in rows:
            self._rows[i].in_flight += 1
        self._launched = _LaunchedStep([(i, self._rows[i]) for i in rows], tokens, done, ties)

    def _emit_step(self, step: _LaunchedStep) -> None:
        """Emit a launched step's tokens to the requests that still hold their rows (one cancelled or ended since
        gets nothing)."""
        try:
            if step.done is not None:
                step.done.synchronize()
            tokens = step.tokens.tolist()
            if step.ties is not None and step.ties.item() and not self._ties_reported:
                log.warning(TIES_OVERFLOW)
                self._ties_reported = True
        except Exception as e:  # noqa: BLE001 - the step's rows fail; the engine stays up
            log.exception("BatchEngine: decode step failed")
            for i, req in step.rows:
                if req.row == i:
                    self._finish(req, None, "error", f"{type(e).__name__}: {e}")
            return
        for i, req in step.rows:
            req.in_flight -= 1
            if req.row == i:
                self._emit_token(req, tokens[i])

    def _emit_token(self, req: _Request, token: int, activate: bool = False) -> None:
        req.generated += 1
        with self._lock:
            self._tokens += 1
        reason = "stop" if token in req.stops else "length" if req.generated >= req.params.max_new_tokens else None
        if reason is not None:
            self._finish(req, token, reason)
            return
        try:
            req.on_event(TokenEvent(token, None))
        except Exception:  # noqa: BLE001 - the contract: a raising on_event cancels its own request only
            log.exception("BatchEngine: on_event of request %d raised; cancelling it", req.id)
            self._finish(req, None, "cancelled")
            return
        if activate:
            self.active[req.row] = True

    def _finish(self, req: _Request, token: int | None, reason: str, error: str | None = None) -> None:
        """Free the request's row and send its final event."""
        if req.row >= 0 and self._rows[req.row] is req:
            self.active[req.row] = False
            self._rows[req.row] = None
            with self._lock:
                self._held -= 1
        if req in self._prefilling:
            self._prefilling.remove(req)
        req.row = -1
        self._end_unadmitted(req, reason, token, error)

    def _end_unadmitted(self, req: _Request, reason: str, token: int | None = None, error: str | None = None):
        with self._lock:
            self._live.discard(req.id)
            self._cancels.discard(req.id)
        try:
            req.on_event(TokenEvent(token, reason, error))
        except Exception:  # noqa: BLE001 - the request is over either way
            log.exception("BatchEngine: on_event of request %d raised on its final event", req.id)

    def _cancel_everything(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        with torch.no_grad():
            for req in [r for r in self._rows if r is not None]:
                self._finish(req, None, "cancelled")
        for req in waiting:
            self._end_unadmitted(req, "cancelled")

    # -- the decode step ----------------------------------------------------------------------------------------
    def _step_attention(self):
        return step_attention(self._attention_configs)

    def _choose(self, logits: torch.Tensor, rows: slice, mode: tuple, counter: torch.Tensor):
        """logits [n, V] fp32 of the rows `rows` -> [n] tokens under those rows' settings."""
        sampled, seeded, k_cap = mode
        if not sampled:
            return logits.argmax(dim=-1)
        noise = None
        if seeded:  # seeded rows: noise per (seed, token index, token id), at the ids the sampler looks at

            def noise(ids):
                own = noise_at(self.seed[rows], counter, ids)
                return torch.where(self.seeded[rows, None], own, torch.empty_like(own).exponential_())

        return sample(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows],
                      self.greedy[rows], noise, k_cap=k_cap, ties_overflow=self.ties_overflow)  # fmt: skip

    def _logits(self, next_ids: torch.Tensor, position: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The model call of the step over the first b rows ([b] views) -> fp32 logits [b, V]."""
        call = _DecodeCall(self.cache, next_ids.shape[0], position, active)
        logits = self.model(
            input_ids=next_ids, attention_mask=call.masks(), **{self._cache_kw: call}, use_cache=True,
            position_ids=torch.where(active, position, 0)[:, None], logits_to_keep=1,
        ).logits  # fmt: skip
        return logits[:, -1].float()

    def _step(self, b: int, mode: tuple) -> None:
        """Decode rows [0, b): each decoding row's next_ids at its position -> the next token in next_ids."""
        active, position = self.active[:b], self.position[:b]
        logits = self._logits_fn(self.next_ids[:b], position, active)
        token = self._choose(logits, slice(0, b), mode, self.counter[:b])
        self.next_ids[:b, 0].copy_(torch.where(active, token, self.next_ids[:b, 0]))
        step = active.long()
        self.position[:b].add_(step)
        self.counter[:b].add_(step)

    def _run_step(self, b: int, mode: tuple) -> None:
        with self._step_attention():
            self._step(b, mode)

    def _warm_step(self, b: int, mode: tuple) -> None:
        """`_run_step` before a capture: with compile=True the first one compiles, and a compiler failure leaves the
        engine on the uncompiled step (slower, the same tokens) with a warning instead of failing the server's
        start."""
        try:
            self._run_step(b, mode)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the uncompiled step still works
            if self._logits_fn == self._logits or isinstance(exc, torch.OutOfMemoryError):  # bound methods: ==
                raise
            log.warning("BatchEngine: compiling the decode step failed; every bucket runs the uncompiled step "
                        "(slower): %s: %s", type(exc).__name__, exc)  # fmt: skip
            self._logits_fn = self._logits
            self._run_step(b, mode)

    def _graph(self, b: int, mode: tuple) -> torch.cuda.CUDAGraph:
        """The captured step of bucket b in `mode`, captured now if new. Warm-up and capture run the step for real
        with every row switched off, which changes nothing but the scratch slots and the generator."""
        graph = self._graphs.get((b, mode))
        if graph is not None:
            return graph
        with self._rows_off():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compilation, lazy kernel loads, cuBLAS workspaces: capture forbids them
                    self._warm_step(b, mode)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), self._step_attention():
                self._step(b, mode)
        self._graphs[(b, mode)] = graph
        return graph

    @contextlib.contextmanager
    def _rows_off(self):
        """Every row switched off: a step then writes only the scratch slots (and draws from the generator)."""
        saved = self.active.clone()
        self.active.zero_()
        try:
            yield
        finally:
            self.active.copy_(saved)
