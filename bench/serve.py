"""Serving benchmark: a bounded load generator over loopback against `python -m g4ops serve`, in the shape of
SGLang's published Gemma-4 numbers (anchors.md): random-token prompts of `--prompt-tokens`, `--output-tokens` new
tokens each (`ignore_eos`, so every request generates exactly that many), at each concurrency of `--concurrency`.

Per level: `--rounds` requests per concurrent client, each a streaming /v1/completions call (prompt as token ids,
greedy unless `--temperature`), after a warm-up that walks the engine through every batch size up to the level
(its CUDA graphs are captured on first use). Checked first: every request succeeds and reports exactly
`--output-tokens` completion tokens, and the server's generation-token counter (/metrics) grew by the sum; a level
that fails the check reports an error instead of numbers. Then reported, measured at the client: output tok/s
(every output token of the level over its wall time), TTFT (send to first text), ITL (gaps between text chunks;
the server may merge tokens that arrive together into one chunk), TPOT ((end - first text) / (tokens - 1) per
request), end-to-end latency; p50 and p99 of each.

By default it launches the server itself (`python -m g4ops serve` with `--model` or `--shape`, sized to the largest
level) on a free loopback port and stops it with SIGTERM at the end; `--url` uses one already running instead.

    python bench/serve.py --shape e4b --out $OUT/serve.json        # H200: E4B's decoder, random bf16 weights
    python bench/serve.py --model /path/to/gemma-4-E4B-it --out $OUT/serve.json
    python bench/serve.py --concurrency 1,2 --prompt-tokens 16 --output-tokens 8 --rounds 1 --out /tmp/s.json  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:  # the HTTP client the openai package uses (httpx2 since openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent
FIRST_ID = 3  # prompt ids start above Gemma's pad/eos/bos (0, 1, 2)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary(values: list[float], scale: float = 1.0) -> dict:
    return {"p50": _scaled(percentile(values, 50), scale), "p99": _scaled(percentile(values, 99), scale),
            "mean": _scaled(statistics.fmean(values) if values else None, scale), "n": len(values)}


def _scaled(v, scale):
    return None if v is None else v * scale


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float,
                      timeout: float) -> dict:  # fmt: skip
    """Stream one completion; -> timings (perf_counter seconds) and the usage the server reported."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, usage, error = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as reply:
        if reply.status_code != 200:
            return {"error": f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:300]}"}
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"].get("message")
            if data.get("usage"):
                usage = data["usage"]
            if any(choice.get("text") for choice in data.get("choices", ())):
                chunks.append(time.perf_counter())
    end = time.perf_counter()
    if error or usage is None:
        return {"error": error or "no usage in the stream"}
    return {"start": start, "chunks": chunks, "end": end, "tokens": usage["completion_tokens"]}


