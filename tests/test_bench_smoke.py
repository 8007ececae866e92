"""The benchmark scripts run end to end on CPU with the tiny model (they are run for real on the GPU machine; this
proves they are not broken in between). Each runs as its own process, as a user would launch it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from g4ops.ops._torch_version import torch_version

ROOT = Path(__file__).resolve().parent.parent


def _without_switches() -> dict:
    """This process's environment without g4ops' G4OPS_* switches (tests that set their own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("G4OPS_")}


def _run(args, tmp_path, timeout=240, env=None):
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def test_e2e_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    proc = _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--json", str(out)], tmp_path)
    assert "== summary ==" in proc.stdout
    res = json.loads(out.read_text())
    assert "errors" not in res, res.get("errors")
    decode = {(r["variant"], r["batch"]): r for r in res["decode"]}
    for (variant, batch), r in decode.items():
        assert r.get("tok_s", 0) > 0, r
        assert r["final_position"] == 6 + 12  # prompt + every requested token (EOS suppressed)
    assert decode[("g4ops", 2)]["same_tokens_head"] is True  # fp32 on CPU: identical greedy tokens
    train = {(r["variant"], r["optimizer"]): r for r in res["train"]}
    for optimizer in ("none", "adamw", "g4ops-adamw"):
        for variant in ("stock", "g4ops"):
            row = train[(variant, optimizer)]
            assert row.get("tok_s", 0) > 0 and row.get("back_to_back_tok_s", 0) > 0, row
        assert train[("g4ops", optimizer)]["loss_matches_stock"] is True
        assert "tok_s" in train[("liger", optimizer)] or "error" in train[("liger", optimizer)]
    parity = res["parity"]
    assert parity["teacher_forced"]["teacher_forced_top1_agreement"] == 1.0
    floor = ("stock_vs_fp32_top1_agreement", "g4ops_vs_fp32_top1_agreement", "stock_greedy_vs_fp32_agreement")
    assert all(0.0 <= parity["teacher_forced"][key] <= 1.0 for key in floor), parity["teacher_forced"]
    assert parity["teacher_forced"]["stock_vs_fp32_top1_agreement"] == 1.0  # an fp32 smoke: the truth is stock itself
    assert parity["fp32_greedy"]["identical"] is True


def test_e2e_lora_under_autocast(tmp_path):
    """`--autocast bf16` (Trainer's and TRL's bf16=True over fp32 weights): every row says so, g4ops' first loss
    matches stock's, and no MLP leaves the fused LoRA path."""
    out = tmp_path / "autocast.json"
    _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--layers", "3", "--parts", "train", "--seqs", "32",
          "--lora", "4", "--variants", "stock,g4ops", "--dtype", "fp32", "--autocast", "bf16", "--optimizers", "none",
          "--warmup-steps", "1", "--steps", "1", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
    assert {r.get("autocast") for r in rows.values()} == {"bf16"}, rows
    assert rows["g4ops"]["loss_matches_stock"] is True and rows["g4ops"]["lora_mlp_fallback"] == [], rows["g4ops"]


def test_e2e_refuses_flex_masked_where_the_integration_does(monkeypatch):
    """`--sliding flex-masked` under a torch whose integration keeps masked sliding layers on SDPA would label stock
    rows as FlexAttention's: the arguments are refused, naming why."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e

    monkeypatch.setattr(e2e, "torch_version", lambda: (2, 13))
    e2e.parse_args(["--sliding", "flex-masked"])
    monkeypatch.setattr(e2e, "torch_version", lambda: (2, 11))
    with pytest.raises(SystemExit):
        e2e.parse_args(["--sliding", "flex-masked"])
    e2e.parse_args(["--sliding", "flex"])


def test_e2e_flex_options_reach_the_sliding_flex_call(monkeypatch):
    """`--flex-options JSON` sets the kernel options g4ops.ops.attention.sliding_window_attention passes to flex."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import e2e
    import g4ops.ops.attention

    monkeypatch.setattr(g4ops.ops.attention, "SLIDING_FLEX_KERNEL_OPTIONS", None)
    monkeypatch.setattr(g4ops.hf.attention_interface, "SLIDING_VIA_FLEX", True)
    args = e2e.parse_args(["--flex-options", '{"bwd_num_warps": 8, "USE_TMA": true}'])
    e2e.use_sliding(args.sliding, args.flex_options)
    assert g4ops.ops.attention.SLIDING_FLEX_KERNEL_OPTIONS == {"bwd_num_warps": 8, "USE_TMA": True}
    e2e.use_sliding("flex", e2e.parse_args([]).flex_options)
    assert g4ops.ops.attention.SLIDING_FLEX_KERNEL_OPTIONS is None


