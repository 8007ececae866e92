"""End-to-end Gemma-4 benchmark: decode, finetune steps and parity, stock vs g4ops (and Liger / torch.compile) in one run.

    python bench/e2e.py --layers 42 --json $OUT/e2e.json                     # everything, E4B-shaped, on CUDA
    python bench/e2e.py --parts decode --layers 12 --batches 1               # one quick part
    python bench/e2e.py --device cpu --shape tiny-e4b --smoke                # seconds; what CI runs

Parts (`--parts`, comma-separated; default all):
  decode  Greedy decode at each `--batches` size. Variants:
          stock                 `model.generate(..., cache_implementation="static")`; transformers compiles the
                                static-cache decode step by itself on CUDA
          g4ops                 the same call with g4ops enabled, which routes it to g4ops.engine.decoder.Decoder on
                                CUDA (the row says whether it did)
          g4ops-graph[-compile] GreedyDecoder called directly, g4ops enabled (the whole step in one CUDA graph;
                                -compile compiles the step before capturing it)
          g4ops-graph-sdpa-compile  the same with the model's own (sdpa) attention in the step instead of
                                g4ops.decode_attention: what the decode attention gains
          stock-graph[-compile] the same with stock modules: do g4ops' ops help inside the graph?
          Each runs twice with `--decode-tokens` new tokens (the default 600 crosses position 512, the sliding
          window; the same length both times, so caches and graphs are reused): the first is the warm-up, the second
          is timed. Reported: tok/s of the timed call (batch x new tokens / seconds, prefill included); the warm-up's
          wall time (compilation included); for stock, the first fast token of the warm-up (the first of 8
          consecutive tokens each under 1.5x the timed per-token time, from a streamer's timestamps) and the seconds
          from process start to it (each variant runs in its own process on CUDA, see below); for the
          others, the end of the warm-up's capture or call (an upper bound: a streamer would make the routed
          generate fall back to stock).
  train   full finetune step at 1 x `--seqs` tokens, for each of `--variants`: stock (eager), stock-compile, liger
          (Liger-Kernel's `apply_liger_kernel_to_gemma4_text`, where importable), g4ops (eager, `g4ops.enable()`),
          g4ops-compile; and for each of `--optimizers`: none (fwd + bwd), adamw (+ torch.optim.AdamW, fused on
          CUDA), g4ops-adamw (+ g4ops.optim.AdamW). A variant's model is built and compiled once for all its
          optimizers, each starting from the initial weights. Reported: tok/s (median step), peak memory
          (max_memory_allocated, params, grads and optimizer state included), the first loss (checked against stock
          eager's with the same optimizer before any timing counts), and `back_to_back_tok_s`: `--steps` more steps
          with no sync between them (the host's per-step work then overlaps the GPU's; a synced step exposes it). A
          variant that runs out of memory is reported as OOM and the run goes on.
          `--g4ops-attention`: the g4ops variants also run g4ops attention (`enable(model, attention=True)`);
          `--sliding stock` keeps its sliding layers on stock SDPA instead of FlexAttention (compiled CUDA only);
          `--sliding flex-masked` also runs those of padded and packed batches on FlexAttention with their mask.
          `--lora R`: every variant trains peft LoRA adapters of rank R (alpha 2R, dropout 0, peft's init) on
          q/k/v/o/gate/up/down with the base weights frozen, instead of a full finetune (name the `--json` file
          with "lora"). The g4ops rows record `lora_mlp_fallback`: empty when every MLP runs g4ops' fused LoRA
          path (g4ops/hf/peft_lora.py), else why not.
          `--compile-mode reduce-overhead`: the *-compile variants replay each step from CUDA graphs (Inductor's
          graph trees; the step marks its start with torch.compiler.cudagraph_mark_step_begin); rows record
          `cudagraph_skips`, the graphs Inductor left uncaptured (TORCH_LOGS=perf_hints says why).
          `--autocast bf16`: each step's forward under torch.autocast, as HF Trainer's and TRL's bf16=True run it
          (over fp32 weights with `--dtype fp32`, as TRL loads them).
          `--grad-ckpt`: transformers' gradient checkpointing on every variant (use_reentrant=False); with long
          `--seqs`, the longest sequence that trains is the longest row without "OOM".
          `--layout`: `single` (one sequence of `--seqs` tokens, the default), `padded` (a batch of 4 sequences
          of seq/4 x (1, 7/8, 3/4, 5/8) tokens, right-padded to seq/4, attention_mask and -100 labels on the
          padding) or `packed` (the same 4 sequences in one row, position_ids restarting at each, the first label of
          each -100, as transformers' DataCollatorWithFlattening and TRL's padding-free packing give them). tok/s
          counts real tokens, so padded and packed rows compare directly (each row records `real_tokens`). Both pass
          use_cache=False, as a trainer's step should: with a cache, transformers builds no packed mask and the
          packed sequences see each other (tests/test_packing.py; on the tiny model in fp32 stock's packed loss was
          6.2725 with the cache, where each sequence alone gives 6.2803).
  parity  bf16: stock greedy decode of `--parity-tokens`, then teacher-forced top-1 agreement of g4ops with stock
          over that sequence; g4ops' own greedy decode and its first divergence from stock, with the stock and
          g4ops top-1/top-2 logit margins there. Noise floor: the same bf16 weights cast to fp32 (stock modules) give
          the truth's teacher-forced argmaxes on that sequence; reported are the top-1 agreements with it of stock
          bf16, of g4ops bf16 and of stock's greedy tokens, and both max |logit diff|s from it (a deep random-weight
          model amplifies bf16 rounding, so g4ops-vs-stock is judged against stock-vs-fp32, not against 1.0).
          fp32 (`--fp32-layers` layers): greedy tokens of g4ops identical to stock's. Both dtypes also check
          GreedyDecoder's tokens against stock (graph_decoder rows).

On the lent GPU (10-minute calls), split the run; stock's static-cache compile alone takes about 200 s at 42 layers.
On CUDA every decode variant and batch size runs in its own child process (`--decode-processes each`, the default
there): on the H200 a 42-layer g4ops `generate` ran at 0.09x when a compiled 42-layer stock model had run before it
in the same process, and at stock's speed alone (bench/results/2026-11-29-h200-session3-decode.md; not explained
yet). Stock's 200 s compile and ours still share one 10-minute call only at one batch size:
    python bench/e2e.py --parts train --seqs 2048 --json $OUT/e2e_train2k.json
    python bench/e2e.py --parts train --seqs 8192 --json $OUT/e2e_train8k.json
    python bench/e2e.py --parts decode --batches 1 --decode-variants stock,g4ops --json $OUT/e2e_decode1.json
    python bench/e2e.py --parts parity --json $OUT/e2e_parity.json
Liger-Kernel is measured where `import liger_kernel` works (0.8.5 has `apply_liger_kernel_to_gemma4_text`, used
here); otherwise its rows say why they are missing.

`--merge A.json B.json ...` runs nothing: it joins the train rows of files this script wrote, one variant each (as
bench/gpu_round.sh's `e2e-each` stage writes them, each variant in its own process of one call), into one table with
each row's tok/s and first loss against the `--merge-reference` variant's row of the same workload (default
stock-compile). Files from different GPUs or torch/transformers versions are refused: ratios compare within one call.
g4ops' switches are environment variables (G4OPS_LORA_SPLIT=1, G4OPS_LORA_COMPILE=0, ...): the file's meta records
the ones set (`g4ops_env`), and so does each g4ops row, which the tables then label (`g4ops [G4OPS_LORA_SPLIT=1]`);
so one call can compare g4ops under two settings, one process each.
`--timing-turns DIR` lets such processes start side by side: they compile together and time one at a time
(`TimingTurns`), so a call pays the longest 42-layer compile instead of their sum.

`--model PATH` runs any part on a local checkpoint (its own layer count, in fp32 too) instead of random weights;
`--prompt TEXT` then gives decode and parity a real prompt by its tokenizer. A trained model's top-1/top-2 margins
are what the 0.99 parity target assumes (bench/results/2026-11-29-h200-session5-train42.md).

Every model is rebuilt from the same seed for each variant (a full E4B builds on the GPU in about a second), so
variants do not share patched modules or optimizer memory; dynamo's caches are reset between variants, which did
not isolate the decode variants above. The table goes to stdout, all numbers to
`--json`.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before torch/transformers imports: "time from process start"


import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import traceback
from pathlib import Path

import torch

import g4ops
from g4ops.models import build_model, load_checkpoint, load_tokenizer, special_tokens, text_config
from g4ops.ops._torch_version import torch_version
from g4ops.ops.attention import MASKED_FLEX_MIN_TORCH

VARIANTS = ("stock", "stock-compile", "liger", "g4ops", "g4ops-compile")
DECODE_VARIANTS = ("stock", "g4ops", "g4ops-graph", "g4ops-graph-compile", "g4ops-graph-sdpa-compile", "stock-graph",
                   "stock-graph-compile")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def model_for(args, dtype=None, layers=None):
    """A fresh model: the `--model` checkpoint (all its layers), else `--shape` with random weights."""
    torch._dynamo.reset()
    free(args.device)
    if args.model:
        return load_checkpoint(args.model, dtype=dtype or DTYPES[args.dtype], device=args.device)
    return build_model(
        args.shape, num_layers=layers if layers is not None else args.layers, dtype=dtype or DTYPES[args.dtype],
        device=args.device, seed=args.seed,
    )


def random_ids(args, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if args.model:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model, local_files_only=True).get_text_config().vocab_size
    else:
        vocab = text_config(args.shape).vocab_size
    return torch.randint(3, vocab, (batch, length), generator=gen).to(args.device)


def prompt_ids(args, batch: int, seed: int) -> torch.Tensor:
    """`--prompt` by the checkpoint's tokenizer (a trained model's real margins), else `--prompt-len` random ids."""
    if not args.prompt:
        return random_ids(args, batch, args.prompt_len, seed)
    ids = load_tokenizer(args.model)(args.prompt, return_tensors="pt").input_ids
    return ids.repeat(batch, 1).to(args.device)


@contextlib.contextmanager
def g4ops_on(enabled: bool):
    if not enabled:
        yield
        return
    g4ops.enable()
    try:
        yield
    finally:
        g4ops.disable()
        torch._dynamo.reset()


def liger_patch():
    """Liger-Kernel's Gemma-4 text patch if importable: (apply(model), undo(), version) or raises ImportError."""
    import liger_kernel
    from liger_kernel.transformers import monkey_patch
    from transformers.models.gemma4 import modeling_gemma4

    apply = getattr(monkey_patch, "apply_liger_kernel_to_gemma4_text", None)
    if apply is None:
        raise ImportError(f"liger_kernel {getattr(liger_kernel, '__version__', '?')} has no Gemma-4 text patch")
    # It swaps module-level classes (Gemma4RMSNorm, Gemma4TextMLP) besides patching the instance: put them back.
    saved = {name: getattr(modeling_gemma4, name) for name in ("Gemma4RMSNorm", "Gemma4TextMLP")}
    saved_forward = modeling_gemma4.Gemma4ForCausalLM.forward

    def undo():
        for name, value in saved.items():
            setattr(modeling_gemma4, name, value)
        modeling_gemma4.Gemma4ForCausalLM.forward = saved_forward

    version = getattr(liger_kernel, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v

        version = _v("liger-kernel")
    return (lambda model: apply(model=model)), undo, version


# ----------------------------------------------------------------------------------------------------------------
# decode


class TokenClock:
    """A generate() streamer that only timestamps: put() gets the prompt once, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def first_fast_token(times: list[float], fast_gap: float, run: int = 8) -> int | None:
    """Index (in new tokens) of the first token after which `run` consecutive gaps are all under 1.5x the steady
    per-token time `fast_gap`: where compilation and CUDA-graph recording are over."""
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # times[0]: the prompt; times[1]: first new token
    for i in range(len(gaps) - run + 1):
        if all(g < 1.5 * fast_gap for g in gaps[i:i + run]):
            return i + 1  # the token at times[i + 1] is the first one of the fast run
    return None


def bench_decode(args, results):
    if args.decode_processes == "each" and len(args.batches) * len(args.decode_variants) > 1:
        rows = [row for batch in args.batches for variant in args.decode_variants
                for row in decode_in_child(args, batch, variant)]  # fmt: skip
    else:
        rows = decode_rows(args)
    for batch in args.batches:
        by_variant = {r["variant"]: r for r in rows if r["batch"] == batch and "tok_s" in r}
        stock = by_variant.get("stock")
        for name, row in by_variant.items():
            if stock is not None and name != "stock":
                row["speedup_vs_stock"] = row["tok_s"] / stock["tok_s"]
                row["same_tokens_head"] = row["tokens_head"] == stock["tokens_head"]
    results["decode"] = rows


def decode_in_child(args, batch: int, variant: str) -> list[dict]:
    """One decode variant at one batch size in a fresh Python process (`--decode-processes each`): on the H200 a
    42-layer g4ops `generate` ran at 0.09x after a compiled stock model in the same process, and at stock's speed
    alone (bench/results/2026-11-29-h200-session3-decode.md). Its "from process start" times are its own."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/decode.json"
        cmd = [sys.executable, __file__, "--parts", "decode", "--decode-processes", "shared", "--json", out,
               "--batches", str(batch), "--decode-variants", variant, "--device", args.device, "--shape", args.shape,
               "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens),
               "--seed", str(args.seed)]  # fmt: skip
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        if args.model:
            cmd += ["--model", args.model] + (["--prompt", args.prompt] if args.prompt else [])
        code = subprocess.run(cmd).returncode
        try:
            with open(out) as f:
                child = json.load(f)
        except (OSError, ValueError):
            child = {}
    rows = child.get("decode") or [dict(part="decode", variant=variant, batch=batch, new_tokens=args.decode_tokens,
                                        error=child.get("errors", {}).get("decode", f"child process exit {code}"))]
    for row in rows:
        row["process"] = "own"
    return rows


def decode_rows(args) -> list[dict]:
    """Every decode variant at every batch size, in this process."""
    rows = []
    for batch in args.batches:
        prompt = prompt_ids(args, batch, seed=args.seed + 100 + batch)
        for variant in args.decode_variants:
            row = dict(part="decode", variant=variant, batch=batch, new_tokens=args.decode_tokens)
            state = {}
            try:
                with g4ops_on(variant.startswith("g4ops")):
                    state["model"] = model = model_for(args)
                    if "-graph" in variant:
                        row.update(decode_graphed(args, model, prompt, variant.endswith("compile"),
                                                  decode_attention="-sdpa" not in variant))
                    else:
                        # Same max_new_tokens in both calls: the static cache (and so the compiled step) has one size.
                        # min_new_tokens keeps random weights from stopping at EOS.
                        kw = dict(
                            do_sample=False, cache_implementation="static",
                            pad_token_id=special_tokens(model).pad_token_id,
                            attention_mask=torch.ones_like(prompt), max_new_tokens=args.decode_tokens,
                            min_new_tokens=args.decode_tokens,
                        )
                        # A streamer makes g4ops' generate fall back to stock (it has no per-token host step), so
                        # only stock's warm-up is timestamped per token.
                        clock = TokenClock() if variant == "stock" else None
                        t = time.perf_counter()
                        with torch.no_grad():
                            model.generate(prompt, streamer=clock, **kw)  # warm-up: compiles, crosses the window
                        sync(args.device)
                        row["warmup_s"] = time.perf_counter() - t
                        if clock is None:  # upper bound: the end of the warm-up call
                            row["first_fast_token_since_process_start_s"] = time.perf_counter() - _T0
                            row["routed_to_decoder"] = "_g4ops_decoder" in vars(model)
                        t = time.perf_counter()
                        with torch.no_grad():
                            state["out"] = out = model.generate(prompt, **kw)
                        sync(args.device)
                        dt = time.perf_counter() - t
                        new = out.shape[1] - prompt.shape[1]
                        row.update(seconds=dt, tok_s=batch * new / dt, final_position=int(out.shape[1]))
                        row["tokens_head"] = out[0, prompt.shape[1]:prompt.shape[1] + 16].tolist()
                        idx = first_fast_token(clock.times, dt / new) if clock is not None else None
                        if idx is not None:
                            row["first_fast_token"] = idx
                            row["first_fast_token_since_generate_s"] = clock.times[idx] - clock.times[0]
                            row["first_fast_token_since_process_start_s"] = clock.times[idx] - _T0
            except Exception as exc:  # noqa: BLE001 - report and go on
                row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            finally:
                state.clear()
                model = out = None
                free(args.device)
            rows.append(row)
            print_row(row)
    return rows


def decode_graphed(args, model, prompt, compile_step: bool, decode_attention: bool = True) -> dict:
    """g4ops' CUDA-graphed greedy decoder: build + capture (timed as the warm-up), then the timed generate."""
    from g4ops.engine.decoder import GreedyDecoder

    batch, n = prompt.shape
    t = time.perf_counter()
    decoder = GreedyDecoder(model, batch_size=batch, max_length=n + args.decode_tokens, compile=compile_step,
                            decode_attention=decode_attention)
    decoder.generate(prompt, 2)  # captures the step graph (compiling it first for -compile)
    sync(args.device)
    ready = time.perf_counter()
    decoder.generate(prompt, args.decode_tokens)  # a full warm-up run, as the generate() variants get
    sync(args.device)
    row = dict(warmup_s=time.perf_counter() - t, first_fast_token_since_process_start_s=ready - _T0,
               first_fast_token_since_generate_s=ready - t)
    t = time.perf_counter()
    out = decoder.generate(prompt, args.decode_tokens)
    sync(args.device)
    dt = time.perf_counter() - t
    new = out.shape[1] - n
    row.update(seconds=dt, tok_s=batch * new / dt, final_position=int(out.shape[1]),
               tokens_head=out[0, n:n + 16].tolist())
    return row


# ----------------------------------------------------------------------------------------------------------------
# train


OPTIMIZERS = ("none", "adamw", "g4ops-adamw")


def make_optimizer(name: str, model, device: str):
    """None (fwd + bwd only), torch's AdamW (fused on CUDA, its fastest), or g4ops.optim.AdamW; same settings."""
    if name == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=device.startswith("cuda"))
    return g4ops.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


