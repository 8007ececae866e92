"""g4ops.engine.batch.BatchEngine on tiny Gemma-4 models built in code: greedy tokens against each request's solo run
and stock `generate(do_sample=False)`, requests joining and leaving a running batch, chunked prefill across the
sliding window (8 in the tiny models), seeded sampling against the sampler on stock's teacher-forced logits,
cancel, stop tokens, lengths, errors, the engine thread and shutdown. CUDA: the captured buckets against eager.

Most tests drive the loop with `engine.step()` in the test's thread, so the join/leave schedule is exact; the
thread tests use `start()`. fp32 throughout (the only difference from stock is the order attention sums keys).
"""

from __future__ import annotations

import threading

import pytest
import torch

from g4ops.engine.batch import BatchEngine, QueueFull, SamplingParams, TokenEvent
from g4ops.engine.sampler import sample, seeded_exponential
from g4ops.models import build_model

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

NEW = 14


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are microseconds: two intra-op threads on a shared machine only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-e4b")


class Collect:
    """on_event that records the events."""

    def __init__(self):
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent):
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def reason(self) -> str | None:
        return self.events[-1].finish_reason if self.events else None


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(new=NEW, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=new, temperature=0.0, **kw)


def _drive(engine, schedule, max_steps=1000):
    """schedule: [(loop iteration at which to submit, prompt, params)] -> one Collect per entry."""
    outs = [Collect() for _ in schedule]
    last = max(at for at, _, _ in schedule)
    for i in range(max_steps):
        for (at, prompt, params), out in zip(schedule, outs):
            if at == i:
                engine.submit(prompt, params, out)
        engine.step()
        if i >= last and all(o.done.is_set() for o in outs):
            return outs
    raise AssertionError("the engine did not finish the schedule")


_STOCK: dict = {}


def _stock(model, prompt, new=NEW, eos=None) -> list[int]:
    """Stock greedy search's new tokens (memoised: several tests ask for the same prompts)."""
    key = (id(model), tuple(prompt), new, eos)
    if key not in _STOCK:
        _STOCK[key] = _stock_generate(model, prompt, new, eos)
    return _STOCK[key]


def _stock_generate(model, prompt, new, eos) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eos,
                           min_new_tokens=0 if eos is not None else new)  # fmt: skip
    with torch.no_grad():
        ids = torch.tensor([prompt], device=next(model.parameters()).device)
        return model.generate(ids, generation_config=cfg)[0, len(prompt) :].tolist()


