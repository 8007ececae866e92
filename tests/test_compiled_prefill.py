"""The compiled prefill (decoder.compiled_prefill: torch.compile with dynamic shapes) of Decoder and BatchEngine
against the eager prefill and stock `generate`, on the tiny E4B-shaped model (window 8, KV-shared layers of both
types): the tokens, the KV cache after the prefill, how many graphs prompts of many lengths and row counts compile
(the bound: size 1 is all that is specialised, see compiled_prefill), and the eager fallback.

The backend runs Dynamo's graph with eager kernels ("eager"; "aot_eager", through AOTAutograd's functionalisation
of the in-place cache writes, in one test on a 3-layer model): what they check is the trace, its guards and its
writes into the cache, in seconds, where inductor on a CPU compiles for minutes. fp32 throughout.
"""

from __future__ import annotations

import logging

import pytest
import torch

import g4ops.engine.decoder as decoder_mod
from g4ops.engine.batch import BatchEngine, SamplingParams
from g4ops.engine.decoder import Decoder
from g4ops.models import build_model

try:
    from .devices import one_intra_op_thread  # noqa: F401 - an autouse fixture of this module
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from devices import one_intra_op_thread  # noqa: F401

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

NEW = 12


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given, then hands them to `inner`."""

    def __init__(self, inner: str):
        self.inner, self.graphs = inner, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


@pytest.fixture
def backend(monkeypatch):
    torch._dynamo.reset()  # no graphs of another test's backend (they would count against cache_size_limit)
    counting = CountingBackend("eager")
    monkeypatch.setattr(decoder_mod, "PREFILL_BACKEND", counting)
    return counting


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-e4b")


def _ids(model, batch, length, seed):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _stock(model, ids, mask=None, eos=True):
    """Stock greedy search, NEW tokens: the model's EOS held back by min_new_tokens (the Decoder suppresses it), or
    with `eos=False` no EOS at all (a BatchEngine request without stop tokens goes on past one)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           **({} if eos else {"eos_token_id": None}))  # fmt: skip
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, generation_config=cfg)


def _left_padded(model, pads, length, seed):
    ids = _ids(model, len(pads), length, seed)
    mask = (torch.arange(length)[None, :] >= torch.tensor(pads)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _cache_state(decoder):
    return {i: (decoder.cache.keys[i].clone(), decoder.cache.values[i].clone()) for i in decoder.cache.keys}


def test_decoder_compiled_prefill_equals_eager_and_stock(model, backend):
    # EOS suppressed, as stock's min_new_tokens=NEW does
    eager = Decoder(model, batch_size=3, max_length=48, suppress_tokens=[1])
    compiled = Decoder(model, batch_size=3, max_length=48, suppress_tokens=[1], compile_prefill=True)
    assert compiled.prefill_fn != compiled._prefill_logits
    # below, at and past the window of 8; left-padded rows whose padding crosses the window
    cases = [(_ids(model, 3, n, n), None) for n in (5, 8, 13, 21, 1)]  # 1: the cache's one-token path
    cases += [_left_padded(model, (3, 0, 9), 12, 1), _left_padded(model, (0, 6, 2), 17, 2)]
    for ids, mask in cases:
        eager.prefill(ids, mask)
        compiled.prefill(ids, mask)
        assert torch.equal(compiled.next_ids, eager.next_ids)
        for i, (k, v) in _cache_state(eager).items():  # the whole cache: stale slots of earlier prompts too
            torch.testing.assert_close(compiled.cache.keys[i], k)  # fp32's tolerances
            torch.testing.assert_close(compiled.cache.values[i], v)
        out = compiled.generate(ids, NEW, attention_mask=mask)
        assert torch.equal(out, eager.generate(ids, NEW, attention_mask=mask))
        assert torch.equal(out, _stock(model, ids, mask))
    # seven prompt lengths and paddings, two graphs: the length reaches the graph as a size, never a specialised
    # int, and only the 1-token prompt (size 1, specialised) has its own
    assert backend.graphs == 2


def _prompt(length, seed):
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Tokens:
    def __init__(self):
        self.tokens, self.reason = [], None

    def __call__(self, event):
        if event.token_id is not None:
            self.tokens.append(event.token_id)
        self.reason = event.finish_reason or self.reason


def _serve(engine, prompts, new=NEW):
    outs = [_Tokens() for _ in prompts]
    for p, out in zip(prompts, outs):
        engine.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0), out)
    for _ in range(1000):
        engine.step()
        if all(o.reason is not None for o in outs):
            return outs
    raise AssertionError("the engine did not finish")