def test_e2e_train_with_g4ops_attention(tmp_path):
    """The finetune rows of the issue's table run with `--g4ops-attention` (on CPU: the chunked full layers, stock
    sliding layers; FlexAttention needs a compiled CUDA model)."""
    out = tmp_path / "e2e.json"
    _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--parts", "train", "--variants",
          "stock,g4ops", "--optimizers", "none", "--g4ops-attention", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
    assert rows["g4ops"]["attention"] == "g4ops" and rows["g4ops"]["sliding"] == "stock", rows["g4ops"]
    assert rows["g4ops"]["loss_matches_stock"] is True and rows["g4ops"]["tok_s"] > 0


@pytest.mark.parametrize("eager_linear", [None, "op"], ids=["eager-default", "eager-op"])
def test_e2e_lora_rows_route_the_attention_projections(tmp_path, eager_linear):
    """--lora: the g4ops row's MLPs run the fused LoRA MLP and its loss matches stock peft's; its attention
    projections, routed by enable(model) after peft wraps them, run peft's forward in an eager step unless
    G4OPS_LORA_EAGER_LINEAR=op (g4ops.hf.peft_lora.EAGER_LINEAR_VIA_OP); the row counts those that run
    g4ops.lora_linear."""
    out = tmp_path / "e2e.json"
    env = _without_switches() | ({"G4OPS_LORA_EAGER_LINEAR": eager_linear} if eager_linear else {})
    _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--parts", "train", "--variants",
          "stock,g4ops", "--optimizers", "none", "--lora", "2", "--json", str(out)], tmp_path, env=env)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
    g4 = rows["g4ops"]
    assert (g4["lora_linear_projections"] > 0) == (eager_linear == "op") and g4["lora_mlp_fallback"] == [], g4
    assert g4.get("g4ops_env", {}) == ({"G4OPS_LORA_EAGER_LINEAR": "op"} if eager_linear else {}), g4
    assert g4["loss_matches_stock"] is True and "error" not in rows["stock"], rows


def test_e2e_train_with_gradient_checkpointing(tmp_path):
    """--grad-ckpt (the longest-sequence search) turns checkpointing on in every variant's model; losses still agree."""
    out = tmp_path / "e2e.json"
    _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--parts", "train", "--variants",
          "stock,g4ops", "--optimizers", "none", "--grad-ckpt", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
    assert all(rows[v].get("grad_ckpt") is True and "error" not in rows[v] for v in ("stock", "g4ops")), rows
    assert rows["g4ops"]["loss_matches_stock"] is True


def test_e2e_train_padded_and_packed_layouts(tmp_path):
    """--layout padded / packed (issue 18's rows): the same 4 sequences as a padded batch and packed in one row give
    one loss (fp32: each sequence's own tokens and positions, nothing seen across a boundary), stock's and g4ops'."""
    losses = {}
    for layout in ("padded", "packed"):
        out = tmp_path / f"e2e-{layout}.json"
        _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--parts", "train", "--optimizers",
              "none", "--layout", layout, "--json", str(out)], tmp_path)  # fmt: skip
        rows = {r["variant"]: r for r in json.loads(out.read_text())["train"]}
        assert all(rows[v]["layout"] == layout and rows[v]["tok_s"] > 0 for v in ("stock", "g4ops")), rows
        assert rows["g4ops"]["loss_matches_stock"] is True
        losses[layout] = {v: (rows[v]["first_loss"], rows[v]["real_tokens"]) for v in ("stock", "g4ops")}
    for v in ("stock", "g4ops"):
        (padded, n_padded), (packed, n_packed) = losses["padded"][v], losses["packed"][v]
        assert n_padded == n_packed and abs(padded - packed) <= 1e-5 * abs(padded), losses