# -- greedy: batched == solo == stock ------------------------------------------------------------------------------
class _Calls:
    """Wraps the model for an engine and records each call's input_ids shape."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __call__(self, **kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))
        return self.model(**kwargs)


@pytest.mark.parametrize(
    "chunk, lengths, joins",
    [
        (5, (3, 20, 11, 30, 8), (0, 2, 3, 9, 9)),
        (12, (3, 20, 11, 30, 8), (0, 2, 3, 9, 9)),
        (24, (30, 11, 3, 8, 20), (0, 0, 0, 0, 1)),  # the 30 one: 24 tokens, then 6 padded to 11 beside the 11
    ],
    ids=["chunk5-crosses-window", "chunk12-longer-than-window", "budget24-several-prompts-per-call"],
)
def test_greedy_batched_equals_solo_and_stock(model, chunk, lengths, joins):
    # prompt lengths below, at and well past the window; joins at different iterations, so rows sit at different
    # positions and prefill calls run between decode steps of the others; with budget 24, prompts of different
    # lengths share a prefill call (left-padded), some crossing the window inside it
    prompts = [_prompt(n, seed=n) for n in lengths]
    engine = BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=chunk)
    engine.model = calls = _Calls(model)
    outs = _drive(engine, [(at, p, _greedy()) for at, p in zip(joins, prompts)])  # 5 requests, 4 rows: one waits
    prefills = [s for s in calls.shapes if s[1] > 1]
    assert all(k * n <= chunk for k, n in prefills) and any(k > 1 for k, _ in prefills) == (chunk == 24)
    for prompt, out in zip(prompts, outs):
        solo = _drive(BatchEngine(model, max_batch=1, max_context=64, prefill_chunk=chunk), [(0, prompt, _greedy())])
        assert out.reason == "length" and len(out.tokens) == NEW
        assert out.tokens == solo[0].tokens == _stock(model, prompt)
    assert engine.stats().kv_slots_in_use == 0 and engine.stats().decode_steps > NEW


def test_whole_prompts_are_padded_to_a_captured_prefill_shape(model):
    """pad_prefill (the default on CUDA, where the padded call is replayed from a CUDA graph per shape): a prefill
    call of whole prompts within one chunk is padded to a batch bucket of rows and the longest prompt's prefill
    width, and the tokens stay stock's (fp32); a prompt longer than the chunk is chunked unpadded."""
    from g4ops.engine.decoder import prefill_width

    for length, width in ((3, 16), (11, 16), (20, 32), (40, None)):
        prompt = _prompt(length, seed=length)
        engine = BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=32, pad_prefill=True)
        engine.model = calls = _Calls(model)
        out = _drive(engine, [(0, prompt, _greedy())])
        prefills = [s for s in calls.shapes if s[1] > 1]
        assert prefills == ([(1, width)] if width else [(1, 32), (1, 8)]), length
        assert width is None or width == prefill_width(length)
        assert out[0].tokens == _stock(model, prompt), length
    engine = BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=32, pad_prefill=True)
    engine.model = calls = _Calls(model)
    shared = _drive(engine, [(0, _prompt(3, seed=3), _greedy()), (0, _prompt(11, seed=11), _greedy())])
    assert [s for s in calls.shapes if s[1] > 1] == [(2, 16)]  # one call: 2 rows, the longer prompt's width
    assert [o.tokens for o in shared] == [_stock(model, _prompt(n, seed=n)) for n in (3, 11)]
    # three whole prompts: a padding row (no real token, it writes only scratch slots) makes the 4-row bucket;
    # with a 48-token chunk the 4 x 16 shape would pass it, so the three share an unpadded call
    lengths = (3, 11, 6)
    for chunk, shape in ((64, (4, 16)), (48, (3, 11))):
        engine = BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=chunk, pad_prefill=True)
        engine.model = calls = _Calls(model)
        three = _drive(engine, [(0, _prompt(n, seed=n), _greedy()) for n in lengths])
        assert [s for s in calls.shapes if s[1] > 1] == [shape]
        assert [o.tokens for o in three] == [_stock(model, _prompt(n, seed=n)) for n in lengths]


def test_conditional_generation_model_text_only():
    # google/gemma-4-E4B-it loads as Gemma4ForConditionalGeneration: the engine drives its text path
    from g4ops.models import build_multimodal_model

    model = build_multimodal_model("tiny-e4b")
    prompts = [_prompt(13, 26), _prompt(4, 27)]
    outs = _drive(BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=5),
                  [(0, prompts[0], _greedy()), (1, prompts[1], _greedy())])  # fmt: skip
    assert [o.tokens for o in outs] == [_stock(model, p) for p in prompts]


@pytest.mark.parametrize("attention", [False, True], ids=["enable", "enable-attention"])
def test_under_g4ops_enable(attention):
    # g4ops' patched modules in prefill and step (and its attention for prefill), on the E2B shape (one KV head)
    import g4ops

    model = build_model("tiny-e2b")
    prompts = [_prompt(n, 28 + n) for n in (13, 4, 21)]
    refs = [_stock(model, p) for p in prompts]
    with g4ops.enable(model, attention=True) if attention else g4ops.enable():
        outs = _drive(BatchEngine(model, max_batch=3, max_context=64, prefill_chunk=24),
                      [(0, p, _greedy()) for p in prompts])  # fmt: skip
    assert [o.tokens for o in outs] == refs


