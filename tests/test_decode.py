"""g4ops.engine.decoder.Decoder against stock `model.generate` greedy search, on tiny Gemma-4 models built in code.

fp32 throughout, so the only difference from stock is the order in which attention sums over the cached keys. The
tiny models have a sliding window of 8, so 30 new tokens cross it many times; the E4B-shaped one has KV-shared
layers of both types and two KV heads, the E2B-shaped one a double-wide MLP.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import g4ops
from g4ops.engine.decoder import GreedyDecoder
from g4ops.models import build_model

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

NEW = 30


def _prompt(model, batch=2, length=5, seed=1):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _stock_generate(model, ids, new=NEW, eos=None):
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=eos,
                           min_new_tokens=0 if eos is not None else new)  # fmt: skip
    with torch.no_grad():
        return model.generate(ids, generation_config=cfg)


def _assert_stock_argmax(model, tokens, prompt_len):
    """Each generated token is the argmax of stock's teacher-forced logits, up to fp32 ties (near-equal top logits
    of a random tiny model can flip under any reordering of a sum)."""
    with torch.no_grad():
        logits = model(tokens).logits.double()[:, prompt_len - 1 : -1]
    chosen = logits.gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)
    shortfall = logits.max(dim=-1).values - chosen
    assert shortfall.max().item() <= 1e-4, f"a token is not stock's argmax: shortfall {shortfall.max().item():.3g}"


@pytest.mark.parametrize("enabled", [False, True], ids=["stock-modules", "g4ops-enabled"])
def test_tokens_equal_stock_generate(enabled):
    model = build_model("tiny-e2b")
    ids = _prompt(model)
    ref = _stock_generate(model, ids)
    with g4ops.enable() if enabled else contextlib.nullcontext():
        out = GreedyDecoder(model, batch_size=2, max_length=64).generate(ids, NEW)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("shape", ["tiny-e4b", "tiny-e2b"])
def test_every_token_is_stock_argmax(shape):
    model = build_model(shape)
    ids = _prompt(model, batch=3, length=11)  # prefill longer than the window: the ring keeps the last 8
    out = GreedyDecoder(model, batch_size=3, max_length=48).generate(ids, NEW)
    assert out.shape == (3, 11 + NEW) and torch.equal(out[:, :11], ids)
    _assert_stock_argmax(model, out, 11)


def test_decoder_reuse_and_eos_like_generate():
    model = build_model("tiny-e2b")
    ids = _prompt(model)
    decoder = GreedyDecoder(model, batch_size=2, max_length=64, sync_every=4)
    free_run = decoder.generate(ids, NEW)
    # an EOS that one row emits early: stock pads that row after it and stops once both rows have one
    eos = int(free_run[0, ids.shape[1] + 3])
    ref = _stock_generate(model, ids, eos=eos)
    out = decoder.generate(ids, NEW, eos_token_id=eos)
    assert torch.equal(out, ref), (out, ref)
    assert torch.equal(decoder.generate(ids, NEW), free_run)  # state fully reset by the next prefill


def test_compiled_step_matches_eager_step():
    """compile=True compiles the step's model call once: greedy and sampling steps share it (the sampler runs eagerly
    around it), and both give the eager step's tokens."""
    from torch._dynamo.utils import counters

    model = build_model("tiny-e2b")
    ids = _prompt(model)
    eager_decoder = GreedyDecoder(model, batch_size=2, max_length=40)
    eager = eager_decoder.generate(ids, 20)
    torch._dynamo.reset()
    # the step only: the compiled prefill has its own tests (tests/test_compiled_prefill.py, cheaper backends)
    decoder = GreedyDecoder(model, batch_size=2, max_length=40, compile=True, compile_prefill=False)
    compiled = decoder.generate(ids, 20)
    assert torch.equal(compiled, eager)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    sampling = dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.9)
    torch.manual_seed(3)
    sampled = decoder.generate(ids, 20, **sampling)
    assert counters["stats"]["unique_graphs"] == graphs  # no compilation for the sampling step
    torch.manual_seed(3)
    assert torch.equal(sampled, eager_decoder.generate(ids, 20, **sampling))