LAYOUT_FRACTIONS = (1.0, 0.875, 0.75, 0.625)  # padded / packed: the 4 sequences' lengths, in units of seq/4


def train_batch(args, seq: int) -> dict:
    """The model inputs of one train step for `--layout` (labels included) and its real (non-padding) tokens."""
    if args.layout == "single":
        ids = random_ids(args, 1, seq, seed=args.seed + seq)
        return dict(input_ids=ids, labels=ids), ids.numel()
    width = seq // len(LAYOUT_FRACTIONS)
    lengths = [max(2, int(width * f)) for f in LAYOUT_FRACTIONS]
    seqs = [random_ids(args, 1, n, seed=args.seed + seq + i)[0] for i, n in enumerate(lengths)]
    if args.layout == "padded":
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=args.device)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):
            ids[row, : s.numel()], mask[row, : s.numel()] = s, 1
        labels = ids.masked_fill(mask == 0, -100)
        return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False), int(mask.sum())
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(s.numel(), device=args.device) for s in seqs])[None]
    labels = ids.masked_fill(position_ids == 0, -100)  # no prediction across a sequence boundary
    return dict(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False), ids.numel()


def lora_model(model, rank: int):
    """peft LoRA of `rank` on every Gemma-4 text projection, as a LoRA finetune sets it up (base weights frozen)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS,
                             task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(model, config)


def add_sliding_arg(parser) -> None:
    """`--sliding`, the g4ops attention's sliding-layer path (this script's and profile_steps.py's)."""
    parser.add_argument("--sliding", choices=["flex", "stock", "flex-masked"], default="flex",
                        help="with g4ops attention, compiled on CUDA: sliding layers on FlexAttention or stock SDPA; "
                             "flex-masked: also those of padded and packed batches (MASKED_SLIDING_VIA_FLEX)")
    parser.add_argument("--flex-options", type=json.loads, default=None, metavar="JSON",
                        help="FlexAttention kernel options for the sliding layers, e.g. '{\"bwd_num_warps\": 8}' "
                             "(g4ops.ops.attention.SLIDING_FLEX_KERNEL_OPTIONS); '{}': Inductor's defaults; unset: "
                             "g4ops' own choice")