def test_rows_are_reused_without_stale_keys(model):
    # a long prompt fills row 0's ring and full slots, leaves after 2 tokens; a short prompt takes row 0 next while
    # row 1 keeps decoding: the short one must not see the long one's keys
    long_p, short_p, other = _prompt(30, 1), _prompt(4, 2), _prompt(6, 3)
    engine = BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=7)
    outs = _drive(engine, [(0, long_p, _greedy(2)), (0, other, _greedy(20)), (8, short_p, _greedy())])
    assert outs[0].tokens == _stock(model, long_p, 2)
    assert outs[1].tokens == _stock(model, other, 20)
    assert outs[2].tokens == _stock(model, short_p)


def test_join_does_not_wait_for_the_batch(model):
    a, b = _prompt(5, 4), _prompt(5, 5)
    engine = BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=64)
    first, second = Collect(), Collect()
    engine.submit(a, _greedy(40), first)
    for _ in range(4):
        engine.step()
    engine.submit(b, _greedy(3), second)
    for _ in range(3):  # one iteration: admission + prefill (first token) + a decode step with both rows
        engine.step()
    assert second.reason == "length" and not first.done.is_set()  # b came and went while a keeps running
    # the prefill's token, then one per decode step, read one step behind: the last step launched is not read yet
    assert len(first.tokens) == 1 + 4 + 3 - 1


def test_the_next_step_runs_while_a_step_is_read_back(model):
    """What the read-back pipeline is for: a decoded token reaches its request after the next step was launched, so
    the host's work between steps overlaps the device's. A row stops launching at its length (no step in vain); a
    row ended by a stop token decodes one step in vain, whose token is dropped, and its row serves the next request
    exactly."""
    prompt, new = _prompt(5, 4), 6
    engine = BatchEngine(model, max_batch=2, max_context=64)
    steps_at_event = []

    def on_event(event):
        steps_at_event.append(engine.stats().decode_steps)
        out(event)

    out = Collect()
    engine.submit(prompt, _greedy(new), on_event)
    while not out.done.is_set():
        engine.step()
    # the prefill's token, then token j (from step j - 1) once step j is launched; the last launches nothing more
    assert steps_at_event == [0, 2, 3, 4, 5, 5]
    assert out.tokens == _stock(model, prompt, new)

    # the first decoded token not seen before it ends the next run of the same prompt
    end = next(j for j in range(1, new - 1) if out.tokens[j] not in out.tokens[:j])
    stopped, after = Collect(), Collect()
    engine.submit(prompt, _greedy(new, stop_token_ids=[out.tokens[end]]), stopped)
    while not stopped.done.is_set():
        engine.step()
    assert stopped.tokens == out.tokens[: end + 1] and stopped.reason == "stop"
    later = _prompt(5, 5)
    engine.submit(later, _greedy(8), after)  # takes row 0 again, after the step in vain wrote its next slot
    while not after.done.is_set():
        engine.step()
    assert after.tokens == _stock(model, later, 8)


