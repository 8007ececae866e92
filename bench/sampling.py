"""The `generate()` calls users make, stock vs g4ops, each variant and row in its own process.

    python bench/sampling.py --out $OUT/sampling.json                          # E4B-shaped, 42 layers, CUDA
    python bench/sampling.py --variants g4ops --rows default --out $OUT/g.json # one slice (10-minute calls)
    python bench/sampling.py --merge $OUT/s.json $OUT/g.json --out $OUT/all.json
    python bench/sampling.py --smoke --out /tmp/sampling.json                  # tiny model on CPU (CI)

Rows (`--rows`), each at every `--batches` size (default 1, 4, 16), `--tokens` new tokens (default 200) after a
`--prompt-len` prompt, on a model with random bf16 weights whose generation config is gemma-4-E4B-it's
(do_sample, temperature 1.0, top_k 64, top_p 0.95, eos [1, 106, 50]):
  greedy-static     generate(input_ids, attention_mask, max_new_tokens, do_sample=False,
                    cache_implementation="static"): stock compiles its decode step by itself
  default           generate(input_ids=..., attention_mask=..., max_new_tokens=...): the checkpoint's sampling, with
                    transformers' default (dynamic) cache
  default-compiled  the same call on torch.compile(model) (an OptimizedModule: its generate is the module's own)
  ttft              time to first token: the default call at batch 1 with a `--ttft-prompt` (512) token prompt and
                    one new token
Variants (`--variants`): stock (transformers as installed), g4ops (`g4ops.enable()`: the calls route to
g4ops.engine.decoder.Decoder; each row records whether it did and, if not, g4ops.generation_route's reason).
A row makes `--calls` timed calls after one warm-up call (compilation, capture); tok/s = batch x new tokens of the
best timed call / its seconds (prefill included). Sampled rows draw from `torch.manual_seed(--seed)`; random weights
may still sample an EOS, so the new-token count is the call's own. Checks before timing counts: the g4ops rows must
be routed; greedy-static's tokens of the two variants are compared (equal in fp32; in bf16 the merged JSON reports
the first differing new token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROWS = ("greedy-static", "default", "default-compiled", "ttft")
E4B_IT = dict(do_sample=True, temperature=1.0, top_k=64, top_p=0.95, eos_token_id=[1, 106, 50], pad_token_id=0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


_BUILT: dict = {}  # --in-process: one model for every row (enable() patches the classes, not the model)


def build(args):
    from transformers import GenerationConfig

    from g4ops.models import build_model

    torch._dynamo.reset()
    if args.in_process and "model" in _BUILT:
        return _BUILT["model"]
    model = build_model(args.shape, num_layers=args.layers, dtype=getattr(torch, args.dtype), device=args.device,
                        seed=args.seed)  # fmt: skip
    model.generation_config = GenerationConfig(**E4B_IT)
    if args.in_process:
        _BUILT["model"] = model
    return model


def prompts(args, batch: int, length: int):
    """Random prompts of `length`, row i left-padded by i % 4 tokens (different lengths, as a batch of chats)."""
    vocab = getattr(args, "vocab")
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(args.seed))
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, : i % 4] = 0
    return ids.masked_fill(mask == 0, 0).to(args.device), mask.to(args.device)


def call(row: str, ids, mask, tokens: int):
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=tokens)
    if row == "greedy-static":
        kw.update(do_sample=False, cache_implementation="static")
    return kw


def run_row(args, variant: str, row: str) -> list[dict]:
    """One row at every batch size, in this process."""
    import g4ops

    if variant == "g4ops":
        if args.device == "cpu":
            import g4ops.hf.generate

            g4ops.hf.generate.ROUTED_DEVICES = ("cuda", "cpu")  # the smoke run exercises the routed path on CPU
        g4ops.enable()
    try:
        return _run_row(args, variant, row)
    finally:
        g4ops.disable()


def _run_row(args, variant: str, row: str) -> list[dict]:
    import g4ops

    model = build(args)
    args.vocab = model.config.get_text_config().vocab_size
    target = torch.compile(model) if row == "default-compiled" else model
    batches = [1] if row == "ttft" else args.batches
    out = []
    for batch in batches:
        length, tokens = (args.ttft_prompt, 1) if row == "ttft" else (args.prompt_len, args.tokens)
        ids, mask = prompts(args, batch, length)
        kw = call(row, ids, mask, tokens)
        route = g4ops.generation_route(target, **kw)
        res = dict(variant=variant, row=row, batch=batch, prompt_len=length, routed=False,
                   route_reason=route.reason)  # fmt: skip
        try:
            times, seqs = [], []
            for i in range(1 + args.calls):
                torch.manual_seed(args.seed)
                sync(args.device)
                t = time.perf_counter()
                with torch.no_grad():
                    seq = target.generate(**kw)
                sync(args.device)
                times.append(time.perf_counter() - t)
                seqs.append(seq)
                if i == 0:
                    res["routed"] = "_g4ops_decoder" in vars(model)
                    if variant == "g4ops" and not res["routed"]:
                        raise RuntimeError(f"not routed: {route.reason}")
            new = seqs[-1].shape[1] - length
            best = min(times[1:])
            res.update(new_tokens=new, first_call_s=round(times[0], 4), best_s=round(best, 5),
                       times_s=[round(t, 5) for t in times[1:]], tok_s=round(batch * new / best, 2),
                       tokens_head=seqs[-1][:, length : length + 32].tolist())  # fmt: skip
            if row == "ttft":
                res["ttft_ms"] = round(best * 1e3, 3)
            if row != "greedy-static":  # a seed before each call: its sampled tokens repeat
                res["seed_reproduces"] = all(torch.equal(s, seqs[0]) for s in seqs[1:])
        except Exception as e:  # noqa: BLE001 - the row reports it, the run goes on
            res["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(json.dumps({k: v for k, v in res.items() if k != "tokens_head"}), flush=True)
        out.append(res)
        vars(model).pop("_g4ops_decoder", None)
    return out


def in_child(args, variant: str, row: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, row, "--out", path, "--device",
               args.device, "--shape", args.shape, "--dtype", args.dtype, "--tokens", str(args.tokens),
               "--prompt-len", str(args.prompt_len), "--ttft-prompt", str(args.ttft_prompt), "--calls",
               str(args.calls), "--seed", str(args.seed), "--batches", ",".join(map(str, args.batches))]  # fmt: skip
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        code = subprocess.run(cmd).returncode
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return [dict(variant=variant, row=row, error=f"child process exit {code}")]


def compare(rows: list[dict]) -> list[dict]:
    """Per (row, batch): g4ops / stock tok/s and, for greedy-static, where the tokens first differ."""
    by = {(r["variant"], r["row"], r.get("batch")): r for r in rows}
    out = []
    for (variant, row, batch), g in sorted(by.items(), key=lambda kv: str(kv[0])):
        s = by.get(("stock", row, batch))
        if variant != "g4ops" or s is None or "tok_s" not in g or "tok_s" not in s:
            continue
        item = dict(row=row, batch=batch, stock_tok_s=s["tok_s"], g4ops_tok_s=g["tok_s"],
                    speedup=round(g["tok_s"] / s["tok_s"], 3))  # fmt: skip
        if row == "ttft":
            item.update(stock_ttft_ms=s["ttft_ms"], g4ops_ttft_ms=g["ttft_ms"])
        if row == "greedy-static":
            a, b = torch.tensor(s["tokens_head"]), torch.tensor(g["tokens_head"])
            n = min(a.shape[1], b.shape[1])
            diff = (a[:, :n] != b[:, :n]).any(dim=0).nonzero()
            item["same_tokens_head"] = not len(diff) and a.shape == b.shape
            item["first_difference"] = int(diff[0]) if len(diff) else None
        out.append(item)
    return out


def meta(args) -> dict:
    import transformers

    info = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, command=" ".join(sys.argv),
                args={k: v for k, v in vars(args).items() if k not in ("merge", "child")})  # fmt: skip
    if args.device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results JSON path")
    ap.add_argument("--variants", default="stock,g4ops")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2, help="timed calls per row and batch, after one warm-up")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's own (42 for e4b)")
    ap.add_argument("--shape", default="e4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny-e4b on CPU in fp32, few tokens: the script runs")
    ap.add_argument("--in-process", action="store_true",
                    help="every variant and row in this process (quick smoke runs; the real run keeps them apart)")
    ap.add_argument("--merge", nargs="+", help="merge these results files into --out (no run)")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "ROW"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny-e4b", "cpu", "float32"
        args.tokens, args.prompt_len, args.ttft_prompt, args.calls = 4, 10, 20, 1
        if args.batches == "1,4,16":
            args.batches = "1,3"
    args.batches = [int(b) for b in str(args.batches).split(",")] if isinstance(args.batches, str) else args.batches
    for name in ("variants", "rows"):
        values = getattr(args, name).split(",")
        allowed = ("stock", "g4ops") if name == "variants" else ROWS
        bad = [v for v in values if v not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}, choose from {list(allowed)}")
        setattr(args, name, values)
    return args


def write(path: str, results: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        write(args.out, run_row(args, *args.child))
        return
    if args.merge:
        parts = [json.load(open(p)) for p in args.merge]
        rows = [r for p in parts for r in p["rows"]]
        write(args.out, dict(meta=[p["meta"] for p in parts], rows=rows, comparison=compare(rows)))
        return
    run = run_row if args.in_process else in_child
    rows = [r for variant in args.variants for row in args.rows for r in run(args, variant, row)]
    results = dict(meta=meta(args), rows=rows, comparison=compare(rows))
    write(args.out, results)
    print("\nrow               batch  stock tok/s  g4ops tok/s  speedup")
    for c in results["comparison"]:
        extra = f"  ttft {c['stock_ttft_ms']} vs {c['g4ops_ttft_ms']} ms" if c["row"] == "ttft" else ""
        same = f"  same greedy tokens: {c['same_tokens_head']}" if "same_tokens_head" in c else ""
        print(f"{c['row']:<17} {c['batch']:>5}  {c['stock_tok_s']:>11}  {c['g4ops_tok_s']:>11}  {c['speedup']:>7}"
              f"{extra}{same}")  # fmt: skip


if __name__ == "__main__":
    main()