def check_sliding_arg(parser, choice: str) -> None:
    """flex-masked on a torch where the integration refuses it would time stock SDPA under its name."""
    if choice == "flex-masked" and torch_version() < MASKED_FLEX_MIN_TORCH:
        parser.error(f"--sliding flex-masked: torch {torch.__version__} keeps masked sliding layers on stock SDPA "
                     "(g4ops.ops.attention.MASKED_FLEX_MIN_TORCH): the rows would not time FlexAttention")


def use_sliding(choice: str, flex_options: dict | None = None) -> None:
    """Set g4ops' sliding-layer switches for a `--sliding` choice and `--flex-options`."""
    g4ops.hf.attention_interface.SLIDING_VIA_FLEX = choice != "stock"
    g4ops.hf.attention_interface.MASKED_SLIDING_VIA_FLEX = choice == "flex-masked"
    g4ops.ops.attention.SLIDING_FLEX_KERNEL_OPTIONS = flex_options


def step_autocast(args):
    """torch.autocast to `--autocast`'s dtype around a step's forward, or a context that does nothing."""
    return torch.autocast(torch.device(args.device).type, dtype=DTYPES[args.autocast or "bf16"],
                          enabled=args.autocast is not None)  # fmt: skip


def loss_matches(loss: float, reference: float, tol: float) -> bool:
    """A first loss equals the reference's within `tol` relative (bf16 model: the loss is a mean of seq terms, each
    off by a few bf16 ulps of the logits)."""
    return abs(loss - reference) <= tol * max(1.0, abs(reference))