# -- sampling ------------------------------------------------------------------------------------------------------
def _teacher_forced_samples(model, prompt, tokens, params):
    """What the sampler picks from stock's teacher-forced logits with the request's seeded noise."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    def one(x, dtype):
        return torch.tensor([x], dtype=dtype)

    settings = (one(params.temperature, torch.float32), one(params.top_k, torch.long),
                one(params.top_p, torch.float64), one(params.min_p, torch.float32), one(False, torch.bool))  # fmt: skip
    picks = []
    for i in range(len(tokens)):
        noise = seeded_exponential(one(params.seed, torch.long), one(i, torch.long), logits.shape[-1])
        picks.append(int(sample(logits[i : i + 1], *settings, noise)[0]))
    return picks


def test_a_draw_past_the_tie_bound_is_reported(model, caplog):
    """Degenerate logits (every token tied) put more tokens at the top-k threshold than the sampler's candidates
    hold: BatchEngine and the Decoder say so once, at WARNING, instead of drawing from part of the tie in silence;
    the model's own logits report nothing."""
    import copy
    import logging

    from g4ops.engine.decoder import Decoder
    from g4ops.engine.sampler import TIES_OVERFLOW

    flat = copy.deepcopy(model)
    flat.lm_head.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=64, top_p=0.95)
    prompt = _prompt(5, 1)
    for m, reported in ((flat, 1), (model, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _drive(BatchEngine(m, max_batch=2, max_context=64), [(0, prompt, params), (1, prompt, params)])
            Decoder(m, batch_size=1, max_length=32).generate(torch.tensor([prompt]), 4, do_sample=True, top_k=64,
                                                               top_p=0.95)  # fmt: skip
        messages = [r.getMessage() for r in caplog.records]
        assert messages.count(TIES_OVERFLOW) == 2 * reported, messages  # once per engine, once per Decoder call


def test_seeded_sampling_is_independent_of_neighbours(model):
    seeded = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1234)
    prompt = _prompt(13, 7)
    alone = _drive(BatchEngine(model, max_batch=1, max_context=64, prefill_chunk=5), [(0, prompt, seeded)])[0]
    neighbours = [
        (0, _prompt(9, 8), SamplingParams(max_new_tokens=20, temperature=1.3)),  # unseeded: torch's generator
        (1, _prompt(3, 9), SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=99)),
        (4, _prompt(17, 10), _greedy(6)),
    ]
    engine = BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=5)
    torch.manual_seed(0)
    crowd = _drive(engine, [*neighbours[:2], (2, prompt, seeded), neighbours[2]])
    assert crowd[2].tokens == alone.tokens and len(alone.tokens) == NEW
    assert alone.tokens == _teacher_forced_samples(model, prompt, alone.tokens, seeded)
    other_seed = dict(vars(seeded), seed=4321)
    again = _drive(BatchEngine(model, max_batch=1, max_context=64), [(0, prompt, SamplingParams(**other_seed))])[0]
    assert again.tokens != alone.tokens  # 14 tokens at temperature 0.8: a different seed draws differently
    assert all(0 <= t < 512 for t in crowd[0].tokens) and len(crowd[0].tokens) == 20
    assert crowd[3].tokens == _stock(model, neighbours[2][1], 6)  # a greedy row among sampling rows stays greedy
    # unseeded rows draw from torch's generator: the same global seed and schedule give the same tokens
    torch.manual_seed(0)
    replay = _drive(BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=5),
                    [*neighbours[:2], (2, prompt, seeded), neighbours[2]])  # fmt: skip
    assert replay[0].tokens == crowd[0].tokens


# -- finishing -----------------------------------------------------------------------------------------------------
def test_stop_token_ends_like_stock_eos(model):
    prompt = _prompt(10, 11)
    free = _stock(model, prompt, 30)
    stop = free[5]
    first = free.index(stop)  # the token may occur earlier than index 5
    out = _drive(BatchEngine(model, max_batch=2, max_context=64), [(0, prompt, _greedy(30, stop_token_ids=(stop,)))])
    assert out[0].reason == "stop" and out[0].events[-1].token_id == stop
    assert out[0].tokens == free[: first + 1] == _stock(model, prompt, 30, eos=stop)


@pytest.mark.parametrize("new", [1, 3])
def test_max_new_tokens_ends_with_length(model, new):
    out = _drive(BatchEngine(model, max_batch=2, max_context=64), [(0, _prompt(9, 12), _greedy(new))])[0]
    assert [e.finish_reason for e in out.events] == [None] * (new - 1) + ["length"]
    assert all(e.token_id is not None and e.error is None for e in out.events)


