"""Decoding with the whole step in one CUDA graph: `Decoder(model).generate(input_ids, n, do_sample=...)`.

Why: a profile of `generate(cache_implementation="static")` on an H200
(bench/results/2026-11-29-h200-decode-and-profile.md) shows the GPU busy for 1.77 ms of each 3.6 ms step at batch 1
and 12 layers. The compiled forward is CUDA-graphed, but the
Python around it (input preparation, logits processors, stopping criteria, a host sync per token) is not. Here one
replay runs the whole step on the device: transformers' own Gemma-4 modules (so `g4ops.enable()` patches apply),
the softcapped logits, the token choice (argmax, or engine.sampler's warpers and draw), the KV write and the position
advance. The host only replays, and reads the tokens back once every `sync_every` steps to stop at EOS (every step,
one step behind the device, for a streamer or `max_time`).

The KV cache is engine.cache.GraphKVCache. Attention in the step is `g4ops.decode_attention` (while the decoder
traces or runs a step, its model's Gemma-4 text configs name the "g4ops_graph_decode" attention implementation;
prefill keeps the model's own): one pass over the slots, the query heads of a KV head sharing its reads, split over
the slots across the GPU. Stock's sdpa path repeats K/V per query head and runs one thread block per head: on the
H200 it took 16 us per sliding layer and 56 us per full layer, where a whole layer's step takes about 140 us
(bench/results/2026-11-30-h200-session6-decode.md).

Exactness: the modules and dtypes are stock's, so the logits equal stock's up to attention's rounding: the order in
which it sums over the cached keys (the ring is not in position order, and masked slots differ in number), and
decode_attention keeps the probabilities in fp32 where some of stock's SDPA kernels round them to 16 bits. The token
is chosen from the fp32 copy of the logits, as `generate` does: the repetition penalty (if on), EOS held back
for `min_new_tokens` and `suppress_tokens` first, then greedy's first argmax or the sampler (temperature, top-k,
top-p, min-p as transformers' warpers, bit for bit). Sampling draws from torch's generator of the model's device,
inside the graph (philox offsets advance per replay), so `torch.manual_seed(s)` before `generate` reproduces its
tokens; they are not stock's tokens for that seed (stock draws with `torch.multinomial`, a host-synchronising op),
only the same distribution. Prompts of different lengths come left-padded, as for stock.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import math
import time

import torch

from .. import ops
from .cache import GraphKVCache, text_attentions
from .sampler import TIES_OVERFLOW, check_params, divide_as_by_float, sample

logger = logging.getLogger("g4ops")
DECODE_ATTENTION = "g4ops_graph_decode"  # the attention implementation name the step's configs carry
K_CAPS = (64, 256, 1024)  # top-k bounds a sampling graph may use: sampler.sample's k_cap (it samples from candidates)
_MAX_EOS_IDS = 8  # the EOS ids min_new_tokens holds back live in a fixed-size buffer (the graph's shapes are fixed)
# why a repetition penalty is not taken over left-padded prompts (the Decoder raises it, the generate route says it)
PENALTY_WITH_PADDING = ("repetition_penalty with left-padded prompts is not supported (transformers 5.24 leaves the "
                        "padding out of the penalty, earlier releases count it)")  # fmt: skip
PREFILL_BACKEND = "inductor"  # torch.compile backend of the compiled prefill (tests on CPU swap in a cheaper one)
# Prompt widths the prefill is left-padded to, so that one captured CUDA graph serves every prompt length up to it:
# an eager 42-layer E4B prefill is launch-bound (45.2 ms to the first token for 512 tokens on the H200, 19.7 ms
# replayed from a graph: bench/results/2026-12-02-h200-session13.md). Beyond the last width, or PREFILL_GRAPH_TOKENS
# rows x width, the prefill runs eagerly: there the work outweighs the launches, and a graph's memory pool would
# hold the activations of that many tokens for good.
PREFILL_WIDTHS = (16, 32, 64, 128, 256, 512, 1024)
PREFILL_GRAPH_TOKENS = 8192


def prefill_width(prompt: int, batch: int = 1) -> int:
    """The width a prompt of `prompt` tokens is left-padded to for a captured prefill (itself if none fits)."""
    return next((w for w in PREFILL_WIDTHS if w >= prompt and w * batch <= PREFILL_GRAPH_TOKENS), prompt)


class PrefillGraphs:
    """`fn(*tensors)` replayed from a CUDA graph per key (a prefill width or shape): the first call of a key runs `fn`
    eagerly on a side stream (the call's real work, and the capture's warm-up: lazy kernel loads, cuBLAS
    workspaces), then records it; recording runs nothing, so what that call wrote (the KV cache) stays. Later calls
    copy their tensors into the recorded inputs and replay. A key whose capture fails runs eagerly from then on,
    after one warning. The output of a replay is the graph's own tensor: read it before the next call."""

    def __init__(self, fn, what: str):
        self.fn, self.what = fn, what
        self.graphs: dict = {}  # key -> (graph, recorded inputs, recorded output), or None: eager
        self._pool = None  # one memory pool for every key: the calls never overlap

    def __call__(self, key, *tensors: torch.Tensor):
        if key in self.graphs:
            entry = self.graphs[key]
            if entry is None:
                return self.fn(*tensors)
            graph, recorded, output = entry
            for r, t in zip(recorded, tensors):
                r.copy_(t)
            graph.replay()
            return output
        recorded = [t.clone() for t in tensors]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = self.fn(*recorded)
        torch.cuda.current_stream().wait_stream(side)
        first = first.clone()  # used on this stream from here on
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                output = self.fn(*recorded)
        except RuntimeError as e:
            logger.warning("g4ops: %s (%s) could not be captured as a CUDA graph and runs eagerly: %s", self.what,
                           key, e)  # fmt: skip
            torch.cuda.synchronize()
            self.graphs[key] = None
            return first
        self._pool = graph.pool()
        self.graphs[key] = (graph, recorded, output)
        return first


