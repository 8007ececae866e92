"""`model.generate(...)` under g4ops.enable(): the calls users make (the checkpoint's sampling config, the default
dynamic cache, streamers, stop strings, a multimodal class with text-only processor outputs) run on
g4ops.engine's Decoder and give stock's result; everything else runs stock and says why (g4ops.generation_route).

fp32 tiny models on CPU ("cpu" added to ROUTED_DEVICES), so greedy tokens equal stock's exactly; sampled tokens are
not stock's for a seed (stock draws with torch.multinomial), so they are checked for reproducibility, top_k=1 against
greedy, and by a chi-square test of the first token against transformers' warpers.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import g4ops
from g4ops.hf import generate as hf_generate
from g4ops.models import build_model, tiny_tokenizer
from devices import DEVICES

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

NEW = 8
E4B_IT = dict(do_sample=True, temperature=1.0, top_k=64, top_p=0.95, eos_token_id=[1, 106, 50])  # its config


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-e4b")


@pytest.fixture
def routing(monkeypatch):
    monkeypatch.setattr(hf_generate, "ROUTED_DEVICES", ("cuda", "cpu"))
    yield
    g4ops.disable()


def _prompts(batch=3, length=7, seed=1, vocab=512):
    """Left-padded prompts of different lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : int(torch.randint(0, length - 1, (1,), generator=g))] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _gen(model, ids, mask=None, **kw):
    kw = dict(dict(max_new_tokens=NEW, pad_token_id=0), **kw)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kw)


def _routed(model):
    return "_g4ops_decoder" in vars(model)


@pytest.mark.parametrize("cache", [None, "static"], ids=["default-cache", "static"])
def test_greedy_equals_stock_with_eos_lists(model, routing, cache):
    ids, mask = _prompts()
    kw = dict(do_sample=False, cache_implementation=cache) if cache else dict(do_sample=False)
    free = _gen(model, ids, mask, eos_token_id=1, min_new_tokens=NEW, **kw)
    eos = [1, int(free[0, ids.shape[1] + 2]), int(free[2, ids.shape[1] + 5])]  # two rows finish early
    ref = _gen(model, ids, mask, eos_token_id=eos, **kw)
    g4ops.enable()
    assert g4ops.generation_route(model, input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw).routed
    out = _gen(model, ids, mask, eos_token_id=eos, disable_compile=True, **kw)
    assert _routed(model) and torch.equal(out, ref), (out, ref)


def test_checkpoint_sampling_config_routes_and_reproduces_with_seed(model, routing):
    from transformers import GenerationConfig

    ids, mask = _prompts()
    stock_config = model.generation_config
    model.generation_config = GenerationConfig(**E4B_IT, pad_token_id=0)
    try:
        greedy_ref = _gen(model, ids, mask, do_sample=False)
        g4ops.enable()
        assert g4ops.generation_route(model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW).routed
        runs = {}
        for seed in (5, 5, 6):
            torch.manual_seed(seed)
            runs.setdefault(seed, []).append(_gen(model, ids, mask))
        assert _routed(model) and vars(model)["_g4ops_decoder"][1].mode == ("sample", 64, True, True, False)
        assert torch.equal(runs[5][0], runs[5][1]) and not torch.equal(runs[5][0], runs[6][0])
        assert torch.equal(_gen(model, ids, mask, top_k=1), greedy_ref)  # top_k=1 sampling is greedy search
    finally:
        model.generation_config = stock_config


class _Recorder:
    """A BaseStreamer that keeps what put() got, in order."""

    def __new__(cls):
        from transformers.generation.streamers import BaseStreamer

        class Recorder(BaseStreamer):
            def __init__(self):
                self.puts, self.ended = [], 0

            def put(self, value):
                self.puts.append(value.clone())

            def end(self):
                self.ended += 1

        return Recorder()