def test_step_attention_is_decode_attention_and_the_config_is_restored(monkeypatch):
    """Every attention of every step goes through g4ops.decode_attention (prefill keeps the model's own), the
    configs name their own implementation again after each step, and the tokens equal the sdpa step's."""
    import g4ops.ops

    model = build_model("tiny-e4b")
    ids = _prompt(model)
    before = model.config._attn_implementation
    sdpa = GreedyDecoder(model, batch_size=2, max_length=64, decode_attention=False).generate(ids, NEW)
    calls = []
    real = g4ops.ops.decode_attention

    def counting(q, k, v, mask, scale):
        calls.append((tuple(q.shape), tuple(k.shape), scale))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(g4ops.ops, "decode_attention", counting)
    out = GreedyDecoder(model, batch_size=2, max_length=64).generate(ids, NEW)
    assert torch.equal(out, sdpa)
    assert len(calls) == (NEW - 1) * model.config.num_hidden_layers  # the first new token comes from prefill
    assert {c[2] for c in calls} == {model.model.layers[0].self_attn.scaling}
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="decode step only"):  # a call that is not a decode step is refused
        from g4ops.engine.decoder import decode_step_attention

        q = torch.randn(1, 2, 3, 8)
        decode_step_attention(None, q, q, q, None)


def test_decoder_under_g4ops_attention_keeps_that_implementation():
    """With `enable(model, attention=True)` the model's text attention is "g4ops": the step switches to
    decode_attention and back, prefill runs g4ops attention, and every token is stock's argmax (fp32)."""
    model = build_model("tiny-e4b")
    ids = _prompt(model)
    with g4ops.enable(model, attention=True):
        assert model.config._attn_implementation == "g4ops"
        out = GreedyDecoder(model, batch_size=2, max_length=64).generate(ids, NEW)
        assert model.config._attn_implementation == "g4ops"
    _assert_stock_argmax(model, out, ids.shape[1])


@pytest.mark.parametrize(
    "kwargs, call, message",
    [
        (dict(batch_size=2, max_length=16), lambda d, ids: d.generate(ids, 20), "must fit max_length 16"),
        (dict(batch_size=3, max_length=64), lambda d, ids: d.generate(ids, 4), r"input_ids must be \[batch=3"),
        (dict(batch_size=0), None, "batch_size must be >= 1"),
    ],
)
def test_bad_input(kwargs, call, message):
    model = build_model("tiny-e4b")
    with pytest.raises(ValueError, match=message):
        decoder = GreedyDecoder(model, **kwargs)
        call(decoder, _prompt(model))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_matches_eager_steps(dtype):
    model = build_model("tiny-e4b", dtype=dtype, device="cuda")
    ids = _prompt(model).cuda()
    with g4ops.enable():
        graphed = GreedyDecoder(model, batch_size=2, max_length=64)
        out = graphed.generate(ids, NEW)
        assert graphed.graph is not None
        ref = GreedyDecoder(model, batch_size=2, max_length=64, cuda_graph=False).generate(ids, NEW)
    assert torch.equal(out, ref)
    if dtype == torch.float32:
        _assert_stock_argmax(model, out, ids.shape[1])


def test_padded_prefill_gives_stock_tokens():
    """The prompt left-padded to its prefill width (what lets one CUDA graph serve every length) changes no token:
    fp32, a left-padded batch, the ring of the sliding layers (window 8) holding padding and real slots; a width
    that would not leave room for the new tokens is not padded."""
    from g4ops.engine.decoder import prefill_width

    model = build_model("tiny-e4b")
    ids = _prompt(model, length=11)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = _generate(model, ids, attention_mask=mask, min_new_tokens=NEW)
    decoder = GreedyDecoder(model, batch_size=2, max_length=64, pad_prefill=True)
    out = decoder.generate(ids, NEW, eos_token_id=1, attention_mask=mask, min_new_tokens=NEW)
    assert torch.equal(out, ref)
    width = prefill_width(11, 2)
    assert width == 16 and torch.equal(decoder.cache.pad.flatten(), torch.tensor([5, 9]))  # the padded path ran
    assert int(decoder.prompt_len) == width
    tight = GreedyDecoder(model, batch_size=2, max_length=11 + NEW, pad_prefill=True)
    assert torch.equal(tight.generate(ids, NEW, eos_token_id=1, attention_mask=mask, min_new_tokens=NEW), ref)
    assert int(tight.prompt_len) == 11  # 16 + NEW would not fit: not padded


