"""Run neuron_backend's buckets through torch-xla 2.9 on CPU: the closest thing to neuronx-cc without a NeuronCore.

torch-neuronx is torch-xla underneath, so what XLA sees here is what the Neuron compiler gets: one graph per bucket,
the KV buffers as device data updated in place, hence donated input buffers aliased to outputs. The script reports,
per bucket, how many graphs were compiled (1 each: prefill buckets and decode), that decode steps at new positions
compile nothing (positions are inputs, not constants), and the input/output alias count, which must equal the
number of KV buffers (every KV buffer aliased, nothing else).

    --tp 1   one XLA CPU device, executed end to end; tokens compared with the eager CPU model (same weights)
    --tp 2   two XLA CPU devices, executed: one GSPMD program, the TP=1 module annotated with neuron_backend's TP=2
             shard layout (q/k/v/gate/up/vocab rows, o/down columns, KV buffers by kv head); XLA partitions it and
             inserts the collectives. Tokens compared with the eager CPU model.
    --tp 2 --per-rank
             the per-rank graphs NxD compiles (XlaCollectives all-reduce / all-gather in each rank's graph), on two
             XLA CPU devices (one thread each). torch-xla cannot execute such collectives on XLA:CPU
             (pytorch/xla#5005: seen here on 2.9.0 as a rendezvous timeout), so they are traced and compiled only:
             compile counts and decode graph-hash stability per rank, no alias count (decided at execution).

Needs its own venv (torch 2.9 + torch-xla 2.9 from PyPI; no transformers needed):
    python3 -m venv /work/xla && /work/xla/bin/pip install 'torch==2.9.*' 'torch-xla==2.9.*'
    PYTHONPATH=. PJRT_DEVICE=CPU /work/xla/bin/python bench/neuron_xla_proxy.py --tp 1 --json out.json
    PYTHONPATH=. PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 /work/xla/bin/python bench/neuron_xla_proxy.py --tp 2 [--per-rank]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

# Runs in its own torch-xla venv, where this checkout is not installed: import neuron_backend from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from neuron_backend.config import FULL, SLIDING, BuildSettings, RopeConfig, TextConfig  # noqa: E402
from neuron_backend.generate import greedy_generate, module_step  # noqa: E402
from neuron_backend.loader import build_rank_model  # noqa: E402

# Same shapes as g4ops.models (built here without transformers, which this venv does not have).
SHAPES = {
    "tiny-e4b": dict(hidden=64, inter=128, layers=6, period=3, heads=4, kv=2, hd=16, ghd=32, ple=16, shared=2,
                     vocab=512, window=8, max_seq=64, buckets=(16,), prompt=13, new=16),
    "e4b-mini": dict(hidden=128, inter=256, layers=12, period=6, heads=8, kv=2, hd=256, ghd=512, ple=32, shared=5,
                     vocab=1024, window=512, max_seq=640, buckets=(128, 512), prompt=500, new=16),
}  # fmt: skip


def text_config(shape: str) -> TextConfig:
    s = SHAPES[shape]
    types = [FULL if (i + 1) % s["period"] == 0 else SLIDING for i in range(s["layers"])]
    types[-1] = FULL
    return TextConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
        layer_types=tuple(types), head_dims=tuple(s["ghd"] if t == FULL else s["hd"] for t in types),
        kv_heads=(s["kv"],) * s["layers"], intermediate_sizes=(s["inter"],) * s["layers"],
        k_eq_v=(False,) * s["layers"], sliding_window=s["window"],
        rope={SLIDING: RopeConfig(10_000.0), FULL: RopeConfig(1_000_000.0, "proportional", 0.25)},
        final_logit_softcapping=30.0, ple_dim=s["ple"], ple_vocab_size=s["vocab"], num_kv_shared_layers=s["shared"],
    )  # fmt: skip


def random_hf_state_dict(cfg: TextConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Gemma4ForCausalLM-layout state dict with random weights (norms and layer_scalar randomised too)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    norm = lambda n: 1.0 + 0.5 * torch.randn(n, generator=g)  # noqa: E731
    H, L, P = cfg.hidden_size, cfg.num_layers, cfg.ple_dim
    sd = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, H),
        "model.embed_tokens_per_layer.weight": rnd(cfg.ple_vocab_size, L * P),
        "model.per_layer_model_projection.weight": rnd(L * P, H),
        "model.per_layer_projection_norm.weight": norm(P),
        "model.norm.weight": norm(H),
    }
    for i in range(L):
        p, d, kv = f"model.layers.{i}.", cfg.head_dims[i], cfg.kv_heads[i]
        sd[p + "self_attn.q_proj.weight"] = rnd(cfg.num_heads * d, H)
        sd[p + "self_attn.q_norm.weight"] = norm(d)
        sd[p + "self_attn.o_proj.weight"] = rnd(H, cfg.num_heads * d)
        if cfg.is_kv_owner(i):
            sd[p + "self_attn.k_proj.weight"] = rnd(kv * d, H)
            sd[p + "self_attn.v_proj.weight"] = rnd(kv * d, H)
            sd[p + "self_attn.k_norm.weight"] = norm(d)
        for n in ("gate_proj", "up_proj"):
            sd[p + f"mlp.{n}.weight"] = rnd(cfg.intermediate_sizes[i], H)
        sd[p + "mlp.down_proj.weight"] = rnd(H, cfg.intermediate_sizes[i])
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm"):  # fmt: skip
            sd[p + f"{n}.weight"] = norm(H)
        sd[p + "layer_scalar"] = 0.5 + torch.rand(1, generator=g)
        sd[p + "per_layer_input_gate.weight"] = rnd(P, H)
        sd[p + "per_layer_projection.weight"] = rnd(H, P)
    return sd


def _metric_count(name: str) -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return float(data[0]) if data else 0.0


def _metric_sum(name: str) -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return float(data[1]) if data else 0.0


class XlaStep:
    """Runs one bucket on the XLA device and records, per call, compiles and aliases (deltas of torch-xla's metrics)."""

    def __init__(self, model, device, execute: bool = True):
        self.model, self.device, self.execute = model, device, execute
        self.calls: list[dict] = []

    def __call__(self, ids, start, valid, ple_tokens):
        import torch_xla

        # CompileTime gets one sample per compiled graph; InputOutputAliasCount one sample per compile, valued at
        # the number of input buffers that graph aliases to outputs.
        before = (_metric_count("CompileTime"), _metric_sum("InputOutputAliasCount"))
        args = [t.to(self.device) for t in (ids, start, valid)]
        if ple_tokens is not None:
            args.append(ple_tokens.to(self.device))
        out = self.model(*args)
        tensors = [out] + self.model.kv_tensors()
        graph_hash = torch_xla._XLAC._get_graph_hash(tensors)
        if self.execute:
            torch_xla.sync()
            result = out.cpu()
        else:  # compile only (XLA:CPU cannot run collectives), then drop the pending graph: fresh KV device data
            torch_xla._XLAC._xla_warm_up_cache(tensors, [])
            for name, buf in zip(self.model.kv_names, self.model.kv_tensors()):
                self.model._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype).to(self.device)
            # the collectives' ordering token would otherwise carry this step's pending graph into the next
            torch_xla._XLAC._set_all_reduce_token(str(self.device), None)
            result = torch.zeros_like(ids[:, 0])
        after = (_metric_count("CompileTime"), _metric_sum("InputOutputAliasCount"))
        self.calls.append(dict(tokens=ids.shape[1], start=int(start[0]), compiles=int(after[0] - before[0]),
                               aliases=int(after[1] - before[1]), graph_hash=graph_hash.hex()
                               if isinstance(graph_hash, bytes) else str(graph_hash)))  # fmt: skip
        return result


