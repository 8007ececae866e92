"""g4ops.engine.sampler against transformers' own warpers (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper, built as generate builds them), a chi-square test of the draws, seeds, and the
counter-based noise. The logits are rounded through bf16 (as a bf16 model's are) so ties are common."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from g4ops.engine.sampler import check_params, noise_at, sample, seeded_exponential, warp
from tests.devices import DEVICES

lp = pytest.importorskip("transformers.generation.logits_process")


def _hf_warp(logits, temperature, top_k, top_p, min_p, keep=1):
    """The warpers generate's `_get_logits_processor` appends for these settings, applied in its order."""
    procs = []
    if temperature != 1.0:
        procs.append(lp.TemperatureLogitsWarper(float(temperature)))
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=keep))
    if top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=keep))
    if min_p is not None:
        procs.append(lp.MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=keep))
    for p in procs:
        logits = p(None, logits)
    return logits


def _rows(b, device, temperature=1.0, top_k=0, top_p=1.0, min_p=None):
    return dict(
        temperature=torch.full((b,), temperature, device=device),
        top_k=torch.full((b,), top_k, dtype=torch.long, device=device),
        top_p=torch.full((b,), top_p, dtype=torch.float64, device=device),  # fp64: HF's `1 - top_p` in double
        min_p=torch.full((b,), 0.0 if min_p is None else min_p, device=device),
    )


def _logits(b, v, seed, scale=3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * scale).to(torch.bfloat16).float().to(device)


SETTINGS = [  # (temperature, top_k, top_p, min_p): E4B-it's own config first
    (1.0, 64, 0.95, None), (0.7, 5, 0.9, None), (1.3, 0, 0.8, None), (0.5, 40, 1.0, 0.1), (1.0, 0, 1.0, 0.2),
    (2.0, 3, 0.3, 0.05), (1.0, 1, 1.0, None), (0.9, 0, 0.0, None),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [2, 7, 100, 1031, 4099])
