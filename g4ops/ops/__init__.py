"""The op layer (design.md section 2): g4ops' operators as PyTorch custom ops, knowing neither transformers nor peft.

    core.py           the `g4ops` torch library: the op schemas (declared once), input checks, fake/autograd/autocast
                      registrations and the Python API of rms_norm, geglu_mlp, gelu_tanh_mul, sandwich_norm,
                      embedding, decode_attention and adamw_step
    reference.py      the reference math: CPU kernel, fast twin of the test oracle, the Neuron lowering
    _build.py         JIT build and loading of csrc/'s CUDA kernels; clear errors, opt-in reference fallback
    attention.py      exact chunked attention and the FlexAttention sliding-window band (imported when first used)
    lora.py           LoRA as ops: the MLP op and the one-projection op, their autograd formulas and kernels
    loss.py           fused linear cross-entropy with Gemma's final logit softcap
    _fused.py         running an op's own elementwise math through torch.compile (loss.py, lora.py)
    _torch_version.py which torch a feature needs

Here: the public wrappers of core.py (`g4ops.ops.rms_norm(...)`), looked up on this package by the layers above so
that a test can swap one (monkeypatch.setattr(g4ops.ops, "sandwich_norm", ...)). Private names (`_lib`,
`_BELOW_AUTOGRAD`, `NAMESPACE`, the checks) are imported from the module that defines them.
"""

from .core import (adamw_step, decode_attention, embedding, geglu_mlp, gelu_tanh_mul, rms_norm, sandwich_norm,
                   to_autocast_dtype)  # fmt: skip

__all__ = [
    "adamw_step",
    "decode_attention",
    "embedding",
    "geglu_mlp",
    "gelu_tanh_mul",
    "rms_norm",
    "sandwich_norm",
    "to_autocast_dtype",
]