def compiled_prefill(fn, dynamic_dims: dict[int, tuple[int, ...]]):
    """torch.compile a prefill model call with dynamic shapes: one graph serves every prompt length (and, in
    BatchEngine, every row count and cached length), where fixed-length buckets would pad the arithmetic and cost
    one compilation per bucket. `dynamic_dims`: {positional argument: its dimensions that vary per call}, marked
    dynamic on each call (where the size is not 1: size 1 is specialised, a graph of its own); everything else
    (weights, the cache's buffers) stays static, which on the tiny model on a CPU made Dynamo and AOTAutograd 2.6x
    faster than dynamic=True and the graph half as many nodes. Every value that varies per call reaches the graph
    as a marked size or a tensor's contents, so Dynamo guards on no per-call Python value. Duck sizing is off while
    it traces: it would give marked sizes that happen to be equal in the first call one symbol, and recompile when
    they differ. The Decoder's 1-token prompts get a graph of their own; BatchEngine compiles one graph for 1-row
    calls and one for several (it pads 1-token chunks to 2)."""
    from torch.fx.experimental import _config as fx_config

    compiled = torch.compile(fn, fullgraph=True, backend=PREFILL_BACKEND)

    @functools.wraps(fn)
    def run(*args):
        for i, dims in dynamic_dims.items():
            varying = [d for d in dims if args[i].shape[d] != 1]
            if varying:
                torch._dynamo.mark_dynamic(args[i], varying)
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args)

    return run


def is_compiled(fn, eager) -> bool:
    return fn != eager  # bound methods: equal, never identical


def decode_step_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """AttentionInterface entry for the decode step: query [B, Hq, 1, D] over the cache buffers key/value
    [B, Hkv, slots, D] under the step's bool mask [B, 1, 1, slots] -> ([B, 1, Hq, D], None)."""
    if query.shape[2] != 1 or not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise RuntimeError(f"{DECODE_ATTENTION} attention serves the Decoder's decode step only (one query token "
                           f"and the cache's bool mask), got query {list(query.shape)}")  # fmt: skip
    if dropout or kwargs.get("softcap") is not None:
        raise RuntimeError(f"{DECODE_ATTENTION} attention has no dropout or logit softcap")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ops.decode_attention(query, key, value, attention_mask, scale).transpose(1, 2), None


def _register_decode_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_step_attention)


def as_id_list(ids) -> list[int]:
    """None, an int, a list or a tensor of token ids -> list of ints."""
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        return [int(t) for t in ids.flatten()]
    return [int(ids)] if isinstance(ids, int) else [int(t) for t in ids]