def train_variant(args, variant: str, seq: int, batch: dict, real_tokens: int) -> list[dict]:
    """One row per `--optimizers` entry, all on one model built and compiled once (a 42-layer compile takes
    minutes; the forward + backward graph does not depend on the optimizer). Each optimizer starts from the initial
    weights (restored from a host copy) and its state is freed before the next, so its peak memory is its own."""
    liger_undo = None
    state = {}  # everything big, dropped in `finally` even when a step ran out of memory
    rows = []
    use_g4ops, compiled = variant.startswith("g4ops"), variant.endswith("compile")
    common = dict(part="train", variant=variant, seq=seq, layout=args.layout, real_tokens=real_tokens)
    switches = g4ops_switches()
    if use_g4ops and switches:
        common["g4ops_env"] = switches
    try:
        with g4ops_on(use_g4ops):
            state["model"] = model = model_for(args).train()
            if use_g4ops and args.g4ops_attention:
                g4ops.enable(model, attention=True)  # also switch its attention to g4ops' implementation
                use_sliding(args.sliding, args.flex_options)
                on_flex = compiled and args.device.startswith("cuda")
                common["sliding"] = args.sliding if on_flex else "stock"
            common["attention"] = model.config._attn_implementation
            if args.autocast:
                common["autocast"] = args.autocast
            if args.grad_ckpt:  # before peft wraps it, as a LoRA finetune turns it on
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                common["grad_ckpt"] = True
            if variant == "liger":
                apply, liger_undo, version = liger_patch()
                apply(model)
                common["liger_version"] = version
            if args.lora:
                state["model"] = model = lora_model(model, args.lora)
                common["lora_r"] = args.lora
                if use_g4ops and args.lora_attention == "g4ops":  # after peft: its attention projections' layers
                    g4ops.enable(model)  # now exist, and enable(model) routes them to g4ops.lora_linear
                if use_g4ops:  # asked outside the compiled step, whose trace does not log
                    # projections that run g4ops' LoRA math in this step: eager steps run peft's forward on them
                    # unless g4ops.hf.peft_lora.EAGER_LINEAR_VIA_OP (G4OPS_LORA_EAGER_LINEAR=op)
                    routed = sum(map(g4ops.hf.peft_lora.runs_lora_linear, model.modules()))
                    via_lora_linear = compiled or g4ops.hf.peft_lora.EAGER_LINEAR_VIA_OP
                    common["lora_linear_projections"] = routed if via_lora_linear else 0
                    mlps = [m for m in model.modules() if type(m).__name__ == "Gemma4TextMLP"]
                    with step_autocast(args):  # the fallback reasons the step's own forward would meet
                        reasons = {g4ops.hf.peft_lora.fallback_reason(m) for m in mlps}
                        common["lora_mlp_fallback"] = sorted(reasons - {None})
            if compiled and args.compile_mode != "default":
                common["compile_mode"] = args.compile_mode
            if compiled and args.dict_tag_guards:
                common["dict_tag_guards"] = True
            state["step_model"] = step_model = torch.compile(model, mode=args.compile_mode) if compiled else model
            if any(o != "none" for o in args.optimizers):
                state["initial"] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
            for optimizer in args.optimizers:
                rows.append(dict(common, optimizer=optimizer))
                measure_optimizer_row(args, model, step_model, optimizer, batch, real_tokens, state, rows[-1])
                if use_g4ops and "error" not in rows[-1]:  # the kernels load on first use
                    rows[-1]["g4ops_kernels_loaded"] = g4ops.kernel_status()["loaded"]
    except Exception as exc:  # noqa: BLE001 - report (one row per optimizer not measured) and go on
        error = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {exc}"
        rows += [dict(common, optimizer=o, error=error) for o in args.optimizers[len(rows):]]
        if not is_oom(exc) and not isinstance(exc, ImportError):
            traceback.print_exc()
    finally:
        if liger_undo is not None:
            liger_undo()
        state.clear()
        model = step_model = None
        torch._dynamo.reset()
        free(args.device)
    return rows