def test_cancel_frees_the_row(model):
    engine = BatchEngine(model, max_batch=2, max_context=64, prefill_chunk=4)
    a, b, c = Collect(), Collect(), Collect()
    ra = engine.submit(_prompt(6, 13), _greedy(40), a)
    engine.submit(_prompt(6, 14), _greedy(40), b)
    rc = engine.submit(_prompt(6, 15), _greedy(5), c)
    for _ in range(4):
        engine.step()
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_slots_in_use, s.kv_slots_total) == (2, 1, 2, 2)
    engine.cancel(ra)
    engine.cancel(ra)  # idempotent
    engine.step()
    assert a.events[-1] == TokenEvent(None, "cancelled") and a.events.count(TokenEvent(None, "cancelled")) == 1
    assert engine.stats().waiting == 0 and engine.stats().kv_slots_in_use == 2  # c took a's row at once
    while not c.done.is_set():
        engine.step()
    assert c.tokens == _stock(model, _prompt(6, 15), 5)  # in a's old row
    engine.cancel(rc)  # finished: nothing happens
    engine.step()
    assert c.reason == "length"
    # a waiting request cancelled before admission
    d = Collect()
    rd = engine.submit(_prompt(6, 16), _greedy(5), d)
    engine.submit(_prompt(6, 17), _greedy(5), Collect())
    engine.cancel(rd)
    engine.step()
    assert d.events == [TokenEvent(None, "cancelled")]


def test_raising_on_event_cancels_only_its_request(model):
    class Raises(Collect):
        def __call__(self, event):
            super().__call__(event)
            if len(self.events) == 3:
                raise RuntimeError("client went away")

    bad, good = Raises(), Collect()
    engine = BatchEngine(model, max_batch=2, max_context=64)
    engine.submit(_prompt(5, 18), _greedy(), bad)
    engine.submit(_prompt(7, 19), _greedy(), good)
    while not good.done.is_set():
        engine.step()
    assert bad.events[-1] == TokenEvent(None, "cancelled") and len(bad.events) == 4
    assert good.tokens == _stock(model, _prompt(7, 19))
    assert engine.stats().kv_slots_in_use == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model, monkeypatch):
    engine = BatchEngine(model, max_batch=2, max_context=64)
    forward = model.forward
    fail = {"prefill": False, "decode": False}

    def flaky(*args, **kwargs):
        n = kwargs["input_ids"].shape[1]
        if fail["prefill"] and n > 1 or fail["decode"] and n == 1:
            raise RuntimeError("injected")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    running = Collect()
    engine.submit(_prompt(5, 20), _greedy(), running)
    engine.step()
    fail["prefill"] = True  # a prefill fails: only that request
    broken = Collect()
    engine.submit(_prompt(5, 21), _greedy(), broken)
    engine.step()
    assert broken.events[-1].finish_reason == "error" and "injected" in broken.events[-1].error
    assert not running.done.is_set()
    fail["prefill"] = False
    fail["decode"] = True  # a decode step fails: every decoding row
    engine.step()
    assert running.events[-1].finish_reason == "error" and engine.stats().kv_slots_in_use == 0
    fail["decode"] = False
    after = _drive(engine, [(0, _prompt(8, 22), _greedy())])[0]
    assert after.tokens == _stock(model, _prompt(8, 22))