@contextlib.contextmanager
def step_attention(configs):
    """Name DECODE_ATTENTION in the text attention configs while a decode step is traced, captured or run eagerly
    (prefill keeps the model's own implementation)."""
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation = name

class Decoder:
    """Greedy or sampled decoding of a Gemma-4 causal LM with the decode step captured once as a CUDA graph.

    decoder = Decoder(model, batch_size=1, max_length=2048)
    tokens = decoder.generate(input_ids, max_new_tokens=256)                            # greedy
    tokens = decoder.generate(input_ids, 256, do_sample=True, top_k=64, top_p=0.95)     # sampled
    # -> [B, prompt + generated], like model.generate

    `model`: a transformers Gemma4ForCausalLM (or Gemma4ForConditionalGeneration, text only). On CUDA each kind of
    step (greedy; sampling with a top-k candidate size from K_CAPS or the full sort) is captured at its first
    `generate` (`cuda_graph=False` runs it eagerly, as on other devices). With `compile=True` the step's model call is
    compiled by torch.compile first (fewer, fused kernels; costs compile time; the sampler stays eager, so one
    compilation serves every kind of step). `compile_prefill=True` runs the
    prefill's model call compiled too (`compiled_prefill`: dynamic shapes, one graph for every prompt length but 1;
    eager, a prefill is launch-bound); a compiler failure leaves the prefill eager, with one warning. Off by default:
    on the H200 (2026-12-01, torch 2.11) a routed sampled `generate` with it on printed nothing in about 170 s, where
    its first call took 48.8 s with the prefill eager (bench/results/2026-12-01-h200-session11.md); its speed and
    first-call time are not measured yet.
    `pad_prefill` (default: on CUDA, unless the prefill is compiled): the prompt is left-padded to its
    `prefill_width`, and with `cuda_graph` the prefill's model call is replayed from a CUDA graph captured per width
    at its first use (that call runs eagerly, then captures). Padding is what the decoder does for batches of
    different lengths anyway: the padded slots are masked, and the returned ids hold the prompt as given.
    `suppress_tokens`: ids never chosen (as generate's `suppress_tokens`). `decode_attention=False` keeps the
    model's own attention implementation in the step (for comparison).
    """

    def __init__(self, model, batch_size: int = 1, max_length: int = 2048, compile: bool = False,
                 cuda_graph: bool | None = None, sync_every: int = 32, suppress_tokens=None,
                 decode_attention: bool = True, compile_prefill: bool = False,
                 pad_prefill: bool | None = None):  # fmt: skip
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"Decoder: batch_size must be >= 1 and max_length >= 2, got {batch_size}, "
                             f"{max_length}")  # fmt: skip
        param = next(model.parameters())
        self.model = model
        self.batch, self.max_length, self.sync_every = batch_size, max_length, max(1, sync_every)
        self.device = param.device
        self.use_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError(f"Decoder: cuda_graph=True needs the model on a CUDA device, not {self.device}")
        dev = self.device
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.cache = GraphKVCache(model, batch_size, max_length, self.position)
        self.next_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(batch_size, max_length, dtype=torch.long, device=dev)
        self.suppress = torch.tensor(as_id_list(suppress_tokens), dtype=torch.long, device=dev)
        # per call, read by the captured step: EOS ids (padded by repetition) and how long they stay suppressed
        self.hold_ids = torch.zeros(_MAX_EOS_IDS, dtype=torch.long, device=dev)
        self.hold_until = torch.zeros(1, dtype=torch.long, device=dev)  # in new tokens
        self.prompt_len = torch.zeros(1, dtype=torch.long, device=dev)
        # per call and row, read by a sampling step (sampler.sample's parameters)
        self.temperature = torch.ones(batch_size, device=dev)
        self.top_k = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.top_p = torch.ones(batch_size, dtype=torch.float64, device=dev)
        self.min_p = torch.zeros(batch_size, device=dev)
        self.greedy_rows = torch.zeros(batch_size, dtype=torch.bool, device=dev)
        self.ties_overflow = torch.zeros(1, dtype=torch.bool, device=dev)  # per call: sampler.TIES_OVERFLOW
        # ("greedy",) or ("sample", k_cap or None, top-k on, top-p on, min-p on): static, one graph each (a warper
        # no row uses is left out of the graph, as generate leaves it out of its list)
        self.mode = ("greedy",)
        # per call: repetition_penalty (RepetitionPenaltyLogitsProcessor) over the ids so far, out[:, seen_from:];
        # `penalized` is static (a graph with it and one without, as the modes)
        self.penalty = torch.ones(1, device=dev)
        self.seen_from = torch.zeros(1, dtype=torch.long, device=dev)  # the prompt's first column in `out`
        self.penalized = False
        # compile=True compiles the step's model call, not its sampler (as BatchEngine): one compilation serves every
        # sampling mode, and Inductor's scan over the vocabulary (top-p's cumsum) failed to generate code for a batch
        # of 4 (H200, torch 2.11, 2026-12-02); the eager sampler's kernels replay from the same CUDA graph
        self.logits_fn = torch.compile(self._step_logits, fullgraph=True) if compile else self._step_logits
        self.prefill_fn = (compiled_prefill(self._prefill_logits, {0: (1,)}) if compile_prefill  # the length
                           else self._prefill_logits)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pad_prefill = self.device.type == "cuda" and not compile_prefill if pad_prefill is None else pad_prefill
        self.prefill_graphs = PrefillGraphs(self._prefill_logits, "the Decoder's prefill")  # one per width
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns until 5.40)
        params = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
        self._pool = None
        # the text attention configs the step switches to DECODE_ATTENTION (usually one shared text config)
        self._attention_configs = []
        if decode_attention:
            _register_decode_attention()
            for attn in text_attentions(model):
                config = getattr(attn, "config", None)
                if config is not None and all(config is not c for c in self._attention_configs):
                    self._attention_configs.append(config)

    @property
    def graph_key(self) -> tuple:
        """Which captured step runs: the token choice (`mode`) and whether the repetition penalty is on."""
        return self.mode, self.penalized

    @property
    def graph(self):
        """The graph of the current kind of step, once captured (None before, and off CUDA)."""
        return self.graphs.get(self.graph_key)

    def _step_attention(self):
        """The step's attention implementation, only while the step is traced, captured or run eagerly."""
        return step_attention(self._attention_configs)

    def run_step(self):
        """One decode step, not replayed from the graph (what the graph holds, run eagerly or compiled)."""
        with self._step_attention():
            self._step()

    # -- the step -------------------------------------------------------------------------------------------------
    def _logits_to_next(self, logits: torch.Tensor, generated: torch.Tensor, seen_to: torch.Tensor | int
                        ) -> torch.Tensor:  # fmt: skip
        """`generated`: new tokens before this one ([1] device tensor); `seen_to`: the column of `out` holding the
        last id so far."""
        last = logits[:, -1].float()  # as generate: fp32 copy of the last position
        if self.penalized:  # generate's first processor; the -inf fills below are unchanged by it either way
            last = self._penalize(last, seen_to)
        if self.suppress.numel():
            last = last.index_fill(-1, self.suppress, float("-inf"))
        held = last.index_fill(-1, self.hold_ids, float("-inf"))
        scores = torch.where(generated < self.hold_until, held, last)
        if self.mode[0] == "greedy":
            return scores.argmax(dim=-1)  # the first maximum, as generate
        _, k_cap, top_k_on, top_p_on, min_p_on = self.mode
        return sample(scores, self.temperature, self.top_k if top_k_on else None, self.top_p if top_p_on else None,
                      self.min_p if min_p_on else None, self.greedy_rows, k_cap=k_cap,
                      ties_overflow=self.ties_overflow)  # fmt: skip

    def _penalize(self, scores: torch.Tensor, seen_to: torch.Tensor | int) -> torch.Tensor:
        """RepetitionPenaltyLogitsProcessor on fp32 scores [B, V]: the score of every id in the sequence so far
        (out[:, seen_from : seen_to + 1]) is multiplied by the penalty where negative and divided by it otherwise,
        with the arithmetic `score * float` and `score / float` do on this device (sampler.divide_as_by_float).
        Fixed shapes: a mask over the whole `out`."""
        vocab = scores.shape[-1]
        columns = torch.arange(self.out.shape[1], device=self.device)
        valid = (columns >= self.seen_from) & (columns <= seen_to) & (self.out < vocab)  # HF drops ids past V
        seen = torch.zeros_like(scores).scatter_reduce_(1, self.out.clamp(max=vocab - 1), valid.to(scores.dtype),
                                                         "amax") > 0  # fmt: skip
        divided = divide_as_by_float(scores, self.penalty)
        return torch.where(seen, torch.where(scores < 0, scores * self.penalty, divided), scores)

    def _step_logits(self) -> torch.Tensor:
        """The step's model call: the logits [B, 1, V] of the token in `next_ids` at `position`."""
        position_ids = self.position.view(1, 1) - self.cache.pad  # RoPE positions skip the left padding
        return self.model(
            input_ids=self.next_ids, attention_mask=self.cache.decode_masks(), position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **{self._cache_kwarg: self.cache},
        ).logits  # fmt: skip

    def _step(self):
        """Decode the token in `next_ids` at `position`; leaves the next token in `next_ids` and in `out`."""
        nxt = self._logits_to_next(self.logits_fn(), self.position + 1 - self.prompt_len, self.position)
        self.position.add_(1)
        self.out.index_copy_(1, self.position, nxt[:, None])
        self.next_ids.copy_(nxt[:, None])

    def _capture(self):
        """Warm up on a side stream (compilation, cuBLAS handles, lazy kernel loads), then record one step. The
        warm-up and the capture really run the step on whatever state there is; that is harmless, because prefill
        rewrites the state and a step writes a KV slot before any mask exposes it. The random draws they make are
        undone (fork_rng), so a seed set before the call gives the same tokens whether or not this call captured."""
        with torch.random.fork_rng(devices=[self.device]):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    try:
                        self.run_step()
                    except Exception as e:  # noqa: BLE001 - any compiler failure: the uncompiled step still works
                        if self.logits_fn == self._step_logits:  # bound methods: equal, never identical
                            raise
                        logger.warning("g4ops: compiling the decode step's model call failed; it runs as a CUDA graph "
                                       "of the uncompiled call (slower): %s: %s", type(e).__name__, e)  # fmt: skip
                        self.logits_fn = self._step_logits
                        self.run_step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # one memory pool for the decoder's graphs: they never run concurrently, and each writes its results
            # into the decoder's own buffers
            try:
                with torch.cuda.graph(graph, pool=self._pool), self._step_attention():
                    self._step()
            except RuntimeError as e:
                if self.graph_key == (("greedy",), False):
                    raise
                # a sampling or penalty op this torch cannot capture: the step still runs, eagerly, and says so
                logger.warning("g4ops: the decode step %s could not be captured as a CUDA graph and runs "
                               "eagerly (slow): %s", self.graph_key, e)  # fmt: skip
                torch.cuda.synchronize()
                self.graphs[self.graph_key] = None
                return
            self._pool = graph.pool()
        self.graphs[self.graph_key] = graph

    # -- generation -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                new_tokens: int = 1) -> int:  # fmt: skip
        """Run the prompt from position 0 and leave its next token (greedy or sampled, by the current mode) in
        `next_ids` (and `out`). `attention_mask` [B, prompt]: 0 marks left padding (as a tokenizer with
        padding_side="left" makes). With `pad_prefill`, the prompt is left-padded further to its
        `prefill_width` where that width and `new_tokens` fit `max_length`. -> the prompt's width in the cache (the
        position of the token left in `next_ids`)."""
        b, n = input_ids.shape
        pad = torch.zeros(b, dtype=torch.long, device=self.device)
        if attention_mask is not None:
            mask = attention_mask.to(self.device).bool()
            pad = n - mask.sum(dim=1)
            if attention_mask.shape != input_ids.shape or not torch.equal(
                    mask, torch.arange(n, device=self.device)[None, :] >= pad[:, None]):  # fmt: skip
                raise ValueError("Decoder: attention_mask must be [batch, prompt] with zeros only as left "
                                 "padding (use padding_side='left')")  # fmt: skip
            if bool((pad >= n).any()):
                raise ValueError("Decoder: a prompt in the batch is all padding")
        width = prefill_width(n, b) if self.pad_prefill else n
        if width + new_tokens > self.max_length:
            width = n
        if width > n:
            input_ids = torch.nn.functional.pad(input_ids, (width - n, 0))  # token 0 in the masked slots
            pad = pad + (width - n)
        self.cache.pad.copy_(pad[:, None])
        self.out[:, :width] = input_ids
        self.seen_from.fill_(width - n)  # the ids so far start at the prompt as given, not at the padding added here
        logits = self._run_prefill(input_ids)
        nxt = self._logits_to_next(logits, torch.zeros_like(self.prompt_len), width - 1)
        self.out[:, width] = nxt
        self.next_ids.copy_(nxt[:, None])
        self.position.fill_(width)
        self.prompt_len.fill_(width)
        return width

    def _prefill_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prefill's model call (compiled by `compiled_prefill`): the prompt [B, n] from position 0 under the
        left padding in `cache.pad` -> the last position's logits [B, 1, V]."""
        n = input_ids.shape[1]  # a SymInt when compiled: the masks and the cache's writes take it from the shape
        position_ids = (torch.arange(n, device=input_ids.device)[None, :] - self.cache.pad).clamp(min=0)
        if n == 1:  # the cache takes one token as a decode step (a write at `position`): that step at position 0
            self.position.zero_()
            masks = self.cache.decode_masks()
        else:
            masks = self.cache.prefill_masks(n)
        return self.model(
            input_ids=input_ids, attention_mask=masks, position_ids=position_ids,
            use_cache=True, logits_to_keep=1, **{self._cache_kwarg: self.cache},
        ).logits  # fmt: skip

    def _run_prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        graphable = width in PREFILL_WIDTHS and width * input_ids.shape[0] <= PREFILL_GRAPH_TOKENS
        if self.use_graph and self.pad_prefill and graphable:
            return self.prefill_graphs(width, input_ids)
        try:
            return self.prefill_fn(input_ids)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager prefill still works
            if not is_compiled(self.prefill_fn, self._prefill_logits) or isinstance(e, torch.OutOfMemoryError):
                raise
            # a compiler error raises while tracing or building, before the graph runs, so the cache is untouched
            # (and a prefill from position 0 rewrites every slot it reads anyway)
            logger.warning("g4ops: compiling the prefill failed; prefill runs eagerly (slower): %s: %s",
                           type(e).__name__, e)  # fmt: skip
            self.prefill_fn = self._prefill_logits
            return self.prefill_fn(input_ids)

    def _set_sampling(self, do_sample: bool, temperature, top_k, top_p, min_p) -> None:
        """Copy one call's sampling settings (scalars or [B] per row) into the step's buffers; choose the mode."""
        if not do_sample:
            self.mode = ("greedy",)
            return
        b = self.batch

        def rows(value, name, dtype):
            t = torch.as_tensor(value, dtype=dtype)
            if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != b):
                raise ValueError(f"Decoder: {name} must be a number or [batch={b}] values, got {list(t.shape)}")
            return t.cpu().expand(b)  # on the host: checked and read there, then copied into the step's buffers

        values = dict(temperature=rows(temperature, "temperature", torch.float32),
                      top_k=rows(0 if top_k is None else top_k, "top_k", torch.long),
                      top_p=rows(1.0 if top_p is None else top_p, "top_p", torch.float64),
                      min_p=rows(0.0 if min_p is None else min_p, "min_p", torch.float32))  # fmt: skip
        check_params(**values)
        for name, t in values.items():
            getattr(self, name).copy_(t)
        self.greedy_rows.zero_()
        ks = as_id_list(values["top_k"])
        k_cap = next((c for c in K_CAPS if all(0 < k <= c for k in ks)), None)
        on = (any(k > 0 for k in ks), bool((values["top_p"] < 1).any()), bool((values["min_p"] > 0).any()))
        self.mode = ("sample", k_cap, *on)

    def _set_penalty(self, repetition_penalty, attention_mask) -> None:
        if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float)) or not (
                repetition_penalty > 0 and math.isfinite(repetition_penalty)):  # fmt: skip
            raise ValueError(f"Decoder: repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")
        self.penalized = repetition_penalty != 1.0
        if self.penalized and attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(f"Decoder: {PENALTY_WITH_PADDING}")
        self.penalty.fill_(float(repetition_penalty))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None, pad_token_id: int = 0,
                 attention_mask: torch.Tensor | None = None, min_new_tokens: int = 0, do_sample: bool = False,
                 temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty: float = 1.0, streamer=None,
                 stop=None, max_time: float | None = None, start_time: float | None = None):  # fmt: skip
        """-> [B, prompt + generated] token ids, as `model.generate` returns them: a row is finished by an EOS id or
        by `stop` (a host function of the ids so far [B, L] -> [B] bool, e.g. transformers' StopStringCriteria),
        padded with `pad_token_id` after that, and generation stops once every row is finished, after
        `max_new_tokens`, or after the first step that ends later than `max_time` seconds from `start_time`
        (default: now). `streamer` (a transformers BaseStreamer) gets `put(prompt)`, then each step's [B] tokens
        (finished rows padded) as they are produced, then `end()`, as stock calls it. Prompts of different lengths
        come left-padded, with their `attention_mask`. Sampling: `do_sample=True` with `temperature`, `top_k`
        (0: off), `top_p` (1: off), `min_p` (0: off), each a number or one value per row. `repetition_penalty` (1:
        off; greedy or sampled): generate's RepetitionPenaltyLogitsProcessor over the prompt and the new ids, for
        unpadded prompts only (transformers 5.24 leaves left padding out of it, earlier releases count it)."""
        start_time = time.time() if start_time is None else start_time
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"Decoder: input_ids must be [batch={self.batch}, prompt], "
                             f"got {list(input_ids.shape)}")  # fmt: skip
        n = input_ids.shape[1]
        if n < 1 or max_new_tokens < 1 or n + max_new_tokens > self.max_length:
            raise ValueError(f"Decoder: prompt {n} + {max_new_tokens} new tokens must fit max_length "
                             f"{self.max_length} (and both be >= 1)")  # fmt: skip
        input_ids = input_ids.to(self.device)
        eos_ids = sorted(set(as_id_list(eos_token_id)))
        if len(eos_ids) > _MAX_EOS_IDS:
            raise ValueError(f"Decoder: at most {_MAX_EOS_IDS} EOS ids, got {len(eos_ids)}")
        if eos_ids:
            self.hold_ids.copy_(torch.tensor([eos_ids[i % len(eos_ids)] for i in range(_MAX_EOS_IDS)]))
        self.hold_until.fill_(min_new_tokens if eos_ids else 0)
        self._set_sampling(do_sample, temperature, top_k, top_p, min_p)
        self._set_penalty(repetition_penalty, attention_mask)
        if self.use_graph and self.graph_key not in self.graphs:
            self._capture()
        self.ties_overflow.zero_()
        if streamer is not None:
            streamer.put(input_ids.cpu())
        width = self.prefill(input_ids, attention_mask, new_tokens=max_new_tokens)
        graph = self.graphs.get(self.graph_key)
        run = graph.replay if graph is not None else self.run_step
        per_step = streamer is not None or max_time is not None
        reader = _StepReader(self.out, width, lookahead=per_step and self.device.type == "cuda")
        stops = _Stops(input_ids.cpu(), eos_ids, pad_token_id, stop, streamer)
        queued = 1  # new tokens enqueued so far (the first came from prefill)
        reader.request(0, 1)
        while True:
            if per_step:  # one step at a time, the next one enqueued before this one is read
                if queued < max_new_tokens:
                    run()
                    reader.request(queued, 1)
                    queued += 1
                columns = reader.take_oldest()
            else:
                steps = min(self.sync_every, max_new_tokens - queued)
                for _ in range(steps):
                    run()
                if steps:
                    reader.request(queued, steps)
                queued += steps
                columns = reader.take_all()
            finished = stops.feed(columns)
            timed_out = max_time is not None and time.time() - start_time > max_time
            if finished or timed_out or stops.length >= max_new_tokens:
                break
        if streamer is not None:
            streamer.end()
        if self.mode[0] == "sample" and bool(self.ties_overflow):  # one sync, after the last step was read
            logger.warning(TIES_OVERFLOW)
        return stops.ids().to(self.device)