def test_per_row_sampling_settings():
    """One value per row: a top_k=1 row is greedy search whatever the others do; a seed repeats the draws; a bad
    value is refused naming the parameter."""
    model = build_model("tiny-e4b")
    ids = _prompt(model)
    decoder = GreedyDecoder(model, batch_size=2, max_length=48)
    greedy = decoder.generate(ids, 12)
    rows = dict(do_sample=True, temperature=torch.tensor([0.7, 1.5]), top_k=torch.tensor([1, 0]),
                top_p=torch.tensor([1.0, 0.9], dtype=torch.float64), min_p=torch.tensor([0.0, 0.02]))  # fmt: skip
    torch.manual_seed(3)
    a = decoder.generate(ids, 12, **rows)
    assert decoder.mode == ("sample", None, True, True, True)  # a row without top-k: the full sort
    torch.manual_seed(3)
    assert torch.equal(decoder.generate(ids, 12, **rows), a) and torch.equal(a[0], greedy[0])
    assert not torch.equal(a[1], greedy[1])
    with pytest.raises(ValueError, match="top_p must be in"):
        decoder.generate(ids, 4, do_sample=True, top_p=torch.tensor([0.5, 1.5]))


def test_suppress_tokens_like_generate():
    from transformers import GenerationConfig

    model = build_model("tiny-e2b")
    ids = _prompt(model)
    banned = sorted(set(_stock_generate(model, ids)[:, ids.shape[1] :].flatten().tolist()))[:3]
    cfg = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=1, suppress_tokens=banned)  # fmt: skip
    with torch.no_grad():
        ref = model.generate(ids, generation_config=cfg)
    out = GreedyDecoder(model, batch_size=2, max_length=64, suppress_tokens=banned).generate(ids, NEW)
    assert torch.equal(out, ref) and not torch.isin(out[:, ids.shape[1] :], torch.tensor(banned)).any()


# ----------------------------------------------------------------------------------------------------------------
# g4ops.enable() routes eligible generate() calls to the decoder (on CUDA; here "cpu" is added to exercise it)


@pytest.fixture
def route_cpu(monkeypatch):
    from g4ops.hf import generate as hf_generate

    monkeypatch.setattr(hf_generate, "ROUTED_DEVICES", ("cuda", "cpu"))
    yield
    g4ops.disable()


def _generate(model, ids, **kw):
    kw = dict(dict(max_new_tokens=NEW, do_sample=False, cache_implementation="static", pad_token_id=0,
                   eos_token_id=1, disable_compile=True), **kw)  # fmt: skip
    with torch.no_grad():
        return model.generate(ids, **kw)


@pytest.mark.parametrize("how", ["class", "model"])
@pytest.mark.parametrize("case", ["eos suppressed", "eos stops", "suppress_tokens", "min_new_tokens"])
def test_enable_routes_greedy_static_generate_to_the_decoder(route_cpu, how, case):
    model = build_model("tiny-e2b")
    ids = _prompt(model)
    free = _generate(model, ids, min_new_tokens=NEW)
    kw = {
        "eos suppressed": dict(min_new_tokens=NEW),
        "eos stops": dict(eos_token_id=int(free[1, ids.shape[1] + 4])),
        "suppress_tokens": dict(min_new_tokens=NEW, suppress_tokens=free[0, ids.shape[1]:][:2].tolist()),
        # an EOS that a row emits at its 2nd new token, held back for the first 6
        "min_new_tokens": dict(min_new_tokens=6, eos_token_id=int(free[0, ids.shape[1] + 1])),
    }[case]
    ref = _generate(model, ids, **kw)
    g4ops.enable() if how == "class" else g4ops.enable(model)
    out = _generate(model, ids, attention_mask=torch.ones_like(ids), **kw)
    assert "_g4ops_decoder" in vars(model), "the call was not routed"
    assert torch.equal(out, ref)


