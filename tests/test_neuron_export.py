"""Per-bucket graph hygiene (design.md section 6): each bucket exports as one graph with no breaks, the graph
mutates exactly the KV buffers, the Neuron flavour returns them as aliased outputs, and nothing rank-dependent
is left as a constant the SPMD trace would bake in."""

from __future__ import annotations

import pytest
import torch

import g4ops
from neuron_backend.check import build_stock
from neuron_backend.compile import (
    NeuronUnavailable,
    neuron_module,
    promote_persistent_buffers,
    require_neuron,
)
from neuron_backend.config import BuildSettings, from_hf_config
from neuron_backend.export import example_inputs, export_buckets
from neuron_backend.loader import build_rank_model

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")


@pytest.fixture(scope="module")
def tiny():
    g4ops.disable()
    hf = build_stock("tiny-e4b")
    return hf, from_hf_config(hf.config)


def test_every_bucket_exports_and_mutates_exactly_the_kv_buffers(tiny):
    hf, cfg = tiny
    s = BuildSettings(tp=1, max_seq=32, prefill_buckets=(16,))  # a prefill chunk longer than the window (8)
    model, _, _ = build_rank_model(hf.state_dict(), cfg, s)
    kv = sorted(model.kv_names)
    assert len(kv) == 2 * len(cfg.kv_owner_layers) == 8  # 4 KV-owning layers of 6, K and V each
    exports = export_buckets(model)
    assert [e.name for e in exports] == ["prefill_16", "decode"]
    for e in exports:
        assert e.graph_breaks == 0, e.name
        assert e.mutated_buffers == kv, e.name
        targets = {str(n.target) for n in e.program.graph.nodes if n.op == "call_function"}
        assert "g4ops.rms_norm.default" in targets and "g4ops.geglu_mlp.default" in targets
        # the exported program computes what the module computes (run on fresh buffers)
        args = example_inputs(model, e.tokens)
        model.reset_cache()
        eager = model(*args)
        model.reset_cache()
        assert torch.equal(e.program.module()(*args), eager)


def test_ring_buffers_are_sized_to_the_window(tiny):
    hf, cfg = tiny
    s = BuildSettings(tp=1, max_seq=64, prefill_buckets=(16,))
    model, _, _ = build_rank_model(hf.state_dict(), cfg, s)
    for i in cfg.kv_owner_layers:
        slots = getattr(model, f"k_cache_{i}").shape[2]
        assert slots == (cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else 64)


def test_aliased_outputs_mode_returns_new_kv_in_alias_order(tiny):
    hf, cfg = tiny
    s = BuildSettings(tp=1, max_seq=32, prefill_buckets=(16,))
    buf_model, _, _ = build_rank_model(hf.state_dict(), cfg, s)
    ali_model, _, _ = build_rank_model(hf.state_dict(), cfg, s, kv_mode="aliased_outputs")
    args = example_inputs(buf_model, 16)
    with torch.no_grad():
        tok = buf_model(*args)
        out = ali_model(*args)
    aliases = ali_model.io_aliases()
    assert len(out) == 1 + len(ali_model.kv_names) and torch.equal(out[0], tok)
    for name, param in zip(ali_model.kv_names, ali_model.kv_tensors()):
        assert isinstance(param, torch.nn.Parameter) and not param.requires_grad
        assert torch.equal(out[aliases[param]], getattr(buf_model, name))
        assert torch.count_nonzero(param) == 0  # the aliased flavour leaves the mutation to the runtime


def test_rank_dependent_state_becomes_weights_for_the_spmd_trace(tiny):
    _, cfg = tiny

    class NoComm:
        world_size, rank = 2, 0

    model = neuron_module(cfg, BuildSettings(tp=2, max_seq=32), NoComm())
    params = dict(model.named_parameters())
    assert "embed_tokens.vocab_start" in params  # differs per rank: must be a weight, not a baked constant
    assert all(f"layers.{i}.layer_scalar" in params for i in range(cfg.num_layers))
    assert not dict(model.named_buffers(remove_duplicate=False)).keys() - {
        n for n, _ in model.named_buffers() if "inv_freq" in n or n == "embed_scale"
    }
    assert promote_persistent_buffers(model) == []  # idempotent


