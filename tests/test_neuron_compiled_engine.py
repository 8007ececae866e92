"""NeuronEngine over a compiled artifact (compile.py -> CompiledModel -> runner.CompiledRunner), with NxD's
ModelBuilder emulated in-process as in test_neuron_compile_driver.py: the sampling buckets are traced with their
sampling inputs, and greedy and seeded sampled requests at different positions get the in-process engine's tokens."""

from __future__ import annotations

import pytest
import torch

import g4ops
from g4ops.engine.batch import SamplingParams
from neuron_backend.check import build_stock
from neuron_backend.config import BuildSettings, from_hf_config
from neuron_backend.engine import NeuronEngine
from neuron_backend.loader import build_rank_model
from neuron_backend.runner import CompiledRunner, ModuleRunner
from neuron_backend.sampling import SAMPLING_INPUTS
from test_neuron_compile_driver import _install_fake_sdk
from devices import one_intra_op_thread  # noqa: F401 - autouse: this module runs on one thread

pytest.importorskip("safetensors")


def _run(engine, requests):
    out = {}
    for key, (prompt, params) in requests.items():
        engine.submit(prompt, params, lambda e, k=key: out.setdefault(k, []).append(e))
        engine.step()
    for _ in range(100):
        if all(k in out and out[k][-1].finish_reason for k in requests):
            return {k: [e.token_id for e in v] for k, v in out.items()}
        engine.step()
    raise AssertionError("requests did not finish")


def test_engine_over_the_compiled_sampling_artifact_matches_the_module(tmp_path, monkeypatch):
    from neuron_backend.compile import CompiledModel, compile_model

    g4ops.disable()
    hf = build_stock("tiny-e4b")
    cfg, sd = from_hf_config(hf.config), hf.state_dict()
    settings = BuildSettings(tp=1, batch=2, max_seq=40, prefill_buckets=(8, 16), sample_cap=16)
    built = {}
    _install_fake_sdk(monkeypatch, built)
    out = compile_model(sd, cfg, settings, tmp_path / "artifact")
    for key, (_, aliases, shapes, _) in built["executor"].entries.items():
        assert len(shapes) == 4 + len(SAMPLING_INPUTS), key  # ids, start, valid, ple + the sampling inputs
        assert sorted(aliases.values()) == list(range(1, 1 + len(aliases)))  # outputs: token, then the KV states

    g = torch.Generator().manual_seed(5)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    requests = {
        "greedy": (prompt(11), SamplingParams(max_new_tokens=9, temperature=0)),
        "sampled": (prompt(19), SamplingParams(max_new_tokens=12, temperature=0.9, top_k=12, top_p=0.9, seed=3)),
        "late": (prompt(4), SamplingParams(max_new_tokens=6, temperature=1.1, min_p=0.1, seed=4)),
    }
    compiled = NeuronEngine(CompiledRunner(CompiledModel(out)))
    assert (compiled.max_batch, compiled.max_context) == (2, 40)  # from the artifact's config
    got = _run(compiled, requests)
    model, ple, _ = build_rank_model(sd, cfg, settings)
    assert got == _run(NeuronEngine(ModuleRunner(model, ple)), requests)
    assert len(set(got["sampled"])) > 1 and all(len(v) == requests[k][1].max_new_tokens for k, v in got.items())