def summarize(calls: list[dict], kv_count: int) -> dict:
    buckets: dict[str, dict] = {}
    for c in calls:
        name = "decode" if c["tokens"] == 1 else f"prefill_{c['tokens']}"
        b = buckets.setdefault(name, dict(calls=0, compiles=0, hashes=set(), aliases=0))
        b["calls"] += 1
        b["compiles"] += c["compiles"]
        b["hashes"].add(c["graph_hash"])
        b["aliases"] += c["aliases"]
    out = {}
    for name, b in buckets.items():
        out[name] = dict(calls=b["calls"], compiles=b["compiles"], distinct_graphs=len(b["hashes"]),
                         aliased_buffers=b["aliases"], kv_buffers=kv_count)  # fmt: skip
    return out


def _cpu_reference(shape: str):
    """(config, sizes, state dict, TP=1 settings, prompt, PLE table, greedy tokens of the eager CPU model)."""
    cfg, s = text_config(shape), SHAPES[shape]
    sd = random_hf_state_dict(cfg)
    settings = BuildSettings(tp=1, max_seq=s["max_seq"], prefill_buckets=s["buckets"])
    prompt = torch.randint(3, cfg.vocab_size, (1, s["prompt"]), generator=torch.Generator().manual_seed(7))
    cpu_model, ple, _ = build_rank_model(sd, cfg, settings)
    ref = greedy_generate(module_step(cpu_model), prompt, s["new"], settings, ple).tokens
    return cfg, s, sd, settings, prompt, ple, ref


