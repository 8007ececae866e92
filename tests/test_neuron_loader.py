"""The sharded loader accounts for every key of the HF state dict, persistent buffers included."""

from __future__ import annotations

import pytest
import torch

import g4ops
from neuron_backend.check import build_stock
from neuron_backend.config import BuildSettings, from_hf_config
from neuron_backend.loader import StateDictError, shard_state_dict, text_state_dict

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")


@pytest.fixture(scope="module")
def tiny():
    g4ops.disable()
    hf = build_stock("tiny-e4b")
    return hf, from_hf_config(hf.config), {k: v.clone() for k, v in hf.state_dict().items()}


S1 = BuildSettings(tp=1, max_seq=32)
S2 = BuildSettings(tp=2, max_seq=32)


def test_layer_scalar_is_carried_and_random(tiny):
    _, cfg, sd = tiny
    rank_sd, _, report = shard_state_dict(sd, cfg, S2, rank=1)
    for i in range(cfg.num_layers):
        assert torch.equal(rank_sd[f"layers.{i}.layer_scalar"], sd[f"model.layers.{i}.layer_scalar"])
        assert not torch.equal(rank_sd[f"layers.{i}.layer_scalar"], torch.ones(1))
    assert set(report.consumed) == set(sd)


@pytest.mark.parametrize("drop", ["model.layers.3.layer_scalar", "model.layers.0.self_attn.k_norm.weight",
                                  "model.embed_tokens_per_layer.weight", "model.norm.weight",
                                  "model.layers.5.mlp.down_proj.weight"])  # fmt: skip
def test_missing_key_is_refused(tiny, drop):
    _, cfg, sd = tiny
    broken = {k: v for k, v in sd.items() if k != drop}
    with pytest.raises(StateDictError, match="missing") as info:
        shard_state_dict(broken, cfg, S1, rank=0)
    assert drop in str(info.value)


def test_extra_key_is_refused(tiny):
    _, cfg, sd = tiny
    extra = dict(sd, **{"model.layers.0.mlp.gate_proj.bias": torch.zeros(cfg.intermediate_sizes[0])})
    with pytest.raises(StateDictError, match="not consumed") as info:
        shard_state_dict(extra, cfg, S1, rank=0)
    assert "model.layers.0.mlp.gate_proj.bias" in str(info.value)


def test_wrong_shape_is_refused(tiny):
    _, cfg, sd = tiny
    bad = dict(sd, **{"model.layers.1.self_attn.q_norm.weight": torch.ones(3)})
    with pytest.raises(StateDictError, match="expected shape"):
        shard_state_dict(bad, cfg, S1, rank=0)


def test_untied_head_differing_from_embedding_is_refused(tiny):
    _, cfg, sd = tiny
    bad = dict(sd, **{"lm_head.weight": sd["model.embed_tokens.weight"] + 1})
    with pytest.raises(StateDictError, match="ties"):
        shard_state_dict(bad, cfg, S1, rank=0)


def test_kv_shared_layers_unused_kv_weights_are_reported_not_hidden(tiny):
    _, cfg, sd = tiny
    shared = cfg.first_kv_shared_layer
    extra = dict(sd, **{f"model.layers.{shared}.self_attn.k_proj.weight": torch.zeros(32, 64)})
    _, _, report = shard_state_dict(extra, cfg, S1, rank=0)
    assert report.ignored == [f"model.layers.{shared}.self_attn.k_proj.weight"]


def test_multimodal_layout_loads_after_text_state_dict(tiny):
    _, cfg, sd = tiny
    mm = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
    mm["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.zeros(2, 2)
    with pytest.raises(StateDictError):
        shard_state_dict(mm, cfg, S1, rank=0)
    a, _, _ = shard_state_dict(text_state_dict(mm), cfg, S1, rank=0)
    b, _, _ = shard_state_dict(sd, cfg, S1, rank=0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tp2_shards_reassemble_the_full_weights(tiny):
    _, cfg, sd = tiny
    r0, _, _ = shard_state_dict(sd, cfg, S2, rank=0)
    r1, _, _ = shard_state_dict(sd, cfg, S2, rank=1)
    p = "layers.0."
    full = lambda k: sd["model." + k]  # noqa: E731
    for name, dim in [("self_attn.q_proj.weight", 0), ("self_attn.k_proj.weight", 0), ("self_attn.v_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0),
                      ("mlp.down_proj.weight", 1)]:  # fmt: skip
        assert torch.equal(torch.cat([r0[p + name], r1[p + name]], dim), full(p + name)), name
    assert torch.equal(torch.cat([r0["embed_tokens.weight"], r1["embed_tokens.weight"]]), full("embed_tokens.weight"))
    assert (r0["embed_tokens.vocab_start"].item(), r1["embed_tokens.vocab_start"].item()) == (0, cfg.vocab_size // 2)


def test_dropping_layer_scalar_would_change_the_output(tiny):
    """The regression the loader guards against: with layer_scalar left at its init (ones), as the seed's
    ModelBuilder loader did, the model no longer computes stock's logits."""
    from neuron_backend.loader import build_rank_model

    hf, cfg, sd = tiny
    s = BuildSettings(tp=1, max_seq=32, prefill_buckets=(8,), return_logits=True)
    model, ple, _ = build_rank_model(sd, cfg, s)
    ids = torch.randint(3, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.zeros(1, dtype=torch.int64), torch.full((1,), 8), ple(ids))
    with torch.no_grad():
        good = model(*args)[1]
        ref = hf(ids).logits[:, -1].float()
        for layer in model.layers:
            layer.layer_scalar.fill_(1.0)
        bad = model(*args)[1]
    assert (good - ref).abs().max() < 1e-4
    assert (bad - ref).abs().max() > 1e-2


def test_build_from_hf_model(tiny):
    from neuron_backend.loader import build_from_hf_model

    hf, cfg, sd = tiny
    model, ple, report = build_from_hf_model(hf, BuildSettings(tp=1, max_seq=16, prefill_buckets=(8,)))
    assert set(report.consumed) == set(sd) and model.cfg == cfg and ple is not None
