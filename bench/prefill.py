"""Prefill time, eager, captured (`pad_prefill=True`) and compiled (`compile_prefill=True`), for the Decoder and
BatchEngine's prefill call.

    python bench/prefill.py --out $OUT/prefill.json                 # E4B-shaped, 42 layers, bf16, CUDA
    python bench/prefill.py --smoke --out /tmp/prefill.json         # tiny-e4b on CPU in fp32: the script runs

Per variant (eager; graphed: the prompt left-padded to its prefill width and replayed from a CUDA graph per width,
the default on CUDA; compiled) it reports the first call's seconds (the capture or the compile) and, per length, the
median of `--calls` timed prefills (device-synchronised), and whether the first token equals the eager one's. The
compiled variant should compile once for every length (Decoder: one graph; engine: the 1-row graph); `graphs`
reports Dynamo's unique graph count after each variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, calls: int) -> tuple[float, float]:
    """(first call s, median of `calls` more, ms)."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - t
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return first, statistics.median(times) * 1e3


def main() -> None:
    from torch._dynamo.utils import counters

    from g4ops.engine.batch import BatchEngine
    from g4ops.engine.decoder import PREFILL_WIDTHS, Decoder, prefill_width
    from g4ops.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="e4b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="32,128,512,610")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny-e4b on CPU in fp32, short lengths")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.dtype, args.device, args.lengths, args.calls = "tiny-e4b", "float32", "cpu", "5,12,40", 2
    lengths = [int(x) for x in args.lengths.split(",")]
    model = build_model(args.shape, num_layers=args.layers, dtype=getattr(torch, args.dtype), device=args.device)
    vocab = model.config.vocab_size
    max_length = max(lengths) + 8
    rows, first_tokens = [], {}
    torch.set_grad_enabled(False)  # as generate and the engine thread run
    for variant in ("eager", "graphed", "compiled"):
        compiled, graphed = variant == "compiled", variant == "graphed"
        torch._dynamo.reset()
        counters.clear()
        decoder = Decoder(model, batch_size=1, max_length=max_length, compile_prefill=compiled, pad_prefill=graphed)
        engine = BatchEngine(model, max_batch=4, max_context=max_length, prefill_chunk=max_length,
                             compile_prefill=compiled, pad_prefill=graphed)  # fmt: skip
        t = time.perf_counter()
        engine.warmup()  # the engine's prefill graphs (compiled) and its decode step buckets (eager: cheap)
        sync(args.device)
        warm_s = time.perf_counter() - t
        for n in lengths:
            ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(args.device)
            d_first, d_ms = timed(lambda: decoder.prefill(ids), args.device, args.calls)
            token = int(decoder.next_ids[0, 0])
            meta = torch.tensor([[0], [0], [n]], device=args.device)
            width = prefill_width(n)  # as BatchEngine pads a lone prompt (_padded_width)
            captured = graphed and width in PREFILL_WIDTHS and width <= max_length
            width = width if captured else n
            padded = torch.nn.functional.pad(ids, (width - n, 0))

            def engine_call():
                return engine._run_prefill(padded, meta, width, None if captured else 0, graphed=captured)

            e_first, e_ms = timed(engine_call, args.device, args.calls)
            e_token = int(engine_call().argmax(-1)[0])
            first_tokens.setdefault(n, (token, e_token))
            rows.append(dict(variant=variant, length=n, width=width, decoder_first_s=round(d_first, 3),
                             decoder_ms=round(d_ms, 3), engine_first_s=round(e_first, 3), engine_ms=round(e_ms, 3),
                             same_first_token=first_tokens[n] == (token, e_token),
                             decoder_falls_back=compiled and decoder.prefill_fn == decoder._prefill_logits,
                             engine_falls_back=compiled and engine._prefill_fn == engine._prefill_logits,
                             engine_warmup_s=round(warm_s, 3)))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        rows.append(dict(variant=variant, graphs=counters["stats"]["unique_graphs"]))
    meta = dict(shape=args.shape, layers=args.layers, dtype=args.dtype, device=args.device, torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
