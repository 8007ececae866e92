"""NeuronEngine on torch-xla (XLA:CPU, TP=1): the sampling buckets with the scatter decode write, as XLA sees them.

Runs where torch-xla is installed (the torch 2.9 venv of `bash .ci/neuron-stack`; skipped elsewhere). Requests at
different positions, greedy and seeded sampling side by side: the tokens equal the eager CPU engine's, decode
compiles once over every position and sampling setting (they are inputs), prefill stops compiling after its second
call (see the test), and every compiled graph aliases exactly the KV buffers to its outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

from g4ops.engine.batch import SamplingParams  # noqa: E402
from neuron_backend.config import BuildSettings  # noqa: E402
from neuron_backend.engine import NeuronEngine  # noqa: E402
from neuron_backend.loader import build_rank_model  # noqa: E402
from neuron_backend.runner import ModuleRunner  # noqa: E402


def _proxy():
    """bench/neuron_xla_proxy.py: its tiny config, random HF state dict and torch-xla metric readers."""
    path = Path(__file__).resolve().parent.parent / "bench" / "neuron_xla_proxy.py"
    spec = importlib.util.spec_from_file_location("neuron_xla_proxy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class XlaRunner(ModuleRunner):
    """ModuleRunner on an XLA device, recording compiles and aliased buffers per bucket (torch-xla's metrics)."""

    def __init__(self, model, ple, device, proxy):
        super().__init__(model, ple)
        self.device, self.proxy = device, proxy
        self.calls: list[tuple[int, int, int]] = []  # (tokens, compiles, aliased buffers)

    @torch.no_grad()
    def __call__(self, ids, start, valid, sampling=None):
        p = self.proxy
        before = (p._metric_count("CompileTime"), p._metric_sum("InputOutputAliasCount"))
        ple = self.ple(ids).to(self.device) if self.ple is not None else None
        args = [t.to(self.device) for t in (ids, start, valid)]
        out = self.model(*args, ple, *(t.to(self.device) for t in (sampling or ())))
        torch_xla.sync()
        tokens = out.cpu()
        after = (p._metric_count("CompileTime"), p._metric_sum("InputOutputAliasCount"))
        self.calls.append((ids.shape[1], int(after[0] - before[0]), int(after[1] - before[1])))
        return tokens


def _run(engine, requests):
    out = {}
    for key, (prompt, params) in requests.items():
        engine.submit(prompt, params, lambda e, k=key: out.setdefault(k, []).append(e))
        engine.step()  # the requests join a running batch one step apart
    for _ in range(100):
        if all(k in out and out[k][-1].finish_reason for k in requests):
            return {k: [e.token_id for e in v] for k, v in out.items()}
        engine.step()
    raise AssertionError("requests did not finish")


def test_sampling_buckets_on_xla_compile_once_alias_the_kv_and_match_cpu():
    proxy = _proxy()
    cfg = proxy.text_config("tiny-e4b")
    sd = proxy.random_hf_state_dict(cfg)
    s = BuildSettings(tp=1, batch=3, max_seq=40, prefill_buckets=(16,), sample_cap=16)
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    requests = {
        "greedy": (prompt(13), SamplingParams(max_new_tokens=10, temperature=0)),
        "sampled": (prompt(5), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, top_p=0.9, seed=7)),
        "other": (prompt(20), SamplingParams(max_new_tokens=8, temperature=1.2, min_p=0.05, seed=8)),
    }
    cpu_model, cpu_ple, _ = build_rank_model(sd, cfg, s)
    expect = _run(NeuronEngine(ModuleRunner(cpu_model, cpu_ple)), requests)

    dev = torch_xla.device()
    xla_model, ple, _ = build_rank_model(sd, cfg, s)
    runner = XlaRunner(xla_model.to(dev), ple, dev, proxy)
    assert _run(NeuronEngine(runner), requests) == expect
    kv = len(xla_model.kv_names)
    decode = [(c, a) for t, c, a in runner.calls if t == 1]
    prefill = [(c, a) for t, c, a in runner.calls if t > 1]
    assert len(decode) >= 10 and sum(c for c, _ in decode) == 1, decode  # every position, one graph
    # Prefill compiles on its first call and once more on the first call after a decode: XLA:CPU compiles a second
    # graph once the KV inputs are buffers a graph wrote (the same with the former where-write; NxD compiles every
    # bucket ahead of time, so this is the proxy's run-time behaviour only). Never again after that.
    assert sum(c for c, _ in prefill[:2]) <= 2 and sum(c for c, _ in prefill[2:]) == 0, prefill
    assert len(prefill) >= 3, prefill
    for c, a in decode + prefill:
        assert a == c * kv, runner.calls  # each compiled graph aliases exactly the KV buffers to its outputs