def generation_tokens(url: str) -> float:
    """The server's g4ops:generation_tokens_total (summed over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("g4ops:generation_tokens_total"))


async def run_level(url: str, model: str, args, concurrency: int, rng: random.Random) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout) as client:
        def prompt():
            return [rng.randrange(FIRST_ID, args.vocab_size) for _ in range(args.prompt_tokens)]

        # Warm-up: lengths 2, 3, ..., so the running batch shrinks through every size up to `concurrency`.
        warm = await asyncio.gather(*[one_request(client, url, model, prompt(), min(2 + i, args.output_tokens),
                                                  args.temperature,
                                                  args.request_timeout) for i in range(concurrency)])  # fmt: skip
        failed = [r["error"] for r in warm if "error" in r]
        if failed:
            return {"concurrency": concurrency, "error": f"warm-up: {failed[0]}"}

        before = generation_tokens(url)

        async def worker():
            return [await one_request(client, url, model, prompt(), args.output_tokens, args.temperature,
                                      args.request_timeout) for _ in range(args.rounds)]  # fmt: skip

        start = time.perf_counter()
        results = [r for rs in await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]),
                                                      args.level_timeout) for r in rs]  # fmt: skip
        wall = time.perf_counter() - start
    row = {"concurrency": concurrency, "requests": len(results), "prompt_tokens": args.prompt_tokens,
           "output_tokens": args.output_tokens, "wall_s": wall}
    failed = [r["error"] for r in results if "error" in r]
    wrong = [r["tokens"] for r in results if "error" not in r and r["tokens"] != args.output_tokens]
    served = generation_tokens(url) - before
    total = sum(r.get("tokens", 0) for r in results)
    if failed or wrong or served != total:
        row["error"] = (f"{len(failed)} failed (first: {failed[0]})" if failed else
                        f"completion tokens {wrong[:4]} != {args.output_tokens}" if wrong else
                        f"server counted {served} generated tokens, clients {total}")
        return row
    ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["chunks"] and r["tokens"] > 1]
    row.update(output_tok_s=total / wall, ttft_ms=summary(ttft, 1e3), itl_ms=summary(itl, 1e3),
               tpot_ms=summary(tpot, 1e3), e2e_s=summary([r["end"] - r["start"] for r in results]))
    return row


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, max_batch: int, max_context: int):
    """Start `python -m g4ops serve` on a free loopback port; -> (process, url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "g4ops", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(max_batch), "--max-context", str(max_context),
           "--max-waiting", str(max(256, 2 * max_batch)), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    for flag in ("shape", "device", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {args.startup_timeout} s")


def stop(proc, timeout: float) -> int:
    """SIGTERM, as an orchestrator stops a server; uvicorn shuts down cleanly, then re-raises the signal, so a
    clean stop exits with -SIGTERM (or 0)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: launch one)")
    ap.add_argument("--model", help="checkpoint directory for the launched server (default: built-in --shape)")
    ap.add_argument("--shape", help="for the launched server without --model: random weights of this shape (e4b)")
    ap.add_argument("--device", help="for the launched server")
    ap.add_argument("--dtype", help="for the launched server")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrent client at each level")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--vocab-size", type=int, default=512, help="prompt ids are drawn from [3, this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--level-timeout", type=float, default=900.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.prompt_tokens < 1 or args.output_tokens < 2 or args.rounds < 1:
        ap.error("concurrency >= 1, --prompt-tokens >= 1, --output-tokens >= 2 and --rounds >= 1")

    proc = None
    url = args.url
    if url is None:
        proc, url = launch(args, max_batch=max(levels), max_context=args.prompt_tokens + args.output_tokens)
    results = {"config": {k: v for k, v in vars(args).items()}, "environment": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": platform.python_version(),
        "host": platform.node()}, "levels": []}
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        results["server"] = {"url": url, "model": model["id"], "max_model_len": model.get("max_model_len"),
                             "launched": proc is not None}
        rng = random.Random(args.seed)
        print(f"{'conc':>5}{'reqs':>6}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
              f"{'TPOT p50':>10}{'p99':>8}  (ms)", flush=True)
        for c in levels:
            row = asyncio.run(run_level(url, model["id"], args, c, rng))
            results["levels"].append(row)
            if "error" in row:
                print(f"{c:>5}  ERROR {row['error']}", flush=True)
                continue
            t, i, p = row["ttft_ms"], row["itl_ms"], row["tpot_ms"]
            print(f"{c:>5}{row['requests']:>6}{row['output_tok_s']:>11.1f}{t['p50']:>10.1f}{t['p99']:>8.1f}"
                  f"{_f(i['p50']):>9}{_f(i['p99']):>8}{_f(p['p50']):>10}{_f(p['p99']):>8}", flush=True)
    finally:
        if proc is not None:
            results["server_exit_code"] = stop(proc, timeout=60)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    clean = results.get("server_exit_code", 0) in (0, -signal.SIGTERM)
    ok = all("error" not in row for row in results["levels"]) and clean
    return 0 if ok else 1


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
