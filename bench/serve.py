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

By default it launches each of `--servers` in turn on a free loopback port, on the same weights, and stops it with
SIGTERM after its levels: `g4ops` (`python -m g4ops serve`, sized to the largest level) and `transformers`
(stock `transformers serve` with `--baseline-args`, by default continuous batching on). Without `--model` the weights
are random ones of `--shape`, saved once to a temporary checkpoint with the byte-level tiny tokenizer (one token
per ASCII character, so a prompt of N-1 letters is N tokens with BOS) that both servers load. Prompts are text, the
same for both servers; every request must generate exactly `--output-tokens` (g4ops: `ignore_eos`; transformers
serve has no such field, so its requests carry a generation_config with min_new_tokens = max_new_tokens). `--url`
measures one server already running (its kind named by `--servers`) instead.

    python bench/serve.py --shape e4b --out $OUT/serve.json --plot $OUT/serve.png   # H200: E4B, random bf16 weights
    python bench/serve.py --model /path/to/gemma-4-E4B-it --out $OUT/serve.json
    python bench/serve.py --concurrency 1,2 --prompt-tokens 16 --output-tokens 8 --rounds 1 --out /tmp/s.json  # CPU
    python bench/serve.py --plot-only $OUT/serve.json --plot serve.png                # the plot from saved results
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
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # the HTTP client the openai package uses (httpx2 since openai 3)
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent


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


SERVERS = ("g4ops", "transformers")


def request_body(server: str, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    """A streaming /v1/completions body that makes `server` generate exactly `max_tokens` tokens."""
    # include_usage: the OpenAI way to ask for a last chunk with the token counts (transformers serve from 5.25 sends
    # it only when asked)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if server == "g4ops":
        body["ignore_eos"] = True
    else:  # transformers serve: no ignore_eos; a request's generation_config replaces the checkpoint's
        body["generation_config"] = json.dumps({"max_new_tokens": max_tokens, "min_new_tokens": max_tokens,
                                                "do_sample": temperature > 0, "temperature": temperature or 1.0})
    return body


async def one_request(client, url: str, body: dict, timeout: float) -> dict:
    """Stream one completion; -> timings (perf_counter seconds) and the usage the server reported."""
    start = time.perf_counter()
    chunks, usage, error = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as reply:
        if reply.status_code != 200:
            return {"error": f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:300]}"}
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:  # g4ops: an OpenAI error object; transformers serve: a string
                error = data["error"].get("message") if isinstance(data["error"], dict) else str(data["error"])
            if data.get("usage"):
                usage = data["usage"]
            if any(choice.get("text") for choice in data.get("choices", ())):
                chunks.append(time.perf_counter())
    end = time.perf_counter()
    if error or usage is None:
        return {"error": error or "no usage in the stream"}
    return {"start": start, "chunks": chunks, "end": end, "tokens": usage["completion_tokens"],
            "prompt_tokens": usage.get("prompt_tokens")}


