"""`python -m g4ops {demo,build,doctor,serve}`.

demo    stock vs g4ops, eager and torch.compile'd, greedy decode side by side with a parity verdict and timings; a
        tiny built-in Gemma-4 by default (random weights, built in code), or `--model PATH` for a local checkpoint.
build   prebuild the CUDA kernels into the cache (what the first CUDA call would otherwise do).
doctor  versions, GPU, toolkit, and whether the kernels build and the transformers integration probe passes.
serve   an OpenAI-compatible HTTP server (chat/completions, SSE streaming, /metrics) over the batching engine; the
        tiny built-in Gemma-4 by default, or `--model PATH`. Needs the `serve` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import threading
import time

import torch


@contextlib.contextmanager
def _progress(label: str, every_s: float = 5.0):
    """Print a heartbeat while a long step (compilation) runs, so nobody thinks it hung."""
    done = threading.Event()
    start = time.perf_counter()

    def beat():
        while not done.wait(every_s):
            print(f"    ... {label}: {time.perf_counter() - start:.0f} s", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _load(args):
    """(model, prompt_ids, decode) for the tiny built-in model or a local checkpoint."""
    from .models import build_model, load_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")
    ]
    if args.model is None:
        model = build_model("tiny-e4b", dtype=dtype, device=device)
        prompt = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
        return model, prompt.to(device), lambda ids: " ".join(str(i) for i in ids[:16]) + (" ..." if len(ids) > 16 else "")
    from .models import load_tokenizer

    tokenizer = load_tokenizer(args.model)  # first: a directory without one fails before the weights load
    model = load_checkpoint(args.model, dtype=dtype, device=device)
    prompt = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    return model, prompt, lambda ids: repr(tokenizer.decode(ids, skip_special_tokens=True))


def _generate(model, prompt, new_tokens: int, compiled: bool):
    """Greedy decode. Compiled = transformers' own path: a static cache and generate's torch.compile of the decode
    step (prefill stays eager), as a user gets with `cache_implementation="static"`."""
    from transformers import GenerationConfig
    from transformers.generation import CompileConfig

    from .models import special_tokens

    ids = special_tokens(model)
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=ids.pad_token_id, eos_token_id=list(ids.eos_token_id) or None,
        disable_compile=not compiled,
    )
    if compiled:
        config.cache_implementation = "static"
        on_gpu = prompt.is_cuda
        config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if on_gpu else "default")
        config.compile_config._compile_all_devices = not on_gpu  # transformers auto-compiles only on accelerators
    if prompt.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, generation_config=config)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out[0, prompt.shape[1]:].tolist(), time.perf_counter() - start


def _decode_graphed(model, prompt, new_tokens: int, compiled: bool):
    """(tokens, first-run seconds incl. capture, steady seconds) of g4ops.engine.decoder.Decoder (greedy), with
    min_new_tokens as in `_generate`."""
    from .engine.decoder import GreedyDecoder
    from .models import special_tokens

    ids = special_tokens(model)
    decoder = GreedyDecoder(model, batch_size=prompt.shape[0], max_length=prompt.shape[1] + new_tokens,
                            compile=compiled and prompt.is_cuda)
    times, outs = [], []
    for _ in range(2):
        start = time.perf_counter()
        out = decoder.generate(prompt, new_tokens, eos_token_id=list(ids.eos_token_id), pad_token_id=ids.pad_token_id,
                               min_new_tokens=new_tokens)
        outs.append(out[0, prompt.shape[1]:].tolist())
        times.append(time.perf_counter() - start)
    assert outs[0] == outs[1], "g4ops decoder: greedy decode is not deterministic"
    return outs[0], times[0], times[1]


def demo(args) -> int:
    import g4ops

    model, prompt, decode = _load(args)
    device = prompt.device
    print(f"g4ops demo: {'tiny built-in Gemma-4 (random weights)' if args.model is None else args.model} on "
          f"{device} in {next(model.parameters()).dtype}, {args.tokens} greedy tokens\n")
    variants = [("stock", False, False), ("g4ops", True, False)]
    if not args.no_compile:
        variants += [("stock compiled", False, True), ("g4ops compiled", True, True)]
    rows = []
    for name, use_g4ops, compiled in variants:
        patches = g4ops.enable() if use_g4ops else None
        torch._dynamo.reset()
        vars(model).pop("_compiled_call", None)  # transformers caches its compiled decode step on the model
        print(f"  {name}: first run{' (compiling)' if compiled else ''}", flush=True)
        with _progress(f"{name} first run"):
            tokens, first_s = _generate(model, prompt, args.tokens, compiled)
        tokens_again, steady_s = _generate(model, prompt, args.tokens, compiled)
        if patches is not None:
            patches.__exit__(None, None, None)
        assert tokens_again == tokens, f"{name}: greedy decode is not deterministic"
        rows.append((name, tokens, first_s, steady_s))
    with g4ops.enable():  # g4ops' own decode path: the whole step in one CUDA graph (run eagerly off CUDA)
        rows.append(("g4ops decoder", *_decode_graphed(model, prompt, args.tokens, compiled=not args.no_compile)))

    reference = rows[0][1]
    print(f"\n{'variant':<16} {'first run s':>11} {'tok/s':>9}  same as stock  tokens")
    for name, tokens, first_s, steady_s in rows:
        same = tokens == reference
        print(f"{name:<16} {first_s:>11.2f} {len(tokens) / steady_s:>9.1f}  {'yes' if same else 'NO':<13}  {decode(tokens)}")
    mismatches = [name for name, tokens, *_ in rows if tokens != reference]
    if not mismatches:
        print("\nPARITY: every variant produced the same greedy tokens as stock transformers")
        return 0
    for name, tokens, *_ in rows:
        if name in mismatches:
            first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
            print(f"\nPARITY: {name} diverges from stock at new token {first}")
    # bf16/fp16 may legitimately diverge where the top-2 logits nearly tie; fp32 must not.
    return 1 if next(model.parameters()).dtype == torch.float32 else 0


def build(args) -> int:
    from .ops._build import KernelBuildError, build as build_kernels

    start = time.perf_counter()
    try:
        with _progress("building CUDA kernels"):
            library = build_kernels(verbose=args.verbose)
    except KernelBuildError as exc:
        print(f"g4ops build failed: {exc}", file=sys.stderr)
        return 1
    print(f"g4ops CUDA kernels ready in {time.perf_counter() - start:.1f} s: {library}")
    return 0


def doctor(args) -> int:
    from .ops import _build

    print(f"python        {platform.python_version()} ({sys.executable})")
    print(f"torch         {torch.__version__} (CUDA build: {torch.version.cuda})")
    try:
        import transformers

        from transformers.models.gemma4 import modeling_gemma4  # noqa: F401

        print(f"transformers  {transformers.__version__} (Gemma-4: yes)")
    except ImportError as exc:
        print(f"transformers  unusable: {exc}")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU           {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        print("GPU           none visible to torch: the reference kernels run (no compiler needed)")
    from torch.utils.cpp_extension import CUDA_HOME

    print(f"CUDA toolkit  {CUDA_HOME or 'not found'}")
    print(f"kernel cache  {_build.cache_dir()}")
    code = 0
    if torch.cuda.is_available() and not args.no_build:
        code = build(argparse.Namespace(verbose=False))
    status = _build.status()
    print(f"kernels       loaded: {status['loaded']}, error: {status['error']}, "
          f"reference fallback allowed: {status['allow_reference']}")
    try:
        from .hf import modules, patches

        patches._probe(modules.gemma4())
        print("integration   probe passed: installed transformers computes what the ops compute")
    except Exception as exc:  # report, don't crash: doctor is for diagnosing
        print(f"integration   probe FAILED: {exc}")
        code = 1
    return code


def serve(args) -> int:
    from .serve import cli

    return cli.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m g4ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="stock vs g4ops greedy decode, eager and compiled")
    p.add_argument("--model", help="local checkpoint directory (default: tiny built-in Gemma-4)")
    p.add_argument("--prompt", default="The capital of France is", help="prompt for --model")
    p.add_argument("--tokens", type=int, default=24, help="new tokens to generate")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.set_defaults(func=demo)
    p = sub.add_parser("build", help="prebuild the CUDA kernels")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=build)
    p = sub.add_parser("doctor", help="report versions and kernel status")
    p.add_argument("--no-build", action="store_true", help="do not try to build the kernels")
    p.set_defaults(func=doctor)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the batching engine")
    from .serve.cli import add_arguments  # argparse only: the server's packages load when it runs

    add_arguments(p)
    p.set_defaults(func=serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
