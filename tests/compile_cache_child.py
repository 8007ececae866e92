"""One process of tests/test_compile_cache.py: compile a tiny Gemma-4 finetune step with g4ops enabled, run it once,
and report PyTorch's compile-cache counters, the loss and the gradients. Run as
`python tests/compile_cache_child.py MODE OUT_DIR` (MODE: stock, classes or model-attention) with
TORCHINDUCTOR_CACHE_DIR set by the caller. Prints the seconds from the model's construction to the end of the first
backward (compilation included)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import g4ops
from g4ops.models import build_model

mode, out = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
start = time.perf_counter()
model = build_model("tiny-e4b").train()
stock_order = list(set(model.config.layer_types))  # what stock iterates: the order this process's hash seed gives
if mode == "stock":
    handle = None  # for comparison (bench/results/2026-11-29-cpu-compile-cache-reuse.md), not used by the test
elif mode == "classes":
    handle = g4ops.enable()  # class-level patches (the layer-type order by a property on the class)
elif mode == "model-attention":
    handle = g4ops.enable(model, attention=True)  # instance patches, g4ops attention (a registered op)
else:
    raise SystemExit(f"unknown mode {mode}")
ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
loss = torch.compile(model)(input_ids=ids, labels=ids).loss
loss.backward()
print(f"compile and first step: {time.perf_counter() - start:.1f} s")
torch.save({"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}},
           out / "grads.pt")  # fmt: skip
report = {"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
          "stock_layer_type_order": stock_order}  # fmt: skip
(out / "report.json").write_text(json.dumps(report))
