"""CLI.

    python -m neuron_backend check [--tp 2] [--shape tiny-e4b|e4b-mini] [--dtype bfloat16]   CPU, no Neuron SDK
    python -m neuron_backend compile --model DIR --out DIR [--tp 2 --max-seq 512 --buckets 128 --dtype bfloat16]
    python -m neuron_backend generate --artifact DIR --model DIR --prompt TEXT [--max-new-tokens 64]

`compile` and `generate` need torch-neuronx and neuronx-distributed (an inf2 / trn1 instance); without them they
exit with a message saying what to install.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _cmd_check(args) -> int:
    from .check import run_check

    dtype = getattr(torch, args.dtype)
    report = run_check(args.shape, args.tp, seed=args.seed, export=not args.no_export, dtype=dtype)
    print("\n".join(report.lines()))
    exports_ok = args.no_export or report.exports_ok
    if dtype != torch.float32:  # bf16/fp16 numerics are reported, not gated (stock rounds differently)
        return 0 if exports_ok else 1
    return 0 if report.ok and exports_ok else 1


def _cmd_compile(args) -> int:
    from .compile import compile_model, require_neuron
    from .config import BuildSettings
    from .loader import load_hf_checkpoint

    require_neuron()
    dtype = getattr(torch, args.dtype)
    cfg, sd = load_hf_checkpoint(args.model, dtype)
    settings = BuildSettings(
        tp=args.tp, batch=args.batch, max_seq=args.max_seq, prefill_buckets=tuple(args.buckets), dtype=dtype
    )
    t = time.time()
    out = compile_model(sd, cfg, settings, args.out)
    print(f"compiled {len(settings.prefill_buckets)} prefill bucket(s) + decode at TP={args.tp} in "
          f"{time.time() - t:.0f} s -> {out}")  # fmt: skip
    return 0


def _cmd_generate(args) -> int:
    from g4ops.models import load_tokenizer

    from .compile import CompiledModel
    from .generate import greedy_generate

    tok = load_tokenizer(args.model)  # first: a directory without one fails before the artifact loads
    model = CompiledModel(args.artifact)
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    ids = ids.expand(model.settings.batch, -1)
    t = time.time()
    res = greedy_generate(model.step, ids, 1, model.settings, model.ple, model.cfg.pad_token_id)
    first = time.time() - t
    t = time.time()
    res = greedy_generate(model.step, ids, args.max_new_tokens, model.settings, model.ple, model.cfg.pad_token_id)
    total = time.time() - t
    print(tok.decode(res.tokens[0], skip_special_tokens=True))
    decode_tps = (args.max_new_tokens - 1) / max(total - first, 1e-9)
    print(f"first token {first:.3f} s, decode {decode_tps:.1f} tok/s (batch {model.settings.batch})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m neuron_backend", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("check", help="CPU: stock vs TP=1 vs TP=N greedy tokens, export hygiene")
    c.add_argument("--tp", type=int, default=2)
    c.add_argument("--shape", default="tiny-e4b", choices=["tiny-e4b", "e4b-mini"])
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--no-export", action="store_true")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.set_defaults(fn=_cmd_check)

    c = sub.add_parser("compile", help="Neuron: trace + compile every bucket, save the artifact")
    c.add_argument("--model", required=True, help="local HF checkpoint directory (e.g. gemma-4-E4B-it)")
    c.add_argument("--out", required=True)
    c.add_argument("--tp", type=int, default=2)
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--max-seq", type=int, default=512)
    c.add_argument("--buckets", type=int, nargs="+", default=[128])
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    c.set_defaults(fn=_cmd_compile)

    c = sub.add_parser("generate", help="Neuron: greedy generation with a compiled artifact")
    c.add_argument("--artifact", required=True)
    c.add_argument("--model", required=True, help="checkpoint directory, for the tokenizer")
    c.add_argument("--prompt", required=True)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.set_defaults(fn=_cmd_generate)

    args = p.parse_args(argv)
    from .compile import NeuronUnavailable

    try:
        return args.fn(args)
    except NeuronUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
