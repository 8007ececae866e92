"""`python -m g4ops serve --backend neuron`: the OpenAI server (g4ops/serve) over a NeuronEngine.

Without `--neuron-artifact` the served model is built from the loaded HF model (`--model PATH`, or the built-in
`--shape`): TP=1 in process, or `--tp N` CPU rank processes over gloo (the path the tests drive). With
`--neuron-artifact DIR` (compiled by `python -m neuron_backend compile --sample-cap K`) the buckets run on the
NeuronCores through compile.CompiledModel; that needs the Neuron SDK and has never run here.
"""

from __future__ import annotations

import argparse

DEFAULT_SAMPLE_CAP = 64  # gemma-4-E4B-it's generation config samples with top_k 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--backend neuron")
    g.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (CPU: processes over gloo)")
    g.add_argument("--neuron-buckets", type=int, nargs="+", default=[32, 128],
                   help="prefill bucket sizes (clipped to --max-context)")
    g.add_argument("--sample-cap", type=int, default=DEFAULT_SAMPLE_CAP,
                   help="top-k candidates per rank for on-device sampling (requests need top_k <= this)")
    g.add_argument("--neuron-artifact", help="a compiled artifact directory (Neuron SDK); --model gives the tokenizer")


def engine_from_hf_model(model, tp: int, max_batch: int, max_context: int, buckets=(32, 128),
                         sample_cap: int = DEFAULT_SAMPLE_CAP, max_waiting: int = 256, setup=None):  # fmt: skip
    """A NeuronEngine over `model` (an HF Gemma-4 on the CPU) sharded `tp` ways, KV rows = max_batch."""
    from .config import BuildSettings
    from .engine import NeuronEngine
    from .loader import _text_config, build_rank_model, text_state_dict
    from .runner import GlooTPRunner, ModuleRunner

    cfg = _text_config(model.config, model)
    sd = text_state_dict(model.state_dict())
    settings = BuildSettings(tp=tp, batch=max_batch, max_seq=max_context, sample_cap=sample_cap,
                             prefill_buckets=tuple(sorted({min(b, max_context) for b in buckets})),
                             dtype=next(model.parameters()).dtype)  # fmt: skip
    if tp == 1:
        built, ple, _ = build_rank_model(sd, cfg, settings)
        runner = ModuleRunner(built, ple)
    else:
        runner = GlooTPRunner(sd, cfg, settings, setup=setup)
    return NeuronEngine(runner, max_waiting=max_waiting)


def engine_from_args(args, model):
    """The engine `python -m g4ops serve --backend neuron` serves (`model`: what cli.load loaded)."""
    if args.neuron_artifact:
        from .compile import CompiledModel
        from .engine import NeuronEngine
        from .runner import CompiledRunner

        return NeuronEngine(CompiledRunner(CompiledModel(args.neuron_artifact)), max_waiting=args.max_waiting)
    return engine_from_hf_model(model, args.tp, args.max_batch, args.max_context, args.neuron_buckets,
                                args.sample_cap, args.max_waiting)  # fmt: skip
