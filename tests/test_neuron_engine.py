"""NeuronEngine (neuron_backend/engine.py) at TP=1 in process, and the decode step's scatter KV write.

Oracles: stock transformers' full forward (no cache) for greedy tokens, and g4ops.engine.sampler.sample (transformers'
warpers) on stock's logits, teacher-forced, with the request's counter-based noise, for sampled tokens. The TP=2
path over gloo is tests/test_neuron_serve.py (same engine behind the HTTP server)."""

from __future__ import annotations

import queue

import pytest
import torch

from g4ops.engine.batch import SamplingParams
from g4ops.engine.sampler import sample, seeded_exponential
from g4ops.models import build_model
from neuron_backend.config import BuildSettings
from neuron_backend.engine import NeuronEngine
from neuron_backend.loader import _text_config, build_rank_model, text_state_dict
from neuron_backend.runner import ModuleRunner
from neuron_backend.serve import engine_from_hf_model
from devices import one_intra_op_thread  # noqa: F401 - autouse: this module runs on one thread

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

CONTEXT = 48
BUCKETS = (8, 16)  # a 21-token prompt takes two prefill calls (16 + 5 padded to 8)
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def hf():
    return build_model("tiny-e4b")


@pytest.fixture
def engine(hf):
    eng = engine_from_hf_model(hf, 1, max_batch=3, max_context=CONTEXT, buckets=BUCKETS, sample_cap=32)
    yield eng
    eng.shutdown(DEADLINE_S)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _stock_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0, -1].float()


def _greedy(hf, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(_stock_logits(hf, ids).argmax()))
    return ids[-n:]


class _Events:
    def __init__(self):
        self.by_request: dict[int, list] = {}

    def on(self, key):
        return lambda e: self.by_request.setdefault(key, []).append(e)

    def tokens(self, key):
        return [e.token_id for e in self.by_request[key] if e.token_id is not None]


def _drain(engine, events, keys, limit=200):
    for _ in range(limit):
        if all(k in events.by_request and events.by_request[k][-1].finish_reason for k in keys):
            return
        engine.step()
    raise AssertionError("requests did not finish")


def test_rows_at_different_positions_decode_their_own_greedy_tokens(engine, hf):
    """Three requests join the running batch at different steps with different prompt lengths: each decodes at its
    own position in the shared decode calls, and gets stock's greedy tokens (streamed one event per token)."""
    ev, n = _Events(), 9
    prompts = {"a": _prompt(5, 1), "b": _prompt(21, 2), "c": _prompt(11, 3)}
    greedy = SamplingParams(max_new_tokens=n, temperature=0)
    engine.submit(prompts["a"], greedy, ev.on("a"))
    engine.step(), engine.step()
    engine.submit(prompts["b"], greedy, ev.on("b"))
    engine.step()
    positions_seen = set()
    engine.submit(prompts["c"], greedy, ev.on("c"))
    for _ in range(60):
        positions_seen.add(tuple(engine.position[engine.active].tolist()))
        if all(k in ev.by_request and ev.by_request[k][-1].finish_reason for k in prompts):
            break
        engine.step()
    assert any(len(set(p)) == 3 for p in positions_seen), positions_seen  # three rows, three positions, one call
    for k, ids in prompts.items():
        events = ev.by_request[k]
        assert [e.finish_reason for e in events] == [None] * (n - 1) + ["length"]
        assert ev.tokens(k) == _greedy(hf, ids, n), k
    assert engine.stats().running == 0 and engine.stats().generated_tokens == 3 * n