def test_arguments_given_as_nothing_still_route(route_cpu):
    # streamer=None and an empty logits_processor are what wrappers (and bench/e2e.py) pass when they have none;
    # on the H200 (2026-11-29) streamer=None sent every call to stock generate.
    from transformers import LogitsProcessorList, StoppingCriteriaList

    model = build_model("tiny-e2b")
    ids = _prompt(model)
    nothing = dict(streamer=None, logits_processor=LogitsProcessorList(), stopping_criteria=StoppingCriteriaList(),
                   synced_gpus=False, assistant_model=None, negative_prompt_ids=None)  # fmt: skip
    ref = _generate(model, ids, min_new_tokens=NEW)
    g4ops.enable()
    out = _generate(model, ids, min_new_tokens=NEW, **nothing)
    assert "_g4ops_decoder" in vars(model), "the call was not routed"
    assert torch.equal(out, ref)


def test_disable_restores_generate(route_cpu):
    from transformers.generation.utils import GenerationMixin

    hf = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    model = build_model("tiny-e2b")
    classes = (hf.Gemma4ForCausalLM, hf.Gemma4ForConditionalGeneration)
    before = [(c.generate, "generate" in vars(c)) for c in classes]
    with g4ops.enable():
        assert all(c.generate is not GenerationMixin.generate for c in classes)
        _generate(model, _prompt(model), max_new_tokens=4)
        assert "_g4ops_decoder" in vars(model)
    assert [(c.generate, "generate" in vars(c)) for c in classes] == before
    assert "_g4ops_decoder" not in vars(model)  # the decoder's KV cache and graph are let go
    g4ops.enable(model)
    assert "generate" in vars(model)
    g4ops.disable(model)
    assert "generate" not in vars(model) and "_g4ops_decoder" not in vars(model)
    g4ops.enable(model, decode=False)
    assert "generate" not in vars(model)


@pytest.mark.parametrize("shape", ["tiny-e4b", "tiny-e2b"])
@pytest.mark.parametrize("routed", [False, True], ids=["decoder", "routed-generate"])
def test_left_padded_batch_matches_stock_generate(route_cpu, shape, routed):
    # rows of 9, 4 and 12 real tokens, left-padded to 12: the window of 8 is crossed with padding in the cache
    model = build_model(shape)
    ids = _prompt(model, batch=3, length=12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :8] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = _generate(model, ids, attention_mask=mask, min_new_tokens=NEW)
    if routed:
        g4ops.enable()
        out = _generate(model, ids, attention_mask=mask, min_new_tokens=NEW)
        assert "_g4ops_decoder" in vars(model)
    else:
        out = GreedyDecoder(model, batch_size=3, max_length=64, suppress_tokens=[1]).generate(
            ids, NEW, attention_mask=mask)
    assert torch.equal(out, ref), (out != ref).nonzero()[:3]


def test_bad_padding_is_refused():
    model = build_model("tiny-e4b")
    ids = _prompt(model)
    mask = torch.ones_like(ids)
    mask[0, 2] = 0  # inner padding
    with pytest.raises(ValueError, match="left padding"):
        GreedyDecoder(model, batch_size=2, max_length=64).generate(ids, 4, attention_mask=mask)