class TimingTurns:
    """`--timing-turns DIR`: variant processes of one call that run side by side (gpu_round.sh's e2e-each with
    E2E_PARALLEL=1) compile and warm up together, then take their timed steps one at a time. A 42-layer compile is
    minutes of host work that barely uses the GPU, so overlapping them shortens a call by the shorter compiles;
    timing alone keeps each step's numbers its own. Each process waits until all `--timing-parties` are warmed up
    (or have exited, or `--timing-wait-s` passed), then holds an exclusive lock on DIR/lock until it exits, so
    every later step of its own (other optimizers' rows too) runs alone. Rows record when their timed steps ran."""

    def __init__(self, directory: str, parties: int, wait_s: float):
        self.dir, self.parties, self.wait_s = Path(directory), parties, wait_s
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"joined-{os.getpid()}").touch()
        self.lock = None  # the open lock file once this process has its turn (released when the process exits)

    def _settled(self) -> bool:
        """All parties are warmed up or gone (a party that failed before warming up must not stall the others)."""
        ready = {p.name.split("-", 1)[1] for p in self.dir.glob("ready-*")}
        joined = {p.name.split("-", 1)[1] for p in self.dir.glob("joined-*")}
        gone = {pid for pid in joined - ready if not _alive(int(pid))}
        return len(ready | gone) >= self.parties

    def take(self, row: dict) -> None:
        """Blocks until this process may time alone; notes the wait in `row`. Once per process."""
        if self.lock is not None:
            return
        import fcntl

        if torch.cuda.is_initialized():  # hand this process's cached blocks back while others warm up and time
            torch.cuda.empty_cache()
        (self.dir / f"ready-{os.getpid()}").touch()
        start = time.time()
        while not self._settled() and time.time() - start < self.wait_s:
            time.sleep(0.5)
        row["timing_turn"] = dict(parties=self.parties, all_ready=self._settled())
        self.lock = open(self.dir / "lock", "w")  # noqa: SIM115 - held for the rest of the process
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        row["timing_turn"]["waited_s"] = time.time() - start


def add_timing_turns_args(parser) -> None:
    """`--timing-turns` and its two companions (this script's and profile_steps.py's)."""
    parser.add_argument("--timing-turns", default=None, metavar="DIR",
                        help="train: processes started side by side with the same DIR (a new one for each run: files "
                             "left by an earlier run count as parties) compile together and time one at a time "
                             "(TimingTurns; gpu_round.sh E2E_PARALLEL=1)")
    parser.add_argument("--timing-parties", type=int, default=1,
                        help="with --timing-turns: how many processes share it")
    parser.add_argument("--timing-wait-s", type=float, default=900.0,
                        help="with --timing-turns: the longest wait for the other parties to warm up")


def timing_turns(args) -> TimingTurns | None:
    return TimingTurns(args.timing_turns, args.timing_parties, args.timing_wait_s) if args.timing_turns else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def measure_optimizer_row(args, model, step_model, optimizer: str, batch: dict, real_tokens: int, state: dict,
                          row: dict):  # fmt: skip
    """Fills `row`: first step (compilation included for the first optimizer of a compiled variant), first loss,
    median step time of `--steps` after `--warmup-steps`, peak memory; or the error."""
    try:
        if "initial" in state:
            with torch.no_grad():
                for p, saved in zip(model.parameters(), state["initial"]):
                    p.copy_(saved)
        state["opt"] = opt = make_optimizer(optimizer, model, args.device)
        graphed = args.compile_mode == "reduce-overhead" and step_model is not model
        skips_before = cudagraph_skips()

        def step():
            if graphed:  # a new training iteration: the graphs' outputs of the last one may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with step_autocast(args):
                loss = step_model(**batch).loss
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
            return loss.detach()

        free(args.device)
        reset_peak(args.device)
        t = time.perf_counter()
        first = step()  # on the initial weights: the parity check in bench_train
        sync(args.device)
        row["first_step_s"] = time.perf_counter() - t  # compilation included for the first compiled row
        row["first_loss"] = float(first)
        row["warmup_steps_s"] = []  # a recompile after the first call shows here (it cost minutes at 42 layers)
        for _ in range(args.warmup_steps - 1):
            t = time.perf_counter()
            step()
            sync(args.device)
            row["warmup_steps_s"].append(time.perf_counter() - t)
        if args.timing_turns is not None:
            args.turns.take(row)
        row["timed_from"] = time.time()  # wall clock: the timed steps of processes taking turns never overlap
        times = []
        for _ in range(args.steps):
            sync(args.device)
            t = time.perf_counter()
            step()
            sync(args.device)
            times.append(time.perf_counter() - t)
        median = statistics.median(times)
        row.update(step_s=median, tok_s=real_tokens / median, peak_gib=peak_gib(args.device),
                   steps_s=[round(x, 5) for x in times])  # the spread behind the median
        # The same steps back to back, one sync at the end, as a loop that never waits for the GPU runs them: the
        # host's work before a step's first kernel then overlaps the last step's GPU work. tok_s above (a sync
        # around each step) is the headline; the difference is host time that a synced step exposes.
        sync(args.device)
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(args.device)
        row["back_to_back_tok_s"] = real_tokens * args.steps / (time.perf_counter() - t)
        row["timed_to"] = time.time()
        if graphed:  # did the step really replay CUDA graphs? Inductor counts each graph it left uncaptured
            row["cudagraph_skips"] = cudagraph_skips() - skips_before
    except Exception as exc:  # noqa: BLE001 - report and go on with the next optimizer
        row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {exc}"
        if not is_oom(exc) and not isinstance(exc, ImportError):
            traceback.print_exc()
    finally:
        state.pop("opt", None)
        opt = None
        model.zero_grad(set_to_none=True)
        free(args.device)


def cudagraph_skips() -> int:
    """Inductor's count of compiled graphs it did not capture as CUDA graphs (`TORCH_LOGS=perf_hints` says why)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def bench_train(args, results):
    rows = results["train"] = []
    for seq in args.seqs:
        batch, real_tokens = train_batch(args, seq)
        stock = {}  # optimizer -> stock eager's row: the loss reference and the speedup's denominator
        for variant in args.variants:
            for row in train_variant(args, variant, seq, batch, real_tokens):
                optimizer = row.get("optimizer")
                if variant == "stock" and "first_loss" in row:
                    stock[optimizer] = row
                ref = stock.get(optimizer)
                if ref is not None and "first_loss" in row and variant != "stock":
                    row["loss_matches_stock"] = loss_matches(row["first_loss"], ref["first_loss"], args.loss_tol)
                    if "tok_s" in row and "tok_s" in ref:
                        row["speedup_vs_stock"] = row["tok_s"] / ref["tok_s"]
                rows.append(row)
                print_row(row)
            write_json(args, results)  # a 42-layer compile takes minutes: a timeout keeps the rows so far


# ----------------------------------------------------------------------------------------------------------------
# parity


@torch.no_grad()
def greedy(model, prompt, n):
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=special_tokens(model).pad_token_id,
                         attention_mask=torch.ones_like(prompt))
    return out[0, prompt.shape[1]:]


@torch.no_grad()
def teacher_forced_logits(model, seq):
    return model(input_ids=seq).logits[0].float()


def margin(logits_row) -> float:
    top = torch.topk(logits_row, 2).values
    return float(top[0] - top[1])


def suppress_eos(logits: torch.Tensor, eos) -> None:
    """What greedy's min_new_tokens does to the EOS logits, so teacher-forced argmaxes are judged alike."""
    logits[:, torch.as_tensor(eos if isinstance(eos, (list, tuple)) else [eos], dtype=torch.long)] = -math.inf