@pytest.mark.parametrize("setting", SETTINGS, ids=str)
@pytest.mark.parametrize("keep", [1, 3])
def test_warp_equals_transformers_warpers(device, v, setting, keep):
    t, k, p, mp = setting
    x = _logits(5, v, seed=v + k, device=device)
    ref = _hf_warp(x.clone(), t, k, p, mp, keep)
    out = warp(x, **_rows(5, device, t, k, p, mp), min_tokens_to_keep=keep)
    assert torch.equal(out, ref)
    if k:
        assert torch.equal(warp(x, **_rows(5, device, t, k, p, mp), min_tokens_to_keep=keep, k_cap=64), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v", [20011, 262144])  # an odd size and E4B's vocabulary
def test_large_vocabulary_top_k_equals_transformers(device, v):
    x = _logits(3, v, seed=v, device=device)
    x[1, : v // 2] = x[1, v // 2 :].max()  # row 1: half the vocabulary ties at its maximum (far more than k)
    x[2, v - 3 :] = float("-inf")  # row 2: entries another processor removed
    for t, k, p, mp in SETTINGS[:2] + [(1.0, 64, 1.0, None), (1.0, 1, 1.0, None)]:
        ref = _hf_warp(x.clone(), t, k, p, mp)
        assert torch.equal(warp(x, **_rows(3, device, t, k, p, mp), k_cap=64), ref), (t, k, p)


@settings(max_examples=60, deadline=None)
@given(
    v=st.integers(1, 300), b=st.integers(1, 4), levels=st.integers(2, 40), seed=st.integers(0, 2**31),
    temperature=st.sampled_from([0.25, 0.6, 1.0, 1.7]), top_k=st.integers(0, 40),
    top_p=st.sampled_from([0.0, 0.1, 0.5, 0.75, 0.9, 0.95, 1.0]), min_p=st.sampled_from([None, 0.0, 0.05, 0.5, 1.0]),
    keep=st.integers(1, 4),
)  # fmt: skip
def test_warp_equals_transformers_warpers_hypothesis(v, b, levels, seed, temperature, top_k, top_p, min_p, keep):
    # few distinct levels: many ties at the top-k threshold and exact top-p boundaries (equal probabilities)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (b, v), generator=g).float() * 0.5
    ref = _hf_warp(x.clone(), temperature, top_k, top_p, min_p, keep)
    assert torch.equal(warp(x, **_rows(b, "cpu", temperature, top_k, top_p, min_p), min_tokens_to_keep=keep), ref)


@pytest.mark.parametrize("off, value", [("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)])
def test_none_is_off_on_every_row(off, value):
    x = _logits(3, 257, seed=9)
    setting = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    rows = _rows(3, "cpu", **setting)
    rows[off] = torch.full((3,), value, dtype=rows[off].dtype)
    ref = _hf_warp(x.clone(), **dict(setting, **{off: None if off == "min_p" else value}))
    assert torch.equal(warp(x, **rows), ref) and torch.equal(warp(x, **dict(rows, **{off: None})), ref)


def test_top_p_boundary_is_inclusive_as_transformers():
    x = torch.zeros(1, 4)  # probabilities 1/4 each, cumulative sums exact
    for top_p, kept in [(0.5, 2), (0.75, 3), (0.74, 3), (0.76, 4), (0.25, 1), (0.2, 1)]:
        out = warp(x, **_rows(1, "cpu", top_p=top_p))
        assert torch.equal(out, _hf_warp(x.clone(), 1.0, 0, top_p, None)) and int(out.isfinite().sum()) == kept


def test_per_row_parameters_are_independent():
    settings_ = SETTINGS[:6]
    x = _logits(len(settings_), 301, seed=3)
    rows = {
        "temperature": torch.tensor([s[0] for s in settings_]),
        "top_k": torch.tensor([s[1] for s in settings_]),
        "top_p": torch.tensor([s[2] for s in settings_], dtype=torch.float64),
        "min_p": torch.tensor([s[3] or 0.0 for s in settings_]),
    }
    out = warp(x, **rows)
    for i, (t, k, p, mp) in enumerate(settings_):
        assert torch.equal(out[i : i + 1], _hf_warp(x[i : i + 1].clone(), t, k, p, mp)), i


def _chi2_bound(df: int, z: float = 4.0) -> float:
    """Wilson-Hilferty: the chi-square quantile z standard deviations out (z=4: 3e-5 one-sided)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("setting", [(1.0, 64, 0.95, None), (0.6, 6, 0.9, None), (1.5, 0, 1.0, 0.05)], ids=str)
def test_draw_frequencies_match_softmax_of_warp(setting):
    t, k, p, mp = setting
    n, v = 40000, 24
    x = _logits(1, v, seed=11, scale=1.5)
    probs = warp(x, **_rows(1, "cpu", t, k, p, mp)).softmax(-1)[0].double()
    torch.manual_seed(1234)
    tokens = sample(x.expand(n, v), **_rows(n, "cpu", t, k, p, mp), greedy=torch.zeros(n, dtype=torch.bool))
    _assert_draws_follow(tokens, probs, min_kept=3)


def _assert_draws_follow(tokens: torch.Tensor, probs: torch.Tensor, min_kept: int) -> None:
    """No filtered token drawn, and the counts pass a chi-square test against the probabilities."""
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "a filtered token was drawn"
    expected = tokens.shape[0] * probs[kept]
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert df >= min_kept - 1 and stat < _chi2_bound(df), (stat, df)


def test_seed_reproduces_and_top_k_1_is_greedy():
    x = _logits(8, 1000, seed=5)
    rows = _rows(8, "cpu", 1.0, 64, 0.95)
    sampled = torch.zeros(8, dtype=torch.bool)
    torch.manual_seed(7)
    a = sample(x, **rows, greedy=sampled)
    torch.manual_seed(7)
    b = sample(x, **rows, greedy=sampled)
    c = sample(x, **rows, greedy=sampled)  # the generator moved on
    assert torch.equal(a, b) and not torch.equal(b, c)
    argmax = x.argmax(-1)
    assert torch.equal(sample(x, **_rows(8, "cpu", 0.7, 1), greedy=sampled), argmax)
    # greedy rows take the argmax whatever their (even invalid) temperature; the other rows still sample
    mixed = torch.tensor([True, False] * 4)
    rows0 = dict(rows, temperature=torch.where(mixed, 0.0, 1.0))
    torch.manual_seed(7)
    out = sample(x, **rows0, greedy=mixed)
    assert torch.equal(out[mixed], argmax[mixed]) and torch.equal(out[~mixed], a[~mixed])


def test_seeded_exponential_is_a_function_of_seed_counter_and_column():
    seed = torch.tensor([1, 2, 1, 2**40 + 1, -5])
    counter = torch.tensor([9, 9, 9, 9, 2**33])
    e = seeded_exponential(seed, counter, 50000)
    assert e.dtype == torch.float32 and e.shape == (5, 50000) and bool((e > 0).all() and e.isfinite().all())
    assert torch.equal(e[0], e[2])  # same key, same noise, wherever the row sits
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[3])  # the seed's high word counts
    assert torch.equal(seeded_exponential(seed[2:3], counter[2:3], 50000)[0], e[0])  # independent of the batch
    assert not torch.equal(seeded_exponential(seed[:1], counter[:1] + 1, 50000), e[:1])
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e (standard errors ~0.005, 0.01, 0.002 over 50000)
    for row in e:
        assert abs(row.double().mean().item() - 1) < 0.03 and abs(row.double().var().item() - 1) < 0.08
        assert abs((row > 1).double().mean().item() - math.exp(-1)) < 0.012
    # this key hashes to the largest uniform: with 24 bits it rounded to 1.0 in fp32 and the noise was -0.0 (a 0/0
    # for a filtered token, that sample's clamp caught); 23 bits keep it below 1
    assert float(noise_at(torch.tensor([60 * 7919]), torch.tensor([0]), torch.tensor([[177421]]))) > 0
    # columns are not correlated with their neighbours
    r = torch.corrcoef(torch.stack([e[0, :-1], e[0, 1:]]).double())[0, 1].item()
    assert abs(r) < 0.03


def test_noise_at_is_seeded_exponential_at_those_columns():
    seed = torch.tensor([0, 5, 2**40 + 3, 2**62 + 11])
    counter = torch.tensor([0, 1, 2**33 + 7, 19])
    n = 1037
    full = seeded_exponential(seed, counter, n)
    assert torch.equal(noise_at(seed, counter, torch.arange(n).expand(4, n)), full)
    ids = torch.randint(0, n, (4, 41), generator=torch.Generator().manual_seed(0))
    assert torch.equal(noise_at(seed, counter, ids), full.gather(1, ids))


def _race(probs, noise):
    return (probs / noise).argmax(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v, bf16", [(300, False), (1031, False), (1031, True), (262144, True)])
def test_candidates_draw_what_the_vocabulary_draws(device, v, bf16):
    """sample with k_cap (the warpers on the 2 * k_cap largest logits) picks the token the vocabulary-wide draw picks
    with the same noise per token id: fp32 logits without ties against sample itself; bf16-rounded ones (ties at
    top-k's threshold and inside top-p's sort) against warp over the whole row with a stable sort."""
    b = 64
    g = torch.Generator().manual_seed(v)
    x = 30 * torch.tanh(torch.randn(b, v, generator=g) * 4 / 30)
    x = (x.bfloat16().float() if bf16 else x).to(device)
    temperature = torch.rand(b, generator=g) * 1.5 + 0.3
    top_k = torch.randint(1, 65, (b,), generator=g)
    top_p = torch.where(torch.rand(b, generator=g) < 0.2, 1.0, torch.rand(b, generator=g).double())
    min_p = torch.where(torch.rand(b, generator=g) < 0.5, 0.0, torch.rand(b, generator=g) * 0.2)
    rows = {k: t.to(device) for k, t in dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).items()}
    sampled = torch.zeros(b, dtype=torch.bool, device=device)
    seed, counter = torch.arange(b, device=device) * 7919, torch.zeros(b, dtype=torch.long, device=device)
    noise = seeded_exponential(seed, counter, v)
    overflow = torch.zeros(1, dtype=torch.bool, device=device)
    ours = sample(x, **rows, greedy=sampled, noise=noise, k_cap=64, ties_overflow=overflow)
    assert not overflow.item()
    if bf16:
        reference = _race(warp(x, **rows, stable=True).softmax(-1), noise)
    else:
        reference = sample(x, **rows, greedy=sampled, noise=noise)
    assert torch.equal(ours, reference)
    # the noise as a function of the ids (what BatchEngine passes for seeded rows) draws the same
    at_ids = sample(x, **rows, greedy=sampled, noise=lambda ids: noise_at(seed, counter, ids), k_cap=64)
    assert torch.equal(at_ids, ours)


def test_candidates_count_ties_beyond_them():
    """More tokens tied with the k-th value than the candidates hold sets ties_overflow; ties among -inf entries
    (another processor's mask) and ties the candidates hold do not."""
    v, b = 1000, 4
    x = torch.randn(b, v, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0  # every token tied
    x[2, 5:] = float("-inf")  # 5 tokens left: the k-th value is -inf
    x[3, :100] = 7.0  # 100 ties at the top: fewer than the 128 candidates
    rows = _rows(b, "cpu", 1.0, 64, 0.95)
    for which, expect in ((slice(0, 1), False), (slice(1, 2), True), (slice(2, 3), False), (slice(3, 4), False)):
        overflow = torch.zeros(1, dtype=torch.bool)
        sub = {k: t[which] for k, t in rows.items()}
        sample(x[which], **sub, greedy=torch.zeros(1, dtype=torch.bool), k_cap=64, ties_overflow=overflow)
        assert overflow.item() == expect, which
    overflow = torch.zeros(1, dtype=torch.bool)
    greedy = torch.tensor([False, True, False, False])  # the tied row takes its argmax: nothing left out
    sample(x, **rows, greedy=greedy, k_cap=64, ties_overflow=overflow)
    assert not overflow.item()


def test_candidate_draw_frequencies_match_softmax_of_warp():
    n, v = 40000, 300
    x = _logits(1, v, seed=12, scale=1.5)  # bf16-rounded: ties, ordered by id in top-p's sort (stable)
    probs = warp(x, **_rows(1, "cpu", 1.0, 64, 0.95), stable=True).softmax(-1)[0].double()
    torch.manual_seed(4321)
    tokens = sample(x.expand(n, v), **_rows(n, "cpu", 1.0, 64, 0.95), greedy=torch.zeros(n, dtype=torch.bool),
                    k_cap=64)  # fmt: skip
    _assert_draws_follow(tokens, probs, min_kept=11)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_noise_sampling_is_reproducible_per_row(device):
    x = _logits(4, 500, seed=8, device=device)
    rows = _rows(4, device, 1.0, 64, 0.95)
    seed = torch.tensor([3, 4, 5, 6], device=device)
    counter = torch.tensor([0, 0, 0, 0], device=device)
    sampled = torch.zeros(4, dtype=torch.bool, device=device)
    a = sample(x, **rows, greedy=sampled, noise=seeded_exponential(seed, counter, 500))
    swapped = [1, 0, 3, 2]  # each row with its own seed, in another slot of the batch
    b = sample(x[swapped], **{k: r[swapped] for k, r in rows.items()}, greedy=sampled,
               noise=seeded_exponential(seed[swapped], counter, 500))  # fmt: skip
    assert torch.equal(a[swapped], b)
    # the noise decides: the same row sampled under 40 seeds gives more than one token
    many = sample(x[:1].expand(40, -1), **_rows(40, device, 1.0, 64, 0.95), greedy=sampled[:1].expand(40),
                  noise=seeded_exponential(torch.arange(40, device=device), torch.zeros(40, dtype=torch.long,
                                                                                        device=device), 500))
    assert many.unique().numel() > 1


def test_bad_input_names_the_argument():
    x = _logits(2, 10, seed=0)
    rows = _rows(2, "cpu")
    with pytest.raises(ValueError, match="top_k must be a \\[batch=2\\]"):
        warp(x, **dict(rows, top_k=torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match="min_tokens_to_keep"):
        warp(x, **rows, min_tokens_to_keep=0)
    with pytest.raises(ValueError, match="logits must be"):
        warp(x[0], **rows)
    with pytest.raises(ValueError, match="noise must be"):
        sample(x, **rows, greedy=torch.zeros(2, dtype=torch.bool), noise=torch.ones(2, 11))
    with pytest.raises(ValueError, match="n must be"):
        seeded_exponential(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0)
    for name, value in [("temperature", 0.0), ("top_k", -1), ("top_p", 1.5), ("min_p", -0.1)]:
        bad = dict(rows, **{name: torch.full((2,), value, dtype=rows[name].dtype)})
        with pytest.raises(ValueError, match=name):
            check_params(**bad)
    check_params(**dict(rows, temperature=torch.tensor([0.0, 1.0])), greedy=torch.tensor([True, False]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_sampling_advances_and_reproduces_with_the_seed():
    """Under capture `exponential_` reads torch's philox state at each replay: replays differ from each other,
    and `torch.manual_seed` before the replays reproduces them."""
    from tests.devices import capture_cuda_graph

    x = _logits(4, 4099, seed=2, device="cuda")
    rows = _rows(4, "cuda", 1.0, 64, 0.95)
    sampled = torch.zeros(4, dtype=torch.bool, device="cuda")
    graph, out = capture_cuda_graph(lambda: sample(x, **rows, greedy=sampled))

    def run(n):
        res = []
        for _ in range(n):
            graph.replay()
            res.append(out.clone())
        return torch.stack(res)

    torch.manual_seed(99)
    a = run(20)
    torch.manual_seed(99)
    b = run(20)
    assert torch.equal(a, b) and a.unique().numel() > 1
    assert torch.equal(warp(x, **rows), _hf_warp(x.clone(), 1.0, 64, 0.95, None))