GreedyDecoder = Decoder  # the name it had while it could only take the argmax


class _StepReader:
    """Reads the decoder's new token columns back to the host. With `lookahead` (CUDA), each read is a copy into
    pinned memory on a side stream after an event, so the host waits for that step only while the next one runs."""

    def __init__(self, out: torch.Tensor, prompt_len: int, lookahead: bool):
        self.out, self.n, self.lookahead = out, prompt_len, lookahead
        self.pending: collections.deque = collections.deque()

    def request(self, first: int, count: int) -> None:
        """Columns `first .. first+count-1` of the new tokens, once the work enqueued so far has run."""
        if not self.lookahead:
            self.pending.append((first, count, None, None))
            return
        done = torch.cuda.Event()
        done.record()
        side = _copy_stream(self.out.device)
        side.wait_event(done)
        host = torch.empty(self.out.shape[0], count, dtype=self.out.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(self.out[:, self.n + first : self.n + first + count], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self.pending.append((first, count, host, copied))

    def _get(self, item) -> torch.Tensor:
        first, count, host, copied = item
        if host is None:
            return self.out[:, self.n + first : self.n + first + count].cpu()
        copied.synchronize()
        return host

    def take_oldest(self) -> torch.Tensor:
        return self._get(self.pending.popleft())

    def take_all(self) -> torch.Tensor:
        parts = [self._get(item) for item in self.pending]
        self.pending.clear()
        return torch.cat(parts, dim=1)


_COPY_STREAMS: dict = {}


def _copy_stream(device) -> torch.cuda.Stream:
    key = torch.device(device).index
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=device)
    return _COPY_STREAMS[key]


class _Stops:
    """The host's side of generate's stopping criteria, fed one column of new tokens after another: which rows are
    finished (EOS, or the `stop` function on the ids so far), what the streamer gets, and the output's padding."""

    def __init__(self, prompt: torch.Tensor, eos_ids, pad_token_id: int, stop, streamer):
        self.prompt, self.pad, self.stop, self.streamer = prompt, pad_token_id, stop, streamer
        self.eos = torch.tensor(eos_ids, dtype=torch.long)
        self.finished_at = torch.full((prompt.shape[0],), -1, dtype=torch.long)  # the new token that finished a row
        self.length = 0  # new tokens taken so far
        self.tokens: list[torch.Tensor] = []  # [B, k] blocks of new tokens

    def feed(self, columns: torch.Tensor) -> bool:
        """Take new-token columns [B, k]; True once every row is finished (the rest of `columns` is dropped)."""
        if self.stop is None and self.streamer is None:
            return self._feed_block(columns)
        for j in range(columns.shape[1]):
            unfinished = self.finished_at < 0
            tok = columns[:, j].clone()
            if self.eos.numel():  # as stock: only an EOS criterion pads the finished rows
                tok = torch.where(unfinished, tok, torch.full_like(tok, self.pad))
            self.tokens.append(tok[:, None])
            self.length += 1
            ended = torch.isin(tok, self.eos) if self.eos.numel() else torch.zeros_like(unfinished)
            if self.stop is not None:
                ended = ended | torch.as_tensor(self.stop(self.ids())).cpu().bool()
            self.finished_at = torch.where(unfinished & ended, self.length - 1, self.finished_at)
            if self.streamer is not None:
                self.streamer.put(tok)
            if bool((self.finished_at >= 0).all()):
                return True
        return False

    def _feed_block(self, columns: torch.Tensor) -> bool:
        """`feed` for EOS ids alone, the block at once (a column at a time costs the host about 1.5 ms per 32
        columns on a 2-core CPU, time in which the device idles): a row ends at its first EOS column, later
        columns of that row are padding, and the block is cut after the column that ends the last row."""
        k = columns.shape[1]
        if not self.eos.numel():
            self.tokens.append(columns)
            self.length += k
            return False
        ended = torch.isin(columns, self.eos)
        first_eos = torch.where(ended.any(dim=1), ended.int().argmax(dim=1), k)  # k: none in this block
        last_kept = torch.where(self.finished_at >= 0, -1, first_eos)  # the row's last column that is not padding
        columns = torch.where(torch.arange(k)[None, :] > last_kept[:, None], self.pad, columns)
        ends_here = (self.finished_at < 0) & (first_eos < k)
        self.finished_at = torch.where(ends_here, self.length + first_eos, self.finished_at)
        done = bool((self.finished_at >= 0).all())
        if done and ends_here.any():  # the loop would stop after the column that finished the last row
            k = int(first_eos[ends_here].max()) + 1
        self.tokens.append(columns[:, :k])
        self.length += k
        return done

    def ids(self) -> torch.Tensor:
        """[B, prompt + new tokens so far] on the host, as generate returns them."""
        return torch.cat([self.prompt, *self.tokens], dim=1)