def test_streamers_get_what_stock_gives_them(model, routing):
    from transformers import TextIteratorStreamer

    ids, mask = _prompts()
    free = _gen(model, ids, mask, eos_token_id=1, min_new_tokens=NEW)
    eos = int(free[1, ids.shape[1] + 3])  # one row finishes early: later puts carry pad for it
    stock = _Recorder()
    ref = _gen(model, ids, mask, eos_token_id=eos, streamer=stock)
    g4ops.enable()
    ours = _Recorder()
    out = _gen(model, ids, mask, eos_token_id=eos, streamer=ours)
    assert _routed(model) and torch.equal(out, ref)
    assert len(ours.puts) == len(stock.puts) and ours.ended == stock.ended == 1
    assert all(torch.equal(a, b) for a, b in zip(ours.puts, stock.puts))
    # text: a tokenizer's streamer, batch 1, prints exactly the returned new tokens
    tok = tiny_tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = _gen(model, ids[:1], mask[:1], eos_token_id=1, min_new_tokens=NEW, streamer=streamer)
    assert "".join(streamer) == tok.decode(out[0, ids.shape[1] :])


def test_stop_strings_max_time_and_return_dict_like_stock(model, routing):
    tok = tiny_tokenizer()
    ids, mask = _prompts()
    free = _gen(model, ids, mask, eos_token_id=1, min_new_tokens=NEW)
    n = ids.shape[1]
    # a printable byte token (ids 256 + byte in the tiny tokenizer) that some row makes as the stop string
    printable = (free[:, n + 1 : n + NEW - 1] >= 256 + 33) & (free[:, n + 1 : n + NEW - 1] < 256 + 127)
    row, j = (int(i) for i in printable.nonzero()[0])
    stop = tok.decode(free[row, n + 1 + j : n + 2 + j])
    cases = [dict(stop_strings=["zz", stop], tokenizer=tok, eos_token_id=1), dict(max_time=0.0, eos_token_id=1),
             dict(return_dict_in_generate=True, eos_token_id=1),
             dict(max_length=n + 3, min_length=n + 2, eos_token_id=[1, int(free[0, n])])]  # fmt: skip
    refs = [_gen(model, ids, mask, **kw) for kw in cases]
    g4ops.enable()
    for kw, ref in zip(cases, refs):
        assert g4ops.generation_route(model, input_ids=ids, attention_mask=mask, **kw).routed, kw
        out = _gen(model, ids, mask, **kw)
        if kw.get("return_dict_in_generate"):
            assert type(out) is type(ref) and out.scores is None
            out, ref = out.sequences, ref.sequences
        assert torch.equal(out, ref), (kw, out, ref)
    first = next(i for i in range(NEW) if tok.decode(free[row, n + i : n + i + 1]) == stop)
    assert (refs[0][row, n + first + 1 :] == 0).all() and refs[1].shape[1] == n + 1  # the stops did stop


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        (dict(repetition_penalty=1.3, attention_mask="left-padded"), "repetition_penalty"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (dict(do_sample=True, typical_p=0.5), "typical_p"),
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, top_k=-3), "top_k"),
        (dict(cache_implementation="offloaded"), "cache_implementation"),
        (dict(logits_processor="processor"), "logits_processor"),
        (dict(stopping_criteria="criterion"), "stopping_criteria"),
        (dict(attention_mask="right-padded"), "attention_mask"),
        (dict(mm_token_type_ids="image"), "mm_token_type_ids"),
        (dict(stop_strings="ab"), "stop_strings"),
        (dict(eos_token_id=list(range(3, 12))), "eos_token_id"),
        (dict(past_key_values="cache"), "past_key_values"),
        (dict(input_ids=None, inputs_embeds="embeds"), "input_ids"),
        (dict(streamer="not a streamer"), "streamer"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_arguments_run_stock_and_say_why(model, routing, kw, names):
    from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import MinLengthLogitsProcessor
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    ids, mask = _prompts(batch=2)
    fill = {
        "processor": lambda: LogitsProcessorList([MinLengthLogitsProcessor(3, eos_token_id=1)]),
        "criterion": lambda: StoppingCriteriaList([MaxLengthCriteria(max_length=20)]),
        "right-padded": lambda: torch.ones_like(ids).index_fill_(1, torch.tensor([ids.shape[1] - 1]), 0),
        "left-padded": lambda: torch.ones_like(ids).index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(0)),
        "image": lambda: torch.zeros_like(ids).index_fill_(1, torch.tensor([2]), 1),
        "cache": lambda: DynamicCache(config=model.config),
        "embeds": lambda: torch.randn(2, ids.shape[1], model.config.hidden_size),
        "not a streamer": lambda: object(),
    }
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)
    call.update({k: fill[v]() if isinstance(v, str) and v in fill else v for k, v in kw.items()})
    before = g4ops.generation_route(model, **call)
    assert not before.routed and "enable" in before.reason  # not patched yet: says so
    g4ops.enable()
    route = g4ops.generation_route(model, **call)
    assert not route.routed and names in route.reason, route


