"""neuron_backend: Gemma-4 text decoders on AWS Inferentia2 with tensor parallelism and a device-resident KV cache.

    config.py       TextConfig (read once from an HF config) and BuildSettings (TP, batch, KV length, buckets)
    collectives.py  all_reduce_fp32 / all_gather: SingleRank, GlooCollectives (CPU), XlaCollectives (Neuron, XLA)
    parallel.py     column / row / vocab-parallel layers, distributed argmax
    model.py        the Neuron-shaped decoder: static buckets, KV buffers written in place (trace-safe)
    loader.py       sharded loader: every HF key consumed, `layer_scalar` included, loud on missing / left over
    sampling.py     vocab-parallel sampling: per-rank top-k candidates, transformers' warpers on the merged set
    generate.py     greedy loop over the buckets for any backend (the checks)
    runner.py       one bucket call behind one signature: in-process module, gloo TP rank processes, NeuronCores
    engine.py       NeuronEngine: continuous batching, sampling, stop tokens, streaming (BatchEngine's interface)
    serve.py        `python -m g4ops serve --backend neuron`
    cpu_tp.py       TP ranks as CPU processes over gloo
    check.py        stock vs TP=1 vs TP=N greedy check behind `python -m neuron_backend check`
    export.py       torch.export of each bucket and its mutated-buffer list
    compile.py      torch-neuronx / neuronx-distributed ModelBuilder driver (needs the Neuron SDK)

See neuron_backend/README.md.
"""

from .config import BuildSettings, TextConfig, from_hf_config
from .loader import StateDictError, build_from_hf_model, build_rank_model, shard_state_dict, text_state_dict
from .model import NeuronGemma4ForCausalLM, PLETokenEmbedding

__all__ = [
    "BuildSettings",
    "TextConfig",
    "from_hf_config",
    "StateDictError",
    "build_from_hf_model",
    "build_rank_model",
    "shard_state_dict",
    "text_state_dict",
    "NeuronGemma4ForCausalLM",
    "PLETokenEmbedding",
]
