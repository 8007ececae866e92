"""g4ops.decode.GreedyDecoder against stock `model.generate` greedy search, on tiny Gemma-4 models built in code.

fp32 throughout, so the only difference from stock is the order in which attention sums over the cached keys. The
tiny models have a sliding window of 8, so 30 new tokens cross it many times; the E4B-shaped one has KV-shared
layers of both types and two KV heads, the E2B-shaped one a double-wide MLP.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import g4ops
from g4ops.decode import GreedyDecoder
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
    model = build_model("tiny-e2b")
    ids = _prompt(model)
    eager = GreedyDecoder(model, batch_size=2, max_length=40).generate(ids, 20)
    torch._dynamo.reset()
    compiled = GreedyDecoder(model, batch_size=2, max_length=40, compile=True).generate(ids, 20)
    assert torch.equal(compiled, eager)


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
