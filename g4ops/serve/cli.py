"""`python -m g4ops serve`: load the model, start the engine, run uvicorn until SIGINT/SIGTERM.

On SIGTERM uvicorn stops accepting connections, gives requests in flight `--graceful-timeout` seconds to finish,
cancels the rest (each stream's cancellation takes its request out of the engine), then leaves the app's lifespan,
which shuts the engine down."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from ..models import SHAPES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TINY = "tiny-e4b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local checkpoint directory (default: a built-in Gemma-4 of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=TINY,
                        help="without --model: random weights of this shape built in code, with a byte-level "
                             "tokenizer over its vocabulary (e4b: E4B's text decoder, for benchmarks)")
    parser.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoding at once (KV cache rows)")
    parser.add_argument("--max-context", type=int, default=2048, help="prompt + completion tokens per request")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before answering 429")
    # 2048: on the H200 (42 layers) prompts sharing one prefill call took 64 concurrent requests from 1147 to 3346
    # output tok/s against a budget of 256 (an eager prefill call is mostly launch overhead)
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="prompt tokens per prefill call, shared by waiting prompts, between decode steps")
    # on by default on CUDA: one 42-layer E4B request on the H200 (2026-12-01, bench/serve.py) streamed at 5.57 ms per
    # token compiled against 11.1 graphed only; the price is minutes of start-up (each batch bucket compiles once)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the decode step before capturing it: faster steps, minutes of warm-up "
                             "(default: on for CUDA, off on a CPU, where the step runs eagerly)")
    parser.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile the prefill's model call (dynamic shapes: two graphs, for 1-row and "
                             "several-row calls of any prompt length, compiled at start-up) (default: off; its GPU "
                             "start-up time is not measured yet)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--graceful-timeout", type=float, default=10.0,
                        help="seconds requests in flight may run on after SIGTERM before they are cancelled")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--backend", choices=("cuda", "neuron"), default="cuda",
                        help="cuda: g4ops' BatchEngine (CUDA graphs; eager on --device cpu); neuron: neuron_backend's "
                             "tensor-parallel static model (CPU ranks over gloo, or a compiled --neuron-artifact)")
    from neuron_backend.serve import add_arguments as neuron_arguments  # argparse only

    neuron_arguments(parser)


def load(args):
    """(model, tokenizer, served name) from the arguments; never downloads."""
    from ..models import build_model, load_checkpoint, load_tokenizer, tiny_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device.startswith("cuda") else "fp32")]
    if args.model is None:
        model = build_model(args.shape, dtype=dtype, device=device)
        return model, tiny_tokenizer(model.config), args.served_model_name or args.shape
    model = load_checkpoint(args.model, dtype=dtype, device=device)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return model, load_tokenizer(args.model), name


def defaults_for(model):
    """The model's generation config as request defaults, its eos ids (`models.special_tokens`) the stop tokens."""
    from ..models import special_tokens
    from .params import GenerationDefaults

    return GenerationDefaults.from_generation_config(getattr(model, "generation_config", None),
                                                     special_tokens(model).eos_token_id)


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        print(f"g4ops serve needs the serve extra (pip install 'g4ops[serve]'): {exc}", file=sys.stderr)
        return 1

    from ..engine.batch import BatchEngine, SamplingParams
    from .app import create_app

    if args.backend == "neuron":
        args.device = args.device or "cpu"  # the HF model only feeds the shards (CPU ranks or the artifact)
    model, tokenizer, name = load(args)
    defaults = defaults_for(model)
    if args.backend == "neuron":
        from neuron_backend.serve import engine_from_args

        engine = engine_from_args(args, model)
    else:
        device = next(model.parameters()).device
        engine = BatchEngine(model, max_batch=args.max_batch, max_context=args.max_context,
                             max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk,
                             compile=args.compile if args.compile is not None else device.type == "cuda",
                             compile_prefill=args.compile_prefill)  # fmt: skip
    # capture every batch bucket's step now, for greedy and for the checkpoint's sampling, seeded or not: else the
    # first batch of each size stalls while its graph is made
    sampled = SamplingParams(max_new_tokens=1, temperature=defaults.temperature, top_k=defaults.top_k,
                             top_p=defaults.top_p, min_p=defaults.min_p)  # fmt: skip
    engine.warmup([sampled, dataclasses.replace(sampled, seed=0)])
    engine.start()
    app = create_app(engine, tokenizer, name, defaults)
    print(f"g4ops serve: {name} on {next(model.parameters()).device} in {next(model.parameters()).dtype}, "
          f"max_batch {args.max_batch}, max_context {args.max_context}: http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout)
    try:
        uvicorn.Server(config).run()
    finally:
        engine.shutdown(args.graceful_timeout)  # a no-op after the lifespan's; needed when startup failed
    return 0
