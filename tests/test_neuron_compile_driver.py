"""compile.py's wiring, with NxD's ModelBuilder emulated in-process (torch-neuronx cannot be installed here).

The fake keeps the contract the real one has: each bucket's module comes from `load_module()` / `get()`, its KV
parameters are states that `input_output_aliases` ties to forward outputs (the runtime writes those outputs back
into the states, which never leave the device), states are one buffer per name shared by every bucket (NxD's
StateInitializer), the per-rank weights arrive through `nxd_model.initialize` and must name every other parameter,
and the executor routes a call to the bucket whose example input shapes match.
Running greedy generation through the loaded artifact must give the CPU model's tokens.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import g4ops
from neuron_backend.check import build_stock
from neuron_backend.config import BuildSettings, from_hf_config
from neuron_backend.generate import greedy_generate, module_step
from neuron_backend.loader import build_rank_model

pytest.importorskip("safetensors")


class _FakeExecutor(torch.nn.Module):
    def __init__(self, entries):
        super().__init__()
        self.entries = entries  # key -> (module, aliases, example input shapes, compiler args)
        self.nxd_model = self
        self.initialized = False
        self.states: dict[str, torch.Tensor] = {}  # one device buffer per state name, shared by all buckets

    def initialize(self, weights, start_rank=None):
        assert len(weights) == 1, "this fake emulates TP=1 (one rank)"
        for module, aliases, _, _ in self.entries.values():
            states = {n for n, p in module.named_parameters() if any(p is a for a in aliases)}
            expected = {n for n, _ in module.named_parameters()} - states
            assert set(weights[0]) == expected, (set(weights[0]) ^ expected)
            with torch.no_grad():
                for n, p in module.named_parameters():
                    if n in states:
                        self.states.setdefault(n, torch.zeros_like(p))  # states are zero-filled on device
                    else:
                        p.copy_(weights[0][n])
        self.initialized = True

    def forward(self, *inputs):
        assert self.initialized
        shapes = [tuple(t.shape) for t in inputs]
        key = next(k for k, e in self.entries.items() if e[2] == shapes)
        module, aliases, _, _ = self.entries[key]
        names = {id(p): n for n, p in module.named_parameters()}
        with torch.no_grad():
            for param in aliases:  # the bucket reads the shared state buffers ...
                param.copy_(self.states[names[id(param)]])
            out = module(*inputs)
            for param, idx in aliases.items():  # ... and the aliased outputs are written back into them
                self.states[names[id(param)]].copy_(out[idx])
        kept = [o for i, o in enumerate(out) if i not in set(aliases.values())]
        return kept


def _install_fake_sdk(monkeypatch, built):
    class BaseModelInstance:
        def __init__(self, module_cls, input_output_aliases):
            self.module_cls, self.module = module_cls, None

    class ModelBuilder:
        def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None, **kw):
            assert tp_degree == 1
            self.entries = {}

        def add(self, key, model_instance, example_inputs, compiler_args=None, **kw):
            self.entries[key] = (model_instance, example_inputs, compiler_args)
            return self

        def trace(self, initialize_model_weights=True):
            assert not initialize_model_weights  # weights come pre-sharded
            out = {}
            for key, (inst, examples, args) in self.entries.items():
                inst.load_module()
                module, aliases = inst.get(0)
                out[key] = (module, aliases, [tuple(t.shape) for t in examples[0]], args)
            built["executor"] = _FakeExecutor(out)
            return built["executor"]

    ps = types.SimpleNamespace(
        get_tensor_model_parallel_size=lambda: 1,
        get_tensor_model_parallel_replica_groups=lambda: [[0]],
        get_tensor_model_parallel_rank=lambda: 0,
    )
    xm = types.SimpleNamespace(REDUCE_SUM="sum", all_reduce=lambda op, x, groups=None: x,
                               all_gather=lambda x, dim=0, groups=None, pin_layout=False: x)  # fmt: skip
    mods = {
        "torch_neuronx": types.ModuleType("torch_neuronx"),
        "neuronx_distributed": types.ModuleType("neuronx_distributed"),
        "neuronx_distributed.trace": types.ModuleType("neuronx_distributed.trace"),
        "neuronx_distributed.trace.model_builder": types.SimpleNamespace(
            BaseModelInstance=BaseModelInstance, ModelBuilder=ModelBuilder
        ),
        "neuronx_distributed.parallel_layers": types.SimpleNamespace(parallel_state=ps),
        "neuronx_distributed.parallel_layers.parallel_state": ps,
        "torch_xla": types.ModuleType("torch_xla"),
        "torch_xla.core": types.ModuleType("torch_xla.core"),
        "torch_xla.core.xla_model": xm,
    }
    mods["torch_xla.core"].xla_model = xm
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    saved = {}
    monkeypatch.setattr(torch.jit, "save", lambda obj, path: saved.__setitem__(str(path), obj))
    monkeypatch.setattr(torch.jit, "load", lambda path: saved[str(path)])


def test_compile_save_load_generate_matches_cpu(tmp_path, monkeypatch):
    from neuron_backend.compile import COMPILER_ARGS, CompiledModel, compile_model

    g4ops.disable()
    hf = build_stock("tiny-e4b")
    cfg = from_hf_config(hf.config)
    sd = hf.state_dict()
    settings = BuildSettings(tp=1, max_seq=48, prefill_buckets=(8, 16))
    built = {}
    _install_fake_sdk(monkeypatch, built)

    out = compile_model(sd, cfg, settings, tmp_path / "artifact")
    entries = built["executor"].entries
    assert list(entries) == ["prefill_8", "prefill_16", "decode"]
    for key, (module, aliases, shapes, args) in entries.items():
        assert "--auto-cast=none" in args and args == COMPILER_ARGS
        assert len(aliases) == 2 * len(cfg.kv_owner_layers)  # every KV buffer is an aliased state, nothing else
        assert sorted(aliases.values()) == list(range(1, 1 + len(aliases)))
        assert shapes[0] == (1, 1 if key == "decode" else int(key.split("_")[1]))
        # promoted persistent buffers are weights, not constants baked into the graph
        assert "layers.0.layer_scalar" in dict(module.named_parameters())
    assert (out / "weights" / "tp0.safetensors").exists() and (out / "ple.safetensors").exists()

    model = CompiledModel(out)
    prompt = torch.randint(3, cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(3))
    dev = greedy_generate(model.step, prompt, 20, model.settings, model.ple)
    ref_model, ple, _ = build_rank_model(sd, cfg, settings)
    ref = greedy_generate(module_step(ref_model), prompt, 20, settings, ple)
    assert dev.prefill_calls == [(16, 11)]
    assert torch.equal(dev.tokens, ref.tokens)
