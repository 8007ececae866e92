"""Gradient checkpointing with g4ops enabled frees the decoder layers' activations, as it does for stock.

Regression (issue 15): since transformers 5.23, `GradientCheckpointingLayer.__init_subclass__` wraps a layer class's
own `forward` and checkpoints only when `type(self).forward` is that wrapper; enable() replaced the decoder layer's
forward, so no layer was checkpointed. Losses and gradients stayed equal, so only the bytes kept for backward show
it: these tests count them with `torch.autograd.graph.saved_tensors_hooks` and require that checkpointing removes
most of them (on the tiny model, stock keeps 14% of its no-checkpointing bytes; g4ops kept 100% before the fix), on
the fused sandwich-norm layer path and on the stock-forward fallback path, patched on the class and on one model,
for each `use_reentrant`, eager and under torch.compile.
"""

from __future__ import annotations

import pytest
import torch

import g4ops
from g4ops.hf import patches
from g4ops.models import build_model

hf = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

# With checkpointing, what stays saved is each layer's input plus what lives outside the layers (embeddings, final
# norm, loss): 9% (g4ops) and 14% (stock) of the no-checkpointing bytes on the tiny model at 2 x 64 tokens. A layer
# left un-checkpointed keeps about a sixth of the bytes on its own, so 30% fails if any one layer is not.
KEPT_FRACTION_MAX = 0.30


@pytest.fixture(autouse=True)
def _always_disabled():
    g4ops.disable()
    yield
    g4ops.disable()


def _saved_bytes_and_grads(model, ids, checkpointing: bool, use_reentrant=None, compiled: bool = False):
    """(bytes saved for backward during one forward with labels, loss, every parameter's gradient)."""
    model.train()
    if checkpointing:
        kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    run = torch.compile(model, backend="aot_eager", fullgraph=False) if compiled else model
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.gradient_checkpointing_disable()
    return saved[0], loss.detach(), grads


def _count_checkpoint_calls(model) -> list[int]:
    """Wrap each decoder layer's checkpoint function with a call counter (what transformers' own test checks)."""
    calls = [0]
    for layer in model.model.layers:
        inner = layer._gradient_checkpointing_func

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    return calls


def _hook_every_layer_norm(model) -> None:
    """A forward hook on each post-attention norm makes every layer take its stock-forward fallback path."""
    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_hook(lambda *a: None)


def _enable(how: str, model):
    return g4ops.enable() if how == "class" else g4ops.enable(model)


@pytest.mark.parametrize("use_reentrant", [None, True, False])
@pytest.mark.parametrize("how", ["class", "model"])
@pytest.mark.parametrize("layer_path", ["fused", "fallback"])
def test_checkpointing_frees_layer_activations(use_reentrant, how, layer_path, monkeypatch):
    model = build_model("tiny-e4b")
    if layer_path == "fallback":
        _hook_every_layer_norm(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    _, stock_loss, stock_grads = _saved_bytes_and_grads(model, ids, checkpointing=True, use_reentrant=use_reentrant)
    fused_calls = []
    real = g4ops.ops.sandwich_norm
    monkeypatch.setattr(g4ops.ops, "sandwich_norm", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    with _enable(how, model):
        full, _, _ = _saved_bytes_and_grads(model, ids, checkpointing=False)
        fused_calls.clear()
        kept, loss, grads = _saved_bytes_and_grads(model, ids, checkpointing=True, use_reentrant=use_reentrant)
    assert kept <= KEPT_FRACTION_MAX * full, f"checkpointing kept {kept} of {full} bytes: layers not checkpointed"
    assert (len(fused_calls) > 0) == (layer_path == "fused")
    assert abs(loss.item() - stock_loss.item()) <= 2e-5 * abs(stock_loss.item())
    assert grads.keys() == stock_grads.keys()
    for name, g in stock_grads.items():
        err = ((grads[name].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)).item()
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("how", ["class", "model"])
def test_each_layer_runs_its_checkpoint_function(how):
    """transformers' own test_training_gradient_checkpointing asserts this: it failed with '0 not greater than 1'."""
    model = build_model("tiny-e4b").train()
    ids = torch.randint(3, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with _enable(how, model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        calls = _count_checkpoint_calls(model)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert calls[0] == model.config.num_hidden_layers
    model.eval()
    with torch.no_grad(), _enable(how, model):
        calls[0] = 0
        model(input_ids=ids)  # no gradients: no checkpointing, the layers run as they are
    assert calls[0] == 0


@pytest.mark.parametrize("layer_path", ["fused", "fallback"])
def test_checkpointing_frees_layer_activations_under_torch_compile(layer_path):
    model = build_model("tiny-e4b")
    if layer_path == "fallback":
        _hook_every_layer_norm(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    _, stock_loss, _ = _saved_bytes_and_grads(model, ids, checkpointing=True, use_reentrant=False)
    with g4ops.enable():
        torch._dynamo.reset()
        full, _, _ = _saved_bytes_and_grads(model, ids, checkpointing=False, compiled=True)
        torch._dynamo.reset()
        kept, loss, _ = _saved_bytes_and_grads(model, ids, checkpointing=True, use_reentrant=False, compiled=True)
    torch._dynamo.reset()
    assert kept <= KEPT_FRACTION_MAX * full, f"compiled: checkpointing kept {kept} of {full} bytes"
    assert abs(loss.item() - stock_loss.item()) <= 2e-5 * abs(stock_loss.item())


def test_patched_layer_class_keeps_transformers_checkpoint_wrapper_outermost():
    """On transformers with the class-level wrapper, the patched class's forward is such a wrapper around ours, and
    disable() puts transformers' own wrapper back."""
    stock = hf.Gemma4TextDecoderLayer.forward
    with g4ops.enable():
        patched = hf.Gemma4TextDecoderLayer.forward
        assert patched is not stock
        assert patches._is_checkpoint_wrapper(patched) == patches._is_checkpoint_wrapper(stock)
        assert patches._stock_forward_of(hf.Gemma4TextDecoderLayer) is patches._unwrap_checkpoint(stock)
    assert hf.Gemma4TextDecoderLayer.forward is stock
