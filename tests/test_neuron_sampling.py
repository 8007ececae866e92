"""Vocab-parallel sampling (neuron_backend/sampling.py) against g4ops.engine.sampler on the full vocabulary.

sampler.sample is transformers' warpers bit for bit (tests/test_sampler.py); here the shards' top-`cap` candidates,
merged as the all-gather merges them, must draw the same token as `sample` on the whole row with the same
counter-based noise, for every TP degree, odd vocabularies (padded shards) and per-row settings."""

from __future__ import annotations

import pytest
import torch

from g4ops.engine.sampler import sample, seeded_exponential
from neuron_backend.config import padded_vocab
from neuron_backend.sampling import local_candidates, sample_candidates


def _shards(logits: torch.Tensor, tp: int):
    """What each rank's VocabParallelLMHead.local_logits holds: its vocab slice, padded columns at -inf."""
    b, v = logits.shape
    local = padded_vocab(v, tp) // tp
    padded = torch.full((b, local * tp), float("-inf"))
    padded[:, :v] = logits
    return [(padded[:, r * local : (r + 1) * local], torch.tensor(r * local)) for r in range(tp)]


def _rows(b: int, cap: int, g: torch.Generator):
    temperature = torch.rand(b, generator=g) * 1.5 + 0.2
    top_k = torch.randint(1, cap + 1, (b,), generator=g)
    top_p = torch.where(torch.rand(b, generator=g) < 0.3, 1.0, torch.rand(b, generator=g) * 0.9 + 0.05).double()
    min_p = torch.where(torch.rand(b, generator=g) < 0.5, 0.0, torch.rand(b, generator=g) * 0.2)
    seed = torch.randint(0, 2**62, (b,), generator=g)
    counter = torch.randint(0, 1000, (b,), generator=g)
    return temperature, top_k, top_p, min_p, seed, counter


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [263, 1001])
def test_merged_candidates_draw_what_the_full_row_draws(tp, vocab):
    cap, b = 24, 96
    g = torch.Generator().manual_seed(tp * 1000 + vocab)
    # softcapped-looking logits with some spread, so top-p and min-p cut at varied places
    logits = torch.tanh(torch.randn(b, vocab, generator=g) * 2.0) * 30.0 / 4
    temperature, top_k, top_p, min_p, seed, counter = rows = _rows(b, cap, g)
    parts = [local_candidates(shard, start, cap) for shard, start in _shards(logits, tp)]
    values = torch.cat([p[0] for p in parts], dim=-1)  # the all-gather along the last dim, rank order
    ids = torch.cat([p[1] for p in parts], dim=-1)
    assert values.shape[-1] == tp * min(cap, padded_vocab(vocab, tp) // tp)
    ours = sample_candidates(values, ids, *rows, cap=cap)
    full = sample(logits, temperature, top_k, top_p, min_p, torch.zeros(b, dtype=torch.bool),
                  seeded_exponential(seed, counter, vocab))  # fmt: skip
    assert torch.equal(ours, full)
    assert (ours < vocab).all()  # never a padded column


def test_rows_beyond_the_candidates_would_differ():
    """The test above can fail: candidates cut below a row's top_k draw from a smaller set, and a different token
    on some rows (what a wrong cap or a lost shard does)."""
    cap, b, vocab = 24, 96, 1001
    g = torch.Generator().manual_seed(1)
    logits = torch.tanh(torch.randn(b, vocab, generator=g) * 2.0) * 30.0 / 4
    temperature, _, _, _, seed, counter = _rows(b, cap, g)
    top_k, top_p, min_p = torch.full((b,), cap), torch.ones(b, dtype=torch.float64), torch.zeros(b)
    parts = [local_candidates(shard, start, cap // 4) for shard, start in _shards(logits, 2)]
    values, ids = torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts], -1)
    ours = sample_candidates(values, ids, temperature, top_k, top_p, min_p, seed, counter, cap=cap)
    full = sample(logits, temperature, top_k, top_p, min_p, torch.zeros(b, dtype=torch.bool),
                  seeded_exponential(seed, counter, vocab))  # fmt: skip
    assert not torch.equal(ours, full)


def test_greedy_rows_and_seeds():
    """temperature 0 picks the candidates' maximum; a seed and a counter fix the draw; another counter moves it."""
    cap, vocab = 16, 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab, generator=g) * 3
    parts = [local_candidates(s, st, cap) for s, st in _shards(logits, 2)]
    values, ids = torch.cat([p[0] for p in parts], -1), torch.cat([p[1] for p in parts], -1)
    zeros, ones = torch.zeros(8), torch.ones(8)
    k, p64 = torch.full((8,), cap), torch.ones(8, dtype=torch.float64)
    seed = torch.arange(8) * 7919
    greedy = sample_candidates(values, ids, zeros, k, p64, zeros, seed, torch.zeros(8, dtype=torch.long), cap=cap)
    assert torch.equal(greedy, logits.argmax(-1))
    draws = [sample_candidates(values, ids, ones, k, p64, zeros, seed, torch.full((8,), c), cap=cap) for c in range(6)]
    again = sample_candidates(values, ids, ones, k, p64, zeros, seed, torch.zeros(8, dtype=torch.long), cap=cap)
    assert torch.equal(draws[0], again)
    assert len({tuple(d.tolist()) for d in draws}) > 1