@torch.no_grad()
def graph_greedy(model, prompt, n):
    from g4ops.engine.decoder import GreedyDecoder

    decoder = GreedyDecoder(model, batch_size=1, max_length=prompt.shape[1] + n)
    out = decoder.generate(prompt, n, eos_token_id=special_tokens(model).eos_token_id, min_new_tokens=n)
    return out[0, prompt.shape[1]:]  # as `greedy`: min_new_tokens = n


def graph_report(model, prompt, graph_tokens, stock_tokens, dtype) -> dict:
    """GreedyDecoder vs stock: first divergence from stock's greedy tokens, and on the decoder's own sequence, how
    often its token is stock's teacher-forced argmax and by how much stock prefers its own top-1 where not."""
    p = prompt.shape[1]
    logits = teacher_forced_logits(model, torch.cat([prompt[0], graph_tokens]).unsqueeze(0))[p - 1:-1]
    suppress_eos(logits, special_tokens(model).eos_token_id)
    chosen = logits.gather(-1, graph_tokens[:, None]).squeeze(-1)
    diverge = (graph_tokens != stock_tokens).nonzero()
    rep = dict(dtype=dtype, tokens=int(graph_tokens.numel()),
               first_divergence_from_stock_greedy=int(diverge[0]) if diverge.numel() else None,
               stock_teacher_forced_agreement=float((logits.argmax(-1) == graph_tokens).float().mean()),
               max_stock_logit_shortfall=float((logits.max(-1).values - chosen).max()))
    print(f"parity graph decoder {dtype}: {json.dumps(rep)}")
    return rep


def bench_parity(args, results):
    prompt = prompt_ids(args, 1, seed=args.seed + 7)
    p = prompt.shape[1]
    report = {"prompt_tokens": p}
    # bf16 (the model dtype of the run)
    model = model_for(args).eval()
    layers = model.config.get_text_config().num_hidden_layers
    stock_tokens = greedy(model, prompt, args.parity_tokens)
    seq = torch.cat([prompt[0], stock_tokens]).unsqueeze(0)
    stock_logits = teacher_forced_logits(model, seq)
    with g4ops_on(True):
        ours_logits = teacher_forced_logits(model, seq)
        ours_tokens = greedy(model, prompt, args.parity_tokens)
        graph_tokens = graph_greedy(model, prompt, args.parity_tokens)
    report["graph_decoder"] = graph_report(model, prompt, graph_tokens, stock_tokens, args.dtype)
    eos = special_tokens(model).eos_token_id
    # Noise floor: the same weights in fp32, stock modules. A deep random-weight model can amplify bf16 rounding
    # until any two bf16 implementations disagree; agreement of stock bf16 itself with this truth says how much
    # agreement to expect. In place: bf16 -> fp32 is exact, and the bf16 model is not needed any more.
    model.float()
    truth_logits = teacher_forced_logits(model, seq)
    del model
    free(args.device)
    max_abs_logit_diff = float((stock_logits - ours_logits).abs().max())
    stock_vs_fp32_max_abs_logit_diff = float((stock_logits - truth_logits).abs().max())
    g4ops_vs_fp32_max_abs_logit_diff = float((ours_logits - truth_logits).abs().max())
    # greedy ran with min_new_tokens (EOS suppressed, so random weights do not stop early): judge the teacher-forced
    # logits the same way
    for logits in (stock_logits, ours_logits, truth_logits):
        suppress_eos(logits, eos)
    # positions p-1 .. end-1 predict the generated tokens
    s_top = stock_logits[p - 1:-1].argmax(-1)
    o_top = ours_logits[p - 1:-1].argmax(-1)
    t_top = truth_logits[p - 1:-1].argmax(-1)
    del truth_logits
    agree = (s_top == o_top).float().mean().item()
    diverge = (ours_tokens != stock_tokens).nonzero()
    first = int(diverge[0]) if diverge.numel() else None
    bf = dict(
        dtype=args.dtype, layers=layers, tokens=int(stock_tokens.numel()),
        teacher_forced_top1_agreement=agree,
        stock_vs_fp32_top1_agreement=(s_top == t_top).float().mean().item(),
        g4ops_vs_fp32_top1_agreement=(o_top == t_top).float().mean().item(),
        # stock's cached greedy tokens judged by the fp32 truth, as its teacher-forced argmaxes are above
        stock_greedy_vs_fp32_agreement=(stock_tokens == t_top).float().mean().item(),
        stock_greedy_matches_teacher_forced=bool((s_top == stock_tokens).all()),
        first_greedy_divergence=first,
        max_abs_logit_diff=max_abs_logit_diff,
        stock_vs_fp32_max_abs_logit_diff=stock_vs_fp32_max_abs_logit_diff,
        g4ops_vs_fp32_max_abs_logit_diff=g4ops_vs_fp32_max_abs_logit_diff,
    )
    if first is not None:
        row = p - 1 + first
        # both margins on the same (stock) prefix: the teacher-forced row that predicts the diverging token
        bf.update(stock_margin_at_divergence=margin(stock_logits[row]),
                  g4ops_margin_at_divergence=margin(ours_logits[row]))
    report["teacher_forced"] = bf
    print(f"parity {args.dtype}: teacher-forced top-1 agreement {agree:.4f} over {bf['tokens']} tokens (noise floor, "
          f"vs the same weights in fp32: stock {bf['stock_vs_fp32_top1_agreement']:.4f}, g4ops "
          f"{bf['g4ops_vs_fp32_top1_agreement']:.4f}, stock greedy {bf['stock_greedy_vs_fp32_agreement']:.4f}); first "
          f"greedy divergence {first}" + (f" (stock margin {bf['stock_margin_at_divergence']:.4f}, g4ops margin "
                                          f"{bf['g4ops_margin_at_divergence']:.4f})" if first is not None else ""))
    # fp32, fewer layers: greedy tokens identical
    model = model_for(args, dtype=torch.float32, layers=args.fp32_layers).eval()
    layers32 = model.config.get_text_config().num_hidden_layers  # a checkpoint keeps all of its layers
    stock32 = greedy(model, prompt, args.fp32_tokens)
    with g4ops_on(True):
        ours32 = greedy(model, prompt, args.fp32_tokens)
        graph32 = graph_greedy(model, prompt, args.fp32_tokens)
    report["graph_decoder_fp32"] = graph_report(model, prompt, graph32, stock32, "float32")
    del model
    free(args.device)
    diff = (stock32 != ours32).nonzero()
    report["fp32_greedy"] = dict(
        layers=layers32, tokens=int(stock32.numel()), identical=bool(diff.numel() == 0),
        first_divergence=int(diff[0]) if diff.numel() else None,
    )
    print(f"parity fp32 ({layers32} layers): greedy tokens identical = {report['fp32_greedy']['identical']} "
          f"over {report['fp32_greedy']['tokens']} tokens")
    results["parity"] = report