def test_a_failing_capture_falls_back_to_eager(model, monkeypatch):
    engine = BatchEngine(model, max_batch=2, max_context=64)
    engine.use_graph = True  # as on CUDA; the capture below fails as a step with a host sync would

    def no_capture(b, mode):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine, "_graph", no_capture)
    out = _drive(engine, [(0, _prompt(8, 25), _greedy())])[0]
    assert out.tokens == _stock(model, _prompt(8, 25)) and not engine.use_graph


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], _greedy(), "prompt_ids"),
        ([5, 512], _greedy(), "prompt_ids"),
        ([5, -1], _greedy(), "prompt_ids"),
        ([5] * 60, _greedy(5), "max_new_tokens"),  # 60 + 5 > 64
        ([5], _greedy(0), "max_new_tokens"),
        ([5], SamplingParams(max_new_tokens=2.0), "max_new_tokens"),
        ([5], SamplingParams(4, temperature=-0.1), "temperature"),
        ([5], SamplingParams(4, temperature=float("nan")), "temperature"),
        ([5], SamplingParams(4, top_k=-1), "top_k"),
        ([5], SamplingParams(4, top_p=1.5), "top_p"),
        ([5], SamplingParams(4, min_p=-0.5), "min_p"),
        ([5], SamplingParams(4, seed=-3), "seed"),
        ([5], SamplingParams(4, seed=2**63), "seed"),
        ([5], SamplingParams(4, stop_token_ids=(1, 999)), "stop_token_ids"),
        ([5], dict(max_new_tokens=4), "params"),
    ],
)
def test_bad_requests_name_the_field(model, prompt, params, field):
    engine = BatchEngine(model, max_batch=1, max_context=64)
    with pytest.raises(ValueError, match=field):
        engine.submit(prompt, params, Collect())
    assert engine.stats().waiting == 0


