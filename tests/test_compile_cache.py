"""Compiled artifacts are reused across processes: a second process that compiles the same g4ops-enabled work takes
it from PyTorch's compile caches (Inductor's FX-graph cache and the AOTAutograd cache) instead of compiling it
again, and computes the same bits. bench/compile_cache.py runs the processes; this reads its report.

Two things used to defeat that, each found by these counters:
- transformers' Gemma4TextModel iterates a set of layer-type strings whose order follows the string-hash seed, so
  about half of all new processes traced a different graph (enable() iterates it sorted; stock keeps the problem);
- an autograd.Function in the traced graph (g4ops.ops.embedding, g4ops.attention): the AOTAutograd cache refuses
  those; both are now registered ops whose Autograd kernels hold the Function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_second_process_reuses_the_compiled_work(tmp_path):
    # train: enable(model, attention=True), instance patches, both registered ops in the backward;
    # decoder: enable(), class patches, GreedyDecoder(compile=True)
    out = tmp_path / "compile_cache.json"
    cmd = [sys.executable, str(ROOT / "bench" / "compile_cache.py"), "--device", "cpu", "--shape", "tiny-e4b",
           "--paths", "train,decoder", "--variants", "g4ops", "--seq", "24", "--new-tokens", "12", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    rows = {r["path"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {"train", "decoder"}
    for path, row in rows.items():
        assert not any(k.endswith("_error") for k in row), row
        # hash seeds 0 and 1 iterate {"sliding_attention", "full_attention"} in opposite orders
        assert row["first_layer_type_order"] != row["second_layer_type_order"], row
        first, second = row["first_caches"], row["second_caches"]
        assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("autograd_cache_saved", 0) >= 1, row
        for caches in (first, second):
            assert caches.get("fxgraph_cache_bypass", 0) == 0 and caches.get("autograd_cache_bypass", 0) == 0, row
        assert second.get("autograd_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0, row
        assert row["same_result"] is True, row  # loss and every gradient (train), the tokens (decoder)