# ----------------------------------------------------------------------------------------------------------------
# Output


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if not math.isnan(v) else "nan"
    if isinstance(v, dict):  # g4ops_env: one word, as print_row's key=value fields are
        return ",".join(f"{k}={x}" for k, x in v.items())
    return str(v)


def write_json(args, results):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def print_row(row):
    keys = ("part", "variant", "g4ops_env", "batch", "seq", "layout", "real_tokens", "lora_r", "autocast",
            "compile_mode", "optimizer", "tok_s", "back_to_back_tok_s", "peak_gib", "speedup_vs_stock", "first_loss",
            "loss_matches_stock", "first_step_s", "cudagraph_skips", "warmup_s", "first_fast_token",
            "first_fast_token_since_process_start_s", "error")
    print("  ".join(f"{k}={fmt(row[k])}" for k in keys if k in row), flush=True)


def print_table(results):
    print("\n== summary ==")
    if results.get("decode"):
        print(f"{'decode':<16}{'batch':>6}{'tok/s':>10}{'x stock':>9}{'warm-up s':>11}{'1st fast tok':>13}"
              f"{'from start s':>14}")
        for r in results["decode"]:
            print(f"{r['variant']:<16}{r['batch']:>6}{fmt(r.get('tok_s')):>10}{fmt(r.get('speedup_vs_stock')):>9}"
                  f"{fmt(r.get('warmup_s')):>11}{fmt(r.get('first_fast_token')):>13}"
                  f"{fmt(r.get('first_fast_token_since_process_start_s')):>14}  {r.get('error', '')}")
    if results.get("train"):
        print(f"{'train':<16}{'seq':>6}{'optim':>13}{'tok/s':>10}{'x stock':>9}{'peak GiB':>10}{'loss':>9}  ok")
        for r in results["train"]:
            print(f"{variant_label(r):<16}{r['seq']:>6}{r.get('optimizer', '-'):>13}{fmt(r.get('tok_s')):>10}"
                  f"{fmt(r.get('speedup_vs_stock')):>9}{fmt(r.get('peak_gib')):>10}{fmt(r.get('first_loss')):>9}  "
                  f"{fmt(r.get('loss_matches_stock'))} {r.get('error', '')}")
    if results.get("parity"):
        print("parity", json.dumps(results["parity"]))


# A train row's workload: rows with equal keys did the same work, whatever the variant and its compile mode.
WORKLOAD_KEYS = ("seq", "layout", "real_tokens", "lora_r", "optimizer", "autocast", "grad_ckpt")


def merge_train(paths: list[str], reference: str, loss_tol: float) -> dict:
    """`--merge`: the train rows of `paths` (this script's JSON) in one result, each compared with the `reference`
    variant's row of the same workload (`speedup_vs_<reference>`, `loss_matches_<reference>`): the one run without
    G4OPS_* switches, so that a row of the same variant under a switch (an A/B of g4ops' own paths) is compared too."""
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"--merge: no such file: {', '.join(missing)}")
    files = [json.loads(Path(p).read_text()) for p in paths]
    stacks = sorted({json.dumps([f["meta"].get(k) for k in ("gpu", "torch", "transformers")]) for f in files})
    if len(stacks) > 1:
        raise SystemExit(f"--merge: the files come from different GPUs or stacks ({', '.join(stacks)}); their rows "
                         "compare only within one machine and one call")
    rows = [dict(row, source=Path(path).name) for path, f in zip(paths, files) for row in f.get("train", [])]
    refs = {}
    for row in rows:
        if row["variant"] == reference and not row.get("g4ops_env") and "tok_s" in row:
            refs.setdefault(tuple(row.get(k) for k in WORKLOAD_KEYS), row)
    for row in rows:
        ref = refs.get(tuple(row.get(k) for k in WORKLOAD_KEYS))
        if ref is None or ref is row or "tok_s" not in row:
            continue
        row[f"speedup_vs_{reference}"] = row["tok_s"] / ref["tok_s"]
        row[f"loss_matches_{reference}"] = loss_matches(row["first_loss"], ref["first_loss"], loss_tol)
    dates = sorted(f["meta"]["date"] for f in files)
    merged_meta = {k: v for k, v in files[0]["meta"].items() if k not in ("date", "args", "g4ops_env")}
    merged_meta.update(dates=[dates[0], dates[-1]], merged=[Path(p).name for p in paths], reference=reference)
    return {"meta": merged_meta, "train": rows}


def print_merged(results: dict) -> None:
    """`--merge`'s table (markdown): one line per train row."""
    reference = results["meta"]["reference"]
    print(f"| variant | seq | layout | real tokens | lora r | optimizer | tok/s | x {reference} | peak GiB | "
          f"first step s | loss matches {reference} | error |")
    print("|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|")
    for r in results["train"]:
        cells = (variant_label(r), r.get("seq"),
                 r.get("layout"), r.get("real_tokens"), r.get("lora_r"), r.get("optimizer"), r.get("tok_s"),
                 r.get(f"speedup_vs_{reference}"), r.get("peak_gib"), r.get("first_step_s"),
                 r.get(f"loss_matches_{reference}"), r.get("error", ""))  # fmt: skip
        print("| " + " | ".join(map(fmt, cells)) + " |")
    if any("timing_turn" in r for r in results["train"]):
        print("(compiled side by side, timed one at a time (TimingTurns): a first step includes the others' compile "
              "load)")


def g4ops_switches() -> dict:
    """The G4OPS_* environment variables of this process. g4ops reads its switches from the environment
    (G4OPS_LORA_SPLIT, G4OPS_LORA_TRACE, G4OPS_LORA_COMPILE, ...), so a g4ops row taken under one is another
    configuration: its row and the file's meta name them, and the tables label the variant with them."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("G4OPS_")}


def variant_label(row: dict) -> str:
    """A row's variant as the tables print it: with its compile mode and the g4ops switches it ran under."""
    label = row["variant"] + (f" ({row['compile_mode']})" if row.get("compile_mode") else "")
    switches = row.get("g4ops_env") or {}
    return label + (" [" + " ".join(f"{k}={v}" for k, v in switches.items()) + "]" if switches else "")


