"""neuron_backend at TP=1 against stock transformers, in fp32 (design.md section 6, testing ladder step 4).

Greedy tokens must be identical to transformers' own generate. Logits are compared with teacher-forced stock
logits; the allowed difference is derived from stock itself: stock's cached greedy path and its uncached full
forward already differ by `stock_self` (fp32 reassociation), and ours may differ from stock by a few times that.
"""

from __future__ import annotations

import pytest
import torch

import g4ops
from neuron_backend.check import build_stock, stock_greedy, stock_logits
from neuron_backend.config import FULL, SLIDING, BuildSettings, from_hf_config, inv_freq
from neuron_backend.generate import greedy_generate, module_step
from neuron_backend.loader import build_rank_model
from neuron_backend.model import kv_layout

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

SELF_FACTOR = 4.0  # ours vs stock may be this many times stock's own cached-vs-uncached difference
ABS_FLOOR = 1e-5  # fp32 round-off floor when stock agrees with itself to the last bits


@pytest.fixture(autouse=True)
def _stock_is_stock():
    g4ops.disable()
    yield


@pytest.fixture(scope="module")
def tiny():
    g4ops.disable()
    hf = build_stock("tiny-e4b")
    return hf, from_hf_config(hf.config)


@pytest.fixture(scope="module")
def e4b_mini():
    g4ops.disable()
    hf = build_stock("e4b-mini")
    return hf, from_hf_config(hf.config)


def _prompt(vocab, n, seed=7, batch=1):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _stock(hf, prompt, new_tokens):
    """-> (stock greedy tokens, uncached teacher-forced logits, max |diff| of stock's cached vs uncached logits)."""
    tokens, cached = stock_greedy(hf, prompt, new_tokens, return_logits=True)
    uncached = stock_logits(hf, prompt, tokens)
    return tokens, uncached, (cached - uncached).abs().max().item()


def _ours(hf, cfg, prompt, new_tokens, **settings):
    s = BuildSettings(tp=1, return_logits=True, **settings)
    model, ple, _ = build_rank_model(hf.state_dict(), cfg, s)
    res = greedy_generate(module_step(model), prompt, new_tokens, s, ple, cfg.pad_token_id)
    return res, torch.stack(res.logits, dim=1)


@pytest.mark.parametrize(
    "buckets,prompt_len",
    [
        ((16,), 13),  # one prefill chunk longer than the sliding window (8): the ring keeps its last 8 rows
        ((4,), 13),  # chunked prefill 4+4+4+1, each chunk attends over the ring plus itself
        ((4, 16), 3),  # short prompt: decode crosses position 8 and wraps the ring several times
    ],
)
def test_tiny_matches_stock_greedy(tiny, buckets, prompt_len):
    hf, cfg = tiny
    prompt = _prompt(cfg.vocab_size, prompt_len)
    new = 24
    stock, stock_lg, stock_self = _stock(hf, prompt, new)
    res, logits = _ours(hf, cfg, prompt, new, max_seq=64, prefill_buckets=buckets)
    assert torch.equal(res.tokens, stock), f"first divergence at {(res.tokens != stock).nonzero()[:1].tolist()}"
    assert (logits - stock_lg).abs().max().item() <= SELF_FACTOR * stock_self + ABS_FLOOR


def test_tiny_batch_of_two_matches_stock(tiny):
    hf, cfg = tiny
    prompt = _prompt(cfg.vocab_size, 9, seed=3, batch=2)
    stock = stock_greedy(hf, prompt, 16)
    res, _ = _ours(hf, cfg, prompt, 16, batch=2, max_seq=32, prefill_buckets=(16,))
    assert torch.equal(res.tokens, stock)


def test_e4b_mini_crosses_position_512(e4b_mini):
    """E4B's attention shapes (head_dim 256/512, 8/2 heads, window 512, proportional RoPE) past position 512."""
    hf, cfg = e4b_mini
    assert cfg.sliding_window == 512 and set(cfg.head_dims) == {256, 512}
    prompt = _prompt(cfg.vocab_size, 500)
    new = 20  # positions 500..519
    stock, stock_lg, stock_self = _stock(hf, prompt, new)
    res, logits = _ours(hf, cfg, prompt, new, max_seq=640, prefill_buckets=(128, 512))
    assert res.prefill_calls == [(512, 500)]
    assert torch.equal(res.tokens, stock), f"first divergence at {(res.tokens != stock).nonzero()[:1].tolist()}"
    assert (logits - stock_lg).abs().max().item() <= SELF_FACTOR * stock_self + ABS_FLOOR