def test_batch_engine_compiled_prefill_16_concurrent_requests(model, backend):
    # 16 prompts of 16 lengths at once: with a budget of 24 tokens per call, short ones share left-padded calls
    # (rows 2 to 8 of them), long ones go alone and in chunks, crossing the window of 8 inside and between chunks
    lengths = [1, 30, 2, 17, 3, 25, 4, 11, 5, 9, 6, 19, 7, 8, 13, 40]
    prompts = [_prompt(n, seed=n) for n in lengths]
    engines = {c: BatchEngine(model, max_batch=16, max_context=64, prefill_chunk=24, compile_prefill=c)
               for c in (False, True)}  # fmt: skip
    engines[True].warmup()
    assert backend.graphs == 2  # the prefill graphs of one row and of several
    for i in engines[True].cache.keys:  # the warm-up wrote only the scratch slots
        assert not engines[True].cache.keys[i][:, :, :-1].any() and not engines[True].cache.values[i][:, :, :-1].any()
    calls = []  # (rows, chunk length, end) of each compiled prefill call
    compiled_fn = engines[True]._prefill_fn

    def recording(ids, rows, slots):  # the compiled function: no `first`
        calls.append((ids.shape[0], ids.shape[1], slots.shape[0]))
        return compiled_fn(ids, rows, slots)

    engines[True]._prefill_fn = recording
    outs = {c: _serve(e, prompts) for c, e in engines.items()}
    for i, prompt in enumerate(prompts):
        solo = _serve(BatchEngine(model, max_batch=1, max_context=64, prefill_chunk=24), [prompt])[0]
        assert outs[True][i].tokens == outs[False][i].tokens == solo.tokens, lengths[i]
        assert len(solo.tokens) == NEW
        if lengths[i] in (1, 40):  # a 1-token prompt (N = end = 1) and two chunks of one past the window
            assert solo.tokens == _stock(model, torch.tensor([prompt]), eos=False)[0, lengths[i] :].tolist()
    # every row's slots (scratch aside) after the same schedule, to fp32's tolerances: a 1-token chunk padded to 2
    # may take another matmul kernel
    for i in engines[False].cache.keys:
        for buffers in ("keys", "values"):
            ref = getattr(engines[False].cache, buffers)[i][:, :, :-1]
            torch.testing.assert_close(getattr(engines[True].cache, buffers)[i][:, :, :-1], ref)
    # many shapes (1-token chunks and prompts among them), two graphs, both compiled by warmup(): one row, several
    shapes = set(calls)
    assert len(shapes) >= 8 and {k == 1 for k, _, _ in shapes} == {True, False}, shapes
    assert min(n for _, n, _ in shapes) == min(end for _, _, end in shapes) == 2  # 1s padded, never specialised
    assert backend.graphs == 2, (backend.graphs, sorted(shapes))


@pytest.mark.slow  # 30-40 s on a shared 2-core CPU: AOTAutograd traces the model twice
def test_aot_functionalised_prefill_writes_the_cache(monkeypatch):
    """Through AOTAutograd (what inductor gets), the in-place K/V writes of a prefill call still land in the cache."""
    torch._dynamo.reset()
    monkeypatch.setattr(decoder_mod, "PREFILL_BACKEND", "aot_eager")
    small = build_model("tiny-e4b", num_layers=3)
    prompts = [_prompt(n, seed=n + 300) for n in (12, 9, 5)]  # 3 rows in one call (N=12), crossing the window
    engines = [BatchEngine(small, max_batch=4, max_context=32, prefill_chunk=36, compile_prefill=c)
               for c in (False, True)]  # fmt: skip
    eager, compiled = (_serve(e, prompts, new=4) for e in engines)
    assert [c.tokens for c in compiled] == [e.tokens for e in eager]
    for i in engines[0].cache.keys:
        torch.testing.assert_close(engines[1].cache.keys[i][:, :, :-1], engines[0].cache.keys[i][:, :, :-1])
        torch.testing.assert_close(engines[1].cache.values[i][:, :, :-1], engines[0].cache.values[i][:, :, :-1])
    assert engines[1]._prefill_fn != engines[1]._prefill_logits  # still compiled: nothing fell back


