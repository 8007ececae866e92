"""Compiled artifacts are reused across processes: a second process that compiles the same g4ops-enabled finetune
step takes it from PyTorch's compile caches (Inductor's FX-graph cache and the AOTAutograd cache) instead of
compiling it again, and computes the same bits.

Two things used to defeat that, each found by this test's counters:
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

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _run_child(mode: str, cache: Path, out: Path, hash_seed: int) -> dict:
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TORCHINDUCTOR_CACHE_DIR=str(cache),
               PYTHONHASHSEED=str(hash_seed))  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_cache_child.py"), mode, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("mode", ["classes", "model-attention"])
def test_second_process_reuses_the_compiled_step(tmp_path, mode):
    cache = tmp_path / "cache"
    # hash seeds 0 and 1 iterate {"sliding_attention", "full_attention"} in opposite orders (asserted below)
    first = _run_child(mode, cache, tmp_path / "first", hash_seed=0)
    second = _run_child(mode, cache, tmp_path / "second", hash_seed=1)
    assert first["stock_layer_type_order"] != second["stock_layer_type_order"], "the two processes must differ"

    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1, first
    assert first["aot_autograd"].get("autograd_cache_saved", 0) >= 1, first
    for report in (first, second):
        assert report["inductor"].get("fxgraph_cache_bypass", 0) == 0, report
        assert report["aot_autograd"].get("autograd_cache_bypass", 0) == 0, report
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second

    a, b = (torch.load(tmp_path / run / "grads.pt") for run in ("first", "second"))
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[name], b[name]) for name in a), "the cached step computed different bits"
