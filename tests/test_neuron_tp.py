"""neuron_backend at TP=2 (and 4): CPU processes over gloo (torch.multiprocessing spawn, free port) against TP=1,
each rank building its own module and, in the same processes, every rank running the module built as rank 0 with
its own shard (NxD's one traced graph for all cores; the check's mutation test is test_neuron_one_graph.py).

Tokens must be identical (the argmax is distributed: each rank reduces its vocab shard, the gathered maxima pick
the winner). Logits differ from TP=1 only by the summation order of the fp32 all-reduces, so the allowed
difference is fp32 round-off on softcapped logits (|logit| <= 30, ulp 2e-6): TP=1 itself is ~2e-6 from stock on
both models.
"""

from __future__ import annotations

import pytest
import torch

import g4ops
from neuron_backend.check import build_stock
from neuron_backend.config import BuildSettings, from_hf_config
from neuron_backend.cpu_tp import run_tp
from neuron_backend.generate import greedy_generate, module_step
from neuron_backend.loader import build_rank_model

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
pytestmark = pytest.mark.slow  # spawns processes


def _tp1(sd, cfg, prompt, new, **kw):
    s = BuildSettings(tp=1, return_logits=True, **kw)
    model, ple, _ = build_rank_model(sd, cfg, s)
    res = greedy_generate(module_step(model), prompt, new, s, ple, cfg.pad_token_id)
    return res.tokens, torch.stack(res.logits, dim=1)


@pytest.mark.parametrize(
    "shape,prompt_len,new,kw,tol,builds",
    [
        ("tiny-e4b", 13, 24, dict(max_seq=64, prefill_buckets=(4, 16)), 2e-5, ("per_rank", "rank0")),
        # E4B attention shapes past position 512, prefilled in 128-row chunks (4 x 128 + 1 x 116 rows)
        ("e4b-mini", 500, 16, dict(max_seq=640, prefill_buckets=(128,)), 2e-5, ("per_rank",)),
    ],
)
def test_tp2_matches_tp1(shape, prompt_len, new, kw, tol, builds):
    g4ops.disable()
    _check_tp(build_stock(shape), 2, prompt_len, new, kw, tol, builds)


@pytest.mark.parametrize("tp,vocab", [(4, 512), (2, 511)])
def test_other_degrees_and_padded_vocab(tp, vocab):
    """TP=4 on 4 q / 2 kv heads: one q head per rank, its kv head replicated on two ranks. vocab 511 at TP=2: the
    last shard carries one padding row, whose logit must never win the distributed argmax. Both also as one graph
    (every rank running the module built as rank 0): the replicated kv head and the padded shard's mask must come
    from each rank's weights, not from rank 0's Python."""
    from g4ops.models import build_model

    g4ops.disable()
    hf = build_model("tiny-e4b", attn_implementation="eager", vocab_size=vocab, vocab_size_per_layer_input=vocab)
    _check_tp(hf, tp, 6, 16, dict(max_seq=32, prefill_buckets=(8,)), 2e-5, ("per_rank", "rank0"))


def _check_tp(hf, tp, prompt_len, new, kw, tol, builds):
    cfg = from_hf_config(hf.config)
    sd = hf.state_dict()
    prompt = torch.randint(3, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(7))
    tokens1, logits1 = _tp1(sd, cfg, prompt, new, **kw)
    runs = run_tp(sd, cfg, BuildSettings(tp=tp, return_logits=True, **kw), prompt, new, builds=builds)
    assert sorted(runs) == sorted(builds)
    for build, ranks in runs.items():
        for r in ranks:
            assert torch.equal(r["tokens"], tokens1), build
            assert (r["logits"] - logits1).abs().max().item() <= tol, build
        # each rank holds 1 of the 2 kv heads: its KV buffer list is the TP=1 one (same layers), half as wide
        assert ranks[0]["kv_names"] == ranks[1]["kv_names"]
    for r in runs["per_rank"]:
        assert r["consumed_keys"] == len(sd)  # every HF key consumed on every rank (tied lm_head included)
