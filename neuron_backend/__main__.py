"""CLI.

    python -m neuron_backend check [--tp 2] [--shape tiny-e4b|e4b-mini] [--dtype bfloat16]   CPU, no Neuron SDK
    python -m neuron_backend compile --model DIR --out DIR [--tp 2 --max-seq 512 --buckets 128 --dtype bfloat16]
    python -m neuron_backend generate --artifact DIR --model DIR --prompt TEXT [--max-new-tokens 64]
        [--temperature 1 --top-k 64 --top-p 0.95 --seed 0]   streams the reply, stops at the checkpoint's eos ids

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
        tp=args.tp, batch=args.batch, max_seq=args.max_seq, prefill_buckets=tuple(args.buckets), dtype=dtype,
        sample_cap=args.sample_cap,
    )
    t = time.time()
    out = compile_model(sd, cfg, settings, args.out)
    print(f"compiled {len(settings.prefill_buckets)} prefill bucket(s) + decode at TP={args.tp} in "
          f"{time.time() - t:.0f} s -> {out}")  # fmt: skip
    return 0


def _cmd_generate(args) -> int:
    from g4ops.engine.batch import SamplingParams
    from g4ops.models import load_tokenizer, special_tokens

    from .compile import CompiledModel
    from .engine import NeuronEngine
    from .runner import CompiledRunner

    tok = load_tokenizer(args.model)  # first: a directory without one fails before the artifact loads
    engine = NeuronEngine(CompiledRunner(CompiledModel(args.artifact)))
    messages = [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    eos = special_tokens(args.model).eos_token_id
    stops = () if args.ignore_eos else tuple([eos] if isinstance(eos, int) else eos or ())
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop_token_ids=stops)  # fmt: skip
    engine.warmup()
    times, tokens, shown, reason = [], [], "", None
    t = time.perf_counter()
    for event in engine.stream(ids, params):  # streams the text as it grows (decoding the whole reply keeps
        times.append(time.perf_counter())      # multi-byte pieces whole)
        if event.token_id is not None:
            tokens.append(event.token_id)
            now = tok.decode(tokens, skip_special_tokens=True)
            print(now[len(shown) :], end="", flush=True)
            shown = now
        reason = event.finish_reason
    engine.shutdown()
    first = times[0] - t
    decode_tps = (len(times) - 1) / max(times[-1] - times[0], 1e-9)
    print(f"\n[{reason}] {len(tokens)} tokens; first token {first:.3f} s, decode {decode_tps:.1f} tok/s")
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
    c.add_argument("--sample-cap", type=int, default=64,
                   help="top-k candidates per rank for on-device sampling; 0: greedy-only buckets")
    c.set_defaults(fn=_cmd_compile)

    c = sub.add_parser("generate", help="Neuron: greedy generation with a compiled artifact")
    c.add_argument("--artifact", required=True)
    c.add_argument("--model", required=True, help="checkpoint directory, for the tokenizer")
    c.add_argument("--prompt", required=True)
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (needs --sample-cap at "
                   "compile time)")
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--min-p", type=float, default=0.0)
    c.add_argument("--seed", type=int)
    c.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's eos ids")
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
