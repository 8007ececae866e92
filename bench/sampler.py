"""Sampler micro-benchmark: what choosing the next token costs at E4B's vocabulary (262144 entries), per call inside a
CUDA graph, as a captured decode step runs it. Issue 16's default call (sampled, EOS ids) trails the greedy static
call by 0.36 ms per token at batch 1 (5.64 against 5.28 ms, bench/results/2026-12-02-h200-session14.md); this says
how much of that the sampler is.

Variants, on softcapped fp32 logits with gemma-4-E4B-it's config (temperature 1, top_k 64, top_p 0.95):
- `greedy`: the first argmax (greedy's whole token choice);
- `card`: `g4ops.engine.sampler.sample` with k_cap 64 (K_CAPS): the warpers on the 128 largest logits (candidates),
  eager, what the Decoder and BatchEngine capture since session 15;
- `card-vocabulary`: the warpers over the whole vocabulary (top-k's threshold from a topk of 64, top-p over a sort
  of the vocabulary), then the draw: what the engines captured until session 15 (0.42 ms at batch 1 on the H200);
- `card-compiled`: `card` through torch.compile with static shapes (with the vocabulary-wide card, Inductor failed
  on top-p's scan at batch 4 and 16 on the H200);
- `top-k-only`: `card` without top-p;
- `op:*`: one operation alone on the vocabulary-wide row, to split what it costs: `topk64` (top-k's threshold),
  `sort` (top-p's), `softmax`, `cumsum`, `exponential` (the draw's noise). Session 15 (2026-12-02): a two-stage topk
  (the 64 largest of each 4096-entry chunk, then of those) in place of the one topk left the default call at 176.9
  tok/s (177.3 before) at batch 1.

    python bench/sampler.py --json $OUT/sampler.json    # H200: about a minute, most of it compiling
    python bench/sampler.py --smoke                      # CPU, a small vocabulary: the script runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode_attention import time_per_call_us  # bench/decode_attention.py: this script's directory is on sys.path

from g4ops.engine.sampler import sample, warp

SOFTCAP = 30.0  # Gemma-4's final_logit_softcapping


def variants(batch: int, device: str) -> dict:
    """name -> fn(logits) -> [batch] tokens, with the card's parameters as per-row device tensors."""
    temperature = torch.ones(batch, device=device)
    top_k = torch.full((batch,), 64, dtype=torch.long, device=device)
    top_p = torch.full((batch,), 0.95, dtype=torch.float64, device=device)
    greedy = torch.zeros(batch, dtype=torch.bool, device=device)

    def card(logits):
        return sample(logits, temperature, top_k, top_p, None, greedy, k_cap=64)

    def card_vocabulary(logits):
        probs = warp(logits.float(), temperature, top_k, top_p, None, k_cap=64).softmax(dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)

    return {
        "greedy": lambda logits: logits.argmax(dim=-1),
        "card": card,
        "card-vocabulary": card_vocabulary,
        "card-compiled": torch.compile(card, fullgraph=True, dynamic=False),
        "top-k-only": lambda logits: sample(logits, temperature, top_k, None, None, greedy, k_cap=64),
        "op:topk64": lambda logits: torch.topk(logits, 64, dim=-1).values[:, -1],
        "op:sort": lambda logits: torch.sort(logits, dim=-1).values[:, 0],
        "op:softmax": lambda logits: logits.softmax(dim=-1)[:, 0],
        "op:cumsum": lambda logits: logits.cumsum(dim=-1)[:, -1],
        "op:exponential": lambda logits: torch.empty_like(logits).exponential_()[:, 0],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--repeats", type=int, default=20, help="graph replays timed (median)")
    ap.add_argument("--l2-bytes", type=float, default=2 * 60e6, help="logits copies until their bytes exceed this")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="a small vocabulary and few calls: proves the script runs")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        args.vocab, batches, args.calls, args.repeats, args.l2_bytes = 1000, [1, 3], 2, 2, 0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        copies = min(64, 1 + int(args.l2_bytes // (batch * args.vocab * 4)))
        inputs = [((SOFTCAP * torch.tanh(torch.randn(batch, args.vocab, generator=gen) * 4 / SOFTCAP)).to(args.device),)
                  for _ in range(copies)]  # fmt: skip
        row = dict(batch=batch, vocab=args.vocab)
        for name, fn in variants(batch, args.device).items():
            try:
                with torch.no_grad():
                    tokens = fn(*inputs[0])
                    in_range = name.startswith("op:") or bool(((tokens >= 0) & (tokens < args.vocab)).all())
                    if tokens.shape != (batch,) or not in_range:  # an op: one value per row
                        raise RuntimeError(f"tokens out of range: {tokens.tolist()}")
                    row[f"{name}_us"] = time_per_call_us(fn, inputs, args.calls, args.repeats, args.device)
            except Exception as e:  # noqa: BLE001 - a variant that fails (a compiler error) is a result too
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = [key[: -len("_us")] for key in rows[0] if key.endswith("_us")] if rows else []
    names += [key[: -len("_error")] for key in rows[0] if key.endswith("_error")] if rows else []
    print("\n" + f"{'batch':>6}" + "".join(f"{n:>16}" for n in names) + "   (us per call)")
    for r in rows:
        cells = (f"{r[n + '_us']:>16.1f}" if n + "_us" in r else f"{'error':>16}" for n in names)
        print(f"{r['batch']:>6}" + "".join(cells))
    if args.json:
        meta = dict(device=args.device, torch=torch.__version__,
                    gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)  # fmt: skip
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
