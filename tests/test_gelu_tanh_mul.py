"""g4ops.gelu_tanh_mul (the GeGLU product alone, Gemma-4's per-layer-input gate): schema and fake kernel (opcheck),
fp64 gradients (gradcheck), accuracy against an fp64 oracle next to stock's `F.gelu(g, "tanh") * u`, bad input,
and what it is for: an enabled decoder layer computes its per-layer gate with it, so a compiled backward holds one
gelu_tanh_mul_backward per layer (not the gate arithmetic of every layer inside the sum over layers).

The layouts include the one the model passes: per_layer_inputs[:, :, i, :], a slice along a middle dim, which the
CUDA kernels read in place (rows `ld` apart)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import g4ops
from g4ops import ops

try:
    from . import oracle as O
    from .devices import DEVICES
    from .test_ops import _call_modes
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES
    from test_ops import _call_modes

OPS = torch.ops.g4ops
LOW_AND_FP32 = [torch.bfloat16, torch.float16, torch.float32]
# the model's layout ("middle": a per-layer slice of [B, T, layers, D]) and the oracle's strided ones
LAYOUTS = ("middle", *O.LAYOUTS)


def make(shape, dtype, gen, layout, device, scale=1.0):
    """A random nonzero tensor of `shape` in `layout`; "middle" is x[:, :, 1, :] of a [*shape[:-1], 3, D] tensor
    (its rows lie 3 * D apart), or of [1, 3, D] for a 1-D shape."""
    if layout != "middle":
        return O.make_tensor(shape, dtype, gen, layout, device=device, scale=scale)
    base = O.make_tensor((*shape[:-1], 3, shape[-1]), dtype, gen, device=device, scale=scale)
    return base.select(-2, 1)


def _pair(shape, dtype, gen, gate_layout, up_layout, device):
    gate = make(shape, dtype, gen, gate_layout, device, scale=3.0)  # spans gelu's curved part and both tails
    return gate, make(shape, dtype, gen, up_layout, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_AND_FP32, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_gelu_tanh_mul(device, dtype, layout):
    gen = torch.Generator().manual_seed(1)
    gate, up = _pair((2, 5, 24), dtype, gen, "contiguous", layout, device)
    for grads in ((False, False), (True, True), (True, False), (False, True)):
        args = tuple(t.detach().requires_grad_(r) for t, r in zip((gate, up), grads))
        torch.library.opcheck(OPS.gelu_tanh_mul.default, args)
    dy = O.make_tensor(gate.shape, dtype, gen, device=device)
    for mask in ([True, True], [True, False], [False, True], [False, False]):
        torch.library.opcheck(OPS.gelu_tanh_mul_backward.default, (dy, gate, up, mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "middle", "transposed"])
@pytest.mark.parametrize("grads", ["both", "gate", "up"])
def test_gradcheck_gelu_tanh_mul(device, layout, grads):
    gen = torch.Generator().manual_seed(2)
    gate, up = _pair((3, 7), torch.float64, gen, layout, layout, device)
    wanted = {"both": (True, True), "gate": (True, False), "up": (False, True)}[grads]
    args = tuple(t.detach().requires_grad_(r) for t, r in zip((gate, up), wanted))
    assert torch.autograd.gradcheck(g4ops.gelu_tanh_mul, args, eps=1e-6, atol=1e-9, rtol=1e-7)


def _run(fn, gate, up, dy):
    """(h, grad_gate, grad_up) of fn on leaf copies of gate and up (their layouts kept)."""
    g, u = (t.detach().requires_grad_() for t in (gate, up))
    h = fn(g, u)
    h.backward(dy)
    return h, g.grad, u.grad


def _stock(g, u):
    return F.gelu(g, approximate="tanh") * u


@st.composite
def configs(draw):
    dtype = draw(st.sampled_from(LOW_AND_FP32))
    lead = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 7]), min_size=0, max_size=2)))
    dim = draw(st.one_of(st.sampled_from([1, 3, 7, 8, 64, 257, 1025]), st.integers(1, 300)))
    gate_layout, up_layout = draw(st.sampled_from(LAYOUTS)), draw(st.sampled_from(LAYOUTS))
    return dtype, (*lead, dim), gate_layout, up_layout


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_gelu_tanh_mul_no_less_accurate_than_stock(device, config, seed):
    """Forward and both gradients against fp64, each no worse than stock's two-step (two roundings) result; the op
    rounds once, so in bf16 it is usually the more accurate."""
    dtype, shape, gate_layout, up_layout = config
    gen = torch.Generator().manual_seed(seed)
    gate, up = _pair(shape, dtype, gen, gate_layout, up_layout, device)
    dy = O.make_tensor(shape, dtype, gen, device=device)
    ours, stock = _run(g4ops.gelu_tanh_mul, gate, up, dy), _run(_stock, gate, up, dy)
    g64, u64, dy64 = (t.double() for t in (gate, up, dy))
    truth = (O.gelu_tanh(g64) * u64, dy64 * u64 * O.gelu_tanh_grad(g64), dy64 * O.gelu_tanh(g64))
    n = gate.numel()
    for name, g4, st_, ref in zip(("h", "grad_gate", "grad_up"), ours, stock, truth):
        assert g4.dtype == dtype and g4.shape == gate.shape, (name, g4.dtype, g4.shape)
        # (no bound on the error alone: ATen's fp32 tanh formula, which both compute, loses its relative accuracy
        # where gelu's tail cancels, gate < -4 or so, and a one-element draw can sit there)
        O.assert_no_worse_than_stock(name, O.rel_err(g4, ref), O.rel_err(st_, ref), O.floor(dtype, 1, n))


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_mul_frozen_input_gets_no_gradient(device):
    """A frozen `up` (the per-layer input of a LoRA finetune, whose embeddings are frozen) asks the backward for the
    gate's gradient alone, and the result equals the one computed with both."""
    gen = torch.Generator().manual_seed(4)
    gate, up = _pair((5, 40), torch.bfloat16, gen, "contiguous", "middle", device)
    dy = O.make_tensor(gate.shape, torch.bfloat16, gen, device=device)
    g = gate.detach().requires_grad_()
    g4ops.gelu_tanh_mul(g, up).backward(dy)
    assert up.grad is None
    both = _run(g4ops.gelu_tanh_mul, gate, up, dy)
    torch.testing.assert_close(g.grad, both[1], rtol=0, atol=0)