def meta(args):
    info = dict(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), python=platform.python_version(),
        torch=torch.__version__, args={k: v for k, v in vars(args).items() if k != "turns"},
        g4ops_env=g4ops_switches(),
    )  # no kernel status here: taken before any row loads the kernels, it read "not attempted"; train rows record
    # `g4ops_kernels_loaded` after their steps
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="e4b", help="g4ops.models.SHAPES key: e4b, e2b, tiny-e4b, tiny-e2b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own count)")
    ap.add_argument("--model", default=None,
                    help="local checkpoint directory instead of --shape's random weights (all its layers; never "
                         "downloads)")
    ap.add_argument("--prompt", default=None, help="with --model: prompt text for decode and parity (its tokenizer)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--parts", default="decode,train,parity")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="train variants: " + ",".join(VARIANTS))
    ap.add_argument("--batches", default="1,4", help="decode batch sizes")
    ap.add_argument("--decode-variants", default="stock,g4ops,g4ops-graph,g4ops-graph-compile",
                    help=f"decode, any of {DECODE_VARIANTS} (one alone in a fresh process gives its own time from start)")
    ap.add_argument("--decode-processes", choices=["each", "shared"], default=None,
                    help="decode: each variant and batch size in its own Python process (default on CUDA), or all in "
                         "this one (default on CPU)")
    ap.add_argument("--seqs", default="2048,8192", help="train sequence lengths (batch 1)")
    ap.add_argument("--layout", choices=["single", "padded", "packed"], default="single",
                    help="train: one sequence, 4 sequences padded into a batch, or the same 4 packed in one row")
    ap.add_argument("--g4ops-attention", action="store_true",
                    help="train: the g4ops variants also run g4ops attention (enable(model, attention=True))")
    ap.add_argument("--lora-attention", choices=["g4ops", "peft"], default="g4ops",
                    help="--lora, g4ops variants: the attention projections' LoRA layers through g4ops.lora_linear "
                         "(enable(model) after peft wraps them) or peft's own forward")
    add_sliding_arg(ap)
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train: peft LoRA of rank R on every projection instead of a full finetune (0: full)")
    ap.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune"],
                    help="train: torch.compile mode of the *-compile variants; reduce-overhead replays each step "
                         "from CUDA graphs (rows record cudagraph_skips: graphs Inductor did not capture)")
    ap.add_argument("--dict-tag-guards", action="store_true",
                    help="train: torch._dynamo.config.use_recursive_dict_tags_for_guards (off by default in torch): "
                         "a module subtree's guards are skipped while its dicts are unchanged; the per-step guard "
                         "check of a 42-layer LoRA model is milliseconds of host time")
    ap.add_argument("--optimizers", default="none,adamw,g4ops-adamw",
                    help="train, any of: none (fwd+bwd), adamw (torch.optim.AdamW, fused on CUDA), g4ops-adamw "
                         "(g4ops.optim.AdamW); all on one compiled model per variant")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=600, help="timed decode; > 512 crosses the window")
    ap.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                    help="train: each step's forward under torch.autocast to this dtype, as HF Trainer's and TRL's "
                         "bf16=True run it (TRL loads fp32 weights: with --dtype fp32)")
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="train: gradient checkpointing on (use_reentrant=False), e.g. for the longest sequence that "
                         "fits: --seqs 16384,32768,65536 --variants stock,g4ops")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)  # a 42-layer step takes 0.1-0.6 s; 3 left medians noisy
    ap.add_argument("--parity-tokens", type=int, default=300)
    ap.add_argument("--fp32-layers", type=int, default=6, help="parity fp32 model's layers (--shape models only)")
    ap.add_argument("--fp32-tokens", type=int, default=600)
    ap.add_argument("--loss-tol", type=float, default=2e-2, help="relative first-loss tolerance vs stock (bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write all results here")
    add_timing_turns_args(ap)
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: join the train rows of these files (one variant each, one call) into one "
                         "table against --merge-reference (module docstring)")
    ap.add_argument("--merge-reference", default="stock-compile", choices=VARIANTS)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, eager variants only: proves the script runs")
    args = ap.parse_args(argv)
    check_sliding_arg(ap, args.sliding)
    if args.smoke:
        args.batches, args.seqs, args.variants = "2", "16", "stock,liger,g4ops"
        if not args.model and not args.shape.startswith("tiny-"):  # a full-size random model: 32 GB of fp32 on CPU
            args.shape = "tiny-" + args.shape
        args.decode_tokens, args.parity_tokens, args.fp32_tokens = 12, 10, 10
        args.prompt_len, args.warmup_steps, args.steps, args.fp32_layers = 6, 1, 1, 3
        if args.device == "cpu" and args.dtype == "bf16":
            args.dtype = "fp32"  # CPU bf16 GEMMs are slow paths on many CPUs; the smoke proves the script, not speed
        if args.device == "cpu":
            # tiny GEMMs: OpenMP threads only add barrier waits (seen: 10 s instead of 0.06 s on a busy 2-core box)
            torch.set_num_threads(1)
    if args.prompt and not args.model:
        ap.error("--prompt needs --model (the built-in shapes have no tokenizer)")
    if args.model and args.layers is not None:
        ap.error("--layers applies to --shape models; a --model checkpoint runs all of its layers")
    args.turns = timing_turns(args)
    if args.decode_processes is None:
        args.decode_processes = "each" if args.device.startswith("cuda") else "shared"
    args.parts = [p for p in args.parts.split(",") if p]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.decode_variants = [v for v in args.decode_variants.split(",") if v]
    bad = [v for v in args.decode_variants if v not in DECODE_VARIANTS]
    if bad:
        ap.error(f"unknown decode variants {bad}; choose from {', '.join(DECODE_VARIANTS)}")
    args.seqs = [int(s) for s in args.seqs.split(",") if s]
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    bad = [o for o in args.optimizers if o not in OPTIMIZERS]
    if bad:
        ap.error(f"unknown optimizers {bad}; choose from {', '.join(OPTIMIZERS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity must mean fp32
    if args.dict_tag_guards:
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
        torch._dynamo.config.max_saved_pointers_for_recursive_dict_tags_check = 1 << 20  # a 42-layer model's modules
    if args.merge:
        results = merge_train(args.merge, args.merge_reference, args.loss_tol)
        print_merged(results)
        write_json(args, results)
        return results
    results = {"meta": meta(args)}
    parts = {"decode": bench_decode, "train": bench_train, "parity": bench_parity}
    for part in args.parts:
        print(f"== {part} ==", flush=True)
        try:
            parts[part](args, results)
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others' numbers
            traceback.print_exc()
            results.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
        write_json(args, results)  # after every part: a later crash or timeout keeps what was measured
    print_table(results)
    return results


if __name__ == "__main__":
    main()