def test_sampling_is_transformers_sampling_and_ignores_neighbours(engine, hf):
    """A seeded sampled request draws, at every step, what sampler.sample (transformers' warpers) draws from stock's
    logits with its noise; with other requests beside it its tokens do not change."""
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1234)
    prompt = _prompt(13, 4)
    ev = _Events()
    engine.submit(prompt, params, ev.on("alone"))
    _drain(engine, ev, ["alone"])
    tokens = ev.tokens("alone")
    row = lambda x, dt=None: torch.tensor([x], dtype=dt)  # noqa: E731
    for i, token in enumerate(tokens):
        logits = _stock_logits(hf, prompt + tokens[:i])[None]
        expect = sample(logits, row(params.temperature), row(params.top_k), row(params.top_p, torch.float64),
                        row(params.min_p), row(False), seeded_exponential(row(params.seed), row(i), logits.shape[-1]))
        assert int(expect) == token, f"step {i}"
    engine.submit(_prompt(7, 5), SamplingParams(max_new_tokens=8, temperature=1.0, top_k=5), ev.on("x"))
    engine.submit(prompt, params, ev.on("crowded"))
    engine.submit(_prompt(17, 6), SamplingParams(max_new_tokens=4, temperature=0), ev.on("y"))
    _drain(engine, ev, ["x", "crowded", "y"])
    assert ev.tokens("crowded") == tokens
    unseeded = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=32)
    engine.submit(prompt, unseeded, ev.on("u1")), engine.submit(prompt, unseeded, ev.on("u2"))
    _drain(engine, ev, ["u1", "u2"])
    assert ev.tokens("u1") != ev.tokens("u2")  # each unseeded request gets its own seed


def test_stop_token_ends_the_request_after_emitting_it(engine, hf):
    prompt = _prompt(9, 7)
    greedy = _greedy(hf, prompt, 8)
    stop_at = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
    ev = _Events()
    engine.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(greedy[stop_at], 1)),
                  ev.on("r"))  # fmt: skip
    _drain(engine, ev, ["r"])
    assert ev.tokens("r") == greedy[: stop_at + 1]
    assert ev.by_request["r"][-1].finish_reason == "stop"
    assert engine.stats().running == 0


def test_bad_requests_cancel_and_shutdown(hf):
    cfg = _text_config(hf.config, hf)
    s = BuildSettings(tp=1, batch=2, max_seq=CONTEXT, prefill_buckets=BUCKETS)  # greedy-only buckets
    model, ple, _ = build_rank_model(text_state_dict(hf.state_dict()), cfg, s)
    greedy_only = NeuronEngine(ModuleRunner(model, ple), max_waiting=1)
    with pytest.raises(ValueError, match="temperature"):
        greedy_only.submit([5, 6], SamplingParams(max_new_tokens=2, temperature=0.7), lambda e: None)
    with pytest.raises(ValueError, match="max_context"):
        greedy_only.submit(_prompt(40, 0), SamplingParams(max_new_tokens=9, temperature=0), lambda e: None)
    greedy_only.shutdown()

    eng = engine_from_hf_model(hf, 1, max_batch=2, max_context=CONTEXT, buckets=BUCKETS, sample_cap=8, max_waiting=1)
    with pytest.raises(ValueError, match="top_k"):
        eng.submit([5, 6], SamplingParams(max_new_tokens=2, temperature=0.7, top_k=9), lambda e: None)
    got: queue.Queue = queue.Queue()
    eng.start()
    rid = eng.submit(_prompt(6, 1), SamplingParams(max_new_tokens=40, temperature=0), got.put)
    first = got.get(timeout=DEADLINE_S)
    assert first.token_id is not None and first.finish_reason is None
    eng.cancel(rid)
    while (e := got.get(timeout=DEADLINE_S)).finish_reason is None:
        pass
    assert e.finish_reason == "cancelled" and e.token_id is None
    held = eng.submit(_prompt(6, 2), SamplingParams(max_new_tokens=40, temperature=0), got.put)
    eng.shutdown(DEADLINE_S)
    while (e := got.get(timeout=DEADLINE_S)).finish_reason is None:
        pass
    assert e.finish_reason == "cancelled" and held > rid
    with pytest.raises(RuntimeError, match="shutdown"):
        eng.submit([5], SamplingParams(max_new_tokens=1), lambda e: None)


def test_stream_iterates_the_events_and_closing_it_cancels(engine, hf):
    prompt = _prompt(10, 8)
    events = list(engine.stream(prompt, SamplingParams(max_new_tokens=6, temperature=0)))
    assert [e.token_id for e in events] == _greedy(hf, prompt, 6)
    assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
    it = engine.stream(prompt, SamplingParams(max_new_tokens=30, temperature=0))
    assert next(it).token_id == events[0].token_id
    it.close()
    assert engine.stats().running == 0 and engine.stats().waiting == 0
    engine.start()  # with the engine thread: the iterator waits on its events instead of stepping
    assert [e.token_id for e in engine.stream(prompt, SamplingParams(max_new_tokens=6, temperature=0),
                                              timeout=DEADLINE_S)] == [e.token_id for e in events]
