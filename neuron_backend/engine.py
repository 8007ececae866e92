"""NeuronEngine: continuous batching over neuron_backend's static buckets, behind BatchEngine's interface.

`NeuronEngine(runner).start()`, then `submit(prompt_ids, SamplingParams, on_event)` from any thread, as
g4ops.engine.batch.BatchEngine (helpers/engine_interface.md; the server drives either). The runner (runner.py) is
the model: an in-process module, TP ranks over gloo, or the compiled NeuronCores; the KV cache lives behind it.

The static model has `settings.batch` KV rows; a request holds one from admission to its end. The buckets take a
start position and a valid-row count per row, so rows sit at different positions in one call and a row with 0
valid rows is idle (its KV is untouched: model._KVPlan / _DecodePlan). One engine thread loops as BatchEngine's:
cancels, admissions into free rows, then
- one prefill call for every row still in prefill: each contributes its next chunk (at most the largest bucket),
  the call is padded to the smallest bucket holding the longest chunk; the other rows are idle in it;
- one decode call (T = 1) over every decoding row, each at its own position; the other rows are idle.
A finished prompt's first token comes from its last prefill call, every further token from a decode call.

Sampling runs on the device, vocab-parallel (sampling.py): each row's temperature / top_k / top_p / min_p / seed /
token counter are inputs of the call. Every request's noise is keyed by (seed, token index, token id), so a seeded
request's tokens do not depend on its batch neighbours or the TP degree; an unseeded one gets a fresh random seed
at admission. Greedy rows (temperature 0) take the distributed argmax. A request needs top_k <= settings.sample_cap
(top_k = 0 samples from each rank's top sample_cap logits: the limitation sampling.py states); greedy-only
artifacts (sample_cap = 0) refuse temperature > 0.

The request side (submit / cancel / stats / shutdown / start / step, the events, the queue limit) is BatchEngine's
own code: this class keeps the host-side row state BatchEngine's request bookkeeping reads (`active`, the locked
counters) and replaces what touches a model (admission's settings, prefill, decode, warmup).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import random
import threading

import torch

from g4ops.engine.batch import BatchEngine, SamplingParams, _Request

log = logging.getLogger(__name__)

__all__ = ["NeuronEngine"]


class NeuronEngine(BatchEngine):
    """Continuous batching over a runner (runner.py); see the module docstring.

    max_context = settings.max_seq (prompt + new tokens per request); max_batch = settings.batch. `own_runner`:
    shutdown() also closes the runner (its rank processes)."""

    def __init__(self, runner, max_waiting: int = 256, own_runner: bool = True):  # noqa: D107
        # BatchEngine.__init__ builds an HF model's KV cache: not called. What follows is the state its request
        # side uses, under the same names.
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"NeuronEngine: max_waiting must be an int >= 0, got {max_waiting!r}")
        s = runner.settings
        self.runner, self.settings, self.cfg, self.own_runner = runner, s, runner.cfg, own_runner
        self.max_batch, self.max_context, self.max_waiting = s.batch, s.max_seq, max_waiting
        self.vocab_size = runner.cfg.vocab_size
        self.device = torch.device("cpu")  # the host-side row state; the model sits behind the runner
        rows = s.batch
        self.next_ids = torch.zeros(rows, dtype=torch.long)
        self.position = torch.zeros(rows, dtype=torch.long)
        self.active = torch.zeros(rows, dtype=torch.bool)  # decodes in the next decode call
        self.counter = torch.zeros(rows, dtype=torch.long)  # tokens generated: the noise key of the next one
        self.temperature = torch.zeros(rows, dtype=torch.float32)  # 0: greedy
        self.top_k = torch.zeros(rows, dtype=torch.long)
        self.top_p = torch.ones(rows, dtype=torch.float64)  # fp64: 1 - top_p as Python computes it (sampler.py)
        self.min_p = torch.zeros(rows, dtype=torch.float32)
        self.seed = torch.zeros(rows, dtype=torch.long)
        self._seeds = random.Random()  # seeds for unseeded requests (os.urandom-seeded)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._live: set[int] = set()
        self._cancels: set[int] = set()
        self._held = 0
        self._tokens = 0
        self._steps = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: list[_Request | None] = [None] * rows
        self._prefilling: collections.deque[_Request] = collections.deque()
        self._launched = None  # this backend's decode call returns its tokens: no step is ever left in flight

    # -- the public side: BatchEngine's, plus what this backend cannot do -----------------------------------------
    def submit(self, prompt_ids, params: SamplingParams, on_event) -> int:
        temperature = getattr(params, "temperature", None)  # check_request (in super) names bad types
        if isinstance(params, SamplingParams) and isinstance(temperature, (int, float)) and temperature > 0:
            cap = self.settings.sample_cap
            if cap == 0:
                raise ValueError("temperature must be 0: this neuron model was built greedy-only (sample_cap 0)")
            if isinstance(params.top_k, int) and params.top_k > cap:
                raise ValueError(f"top_k must be <= {cap} on the neuron backend (the model's sample_cap), got "
                                 f"{params.top_k}")  # fmt: skip
        return super().submit(prompt_ids, params, on_event)

    def shutdown(self, timeout: float | None = None) -> None:
        super().shutdown(timeout)
        thread = self._thread
        if self.own_runner and (thread is None or not thread.is_alive()):
            self.runner.close()

    def warmup(self, params=()) -> None:
        """Before start(): run every bucket once with every row idle (loads each graph; writes no KV)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                raise RuntimeError("NeuronEngine: warmup() goes before start()")
        b, pad = self.max_batch, self.cfg.pad_token_id
        idle = torch.zeros(b, dtype=torch.long)
        for t in [*sorted(self.settings.prefill_buckets), 1]:
            self._call(torch.full((b, t), pad, dtype=torch.long), idle, idle)

    def stream(self, prompt_ids, params: SamplingParams, timeout: float | None = None):
        """Iterate one request's TokenEvents as they come (the last has a finish_reason). Without start() it runs
        the loop itself (engine.step() in this thread, as `python -m neuron_backend generate`); with the engine
        thread running it waits on its events. Closing the iterator early cancels the request."""
        events: queue.Queue = queue.Queue()
        rid = self.submit(prompt_ids, params, events.put)
        finished = False
        try:
            while True:
                if self._thread is None:
                    while events.empty():
                        self.step()
                event = events.get(timeout=timeout)
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(rid)
                if self._thread is None:
                    self._apply_cancels()

    # -- the loop's model side ----------------------------------------------------------------------------------
    def _call(self, ids, start, valid) -> list[int]:
        sampling = None
        if self.settings.sample_cap:
            sampling = (self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.counter)
        return self.runner(ids, start, valid, sampling).tolist()

    def _assign_row(self, row: int, p) -> None:
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.seed[row] = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        self.counter[row] = 0
        self.active[row] = False

    def _prefill(self) -> None:
        s, b = self.settings, self.max_batch
        batch = [(req, min(len(req.prompt) - req.prefilled, max(s.prefill_buckets))) for req in self._prefilling]
        bucket = s.bucket_for(max(n for _, n in batch))
        ids = torch.full((b, bucket), self.cfg.pad_token_id, dtype=torch.long)
        start = self.position.clone()
        valid = torch.zeros(b, dtype=torch.long)
        for req, n in batch:
            ids[req.row, :n] = torch.tensor(req.prompt[req.prefilled : req.prefilled + n])
            start[req.row], valid[req.row] = req.prefilled, n
        try:
            tokens = self._call(ids, start, valid)
        except Exception as e:  # noqa: BLE001 - these requests fail, the engine stays up
            log.exception("NeuronEngine: prefill of requests %s failed", [r.id for r, _ in batch])
            for req, _ in batch:
                self._finish(req, None, "error", f"{type(e).__name__}: {e}")
            return
        for req, n in batch:
            req.prefilled += n
            if req.prefilled == len(req.prompt):
                self._prefilling.remove(req)
                r = req.row
                self.next_ids[r], self.position[r], self.counter[r] = tokens[r], len(req.prompt), 1
                self._emit_token(req, tokens[r], activate=True)

    def _decode(self) -> None:
        rows = self.active.nonzero().flatten().tolist()
        if not rows:
            return
        try:
            tokens = self._call(self.next_ids[:, None].clone(), self.position.clone(), self.active.long())
        except Exception as e:  # noqa: BLE001 - the step's rows fail; the engine stays up
            log.exception("NeuronEngine: decode step failed")
            for i in rows:
                self._finish(self._rows[i], None, "error", f"{type(e).__name__}: {e}")
            return
        with self._lock:
            self._steps += 1
        for i in rows:
            self.next_ids[i] = tokens[i]
            self.position[i] += 1
            self.counter[i] += 1
            self._emit_token(self._rows[i], tokens[i])