def _bad_cases(device):
    g = torch.randn(3, 8, device=device)
    return {
        "int gate": ((g.to(torch.int32), g), "`gate` must be float16"),
        "shape": ((g, torch.randn(3, 9, device=device)), r"`up` must have the shape of `gate` \[3, 8\]"),
        "dtype": ((g, g.to(torch.bfloat16)), "`up` is torch.bfloat16 but `gate` is torch.float32"),
        "device": ((g, torch.randn(3, 8, device="meta")), "`up` is on meta but `gate` is on"),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "requires_grad", "inference_mode", "fake"])
@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_gelu_tanh_mul_bad_input(device, mode, case):
    args, message = _bad_cases(device)[case]
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        _call_modes(g4ops.gelu_tanh_mul, args, mode)


def _backward_targets(model, ids):
    """The call targets of the backward graph AOTAutograd builds for a compiled training step of `model`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    targets = []

    def backward_compiler(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=backward_compiler)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    return targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainable", ["full", "frozen embeddings"])
def test_enabled_layers_gate_their_per_layer_input_with_the_op(device, trainable):
    """In training each decoder layer's per-layer-input gate is one gelu_tanh_mul, in eager mode (counted calls) and
    in the compiled backward (one gelu_tanh_mul_backward per layer), and not in inference; the gradients equal
    stock's two-step gate within fp32 rounding. On CUDA this checks that the GPU's torch/transformers stack takes
    the op too."""
    from g4ops.models import build_model

    layers = 4
    torch.manual_seed(0)
    stock = build_model("tiny-e4b", num_layers=layers, device=device)
    model = build_model("tiny-e4b", num_layers=layers, device=device)
    model.load_state_dict(stock.state_dict())
    if trainable == "frozen embeddings":
        for m in (stock, model):
            m.get_input_embeddings().weight.requires_grad_(False)
            m.model.embed_tokens_per_layer.weight.requires_grad_(False)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 9), device=device)
    stock(input_ids=ids, labels=ids).loss.backward()

    calls = []
    real = ops.gelu_tanh_mul

    def counting(gate, up):
        calls.append(gate.shape)
        return real(gate, up)

    with g4ops.enable(model):
        ops.gelu_tanh_mul, saved = counting, ops.gelu_tanh_mul
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            assert len(calls) == layers, calls
            with torch.no_grad():  # inference keeps stock's two steps (a compiled decode step fuses them)
                model(input_ids=ids)
            assert len(calls) == layers, calls
        finally:
            ops.gelu_tanh_mul = saved
        for (name, p), q in zip(model.named_parameters(), stock.parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=2e-6, msg=name)
        model.zero_grad()
        targets = _backward_targets(model, ids)
    assert targets.count("g4ops.gelu_tanh_mul_backward.default") == layers, targets