def test_bad_engine_arguments_and_queue_full(model):
    for kw, field in ((dict(max_batch=0), "max_batch"), (dict(max_context=1), "max_context"),
                      (dict(prefill_chunk=0), "prefill_chunk"), (dict(max_waiting=-1), "max_waiting"),
                      (dict(max_context=model.config.max_position_embeddings + 1), "max_context")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            BatchEngine(model, **kw)
    with pytest.raises(ValueError, match="cuda_graph"):
        BatchEngine(model, cuda_graph=True)  # the model is on the CPU
    engine = BatchEngine(model, max_batch=1, max_context=64, max_waiting=2)
    engine.submit([5, 6], _greedy(), Collect())
    engine.submit([5, 6], _greedy(), Collect())
    with pytest.raises(QueueFull):
        engine.submit([5, 6], _greedy(), Collect())
    engine.step()  # one admitted: room for one more
    engine.submit([5, 6], _greedy(), Collect())


def test_warmup_leaves_the_state_alone(model):
    engine = BatchEngine(model, max_batch=3, max_context=64, prefill_chunk=5)
    engine.submit(_prompt(12, 23), _greedy(), first := Collect())
    engine.step()  # a row in prefill while warmup runs every bucket's step
    engine.warmup([SamplingParams(4, temperature=0.7, top_k=50, seed=3), SamplingParams(4, temperature=1.0)])
    second = _drive(engine, [(0, _prompt(9, 24), _greedy())])[0]
    while not first.done.is_set():
        engine.step()
    assert first.tokens == _stock(model, _prompt(12, 23)) and second.tokens == _stock(model, _prompt(9, 24))
    engine.start()
    with pytest.raises(RuntimeError, match="before start"):
        engine.warmup()
    engine.shutdown(timeout=30)


# -- the engine thread ---------------------------------------------------------------------------------------------
def test_thread_serves_concurrent_submits_then_shutdown_cancels(model):
    prompts = [_prompt(n, 30 + n) for n in (4, 15, 9)]
    refs = [_stock(model, p) for p in prompts]  # before start(): the engine thread owns the model from then on
    engine = BatchEngine(model, max_batch=3, max_context=64, prefill_chunk=6)
    engine.start()
    outs = [Collect() for _ in prompts]
    threads = [threading.Thread(target=engine.submit, args=(p, _greedy(), o)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ref, out in zip(refs, outs):
        assert out.done.wait(60), "no final event"
        assert out.tokens == ref
    # in flight at shutdown: two decoding (50 tokens take long on a CPU), two waiting
    late = [Collect() for _ in range(5)]
    for i, out in enumerate(late):
        engine.submit(_prompt(5, 40 + i), _greedy(50), out)
    while len(late[0].events) < 2:
        late[0].done.wait(0.01)
    engine.shutdown(timeout=60)
    assert not engine._thread.is_alive()
    for out in late:
        assert out.events[-1] == TokenEvent(None, "cancelled")
        assert sum(e.finish_reason is not None for e in out.events) == 1
    assert engine.stats().kv_slots_in_use == 0 and engine.stats().waiting == 0
    with pytest.raises(RuntimeError, match="shutdown"):
        engine.submit([5], _greedy(), Collect())


def test_shutdown_without_start_cancels_waiting(model):
    engine = BatchEngine(model, max_batch=1, max_context=64)
    out = Collect()
    engine.submit([5, 6, 7], _greedy(), out)
    engine.shutdown()
    assert out.events == [TokenEvent(None, "cancelled")]


# -- CUDA: the captured buckets ------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _mixed_schedule():
    """Greedy, seeded and unseeded rows joining over time, so the batch grows through buckets 1, 2, 4, 8."""
    sched = []
    for i in range(7):
        n = (3, 20, 11, 30, 8, 5, 17)[i]
        if i % 3 == 0:
            params = _greedy(18)
        else:
            params = SamplingParams(max_new_tokens=18, temperature=0.9, top_k=30, top_p=0.95, seed=100 + i)
        sched.append((2 * i, _prompt(n, 50 + i), params))
    return sched


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_buckets_equal_eager(dtype):
    model = build_model("tiny-e4b", dtype=dtype, device="cuda")
    sched = _mixed_schedule()
    eager = _drive(BatchEngine(model, max_batch=8, max_context=64, prefill_chunk=5, cuda_graph=False), sched)
    engine = BatchEngine(model, max_batch=8, max_context=64, prefill_chunk=5)
    graphed = _drive(engine, sched)
    assert {b for b, _ in engine._graphs} == {1, 2, 4, 8}
    for e, g in zip(eager, graphed):
        assert g.tokens == e.tokens and g.reason == e.reason == "length"
    if dtype == torch.float32:
        for (_, prompt, params), g in zip(sched, graphed):
            if params.temperature == 0:
                assert g.tokens == _stock(model, prompt, 18)


def test_compile_failure_falls_back_to_the_uncompiled_step(model, caplog):
    """`serve` compiles the step by default on CUDA: a compiler failure during warm-up must leave a working engine
    on the uncompiled step with a warning naming the failure, not a server that does not start."""
    sched = [(0, _prompt(7, 1), _greedy()), (2, _prompt(12, 2), _greedy())]
    plain = _drive(BatchEngine(model, max_batch=2, max_context=64, cuda_graph=False), sched)
    engine = BatchEngine(model, max_batch=2, max_context=64, cuda_graph=False)

    def failing_compile(*args):
        raise RuntimeError("inductor says no")

    engine._logits_fn = failing_compile  # what compile=True's torch.compile raises on its first call, made up
    with caplog.at_level("WARNING", logger="g4ops.engine.batch"):
        engine.warmup()
    assert "compiling the decode step failed" in caplog.text and "inductor says no" in caplog.text
    assert engine._logits_fn == engine._logits
    for p, e in zip(plain, _drive(engine, sched)):
        assert e.tokens == p.tokens and e.reason == p.reason


@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_warmed_up_graphs_equal_eager():
    model = build_model("tiny-e4b", device="cuda")
    sched = _mixed_schedule()
    eager = _drive(BatchEngine(model, max_batch=8, max_context=64, prefill_chunk=5, cuda_graph=False), sched)
    engine = BatchEngine(model, max_batch=8, max_context=64, prefill_chunk=5, compile=True)
    engine.warmup([p for _, _, p in sched])
    made = set(engine._graphs)
    assert {b for b, _ in made} == {1, 2, 4, 8} and len({m for _, m in made}) == 2  # greedy, seeded top-k 64
    graphed = _drive(engine, sched)
    assert set(engine._graphs) == made  # nothing captured while serving
    for e, g in zip(eager, graphed):
        assert g.tokens == e.tokens


@pytest.mark.cuda
@needs_cuda
def test_cuda_threaded_graph_engine_matches_stock():
    model = build_model("tiny-e2b", device="cuda")
    engine = BatchEngine(model, max_batch=4, max_context=128, prefill_chunk=64)
    prompts = [_prompt(n, 60 + n) for n in (9, 23, 5, 2, 40)]  # prefill calls: [9, 23], [5, 2], [40]
    refs = [_stock(model, p, 30) for p in prompts]  # before start(): the engine thread owns the model from then on
    outs = [Collect() for _ in prompts]
    engine.start()
    for p, o in zip(prompts, outs):
        engine.submit(p, _greedy(30), o)
    for ref, o in zip(refs, outs):
        assert o.done.wait(120)
        assert o.tokens == ref
    engine.shutdown(timeout=30)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_lone_prompts_replay_the_captured_prefill(dtype):
    """A prompt alone in its prefill call replays the prefill graph of its width (captured by warmup(), nothing new
    captured while serving); tokens equal the eager engine's, which pads the same, and in fp32 stock's."""
    model = build_model("tiny-e4b", dtype=dtype, device="cuda")
    sched = [(6 * i, _prompt(n, seed=n), _greedy()) for i, n in enumerate((3, 11, 20, 16))]
    eager = _drive(BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=32, cuda_graph=False), sched)
    engine = BatchEngine(model, max_batch=4, max_context=64, prefill_chunk=32)
    engine.warmup()
    graphs = engine._prefill_graphs.graphs
    assert set(graphs) == {(1, 16), (1, 32), (2, 16)} and all(g is not None for g in graphs.values())
    graphed = _drive(engine, sched)
    assert set(graphs) == {(1, 16), (1, 32), (2, 16)}
    for (_, prompt, _), e, g in zip(sched, eager, graphed):
        assert g.tokens == e.tokens
        if dtype == torch.float32:
            assert g.tokens == _stock(model, prompt)


def test_compiled_step_writes_the_kv_cache_in_place(model):
    """The compiled decode step writes each row's new K/V into the cache buffers without copying them: a scatter_
    into a [:b] view of a buffer compiled (Inductor) to a copy of all b rows' slots per layer, 3.0 of the 11.2 ms
    step at b = 64 on the H200 (bench/engine.py --profile, 2026-12-03). Inductor's generated code must hold no loop
    over a whole [:b] slice of a cache buffer; the tokens must be the uncompiled step's."""
    from torch._inductor.utils import run_and_get_code

    b = 8
    engines = [BatchEngine(model, max_batch=b, max_context=96, compile=c) for c in (False, True)]
    for engine in engines:
        for keys, values in zip(engine.cache.keys.values(), engine.cache.values.values()):
            keys.normal_(generator=torch.Generator().manual_seed(1))
            values.normal_(generator=torch.Generator().manual_seed(2))
        engine.active[:b] = True
        engine.position[:b] = torch.arange(30, 30 + b)  # rows at different positions, past the sliding window
        engine.next_ids[:b, 0] = torch.arange(3, 3 + b)
    torch._dynamo.reset()
    with torch.no_grad():
        engines[0]._run_step(b, engines[0]._mode([]))
        _, codes = run_and_get_code(lambda: engines[1]._run_step(b, engines[1]._mode([])))
    code = "\n".join(codes)
    slices = {b * k.shape[1] * k.shape[2] * k.shape[3] for k in engines[1].cache.keys.values()}
    copied = [n for n in slices if f"<static_cast<int64_t>({n}L)" in code or f"< {n}" in code]
    assert not copied, f"the compiled step loops over whole cache slices of {copied} elements"
    assert torch.equal(engines[1].next_ids, engines[0].next_ids)
    for i in engines[0].cache.keys:  # the same slots written with the same values
        assert torch.allclose(engines[1].cache.keys[i], engines[0].cache.keys[i], atol=1e-5, rtol=1e-5)
        assert torch.allclose(engines[1].cache.values[i], engines[0].cache.values[i], atol=1e-5, rtol=1e-5)