def test_a_stock_call_logs_its_reason_once(model, routing, caplog):
    ids, mask = _prompts(batch=2)
    g4ops.enable()
    hf_generate._logged_reasons.clear()
    with caplog.at_level(logging.INFO, logger="g4ops"):
        for _ in range(2):
            _gen(model, ids, mask, max_new_tokens=2, no_repeat_ngram_size=2)
    assert not _routed(model)
    logged = [r.getMessage() for r in caplog.records if r.name == "g4ops"]
    assert len(logged) == 1 and "no_repeat_ngram_size=2" in logged[0], logged


@pytest.mark.parametrize("cache", [None, "static"], ids=["default-cache", "static"])
def test_repetition_penalty_routes_and_equals_stock(model, routing, cache):
    """An unpadded batch with repetition_penalty runs on the decoder: greedy tokens equal stock's (a penalty strong
    enough to change them), and a sampled call reproduces with its seed."""
    ids = _prompts(batch=2)[0][:, -5:]  # the unpadded tail of each prompt
    kw = dict(max_new_tokens=12, eos_token_id=1, min_new_tokens=12)
    kw.update(dict(cache_implementation=cache) if cache else {})
    plain = _gen(model, ids, torch.ones_like(ids), do_sample=False, **kw)
    ref = _gen(model, ids, torch.ones_like(ids), do_sample=False, repetition_penalty=3.0, **kw)
    assert not torch.equal(plain, ref)  # the penalty changes the tokens
    g4ops.enable()
    route = g4ops.generation_route(model, input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   repetition_penalty=3.0, **kw)  # fmt: skip
    assert route.routed, route
    out = _gen(model, ids, torch.ones_like(ids), do_sample=False, repetition_penalty=3.0, disable_compile=True, **kw)
    assert _routed(model) and torch.equal(out, ref), (out, ref)
    decoder = vars(model)["_g4ops_decoder"][1]
    assert decoder.penalized
    sampled = []
    for seed in (4, 4):
        torch.manual_seed(seed)
        sampled.append(_gen(model, ids, None, do_sample=True, top_k=20, repetition_penalty=1.5, **kw))
    assert torch.equal(sampled[0], sampled[1])
    assert torch.equal(_gen(model, ids, None, do_sample=False, **kw), plain) and not decoder.penalized


@pytest.mark.parametrize("device", DEVICES)
def test_penalty_equals_transformers_processor(device):
    """Decoder._penalize against RepetitionPenaltyLogitsProcessor on the same ids and fp32 scores on the same device,
    bit for bit: negative and positive scores, repeated ids, and `out` holding stale ids past the sequence and the
    decoder's own padding before it. (Ids past the lm_head's vocabulary are dropped, as transformers 5.24 does;
    5.17's processor raises on them, so they are not compared here.)"""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from g4ops.engine.decoder import Decoder

    g = torch.Generator().manual_seed(0)
    vocab, length, extra, last = 50, 24, 3, 15
    out = torch.randint(0, vocab, (2, length), generator=g)
    out[1, 6] = out[1, 7] = 9  # a repeated id
    out = out.to(device)
    decoder = Decoder.__new__(Decoder)  # _penalize reads only these
    decoder.out, decoder.device = out, torch.device(device)
    decoder.seen_from = torch.tensor([extra], device=device)
    for penalty in (1.3, 0.7):
        decoder.penalty = torch.tensor([penalty], device=device)
        scores = (torch.randn(2, vocab, generator=g) * 3).to(device)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(out[:, extra : last + 1], scores.clone())
        got = decoder._penalize(scores, torch.tensor([last], device=device))
        assert torch.equal(got, ref)
        assert not torch.equal(got, scores)