def test_compile_failure_falls_back_to_the_eager_prefill(model, caplog):
    """A prefill torch.compile cannot build (simulated: what the compiled function raises on its first call) costs
    speed, never a request: one warning naming the failure, then eager prefill with the eager tokens."""
    prompts = [_prompt(n, seed=n + 200) for n in (9, 4)]
    plain = _serve(BatchEngine(model, max_batch=2, max_context=64), prompts)
    engine = BatchEngine(model, max_batch=2, max_context=64, compile_prefill=True)
    decoder = Decoder(model, batch_size=2, max_length=48, compile_prefill=True)

    def refused(*args):
        raise RuntimeError("the compiler says no")

    engine._prefill_fn = decoder.prefill_fn = refused
    with caplog.at_level(logging.WARNING):
        served = _serve(engine, prompts)
        out = decoder.generate(_ids(model, 2, 6, 3), NEW)
    assert [s.tokens for s in served] == [p.tokens for p in plain] and all(s.reason == "length" for s in served)
    assert torch.equal(out, Decoder(model, batch_size=2, max_length=48).generate(_ids(model, 2, 6, 3), NEW))
    assert engine._prefill_fn == engine._prefill_logits and decoder.prefill_fn == decoder._prefill_logits
    failures = [r for r in caplog.records if "compiling the prefill failed" in r.getMessage()]
    assert len(failures) == 2 and all("the compiler says no" in r.getMessage() for r in failures)


def test_compile_prefill_is_opt_in(model):
    """Off by default, compiled step or not (its GPU first-call time is not measured yet: decoder.py's docstring)."""
    for compile_step in (False, True):
        d = Decoder(model, batch_size=1, max_length=16, compile=compile_step)
        e = BatchEngine(model, max_batch=1, max_context=16, compile=compile_step)
        assert d.prefill_fn == d._prefill_logits and e._prefill_fn == e._prefill_logits
    d = Decoder(model, batch_size=1, max_length=16, compile_prefill=True)
    e = BatchEngine(model, max_batch=1, max_context=16, compile_prefill=True)
    assert d.prefill_fn != d._prefill_logits and e._prefill_fn != e._prefill_logits


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@needs_cuda
def test_cuda_inductor_prefill_equals_eager():
    """With compile_prefill=True a GPU compiles the prefill with inductor (dynamic
    shapes) beside the compiled, captured step; fp32 tokens equal the eager engine's and decoder's, nothing falls
    back."""
    torch._dynamo.reset()
    model = build_model("tiny-e4b", device="cuda")
    compiled = Decoder(model, batch_size=3, max_length=48, compile=True, compile_prefill=True, suppress_tokens=[1])
    eager = Decoder(model, batch_size=3, max_length=48, cuda_graph=False, suppress_tokens=[1])
    cases = [(_ids(model, 3, n, n), None) for n in (5, 13, 21, 1)] + [_left_padded(model, (3, 0, 9), 12, 1)]
    for ids, mask in cases:
        ids, mask = ids.cuda(), None if mask is None else mask.cuda()
        out = compiled.generate(ids, NEW, attention_mask=mask)
        assert torch.equal(out, eager.generate(ids, NEW, attention_mask=mask))
    assert compiled.prefill_fn != compiled._prefill_logits
    lengths = [1, 30, 2, 17, 3, 25, 4, 11, 5, 9, 6, 19, 7, 8, 13, 40]
    prompts = [_prompt(n, seed=n) for n in lengths]
    engine = BatchEngine(model, max_batch=16, max_context=64, prefill_chunk=24, compile=True, compile_prefill=True)
    engine.warmup()
    served = _serve(engine, prompts)
    plain = _serve(BatchEngine(model, max_batch=16, max_context=64, prefill_chunk=24, cuda_graph=False), prompts)
    assert [s.tokens for s in served] == [p.tokens for p in plain]
    assert engine._prefill_fn != engine._prefill_logits