def generation_tokens(url: str) -> float:
    """g4ops serve's g4ops:generation_tokens_total (summed over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("g4ops:generation_tokens_total"))


async def run_level(server: str, url: str, model: str, args, concurrency: int, rng: random.Random) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout) as client:
        def request(max_tokens):
            # ASCII letters: with the byte-level tiny tokenizer, prompt_tokens - 1 of them + BOS = prompt_tokens
            prompt = "".join(rng.choice(string.ascii_letters) for _ in range(args.prompt_tokens - 1))
            body = request_body(server, model, prompt, max_tokens, args.temperature)
            return one_request(client, url, body, args.request_timeout)

        # Warm-up: lengths 2, 3, ..., so the running batch shrinks through every size up to `concurrency`.
        warm = await asyncio.gather(*[request(min(2 + i, args.output_tokens)) for i in range(concurrency)])
        failed = [r["error"] for r in warm if "error" in r]
        if failed:
            return {"concurrency": concurrency, "error": f"warm-up: {failed[0]}"}

        counted = server == "g4ops"  # only g4ops serve exports a generated-token counter
        before = generation_tokens(url) if counted else None

        async def worker():
            return [await request(args.output_tokens) for _ in range(args.rounds)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]),
                                                      args.level_timeout) for r in rs]  # fmt: skip
        wall = time.perf_counter() - start
    prompt_tokens = sorted({r["prompt_tokens"] for r in results if r.get("prompt_tokens") is not None})
    row = {"concurrency": concurrency, "requests": len(results), "prompt_tokens": prompt_tokens,
           "output_tokens": args.output_tokens, "wall_s": wall}
    failed = [r["error"] for r in results if "error" in r]
    wrong = [r["tokens"] for r in results if "error" not in r and r["tokens"] != args.output_tokens]
    total = sum(r.get("tokens", 0) for r in results)
    served = generation_tokens(url) - before if counted else total
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


def save_checkpoint(args, directory: str) -> str:
    """Random weights of `--shape` and the byte-level tiny tokenizer, saved where both servers can load them."""
    import torch

    from g4ops.models import build_model, tiny_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    model = build_model(args.shape or "tiny-e4b", dtype=dtype, device=device)
    model.save_pretrained(directory)
    tiny_tokenizer(model.config).save_pretrained(directory)
    del model
    return directory


def server_command(server: str, args, model_dir: str, port: int, max_batch: int, max_context: int,
                   baseline_args: str) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if server == "g4ops":
        cmd = [sys.executable, "-m", "g4ops", "serve", "--model", model_dir, *common, "--max-batch", str(max_batch),
               "--max-context", str(max_context), "--max-waiting", str(max(256, 2 * max_batch)),
               "--log-level", "warning"]  # fmt: skip
        for flag in ("device", "dtype"):
            if getattr(args, flag):
                cmd += [f"--{flag}", getattr(args, flag)]
        return cmd + args.g4ops_args.split()
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", model_dir, *common]
    if args.device:
        cmd += ["--device", args.device]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + baseline_args.split()


def launch(server: str, args, model_dir: str, max_batch: int, max_context: int, baseline_args: str):
    """Start `server` on a free loopback port; -> (process, url)."""
    port = free_port()
    cmd = server_command(server, args, model_dir, port, max_batch, max_context, baseline_args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server} exited with {proc.returncode} before it was ready: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{server} was not ready within {args.startup_timeout} s")


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


def measure(server: str, url: str, args, levels: list[int], stop_on_error: bool = False, model: str | None = None,
            ) -> dict:  # fmt: skip
    """Every level against one running server (up to the first failed one with `stop_on_error`). `model`: the id
    requests name (default: the first of /v1/models)."""
    if model is None:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    run = {"server": server, "url": url, "model": model, "levels": []}
    rng = random.Random(args.seed)  # both servers get the same prompts
    print(f"== {server} ({model})\n{'conc':>5}{'reqs':>6}{'out tok/s':>11}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}"
          f"{'p99':>8}{'TPOT p50':>10}{'p99':>8}  (ms)", flush=True)
    for c in levels:
        row = asyncio.run(run_level(server, url, model, args, c, rng))
        run["levels"].append(row)
        if "error" in row:
            print(f"{c:>5}  ERROR {row['error']}", flush=True)
            if stop_on_error:
                break
            continue
        t, i, p = row["ttft_ms"], row["itl_ms"], row["tpot_ms"]
        print(f"{c:>5}{row['requests']:>6}{row['output_tok_s']:>11.1f}{t['p50']:>10.1f}{t['p99']:>8.1f}"
              f"{_f(i['p50']):>9}{_f(i['p99']):>8}{_f(p['p50']):>10}{_f(p['p99']):>8}", flush=True)
    return run


def launch_and_measure(server: str, args, model_dir: str, levels: list[int], baseline_args: str) -> dict:
    try:
        proc, url = launch(server, args, model_dir, max(levels), args.prompt_tokens + args.output_tokens,
                           baseline_args)  # fmt: skip
    except RuntimeError as exc:  # the other server still runs
        print(f"== {server}: {exc}", flush=True)
        return {"server": server, "error": str(exc), "levels": []}
    # a continuous-batching attempt stops at its first failed level: the fallback reruns them all
    cb_attempt = server == "transformers" and "--continuous-batching" in baseline_args.split()
    # transformers serve names a forced model by its path (and 5.6's /v1/models fails without a hub cache)
    model = model_dir if server == "transformers" else None
    try:
        run = measure(server, url, args, levels, stop_on_error=cb_attempt, model=model)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:  # the other server still runs
        run = {"server": server, "url": url, "error": f"{type(exc).__name__}: {exc}", "levels": []}
    finally:
        code = stop(proc, timeout=60)
    return dict(run, server_args=baseline_args if server == "transformers" else args.g4ops_args,
                server_exit_code=code)


def plot(results: dict, path: str) -> None:
    """Output tok/s and p99 TPOT against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, lat) = plt.subplots(1, 2, figsize=(10, 4))
    for run in results["runs"]:
        ok = [r for r in run["levels"] if "error" not in r]
        xs = [r["concurrency"] for r in ok]
        tput.plot(xs, [r["output_tok_s"] for r in ok], marker="o", label=run["server"])
        lat.plot(xs, [r["tpot_ms"]["p99"] for r in ok], marker="o", label=run["server"])
    levels = sorted({r["concurrency"] for run in results["runs"] for r in run["levels"]})
    for ax, title in ((tput, "output tok/s"), (lat, "p99 time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set(xticks=levels, xticklabels=[str(c) for c in levels], xlabel="concurrent requests", title=title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    env = results["environment"]
    fig.suptitle(f"{results['config'].get('model') or results['config'].get('shape') or 'tiny-e4b'}: "
                 f"{results['config']['prompt_tokens']} prompt + {results['config']['output_tokens']} output tokens, "
                 f"{env['date']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--url", help="a running server of the one kind in --servers (default: launch each)")
    ap.add_argument("--model", help="checkpoint directory both servers load (default: random weights of --shape)")
    ap.add_argument("--shape", help="without --model: random weights of this shape (e4b; default tiny-e4b)")
    ap.add_argument("--device", help="for the launched servers")
    ap.add_argument("--dtype", help="for the launched servers (default: bfloat16 on CUDA, float32 on a CPU)")
    ap.add_argument("--g4ops-args", default="", help="extra arguments of `python -m g4ops serve` (e.g. --no-compile)")
    ap.add_argument("--baseline-args", default="--continuous-batching",
                    help="extra arguments of `transformers serve` (default: %(default)s)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    ap.add_argument("--baseline-concurrency", default=None,
                    help="levels for transformers serve (default: --concurrency); stock without continuous batching "
                         "serves one request at a time, so its high levels cost minutes of device time each")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="requests per concurrent client at each level")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--level-timeout", type=float, default=900.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a PNG of throughput and p99 latency against concurrency here")
    ap.add_argument("--plot-only", help="no run: plot the results in this JSON file (with --plot)")
    args = ap.parse_args(argv)
    if args.plot_only:
        if not args.plot:
            ap.error("--plot-only needs --plot")
        plot(json.loads(Path(args.plot_only).read_text()), args.plot)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    baseline_levels = [int(c) for c in (args.baseline_concurrency or args.concurrency).split(",")]
    servers = args.servers.split(",")
    if min(levels + baseline_levels) < 1 or args.prompt_tokens < 2 or args.output_tokens < 2 or args.rounds < 1:
        ap.error("concurrency >= 1, --prompt-tokens >= 2, --output-tokens >= 2 and --rounds >= 1")
    if not servers or any(s not in SERVERS for s in servers) or (args.url and len(servers) != 1):
        ap.error(f"--servers: names from {SERVERS}, exactly one with --url; got {args.servers!r}")

    results = {"config": dict(vars(args)), "environment": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": platform.python_version(),
        "host": platform.node()}, "runs": []}
    clean = True
    try:
        if args.url:
            results["runs"].append(measure(servers[0], args.url, args, levels))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = args.model or save_checkpoint(args, tmp)
                for server in servers:
                    server_levels = baseline_levels if server == "transformers" else levels
                    run = launch_and_measure(server, args, model_dir, server_levels, args.baseline_args)
                    failed = [r["error"] for r in run["levels"] if "error" in r][:1]
                    if server == "transformers" and "--continuous-batching" in args.baseline_args.split() and failed:
                        # "continuous batching on if it runs": stock's paged cache may not take Gemma-4; then
                        # the baseline is stock serve without it, and the JSON says why
                        print(f"== transformers with continuous batching failed ({failed[0][:200]}); again "
                              "without it", flush=True)
                        plain = args.baseline_args.replace("--continuous-batching", "--no-continuous-batching")
                        run = dict(launch_and_measure(server, args, model_dir, server_levels, plain),
                                   continuous_batching_error=failed[0])  # fmt: skip
                    results["runs"].append(run)
                    if args.out:  # each server's results land as soon as it is done (a call may be cut short)
                        Path(args.out).write_text(json.dumps(results, indent=1))
                    clean = clean and run.get("server_exit_code", 0) in (0, -signal.SIGTERM)
    finally:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    ok = all("error" not in run and all("error" not in r for r in run["levels"]) for run in results["runs"])
    return 0 if ok and clean else 1


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