def test_compile_without_neuron_sdk_says_what_to_install():
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        with pytest.raises(NeuronUnavailable, match="torch-neuronx and neuronx-distributed"):
            require_neuron()
    else:
        pytest.skip("torch-neuronx is installed")


def test_cli_check_runs_and_reports_seq_match(capsys):
    from neuron_backend.__main__ import main

    assert main(["check", "--tp", "1", "--no-export"]) == 0
    out = capsys.readouterr().out
    assert "stock transformers vs TP=1: SEQ_MATCH True" in out and out.strip().splitlines()[-1].startswith(
        "SEQ_MATCH True"
    )


def test_cli_compile_without_neuron_sdk_exits_2(tmp_path, capsys):
    try:
        import torch_neuronx  # noqa: F401

        pytest.skip("torch-neuronx is installed")
    except ImportError:
        pass
    from neuron_backend.__main__ import main

    assert main(["compile", "--model", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "torch-neuronx" in capsys.readouterr().err


def test_real_e4b_layout_at_tp2_on_meta():
    """The real E4B text config at TP=2 (built on the meta device: shapes only): 48 KV buffers (24 owning layers,
    K and V), one kv head per rank, sliding rings of 512 slots, full layers of max_seq, ~4.7 GB of bf16 weights
    per NeuronCore (the PLE table, 5.6 GB, stays on the host)."""
    from g4ops.models import text_config

    from neuron_backend.compile import _ShapeOnly
    from neuron_backend.model import NeuronGemma4ForCausalLM

    cfg = from_hf_config(text_config("e4b"))
    with torch.device("meta"):
        m = NeuronGemma4ForCausalLM(cfg, BuildSettings(tp=2, max_seq=2048, dtype=torch.bfloat16), _ShapeOnly(2))
    assert len(m.kv_names) == 48
    assert m.k_cache_0.shape == (1, 1, 512, 256) and m.k_cache_5.shape == (1, 1, 2048, 512)
    assert m.layers[0].self_attn.q_proj.weight.shape == (4 * 256, 2560)  # 4 of 8 q heads per rank
    assert m.layers[5].self_attn.k_proj.weight.shape == (512, 2560)  # 1 of 2 kv heads, global head_dim 512
    assert not hasattr(m.layers[30].self_attn, "k_proj")  # KV-shared layers own no K/V weights or buffers
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert 4.5e9 < weight_bytes < 5.0e9


def test_real_e4b_at_tp1_fits_one_core_on_meta():
    """README's TP=1 estimate: the real E4B text config at TP=1 (meta device) holds ~9.3 GB of bf16 weights, and
    its KV bytes are the sliding rings (window slots) plus full layers (max_seq slots) of the 24 owning layers;
    weights + KV at 32k context stay under one NeuronCore's 16 GiB with room to spare."""
    from g4ops.models import text_config

    from neuron_backend.compile import _ShapeOnly
    from neuron_backend.config import SLIDING
    from neuron_backend.model import NeuronGemma4ForCausalLM

    cfg = from_hf_config(text_config("e4b"))
    for max_seq in (512, 32768):
        s = BuildSettings(tp=1, max_seq=max_seq, dtype=torch.bfloat16)
        with torch.device("meta"):
            m = NeuronGemma4ForCausalLM(cfg, s, _ShapeOnly(1))
        kv = sum(t.numel() * t.element_size() for t in m.kv_tensors())
        slots = {i: cfg.sliding_window if cfg.layer_types[i] == SLIDING else max_seq for i in cfg.kv_owner_layers}
        assert kv == sum(2 * cfg.kv_heads[i] * n * cfg.head_dims[i] * 2 for i, n in slots.items())  # K+V, bf16
        weights = sum(p.numel() * p.element_size() for p in m.parameters())
        assert 9.0e9 < weights < 9.5e9
        assert weights + kv < 0.6 * 16 * 2**30
