"""Time `model.generate(..., cache_implementation="static")` three ways in one process, to find where a path is slow.

    python bench/generate_paths.py --layers 42 --tokens 600 --variants stock,g4ops,routed
    TORCH_LOGS=recompiles,graph_breaks python bench/generate_paths.py --layers 8 --tokens 600

Variants (each on a fresh E4B-shaped model with random bf16 weights, after `torch._dynamo.reset()`):
  stock   transformers as installed (it compiles the decode step by itself on CUDA)
  g4ops   `g4ops.enable(decode=False)`: g4ops' ops inside stock generate, which compiles them (the path every call
          the decoder does not take goes: sampling, beams, streamers)
  routed  `g4ops.enable()`: the call goes to g4ops.engine.decoder.Decoder
Each variant runs `--calls` identical calls; the first includes compilation. Prints one line per call: seconds,
whether the call was routed, and whether transformers built its compiled forward.
"""

from __future__ import annotations

import argparse
import time

import torch

import g4ops
from g4ops.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=100, help="new tokens (> 512 crosses the sliding window)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="stock,g4ops,routed")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    prompt = torch.randint(3, 1000, (args.batch, 32), device=args.device)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, attention_mask=torch.ones_like(prompt),
              max_new_tokens=args.tokens, min_new_tokens=args.tokens)  # fmt: skip
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        if variant != "stock":
            g4ops.enable(decode=variant == "routed")
        model = build_model("e4b", num_layers=args.layers, dtype=torch.bfloat16, device=args.device, seed=0)
        for call in range(args.calls):
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, streamer=None, **kw)
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"{variant} call {call}: {time.perf_counter() - t:.2f} s, routed={'_g4ops_decoder' in vars(model)}, "
                  f"compiled_forward={hasattr(model, '_compiled_call')}", flush=True)
        g4ops.disable()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