def test_e2e_merge_joins_one_variant_per_file(tmp_path):
    """--merge (gpu_round.sh's e2e-each table): rows of single-variant files, each written by its own process, are
    compared with the reference variant's row of the same workload; a g4ops row taken under a G4OPS_* switch says
    so in its row and the table (the switches change what g4ops runs); files of another machine are refused."""
    paths = []
    for name, variant, switches in (("stock", "stock", {}), ("g4ops", "g4ops", {}),
                                    ("g4ops-inner-eager", "g4ops", {"G4OPS_LORA_COMPILE": "0"})):  # fmt: skip
        paths.append(tmp_path / f"e2e-{name}.json")
        env = _without_switches() | switches
        _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--dtype", "fp32", "--seqs", "32", "--parts",
              "train", "--layout", "packed", "--lora", "2", "--optimizers", "none", "--warmup-steps", "1", "--steps",
              "1", "--variants", variant, "--json", str(paths[-1])], tmp_path, env=env)  # fmt: skip
        assert json.loads(paths[-1].read_text())["meta"]["g4ops_env"] == switches
    merged = tmp_path / "merged.json"
    proc = _run(["bench/e2e.py", "--merge", *map(str, paths), "--merge-reference", "stock", "--json", str(merged)],
                tmp_path)  # fmt: skip
    result = json.loads(merged.read_text())
    rows = {r["source"]: r for r in result["train"]}
    assert [r["variant"] for r in rows.values()] == ["stock", "g4ops", "g4ops"]
    stock, g4, inner_eager = rows["e2e-stock.json"], rows["e2e-g4ops.json"], rows["e2e-g4ops-inner-eager.json"]
    for row in (g4, inner_eager):
        assert row["speedup_vs_stock"] == row["tok_s"] / stock["tok_s"] and row["loss_matches_stock"] is True
    assert "speedup_vs_stock" not in stock
    assert "g4ops_env" not in g4 and inner_eager["g4ops_env"] == {"G4OPS_LORA_COMPILE": "0"}
    assert "| g4ops | 32 | packed | 26 | 2 | none |" in proc.stdout
    assert "| g4ops [G4OPS_LORA_COMPILE=0] | 32 | packed | 26 | 2 | none |" in proc.stdout
    # an A/B of g4ops' own paths: the reference is its row without switches, the switched row is compared with it
    _run(["bench/e2e.py", "--merge", *map(str, paths), "--merge-reference", "g4ops", "--json", str(merged)], tmp_path)
    rows = {r["source"]: r for r in json.loads(merged.read_text())["train"]}
    inner_eager, g4 = rows["e2e-g4ops-inner-eager.json"], rows["e2e-g4ops.json"]
    assert inner_eager["speedup_vs_g4ops"] == inner_eager["tok_s"] / g4["tok_s"], inner_eager
    assert "speedup_vs_g4ops" not in g4 and rows["e2e-stock.json"]["speedup_vs_g4ops"] > 0
    other = json.loads(paths[0].read_text())
    other["meta"]["gpu"] = "another GPU"
    paths[0].write_text(json.dumps(other))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    refused = subprocess.run([sys.executable, "bench/e2e.py", "--merge", *map(str, paths)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0 and "different GPUs or stacks" in refused.stderr, refused.stderr


def test_e2e_timing_turns_time_side_by_side_processes_one_at_a_time(tmp_path):
    """--timing-turns (gpu_round.sh E2E_PARALLEL=1): processes started together each wait until all are warmed up,
    then time alone: no two processes' timed steps (every optimizer's row) overlap in wall-clock time."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    procs = {}
    for variant in ("stock", "g4ops"):
        procs[variant] = subprocess.Popen(
            [sys.executable, "bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--dtype", "fp32", "--seqs",
             "32", "--parts", "train", "--optimizers", "none,adamw", "--warmup-steps", "1", "--steps", "3",
             "--variants", variant, "--timing-turns", str(tmp_path / "turns"), "--timing-parties", "2", "--json",
             str(tmp_path / f"{variant}.json")], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)  # fmt: skip
    windows = []
    for variant, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        rows = json.loads((tmp_path / f"{variant}.json").read_text())["train"]
        assert [r["optimizer"] for r in rows] == ["none", "adamw"] and all("error" not in r for r in rows), rows
        turn = rows[0]["timing_turn"]
        assert turn["parties"] == 2 and turn["all_ready"] is True, turn
        windows.append((min(r["timed_from"] for r in rows), max(r["timed_to"] for r in rows)))
    (first_from, first_to), (second_from, second_to) = sorted(windows)
    assert first_to <= second_from, windows


def test_gpu_round_e2e_each_runs_every_layout_and_the_after_variants_last(tmp_path):
    """gpu_round.sh's e2e-each with E2E_LAYOUTS and E2E_AFTER_VARIANTS (how session 36 took two layouts' compared
    rows in one call): one process and file per variant and layout; the E2E_VARIANTS processes time in turns, the
    after-variants run alone once they have exited; one merged table holds every row. The after-variant here runs
    under two g4ops switches (VARIANT+NAME=VALUE+...), which its file name and rows carry."""
    out = tmp_path / "out"
    switched = "g4ops+G4OPS_LORA_COMPILE=0+G4OPS_LORA_TRACE=1"
    env = dict(_without_switches(), PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OUT=str(out), PY=sys.executable,
               STAGES="e2e-each", E2E_PARALLEL="1", E2E_VARIANTS="stock", E2E_AFTER_VARIANTS=switched,
               E2E_LAYOUTS="packed padded", E2E_REFERENCE="stock",
               E2E_ARGS="--device cpu --shape tiny-e4b --dtype fp32 --seqs 32 --parts train --lora 2 --optimizers none "
                        "--warmup-steps 1 --steps 1")  # fmt: skip
    proc = subprocess.run(["bash", "bench/gpu_round.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {}
    for layout in ("packed", "padded"):
        for variant, name in (("stock", "stock"), ("g4ops", "g4ops-G4OPS_LORA_COMPILE-0-G4OPS_LORA_TRACE-1")):
            (row,) = json.loads((out / f"e2e-{layout}-{name}.json").read_text())["train"]
            assert row["layout"] == layout and row["variant"] == variant and "error" not in row, row
            rows[layout, variant] = row
        assert "g4ops_env" not in rows[layout, "stock"]
        assert rows[layout, "g4ops"]["g4ops_env"] == {"G4OPS_LORA_COMPILE": "0", "G4OPS_LORA_TRACE": "1"}
    for layout in ("packed", "padded"):
        assert rows[layout, "stock"]["timing_turn"]["parties"] == 2  # the two parallel processes, one per layout
        assert "timing_turn" not in rows[layout, "g4ops"]
    parallel_end = max(rows[layout, "stock"]["timed_to"] for layout in ("packed", "padded"))
    assert all(rows[layout, "g4ops"]["timed_from"] >= parallel_end for layout in ("packed", "padded"))
    table = (out / "e2e-table.md").read_text()
    for layout in ("packed", "padded"):
        switched_row = f"| g4ops [G4OPS_LORA_COMPILE=0 G4OPS_LORA_TRACE=1] | 32 | {layout} | 26 | 2 | none |"
        assert switched_row in table and f"| stock | 32 | {layout} |" in table, table


def test_e2e_decode_variants_in_their_own_processes(tmp_path):
    """--decode-processes each (the CUDA default): one child process per variant, rows merged and compared."""
    out = tmp_path / "e2e.json"
    _run(["bench/e2e.py", "--device", "cpu", "--shape", "tiny-e4b", "--smoke", "--parts", "decode",
          "--decode-variants", "stock,g4ops", "--decode-processes", "each", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["decode"]}
    assert set(rows) == {"stock", "g4ops"} and all(r["process"] == "own" and r["tok_s"] > 0 for r in rows.values())
    assert rows["g4ops"]["same_tokens_head"] is True and rows["g4ops"]["speedup_vs_stock"] > 0


@pytest.mark.slow
def test_fsdp2_smoke(tmp_path):
    out = tmp_path / "fsdp2.json"
    _run(["bench/fsdp2.py", "--device", "cpu", "--backend", "gloo", "--shape", "tiny-e4b", "--json", str(out)],
         tmp_path)
    res = json.loads(out.read_text())
    rows = {(r["variant"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {("stock", "eager"), ("g4ops", "eager")}
    stock_error = rows[("stock", "eager")].get("error")
    if stock_error is not None and rows[("g4ops", "eager")].get("error") == stock_error:
        import transformers  # transformers 5.6's KV-shared layers fail under per-layer FSDP2, stock included

        pytest.skip(f"stock transformers {transformers.__version__} fails under FSDP2: {stock_error}")
    for r in rows.values():
        assert "error" not in r, r
        assert r["losses_ok"] is True and r["tok_s_per_gpu"] > 0
    assert rows[("stock", "eager")]["first_loss_vs_1proc"] == pytest.approx(0.0, abs=1e-5)


def test_attention_bench_smoke(tmp_path):
    out = tmp_path / "attention.json"
    proc = _run(["bench/attention.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    assert "== timings" in proc.stdout
    res = json.loads(out.read_text())
    assert all(r["ok"] for r in res["correctness"]), res["correctness"]
    impls = {(r["kind"], r["impl"]) for r in res["timings"] if r.get("fwd_bwd_ms", 0) > 0}
    assert impls == {(kind, impl) for kind in ("full", "sliding") for impl in ("stock", "g4ops")}, res["timings"]


def test_flex_options_bench_smoke(tmp_path):
    """The harness on CPU (flex has no CPU backward: g4ops' full-layer path and SDPA), errors against fp64 small."""
    out = tmp_path / "flex.json"
    _run(["bench/flex_options.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["g4ops", "sdpa-flash"], rows
    for row in rows:
        assert row["fwd_bwd_ms"] > 0 and max(row["rel_err"].values()) < 1e-5, row  # fp32 against fp64


def test_lora_fold_bench_smoke(tmp_path):
    """Both fold orders of bench/lora_fold.py against fp64 on CPU: rounding the small low-rank term (base last) is
    no less accurate than rounding the base product (today's order), and both are within a few bf16 roundings."""
    out = tmp_path / "fold.json"
    _run(["bench/lora_fold.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3, rows
    for row in rows:
        assert 0 < row["base_last_rel_err"] <= row["base_first_rel_err"] < 2 * 2.0**-8, row


@pytest.mark.parametrize("fold", ["base_first", "base_last"])
def test_lora_kernel_count_bench_smoke(tmp_path, fold):
    """bench/lora_kernel_count.py in each fold order: the base projection is one GEMM each way and no other kernel
    (the count reads the generated code right); a LoRA projection's split forward is three GEMMs in either order
    (A's product, and the base and low-rank GEMMs of the fold) with elementwise kernels beside them."""
    out = tmp_path / "count.json"
    _run(["bench/lora_kernel_count.py", "--json", str(out)], tmp_path, env=dict(_without_switches(),
                                                                                 G4OPS_LORA_FOLD=fold))  # fmt: skip
    rows = {(r["op"], r["part"]): r for r in json.loads(out.read_text())["rows"]}
    assert {r["fold"] for r in rows.values()} == {fold}
    assert rows["base linear", "forward"]["kernels"] == 0 and rows["base linear", "forward"]["gemms"] == 1
    assert rows["base linear", "backward dx"]["gemms"] == 1
    assert rows["lora_linear", "forward"]["gemms"] == 3 and rows["lora_linear", "forward"]["kernels"] > 0
    for part in ("forward", "backward"):
        assert rows["lora_geglu_mlp", part]["gemms"] > rows["lora_linear", part]["gemms"], rows


def test_demo_without_compile_reports_parity(tmp_path):
    # the README's main job, minus the compile variants (CI time): every variant, the GreedyDecoder included
    proc = _run(["-m", "g4ops", "demo", "--no-compile", "--tokens", "12"], tmp_path)
    assert "g4ops decoder" in proc.stdout
    assert "PARITY: every variant produced the same greedy tokens as stock transformers" in proc.stdout


def test_embedding_backward_bench_smoke(tmp_path):
    out = tmp_path / "embedding.json"
    _run(["bench/embedding_backward.py", "--device", "cpu", "--rows", "512", "--dim", "16", "--tokens", "64",
          "--reps", "1", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["stock eager", "stock compile", "g4ops compile"]
    assert all(r["ms"] > 0 and r["grad_max_abs_diff_vs_stock_eager"] < 0.1 for r in rows), rows


def _save_checkpoint_with_tokenizer(path: Path, words: list[str]) -> None:
    """A tiny Gemma-4 checkpoint directory, as a real one is laid out: weights, config and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from g4ops.models import build_model

    build_model("tiny-e4b").save_pretrained(path)
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(path)


def test_e2e_parity_on_a_local_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save_checkpoint_with_tokenizer(ckpt, ["the", "cat", "sat", "on", "mat"])
    out = tmp_path / "e2e.json"
    _run(["bench/e2e.py", "--device", "cpu", "--model", str(ckpt), "--prompt", "the cat sat", "--smoke",
          "--parts", "parity", "--json", str(out)], tmp_path)
    res = json.loads(out.read_text())
    assert "errors" not in res, res.get("errors")
    assert res["meta"]["args"]["model"] == str(ckpt)
    parity = res["parity"]
    assert parity["prompt_tokens"] == 3  # the tokenizer's ids of "the cat sat", not --prompt-len random ones
    assert parity["teacher_forced"]["layers"] == 6  # the checkpoint's own count, not --shape's
    assert parity["fp32_greedy"]["layers"] == 6  # --fp32-layers does not cut a checkpoint
    assert parity["fp32_greedy"]["identical"] is True
    assert parity["teacher_forced"]["teacher_forced_top1_agreement"] == 1.0  # fp32 on CPU


def test_e2e_rejects_a_prompt_without_a_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "bench/e2e.py", "--device", "cpu", "--prompt", "hi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--prompt needs --model" in proc.stderr


def test_decode_attention_bench_smoke(tmp_path):
    out = tmp_path / "decode_attention.json"
    _run(["bench/decode_attention.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert {r["layer"] for r in rows} == {"sliding", "full"} and all(r["no_worse_than_stock"] for r in rows)
    assert all(r["err_g4ops"] < 1e-2 and r["g4ops_us"] > 0 for r in rows)


def test_loss_bench_smoke(tmp_path):
    """bench/loss_bench.py finds the op's GEMMs (the frozen weight's one pass: 2 per chunk; the trained weight's one
    pass over every row: 3) and times them beside the op."""
    out = tmp_path / "loss.json"
    _run(["bench/loss_bench.py", "--device", "cpu", "--rows", "96", "--vocab", "1031", "--hidden", "32", "--repeats",
          "1", "--json", str(out)], tmp_path)  # fmt: skip
    res = {r["weight_grad"]: r for r in json.loads(out.read_text())["results"]}
    assert res[False]["gemms"] == 2 and res[True]["gemms"] == 3, res
    assert all(r["op_ms"] > 0 and r["gemm_ms"] > 0 for r in res.values())


def test_sliding_band_prototype_matches_fp64(tmp_path):
    """bench/sliding_band.py's band attention from two causal flash calls per block (the CPU flash kernels here)
    gives the fp64 band attention's output and gradients to fp32 accuracy, over 2 and 3 blocks, 8 query heads on 2
    kv heads; stock sdpa with the dense mask runs beside it."""
    out = tmp_path / "band.json"
    _run(["bench/sliding_band.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    band = [r for r in rows if r["variant"] == "band"]
    assert len(band) == 2 and all("error" not in r for r in rows), rows
    for r in band:
        assert max(r["rel_err"].values()) < 1e-5, r


def test_adamw_bench_smoke(tmp_path):
    out = tmp_path / "adamw.json"
    _run(["bench/adamw.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    res = json.loads(out.read_text())
    rows = {r["impl"]: r for r in res["rows"]}
    assert set(rows) == {"torch-fused", "torch-foreach", "g4ops"}
    assert all(0 < r["ms"] < float("inf") for r in rows.values()), rows  # finite: NaN fails both comparisons
    assert res["check"]["passed"] is True and rows["g4ops"]["check_passed"] is True, res["check"]
    assert res["check"]["param"]["max_ulp"] <= 1 and res["model"]["parameters"] > 0


def test_lora_grad_error_smoke(tmp_path):
    """The diagnosis script of the CUDA LoRA gradient defect runs; on CPU (ATen's reference kernels) the norm patch
    stays within a few percent of stock's error."""
    proc = _run(["bench/lora_grad_error.py", "--device", "cpu", "--keep", "norm", "--targets", "q_proj,gate_proj"],
                tmp_path)  # fmt: skip
    ratios = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.strip().startswith("g4ops/stock")]
    assert len(ratios) == 5 and max(ratios) < 1.1, proc.stdout
    # every norm sent back to stock (all their names end in "norm"): no g4ops call is left, the errors are equal
    proc = _run(["bench/lora_grad_error.py", "--device", "cpu", "--keep", "norm", "--targets", "q_proj",
                 "--stock-norms", "norm"], tmp_path)  # fmt: skip
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("g4ops/stock")]
    assert len(rows) == 5 and all(r[3] == r[5] for r in rows), proc.stdout
    # each norm call replayed alone: on CPU g4ops' norm is stock's ATen code, so the errors agree within reordering
    proc = _run(["bench/lora_grad_error.py", "--device", "cpu", "--targets", "q_proj", "--per-call"], tmp_path)
    ratios = [float(line.split()[2]) for line in proc.stdout.splitlines() if line.strip().startswith("dx g4ops")]
    assert len(ratios) >= 5 and max(ratios) < 1.5, proc.stdout


def test_lora_grad_fused_check(tmp_path):
    """The prototype kernel for a LoRA projection's u and dB (bench/lora_grad_fused.py) against fp64, in Triton's
    interpreter on CPU: within an fp32 GEMM's error at ragged shapes, as today's split pair is (dropping the lo
    parts gives 8e-6, a skipped tile 0.6). Needs triton, which CI's CPU image lacks: it skips there."""
    pytest.importorskip("triton")
    out = tmp_path / "fused.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "bench/lora_grad_fused.py", "--check-only", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and {r["r"] for r in rows} == {4, 16, 24}, rows
    for row in rows:
        assert max(row["fused_err_u"], row["fused_err_db"]) < 1e-6, row
        assert max(row["split_err_u"], row["split_err_db"]) < 1e-6, row


def test_serve_smoke(tmp_path):
    """bench/serve.py saves a tiny checkpoint, launches `python -m g4ops serve` and then stock `transformers serve`
    on it (CPU), loads each at two concurrencies with the same text prompts, checks every request's token count (and
    g4ops' against its counter) and stops each with SIGTERM."""
    out = tmp_path / "serve.json"
    _run(["bench/serve.py", "--concurrency", "1,2", "--prompt-tokens", "12", "--output-tokens", "4", "--rounds", "1",
          "--baseline-args=--no-continuous-batching", "--out", str(out)], tmp_path)  # fmt: skip
    res = json.loads(out.read_text())
    assert [run["server"] for run in res["runs"]] == ["g4ops", "transformers"]
    for run in res["runs"]:
        assert [row["concurrency"] for row in run["levels"]] == [1, 2], run
        for row in run["levels"]:
            assert "error" not in row, (run["server"], row)
            assert row["requests"] == row["concurrency"] and row["output_tok_s"] > 0
            assert row["prompt_tokens"] == [12]  # 11 letters + BOS with the byte-level tokenizer, both servers
            assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"] and row["tpot_ms"]["n"] == row["requests"]
    assert res["runs"][0]["server_exit_code"] in (0, -15)  # SIGTERM: uvicorn stops cleanly, then re-raises it


def test_serve_plot(tmp_path):
    """bench/serve.py --plot-only draws saved results (matplotlib: the bench extra)."""
    pytest.importorskip("matplotlib")
    level = dict(concurrency=1, output_tok_s=10.0, tpot_ms=dict(p50=1.0, p99=2.0))
    results = dict(config=dict(shape="tiny-e4b", prompt_tokens=12, output_tokens=4), environment=dict(date="today"),
                   runs=[dict(server="g4ops", levels=[level, dict(level, concurrency=2)]),
                         dict(server="transformers", levels=[dict(concurrency=1, error="refused")])])  # fmt: skip
    (tmp_path / "serve.json").write_text(json.dumps(results))
    _run(["bench/serve.py", "--plot-only", str(tmp_path / "serve.json"), "--plot", str(tmp_path / "serve.png")],
         tmp_path)  # fmt: skip
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_smoke(tmp_path):
    """bench/sampling.py on the tiny model (fp32, CPU, every row in one process): the g4ops rows are routed, the
    stock rows are not, greedy tokens agree, seeded sampled calls repeat."""
    out = tmp_path / "sampling.json"
    _run(["bench/sampling.py", "--smoke", "--in-process", "--batches", "2", "--out", str(out)], tmp_path, timeout=480)
    res = json.loads(out.read_text())
    rows = {(r["variant"], r["row"], r["batch"]): r for r in res["rows"]}
    assert all("error" not in r and r["tok_s"] > 0 for r in rows.values()), rows
    for row in ("greedy-static", "default", "default-compiled"):
        assert rows[("g4ops", row, 2)]["routed"] and not rows[("stock", row, 2)]["routed"], row
    assert rows[("g4ops", "ttft", 1)]["routed"] and rows[("g4ops", "ttft", 1)]["ttft_ms"] > 0
    assert all(r["seed_reproduces"] for r in rows.values() if r["row"] != "greedy-static")
    same = [c for c in res["comparison"] if c["row"] == "greedy-static"]
    assert same and all(c["same_tokens_head"] for c in same)


def test_sampler_smoke(tmp_path):
    out = tmp_path / "sampler.json"
    _run(["bench/sampler.py", "--device", "cpu", "--smoke", "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:  # every variant ran and was timed (on CPU, the compiled one too)
        assert {k for k in r if k.endswith("_error")} == set(), r
        names = ("greedy", "card", "card-vocabulary", "card-compiled", "top-k-only", "op:sort")
        assert all(r[f"{name}_us"] > 0 for name in names)


def test_engine_bench_smoke(tmp_path):
    """bench/engine.py --smoke: the in-process load on the tiny model; every request got all its tokens."""
    out = tmp_path / "engine.json"
    _run(["bench/engine.py", "--smoke", "--out", str(out)], tmp_path)
    result = json.loads(out.read_text())
    assert [row["concurrency"] for row in result["load"]] == [1, 4]
    assert all(row["output_tok_s"] > 0 and row["requests"] == 2 * row["concurrency"] for row in result["load"])


def test_guard_time_smoke(tmp_path):
    """The guard-check timer runs both variants (Dynamo's guards, no kernels compiled: backend eager), each check
    passes on the step's own arguments, and g4ops adds no missing-attribute guard on a module."""
    out = tmp_path / "guards.json"
    _run(["bench/guard_time.py", "--layers", "2", "--lora", "4", "--backend", "eager", "--calls", "5",
          "--repeats", "2", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"stock", "g4ops"}
    assert all(r["guard_check_ms"] > 0 and r["guards"] > 0 for r in rows.values()), rows
    missing = {variant: row["missing_attribute_guards_on_modules"] for variant, row in rows.items()}
    if None in missing.values():  # torch 2.11's guard entries do not name the attribute a HASATTR guard tests
        assert torch_version() < (2, 13) and missing == {"stock": None, "g4ops": None}, missing
        return
    assert set(missing["g4ops"]) <= set(missing["stock"]), rows


def test_guard_time_graphed_takes_the_lora_ops_path(tmp_path):
    """--graphed 1 times the LoRA path of a compile that replays CUDA graphs (the ops, not the traced math), as the
    graphed headline step runs it: g4ops' step then carries fewer guards than on the traced path."""
    guards = {}
    for graphed in ("0", "1"):
        out = tmp_path / f"guards-{graphed}.json"
        _run(["bench/guard_time.py", "--layers", "2", "--lora", "4", "--backend", "eager", "--calls", "3",
              "--repeats", "1", "--variants", "g4ops", "--graphed", graphed, "--json", str(out)], tmp_path)  # fmt: skip
        result = json.loads(out.read_text())
        assert result["setup"]["graphed"] == int(graphed)
        guards[graphed] = result["rows"][0]["guards"]
    assert 0 < guards["1"] < guards["0"], guards


def test_guard_time_memo_times_a_full_finetunes_forward_call(tmp_path):
    """bench/guard_time.py --backend memo on the full finetune (no LoRA: the compiled frame is transformers'
    decorator wrapper, whose closure Dynamo guards on): the forward call's host time, the part before the graph
    within it, and the graph inputs counted."""
    out = tmp_path / "host.json"
    _run(["bench/guard_time.py", "--layers", "2", "--lora", "0", "--backend", "memo", "--calls", "3",
          "--repeats", "2", "--json", str(out)], tmp_path)  # fmt: skip
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"stock", "g4ops"}
    for row in rows.values():
        assert 0 < row["before_graph_ms"] < row["forward_call_ms"], row
        assert row["forward_graph_inputs"] > row["parameters"], row  # every weight, and the token ids


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_profile_steps_op_table_names_the_launching_op_and_its_shapes(monkeypatch):
    """`profile_steps.py --op-top`: a kernel's GPU time is charged to the ATen op that launched it, with that op's
    input shapes (how a vocabulary-sized fill or add in a training step is told apart from a layer's)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import profile_steps

    a, b = torch.randn(257, 129, device="cuda"), torch.randn(129, 65, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        torch.mm(a, b).add_(1.5)
        torch.cuda.synchronize()
    rows = profile_steps._op_table(prof, top=10)
    assert all(us > 0 for *_, us in rows), rows
    assert any(key == "aten::mm" and "[257, 129]" in shapes and "[129, 65]" in shapes for key, shapes, *_ in rows), rows
    assert any(key == "aten::add_" and "[257, 65]" in shapes for key, shapes, *_ in rows), rows


def test_profile_steps_census_counts_this_cases_graph_breaks_only(monkeypatch):
    """`profile_steps.py`'s census: a step with a graph break per call shows it, and a case starts from zero
    (torch._dynamo.reset() keeps the counters; `_profile` clears them)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import profile_steps
    from torch._dynamo.utils import counters

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    counters.clear()
    torch.compile(broken, backend="eager")(torch.randn(3))
    census = profile_steps._dynamo_counters()
    assert sum(census["graph_breaks"].values()) == 1, census
    assert census["frames"].get("ok", 0) >= 2, census  # the frame before the break and its resume function
    counters.clear()
    assert sum(profile_steps._dynamo_counters()["graph_breaks"].values()) == 0
    torch._dynamo.reset()


def test_profile_steps_charges_host_time_to_the_phase_that_spent_it(monkeypatch):
    """`profile_steps.py`'s phases: a synced step's host time per phase (forward call, backward call, zero_grad),
    which tells host work before the first kernel (the forward call) from work the GPU hides. A forward that sleeps
    and a backward hook that sleeps longer must show in their own phases, once per step."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import time

    import profile_steps

    forward_s, backward_s = 0.03, 0.06

    class Sleepy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(5, 3))

        def forward(self, x):
            time.sleep(forward_s)
            loss = (x @ self.weight).square().sum()
            loss.register_hook(lambda grad: time.sleep(backward_s))
            return type("Output", (), {"loss": loss})

    model = Sleepy()
    step = profile_steps.train_case(model, {"x": torch.randn(4, 5)}, compiled=False)
    for _ in range(3):
        step()
    assert set(step.phases) == {"forward call", "backward call", "zero_grad"}, step.phases
    assert all(len(times) == 3 for times in step.phases.values()), step.phases
    assert min(step.phases["forward call"]) >= forward_s, step.phases
    assert min(step.phases["backward call"]) >= backward_s, step.phases
    assert model.weight.grad is None  # zero_grad ran, and set the gradient to None


def test_lora_host_times_peft_and_the_g4ops_ops_it_routes_to(tmp_path):
    """bench/lora_host.py (the eager LoRA step's per-call host cost): a row per case and implementation, each timed,
    and the g4ops rows took g4ops' path (a projection routed to lora_linear, an MLP without a fallback reason)."""
    out = tmp_path / "lora-host.json"
    _run(["bench/lora_host.py", "--device", "cpu", "--warmup", "2", "--rounds", "2", "--calls", "3", "--json",
          str(out)], tmp_path)  # fmt: skip
    result = json.loads(out.read_text())
    rows = {(r["case"], r["impl"]): r for r in result["rows"]}
    assert set(rows) == {(case, impl) for case in ("q_proj", "mlp") for impl in ("peft", "g4ops")}, rows
    assert all(r["us_per_call"] > 0 for r in rows.values()), rows
    assert rows["q_proj", "g4ops"]["g4ops_path"] is True and rows["mlp", "g4ops"]["g4ops_path"] is True, rows
    assert "g4ops_path" not in rows["q_proj", "peft"]