def run_tp1(shape: str) -> dict:
    import torch_xla

    cfg, s, sd, settings, prompt, ple, ref = _cpu_reference(shape)
    dev = torch_xla.device()
    xla_model, _, _ = build_rank_model(sd, cfg, settings)
    xla_model.to(dev)
    step = XlaStep(xla_model, dev)
    t = time.time()
    res = greedy_generate(step, prompt, s["new"], settings, ple).tokens
    seconds = time.time() - t
    kv = len(xla_model.kv_names)
    return dict(tp=1, shape=shape, seq_match_vs_cpu_eager=bool(torch.equal(res, ref)), seconds=round(seconds, 1),
                kv_buffers=kv, buckets=summarize(step.calls, kv), executed=True)  # fmt: skip


# TP=2 shard layout of neuron_backend (parallel.py / loader.py), as GSPMD partition specs of the full TP=1 module:
# column-parallel weights split their rows, row-parallel weights their columns, the vocab its rows, KV buffers
# their kv-head dim (one kv head per device for E4B-like 2-kv-head configs).
_SPMD_SPECS = (
    (("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
      "embed_tokens.weight"), ("tp", None)),
    (("o_proj.weight", "down_proj.weight"), (None, "tp")),
)  # fmt: skip


def run_tp2_spmd(shape: str) -> dict:
    """Both ranks in one SPMD program on two XLA:CPU devices: the TP=1 module with the TP=2 shard layout as
    sharding annotations; XLA's partitioner inserts the collectives (XLA:CPU runs those within one executable)."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("tp",))
    cfg, s, sd, settings, prompt, ple, ref = _cpu_reference(shape)
    dev = torch_xla.device()
    model, _, _ = build_rank_model(sd, cfg, settings)
    model.to(dev)
    sharded = []
    for name, p in model.named_parameters():
        for suffixes, spec in _SPMD_SPECS:
            if name.endswith(suffixes):
                xs.mark_sharding(p, mesh, spec)
                sharded.append(name)
    for buf in model.kv_tensors():
        xs.mark_sharding(buf, mesh, (None, "tp", None, None))
    step = XlaStep(model, dev)
    t = time.time()
    res = greedy_generate(step, prompt, s["new"], settings, ple).tokens
    kv = len(model.kv_names)
    spec = torch_xla._XLAC._get_xla_sharding_spec  # what the device data really carries after the run
    specs = {"k_cache_0": spec(model.kv_tensors()[0]),
             "layers.0.self_attn.q_proj.weight": spec(model.layers[0].self_attn.q_proj.weight),
             "layers.0.mlp.down_proj.weight": spec(model.layers[0].mlp.down_proj.weight)}  # fmt: skip
    return dict(tp=n, shape=shape, mode="spmd", sharding_specs=specs, executed=True, seq_match_vs_cpu_eager=bool(torch.equal(res, ref)),
                seconds=round(time.time() - t, 1), kv_buffers=kv, sharded_weights=len(sharded),
                buckets=summarize(step.calls, kv),
                note="GSPMD: one program partitioned over 2 XLA:CPU devices with neuron_backend's TP=2 shard "
                     "layout; the per-rank graphs with explicit collectives (what NxD compiles) cannot execute on "
                     "XLA:CPU (pytorch/xla#5005), see --per-rank")  # fmt: skip


def _tp2_rank(shape):
    import torch_xla
    import torch_xla.runtime as xr

    from neuron_backend.collectives import XlaCollectives

    rank, world = xr.global_ordinal(), xr.world_size()
    cfg, s = text_config(shape), SHAPES[shape]
    sd = random_hf_state_dict(cfg)
    settings = BuildSettings(tp=world, max_seq=s["max_seq"], prefill_buckets=s["buckets"])
    dev = torch_xla.device()
    model, ple, _ = build_rank_model(sd, cfg, settings, rank=rank, comm=XlaCollectives(world, rank=rank))
    model.to(dev)
    step = XlaStep(model, dev, execute=False)
    prompt = torch.randint(3, cfg.vocab_size, (1, s["prompt"]), generator=torch.Generator().manual_seed(7))
    greedy_generate(step, prompt, 4, settings, ple)  # prefill + 3 decode steps at new positions
    return dict(rank=rank, buckets=summarize(step.calls, len(model.kv_names)), kv_buffers=len(model.kv_names))


def run_tp2(shape: str) -> dict:
    from torch_xla._internal import pjrt

    results = pjrt.run_multiprocess(_tp2_rank, shape)  # what xmp.spawn runs; CPU: one thread per device
    return dict(tp=2, shape=shape, executed=False, ranks=[results[r] for r in sorted(results)],
                note="compile-only: torch-xla cannot execute collectives on XLA:CPU (pytorch/xla#5005). Both "
                     "ranks are threads of one process, so compile counts are process-wide (both ranks' graphs); "
                     "aliasing is decided at execution, so the aliased column is 0 here by construction.")  # fmt: skip


def print_table(report: dict) -> None:
    default = "2 dev" if report.get("mode") == "spmd" else "rank 0"
    rows = [(report.get("ranks") and f"rank {r['rank']}" or default, r) for r in (report.get("ranks") or [report])]
    print(f"{'rank':8} {'bucket':12} {'calls':>5} {'compiles':>8} {'graphs':>6} {'aliased':>7} {'KV bufs':>7}")
    for label, r in rows:
        for name, b in r["buckets"].items():
            print(f"{label:8} {name:12} {b['calls']:5d} {b['compiles']:8d} {b['distinct_graphs']:6d} "
                  f"{b['aliased_buffers']:7d} {b['kv_buffers']:7d}")  # fmt: skip
    if "seq_match_vs_cpu_eager" in report:
        print(f"SEQ_MATCH (XLA vs CPU eager) {report['seq_match_vs_cpu_eager']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, choices=[1, 2])
    p.add_argument("--shape", default="tiny-e4b", choices=sorted(SHAPES))
    p.add_argument("--per-rank", action="store_true",
                   help="--tp 2: trace + compile each rank's graph with explicit collectives (not executable on XLA:CPU)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    import torch_xla

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if args.tp == 1:
        report = run_tp1(args.shape)
    else:
        report = run_tp2(args.shape) if args.per_rank else run_tp2_spmd(args.shape)
    report.update(date=datetime.date.today().isoformat(), torch=torch.__version__, torch_xla=torch_xla.__version__,
                  device=f"XLA:CPU ({os.environ.get('CPU_NUM_DEVICES', '1')} device(s)), {platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores")  # fmt: skip
    print_table(report)
    if report["executed"]:
        ok = all(b["compiles"] == 1 and b["distinct_graphs"] == 1 and b["aliased_buffers"] == b["kv_buffers"]
                 for b in report["buckets"].values())  # fmt: skip
    else:  # compile-only: every rank's decode graph is the same at every position (no recompiles)
        ok = all(b["distinct_graphs"] == 1 for r in report["ranks"] for b in r["buckets"].values())
    report["ok"] = bool(ok and report.get("seq_match_vs_cpu_eager", True))
    print(json.dumps({k: v for k, v in report.items() if k not in ("buckets", "ranks")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