def test_inv_freq_matches_transformers(tiny, e4b_mini):
    for hf, cfg in (tiny, e4b_mini):
        rotary = hf.model.rotary_emb
        for lt in (SLIDING, FULL):
            assert torch.equal(inv_freq(cfg, lt), getattr(rotary, f"{lt}_inv_freq").float())


def test_config_facts(e4b_mini):
    from g4ops.models import text_config

    cfg = from_hf_config(text_config("e4b"))
    assert len(cfg.kv_owner_layers) == 24 and cfg.num_layers == 42  # 24 KV-owning layers, 18 reuse
    assert cfg.kv_producer[24:] == tuple(22 if t == SLIDING else 23 for t in cfg.layer_types[24:])
    assert cfg.head_dims[5] == 512 and cfg.head_dims[0] == 256 and cfg.kv_heads == (2,) * 42
    e2b = from_hf_config(text_config("e2b"))
    assert e2b.intermediate_sizes[0] * 2 == e2b.intermediate_sizes[-1]  # double-wide MLP on KV-shared layers


@pytest.mark.parametrize(
    "tp,expect",
    [
        (1, [(0, 2, 4)]),
        (2, [(0, 1, 4), (1, 1, 4)]),  # E4B at TP=2: 4 q heads + 1 kv head per rank, groups unchanged
        (4, [(0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]),  # more ranks than kv heads: the kv head is replicated
        (8, [(r // 4, 1, 1) for r in range(8)]),
    ],
)
def test_kv_layout_keeps_query_groups(tp, expect):
    got = [kv_layout(8, 2, tp, r) for r in range(tp)]
    assert got == expect
    for r, (first, kv_local, n_rep) in enumerate(got):  # every local q head reads its global kv head
        q_local = 8 // tp
        for h in range(q_local):
            assert first + h // n_rep == (r * q_local + h) // 4


def test_kv_layout_rejects_bad_degrees():
    with pytest.raises(ValueError, match="not divisible"):
        kv_layout(8, 2, 3, 0)


def test_generate_refuses_kv_overflow(tiny):
    hf, cfg = tiny
    s = BuildSettings(tp=1, max_seq=16, prefill_buckets=(8,))
    model, ple, _ = build_rank_model(hf.state_dict(), cfg, s)
    with pytest.raises(ValueError, match="max_seq"):
        greedy_generate(module_step(model), _prompt(cfg.vocab_size, 10), 8, s, ple)


def test_config_reader_without_per_layer_config():
    """Older transformers 5.x kept `global_head_dim` as a field and had no per_layer_config / kv_sharing_modes:
    the reader must derive the same facts from such a config."""
    from types import SimpleNamespace

    from g4ops.models import text_config

    new = text_config("e4b")
    old = SimpleNamespace(
        **{k: getattr(new, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "layer_types", "sliding_window", "rope_parameters", "rms_norm_eps",
            "final_logit_softcapping", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
            "num_kv_shared_layers", "tie_word_embeddings", "pad_token_id", "attention_k_eq_v",
            "use_double_wide_mlp", "enable_moe_block")},
        head_dim=256, global_head_dim=512, num_key_value_heads=2,  # 5.24 refuses global reads of these
    )  # fmt: skip
    assert from_hf_config(old) == from_hf_config(new)


def test_k_eq_v_attention_matches_stock():
    """26B/31B-style full layers: values are the raw key projection (no v_proj), one global kv head."""
    from g4ops.models import build_model

    g4ops.disable()
    hf = build_model("tiny-e4b", attn_implementation="eager", attention_k_eq_v=True, num_global_key_value_heads=1)
    cfg = from_hf_config(hf.config)
    assert cfg.k_eq_v == (False, False, True, False, False, True) and cfg.kv_heads[2] == 1
    prompt = _prompt(cfg.vocab_size, 6, seed=1)
    res, _ = _ours(hf, cfg, prompt, 16, max_seq=32, prefill_buckets=(8,))
    assert torch.equal(res.tokens, stock_greedy(hf, prompt, 16))
