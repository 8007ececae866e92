"""The decode bucket's KV write (neuron_backend/model.py _DecodePlan): a scatter of one row per sequence into the
KV buffers, in place, with idle rows untouched; the sampling decode bucket still exports with exactly the KV
buffers mutated (the aliasing contract of tests/test_neuron_export.py)."""

from __future__ import annotations

import pytest
import torch

from g4ops.models import build_model
from neuron_backend.config import BuildSettings
from neuron_backend.export import example_inputs
from neuron_backend.loader import _text_config, build_rank_model, text_state_dict
from neuron_backend.runner import ModuleRunner
from devices import one_intra_op_thread  # noqa: F401 - autouse: this module runs on one thread

pytest.importorskip("transformers.models.gemma4.modeling_gemma4")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf():
    return build_model("tiny-e4b")


def test_decode_scatters_one_row_per_sequence_and_idle_rows_keep_their_cache(hf):
    """The decode bucket writes each active row's K/V into its slot only (a scatter, as NxD Inference's KV
    manager); an idle row (n_valid 0) keeps its cache bit for bit; the sampling decode bucket exports
    (torch.export, non-strict: one graph or an error), mutates exactly the KV buffers and computes what eager
    does. (Dynamo's graph-break count of the buckets is test_neuron_export's; here it would add a minute.)"""
    cfg = _text_config(hf.config, hf)
    s = BuildSettings(tp=1, batch=2, max_seq=20, prefill_buckets=(8,), sample_cap=16)
    model, ple, _ = build_rank_model(text_state_dict(hf.state_dict()), cfg, s)
    run = ModuleRunner(model, ple)
    sampling = (torch.tensor([0.0, 0.9]), torch.tensor([0, 16]), torch.ones(2, dtype=torch.float64), torch.zeros(2),
                torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long))  # fmt: skip
    ids = torch.tensor([_prompt(8, 1), _prompt(8, 2)])
    run(ids, torch.zeros(2, dtype=torch.long), torch.tensor([8, 6]), sampling)  # rows at positions 8 and 6
    before = [t.clone() for t in model.kv_tensors()]
    run(torch.tensor([[7], [9]]), torch.tensor([8, 6]), torch.tensor([1, 0]), sampling)  # row 1 idle
    for name, old, new in zip(model.kv_names, before, model.kv_tensors()):
        assert torch.equal(old[1], new[1]), f"{name}: idle row written"
        layer = int(name.rsplit("_", 1)[1])
        slot = 8 % new.shape[2]  # full layers: slot 8; the ring of sliding layers: 8 mod window
        changed = (old[0] != new[0]).any(dim=-1).any(dim=0).nonzero().flatten().tolist()
        assert changed == [slot], f"{name} (layer {layer}): slots {changed} changed"
    args = example_inputs(model, 1)
    program = torch.export.export(model, args, strict=False).run_decompositions()
    assert sorted(program.graph_signature.buffers_to_mutate.values()) == sorted(model.kv_names)
    kv_scatters = [n for n in program.graph.nodes if str(n.target).startswith("aten.scatter")
                   and n.meta["val"].dim() == 4]  # the sampler's own scatters (top-p, min-p) are [batch, candidates]
    assert len(kv_scatters) == len(model.kv_names)
    model.reset_cache()
    eager = model(*args)
    model.reset_cache()
    assert torch.equal(program.module()(*args), eager)