def _chi2_bound(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty: the chi-square quantile z standard deviations out (z=4: 3e-5 one-sided)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_first_token_distribution_matches_transformers_warpers(model, routing):
    """Many rows of one prompt, one new token each: the routed draws' frequencies against softmax of the stock
    model's logits through TopKLogitsWarper(64) and TopPLogitsWarper(0.95) (E4B-it's config; temperature 1 is left
    out, as generate does)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rows, calls = 512, 4
    prompt = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(prompt).logits[:, -1].float()
    probs = TopPLogitsWarper(0.95)(None, TopKLogitsWarper(64)(None, logits)).softmax(-1)[0].double()
    g4ops.enable()
    counts = torch.zeros_like(probs)
    for seed in range(calls):
        torch.manual_seed(seed)
        out = _gen(model, prompt.expand(rows, -1), max_new_tokens=1, **E4B_IT)
        counts += torch.bincount(out[:, -1], minlength=probs.numel()).double()
    assert _routed(model)
    n = rows * calls
    assert counts[probs == 0].sum() == 0, "a token the warpers filter was drawn"
    expected = n * probs
    big = expected >= 5  # pool the rare tokens into one bin (chi-square needs expected counts of 5 or more)
    rare = ~big & (probs > 0)
    observed = torch.cat([counts[big], counts[rare].sum()[None]])
    expected = torch.cat([expected[big], expected[rare].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]  # the pooled bin may be empty
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    assert df >= 10 and stat < _chi2_bound(df), (stat, df)


def test_batch_64_of_different_lengths_equals_stock(model, routing):
    ids, mask = _prompts(batch=64, length=9, seed=4)
    ref = _gen(model, ids, mask, max_new_tokens=4, eos_token_id=1, do_sample=False)
    g4ops.enable()
    out = _gen(model, ids, mask, max_new_tokens=4, eos_token_id=1, do_sample=False)
    assert _routed(model) and torch.equal(out, ref)


def test_multimodal_class_with_text_only_processor_outputs(routing):
    """Gemma4ForConditionalGeneration (the class E4B-it loads as) fed what a processor gives for text only:
    input_ids, attention_mask and mm_token_type_ids of zeros; the default cache."""
    from g4ops.models import build_multimodal_model

    model = build_multimodal_model("tiny-e4b")
    ids, mask = _prompts(batch=2, vocab=model.config.get_text_config().vocab_size)
    kw = dict(mm_token_type_ids=torch.zeros_like(ids), eos_token_id=1, min_new_tokens=NEW, do_sample=False)
    ref = _gen(model, ids, mask, **kw)
    g4ops.enable()
    assert g4ops.generation_route(model, input_ids=ids, attention_mask=mask, **kw).routed
    assert torch.equal(_gen(model, ids, mask, **kw), ref) and _routed(model)
    sampled = dict(kw, do_sample=True, top_k=64, top_p=0.95)
    torch.manual_seed(1)
    a = _gen(model, ids, mask, **sampled)
    torch.manual_seed(1)
    assert torch.equal(a, _gen(model, ids, mask, **sampled))


# -- CUDA: the graph draws from torch's philox state ------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sampled_generate_is_graphed_and_seeded(dtype):
    """The captured graph (not compiled: disable_compile) against the same step run eagerly."""
    model = build_model("tiny-e4b", dtype=dtype, device="cuda")
    ids, mask = (t.cuda() for t in _prompts())
    graph_only = dict(max_new_tokens=40, disable_compile=True)
    with g4ops.enable():
        runs = []
        for seed in (11, 11, 12):  # the first call captures: its draws must not depend on that
            torch.manual_seed(seed)
            runs.append(_gen(model, ids, mask, **graph_only, **E4B_IT))
        key, decoder = vars(model)["_g4ops_decoder"]
        assert key[2] is False and decoder.graph is not None and decoder.mode == ("sample", 64, True, True, False)
        assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
        greedy = _gen(model, ids, mask, **graph_only, do_sample=False, eos_token_id=1)
        if dtype == torch.float32:  # bf16 logits tie at the maximum (H200, 2026-12-01): transformers' top-k keeps
            # every tied token and samples among them, while greedy takes the first, so only fp32 must agree
            assert torch.equal(_gen(model, ids, mask, **graph_only, **dict(E4B_IT, top_k=1, eos_token_id=1)),
                               greedy)  # fmt: skip
        from g4ops.engine.decoder import Decoder

        greedy_eager = Decoder(model, batch_size=3, max_length=256, cuda_graph=False).generate(
            ids, 40, eos_token_id=1, attention_mask=mask)
    assert torch.equal(greedy, greedy_eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_streamer_reads_one_step_behind_like_stock():
    model = build_model("tiny-e4b", device="cuda")
    ids, mask = (t.cuda() for t in _prompts())
    stock = _Recorder()
    ref = _gen(model, ids, mask, max_new_tokens=40, do_sample=False, eos_token_id=1, streamer=stock)
    with g4ops.enable():
        ours = _Recorder()
        out = _gen(model, ids, mask, max_new_tokens=40, do_sample=False, eos_token_id=1, streamer=ours)
        assert vars(model)["_g4ops_decoder"][1].graph is not None
    assert torch.equal(out, ref) and len(ours.puts) == len(stock.puts)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(ours.puts, stock.puts))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("cache", [None, "static"])
def test_cuda_sampled_call_compiles_the_step_and_reproduces(cache):
    """The model card's call compiles the step on either cache (stock compiles only a static cache's forward), then
    captures it: Inductor's random numbers come from torch's generator too, so a seed still repeats the tokens; the
    compiled fp32 greedy step gives stock's tokens."""
    model = build_model("tiny-e4b", device="cuda")
    ids, mask = (t.cuda() for t in _prompts())
    stock_greedy = _gen(model, ids, mask, max_new_tokens=40, do_sample=False, eos_token_id=1)
    with g4ops.enable():
        runs = []
        for seed in (21, 21, 22):
            torch.manual_seed(seed)
            runs.append(_gen(model, ids, mask, max_new_tokens=40, cache_implementation=cache, **E4B_IT))
        key, decoder = vars(model)["_g4ops_decoder"]
        assert key[2] is True and decoder.graph is not None  # compiled, then captured
        greedy = _gen(model, ids, mask, max_new_tokens=40, cache_implementation=cache, do_sample=False, eos_token_id=1)
        assert vars(model)["_g4ops_decoder"][0][2] is True
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert torch.equal(greedy, stock_greedy)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_compile_prefill_switch_reaches_the_routed_decoder(monkeypatch):
    """G4OPS_COMPILE_PREFILL=1 (read at import into hf_generate.COMPILE_PREFILL) gives the routed call a compiled
    prefill beside its compiled step; fp32 greedy tokens stay stock's."""

    monkeypatch.setattr(hf_generate, "COMPILE_PREFILL", True)
    model = build_model("tiny-e4b", device="cuda")
    ids, mask = (t.cuda() for t in _prompts())
    stock = _gen(model, ids, mask, max_new_tokens=24, do_sample=False, eos_token_id=1)
    with g4ops.enable():
        ours = _gen(model, ids, mask, max_new_tokens=24, do_sample=False, eos_token_id=1)
        decoder = vars(model)["_g4ops_decoder"][1]
        assert decoder.prefill_fn != decoder._prefill_logits
    assert torch.equal(ours, stock)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_repetition_penalty_is_graphed_and_equals_stock():
    """A penalised greedy call (fp32, unpadded) on the captured step: stock's tokens, and a graph of its own beside
    the unpenalised one."""
    model = build_model("tiny-e4b", device="cuda")
    ids = _prompts(batch=2)[0][:, -5:].cuda()
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=1, min_new_tokens=40, disable_compile=True)
    ref = _gen(model, ids, None, repetition_penalty=2.0, **kw)
    with g4ops.enable():
        plain = _gen(model, ids, None, **kw)
        out = _gen(model, ids, None, repetition_penalty=2.0, **kw)
        decoder = vars(model)["_g4ops_decoder"][1]
        assert decoder.graphs.get((("greedy",), True)) is not None and decoder.graphs.get((("greedy",), False))
    assert torch.equal(out, ref) and not torch.equal(out, plain)