def test_multimodal_class_text_only_matches_stock_generate(route_cpu):
    # AutoModelForCausalLM loads the released checkpoints as Gemma4ForConditionalGeneration
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from g4ops.models import randomize_norms_and_scalars, text_config

    torch.manual_seed(0)
    cfg = Gemma4Config(text_config=text_config("tiny-e4b").to_dict(), vision_config=None, audio_config=None)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    randomize_norms_and_scalars(model)
    ids = torch.randint(3, cfg.get_text_config().vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, min_new_tokens=NEW)
    out = GreedyDecoder(model, batch_size=2, max_length=48).generate(ids, NEW, eos_token_id=1, min_new_tokens=NEW)
    assert torch.equal(out, ref)
    g4ops.enable()
    routed = _generate(model, ids, min_new_tokens=NEW)
    assert "_g4ops_decoder" in vars(model) and torch.equal(routed, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_routed_generate_left_padded_matches_stock():
    # the user's path on a GPU: enable(), then generate(cache_implementation="static") with a left-padded batch
    model = build_model("tiny-e2b", device="cuda")
    ids = _prompt(model, batch=3, length=12).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :8] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = _generate(model, ids, attention_mask=mask, min_new_tokens=NEW)  # stock, eager static cache
    with g4ops.enable():
        out = _generate(model, ids, attention_mask=mask, min_new_tokens=NEW)
        decoder = vars(model)["_g4ops_decoder"][1]
        assert decoder.graph is not None  # routed and replayed as a CUDA graph
        eager = GreedyDecoder(model, batch_size=3, max_length=64, cuda_graph=False).generate(
            ids, NEW, eos_token_id=1, attention_mask=mask, min_new_tokens=NEW)
    assert torch.equal(out, eager)
    assert torch.equal(out, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefill_is_replayed_from_a_graph_per_width(dtype):
    """Prompts of 5 and 11 tokens share the captured prefill of width 16: the first call captures it, the others
    replay it, and the tokens equal the same decoder run without graphs (the same padding) and, in fp32, stock's
    argmax; without padding nothing is captured."""
    model = build_model("tiny-e4b", dtype=dtype, device="cuda")
    with g4ops.enable():
        graphed = GreedyDecoder(model, batch_size=2, max_length=64)
        eager = GreedyDecoder(model, batch_size=2, max_length=64, cuda_graph=False)
        for length in (5, 11, 5):
            ids = _prompt(model, length=length, seed=length).cuda()
            out = graphed.generate(ids, NEW)
            assert list(graphed.prefill_graphs.graphs) == [16] and graphed.prefill_graphs.graphs[16] is not None
            assert torch.equal(out, eager.generate(ids, NEW))
            if dtype == torch.float32:
                _assert_stock_argmax(model, out, length)
        unpadded = GreedyDecoder(model, batch_size=2, max_length=64, pad_prefill=False)
        assert torch.equal(unpadded.generate(ids, NEW)[:, :5], ids) and not unpadded.prefill_graphs.graphs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_decoder_captures_the_uncompiled_step_when_compiling_fails(caplog):
    """A step model call torch.compile cannot build (simulated) costs speed, never the call: the warm-up logs why,
    captures the uncompiled call, and the tokens are the eager step's."""
    import logging

    model = build_model("tiny-e4b", device="cuda")
    ids = _prompt(model).cuda()
    decoder = GreedyDecoder(model, batch_size=2, max_length=64, compile=True)

    def refused():
        raise RuntimeError("simulated compiler failure")

    decoder.logits_fn = refused
    with caplog.at_level(logging.WARNING, logger="g4ops"):
        out = decoder.generate(ids, NEW)
    assert "compiling the decode step's model call failed" in caplog.text
    assert "simulated compiler failure" in caplog.text
    assert decoder.logits_fn == decoder._step_logits and decoder.graph is not None
    assert torch.equal(out, GreedyDecoder(model, batch_size=2, max_length=64, cuda_graph=False).generate(ids, NEW))


@pytest.mark.parametrize("eos", [[], [1], [1, 5]])
@pytest.mark.parametrize("seed", range(40))
def test_block_stops_equal_the_column_loop(eos, seed):
    """The decoder's host side takes a block of new-token columns at once when only EOS ids can stop a row; it must
    give what the column-at-a-time loop gives (the loop runs when a stop function is set: here one that never
    stops): the ids with finished rows padded, where each row finished, how many columns were taken."""
    from g4ops.engine.decoder import _Stops

    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 5, (1,), generator=gen))
    prompt = torch.randint(0, 9, (batch, 3), generator=gen)
    block = _Stops(prompt, eos, 0, None, None)
    loop = _Stops(prompt, eos, 0, lambda ids: torch.zeros(ids.shape[0], dtype=torch.bool), None)
    block_done = loop_done = False
    for _ in range(4):
        columns = torch.randint(0, 12, (batch, int(torch.randint(1, 7, (1,), generator=gen))), generator=gen)
        block_done = block_done or block.feed(columns)
        loop_done = loop_done or loop.feed(columns)
    assert block_done == loop_done and block.length == loop.length
    assert torch.equal(block.ids(), loop.ids()) and torch.equal(block.finished_at, loop.finished_at)
