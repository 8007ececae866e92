"""peft LoRA on Gemma-4's attention projections through g4ops (`g4ops::lora_linear`, g4ops/ops/lora.py): after
`g4ops.enable(model)` each peft lora.Linear among a Gemma4TextAttention's q/k/v/o_proj runs the op. Exact against
stock peft in fp32, no worse than stock against an fp64 oracle in bf16 (fp32 adapters split onto bf16 products or
not), peft's adapter states, the op itself (opcheck, fp64 gradcheck, bad input, no full weight gradient for a frozen
base), what falls back to peft and says so, disable(), and torch.compile without graph breaks.

The module under test is one Gemma4TextAttention of odd width whose q_proj and o_proj a small holder calls in a row
(the routing is per projection; tests/test_lora.py runs the whole tiny model with LoRA on every projection).
Eager calls of a routed projection run peft's forward by default (`peft_lora.EAGER_LINEAR_VIA_OP`, faster there): the
tests here turn the op on in eager to check it; `test_eager_calls_run_peft_by_default` and the compile test check
the default.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import g4ops
from g4ops.hf import peft_lora
from g4ops.models import text_config
from g4ops.ops import lora

try:
    from . import oracle as O
    from .devices import DEVICES, G4opsCalls, LoraSplitPath
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, G4opsCalls, LoraSplitPath

peft = pytest.importorskip("peft")
hf = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

HIDDEN = 37  # odd on purpose; q_proj maps it to heads * head_dim and o_proj back
TOKENS = (3, 7)
F32, BF16 = torch.float32, torch.bfloat16
TRAIN = ("g4ops.lora_linear_forward.default", "g4ops.lora_linear_backward.default")


@pytest.fixture(autouse=True)
def _always_disabled(monkeypatch):
    monkeypatch.setattr(peft_lora, "EAGER_LINEAR_VIA_OP", True)  # the op, as a compiled model runs it (docstring)
    g4ops.disable()
    with g4ops.enable():  # the one-time probe draws from the global generator: here, not inside a test
        pass
    yield
    g4ops.disable()


class _Holder(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attn = attention

    def forward(self, x):
        return self.attn.o_proj(self.attn.q_proj(x))


def _model(device="cpu", dtype=F32, seed=0, **lora_kwargs):
    config = text_config("tiny-e4b")
    config.hidden_size = HIDDEN
    torch.manual_seed(seed)
    holder = _Holder(hf.Gemma4TextAttention(config, 0)).to(device=device, dtype=dtype)
    settings = dict(r=3, lora_alpha=5, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    settings.update(lora_kwargs)
    return peft.get_peft_model(holder, peft.LoraConfig(**settings)).to(device)


def _inputs(device, dtype, model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = O.make_tensor((*TOKENS, HIDDEN), dtype, gen, device=device)
    return x, O.make_tensor((*TOKENS, HIDDEN), dtype, gen, device=device)


def _run(model, x, grad_out, enabled: bool, seed=7, autocast=None):
    """(output, x's gradient, {trainable parameter: gradient}, g4ops op calls); the same dropout draws either way.
    `autocast`: a dtype to run the forward under torch.autocast with (the backward outside it)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    counter = G4opsCalls()
    torch.manual_seed(seed)
    with g4ops.enable(model) if enabled else contextlib.nullcontext(), counter:
        with torch.autocast(x.device.type, dtype=autocast or BF16, enabled=autocast is not None):
            out = model(x)
        out.backward(grad_out.to(out.dtype))
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert not [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return out.detach(), x.grad, grads, counter.calls


def _tol(k: int) -> float:
    return O.tolerance(F32, k, roundings=4)


def _assert_matches_stock(stock, ours):
    (o0, x0, g0, _), (o1, x1, g1, _) = stock, ours
    k = max(HIDDEN, TOKENS[0] * TOKENS[1])
    assert O.rel_err(o1, o0) <= _tol(k) and O.rel_err(x1, x0) <= _tol(k)
    assert g0.keys() == g1.keys() and g0 and all("lora_" in n for n in g0)
    for name in g0:
        assert O.rel_err(g1[name], g0[name]) <= _tol(k), name


# ----------------------------------------------------------------------------------------------------------------
# fp32: exact against stock peft, the op taken


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("settings", [{}, dict(lora_dropout=0.3), dict(use_rslora=True, r=4, lora_alpha=3)],
                         ids=["plain", "dropout", "rslora"])  # fmt: skip
def test_fp32_matches_peft_and_takes_the_op(device, settings):
    """With dropout, the op's masks are peft's own draws (same seed, same generator calls), so the results match."""
    model = _model(device, **settings).train()
    x, grad_out = _inputs(device, F32, model)
    stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
    _assert_matches_stock(stock, ours)
    assert all(ours[3].get(op) == 2 for op in TRAIN), ours[3]  # q_proj and o_proj
    assert not stock[3]


@pytest.mark.parametrize("device", DEVICES)
def test_several_active_adapters(device):
    model = _model(device).train()
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=7, use_rslora=True, target_modules=["o_proj"],
                                                init_lora_weights=False))  # fmt: skip
    x, grad_out = _inputs(device, F32, model)
    for active in (["default", "second"], ["second"]):
        model.base_model.set_adapter(active)
        stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
        _assert_matches_stock(stock, ours)
        assert {n.split(".")[-2] for n in ours[2]} == set(active)
        # "second" sits on o_proj only: with it alone active, q_proj has no adapter and runs its base layer
        assert ours[3].get(TRAIN[0]) == (2 if "default" in active else 1), ours[3]


@pytest.mark.parametrize("device", DEVICES)
def test_eager_calls_run_peft_by_default(device, monkeypatch, caplog):
    """Eager (HF Trainer's default), the routed projections run peft's forward, bitwise stock, and say so once;
    compiled, they take g4ops' path (test_compiled_fullgraph_has_no_graph_breaks_and_matches_eager)."""
    monkeypatch.setattr(peft_lora, "EAGER_LINEAR_VIA_OP", False)
    monkeypatch.setattr(peft_lora, "_logged", set())
    caplog.set_level(logging.INFO, logger="g4ops")
    model = _model(device, lora_dropout=0.3).train()
    x, grad_out = _inputs(device, F32, model)
    stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
    assert not ours[3], ours[3]  # no g4ops op ran
    assert torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1])
    assert all(torch.equal(ours[2][name], g) for name, g in stock[2].items())
    assert caplog.text.count("run peft's forward, faster there than g4ops.lora_linear") == 1


# ----------------------------------------------------------------------------------------------------------------
# bf16: no worse than stock against fp64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapter_fp32", [True, False], ids=["fp32-adapters", "bf16-adapters"])
@pytest.mark.parametrize("split", ["base_first", "base_last", None],
                         ids=["split-products", "split-products-base-last", "fp32-products"])
def test_bf16_no_worse_than_peft_against_fp64(device, adapter_fp32, split, monkeypatch):
    path = LoraSplitPath(monkeypatch, device, split)
    model = _model(device, BF16).train()  # peft keeps a bf16 model's adapters in fp32
    if not adapter_fp32:
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(BF16)
    exact = copy.deepcopy(model).double()
    x, grad_out = _inputs(device, BF16, model)
    truth = _run(exact, x.double(), grad_out.double(), enabled=False)
    stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
    assert all(ours[3].get(op) == 2 for op in TRAIN)
    # per projection: A(x) in the forward; dY @ B, dB and dA in the backward
    assert len(path.split_mm) == (4 * 2 if split and adapter_fp32 else 0), len(path.split_mm)
    # and per projection, B's products in the forward and A's in dx fold into the base GEMMs' outputs
    assert len(path.folds) == (2 * 2 if split and adapter_fp32 else 0), len(path.folds)
    assert len(path.base_last) == (len(path.folds) if split == "base_last" else 0)
    O.assert_run_no_worse_than_stock(ours, stock, truth, HIDDEN, TOKENS[0] * TOKENS[1], BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_dtype", [F32, BF16], ids=["fp32-weights", "bf16-weights"])
def test_autocast_takes_the_op_no_worse_than_peft(device, model_dtype):
    """Under torch.autocast (Trainer's and TRL's bf16=True) the projections run g4ops.lora_linear with autocast's
    casts (they used to keep peft's forward), with dropout drawn as peft draws it: stock's dtypes, and no worse than
    stock against fp64 (the fp64 model without autocast, dropout off for that comparison)."""
    model = _model(device, model_dtype).train()
    exact = copy.deepcopy(model).double()
    x, grad_out = _inputs(device, model_dtype, model)
    truth = _run(exact, x.double(), grad_out.double(), enabled=False)
    stock = _run(model, x, grad_out, False, autocast=BF16)
    ours = _run(model, x, grad_out, True, autocast=BF16)
    assert all(ours[3].get(op) == 2 for op in TRAIN), ours[3]
    assert (ours[0].dtype, ours[1].dtype) == (stock[0].dtype, stock[1].dtype) == (BF16, model_dtype)
    assert all(ours[2][name].dtype == g.dtype for name, g in stock[2].items())
    O.assert_run_no_worse_than_stock(ours, stock, truth, HIDDEN, TOKENS[0] * TOKENS[1], BF16)
    dropped = _model(device, model_dtype, lora_dropout=0.3).train()  # masks: peft's draws, in the adapters' fp32
    stock = _run(dropped, x, grad_out, False, autocast=BF16)
    ours = _run(dropped, x, grad_out, True, autocast=BF16)
    for name, g4, st in [("out", ours[0], stock[0]), ("grad_x", ours[1], stock[1])] + [
            (name, ours[2][name], stock[2][name]) for name in stock[2]]:  # fmt: skip
        assert O.rel_err(g4, st) <= 4 * O.TOLERANCE[BF16].u, name  # other masks: about 0.8


# ----------------------------------------------------------------------------------------------------------------
# peft's adapter states, fallbacks, disable()


def _forward_calls(model, x):
    counter = G4opsCalls()
    with torch.no_grad(), g4ops.enable(model), counter:
        out = model(x)
    return out, counter.calls


@pytest.mark.parametrize("device", DEVICES)
def test_merged_and_disabled_adapters_run_the_base_layer(device):
    model = _model(device).eval()
    x, _ = _inputs(device, F32, model)
    with torch.no_grad():
        unmerged = model(x)
        with model.disable_adapter():
            base_only = model(x)
    assert O.rel_err(base_only, unmerged) > 1e-2  # the adapters do change the output
    out, calls = _forward_calls(model, x)
    assert calls == {"g4ops.lora_linear.default": 2} and O.rel_err(out, unmerged) <= _tol(HIDDEN)
    with model.disable_adapter():
        out, calls = _forward_calls(model, x)
    assert not calls and torch.equal(out, base_only)
    model.merge_adapter()
    out, calls = _forward_calls(model, x)
    assert not calls and O.rel_err(out, unmerged) <= 1e-4


def test_unsupported_variant_keeps_peft_forward_and_says_why(caplog, monkeypatch):
    monkeypatch.setattr(peft_lora, "_logged", set())  # said once per process: an earlier test may have said it
    model = _model(use_dora=True).train()
    x, grad_out = _inputs("cpu", F32, model)
    caplog.set_level(logging.INFO, logger="g4ops")
    stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
    assert not ours[3] and torch.equal(ours[0], stock[0])
    assert "attention projection keeps peft's forward" in caplog.text and "Dora" in caplog.text


def test_enable_model_routes_and_disable_restores():
    model = _model()
    projections = [model.base_model.model.attn.q_proj, model.base_model.model.attn.o_proj]
    with g4ops.enable(model):
        assert all(hasattr(p.forward.__func__, peft_lora.LINEAR_FORWARD_MARK) for p in projections)
        g4ops.enable(model)  # idempotent: the projection keeps the one forward
        assert g4ops.is_enabled(model)
    assert all("forward" not in vars(p) for p in projections)
    g4ops.enable(model)
    g4ops.disable(model)
    assert all("forward" not in vars(p) for p in projections) and not g4ops.is_enabled(model)


def test_class_wide_enable_says_the_attention_projections_keep_peft(caplog):
    """enable() without the model cannot see which peft layers sit in an attention: the decoder layer says so once
    (eager), and enable(model) after peft routes them."""
    from g4ops.models import build_model

    base = build_model("tiny-e4b")
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    ids = torch.tensor([[5, 6, 7, 8]])
    caplog.set_level(logging.INFO, logger="g4ops")
    peft_lora._logged.discard("unrouted")
    counter = G4opsCalls()
    with torch.no_grad(), g4ops.enable(), counter:
        model(ids)
    assert "call g4ops.enable(model) after peft" in caplog.text and "g4ops.lora_linear.default" not in counter.calls
    with torch.no_grad(), g4ops.enable(base), counter:
        model(ids)
    assert counter.calls["g4ops.lora_linear.default"] == base.config.num_hidden_layers


# ----------------------------------------------------------------------------------------------------------------
# The op


def _op_args(dtype=torch.float64, adapter_dtype=None, n=3, seed=2):
    gen = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    x = O.make_tensor((2, 3, 5), dtype, gen)
    weight = O.make_tensor((7, 5), dtype, gen, scale=5**-0.5)
    ranks = [2, 3, 1][:n]
    lora_a = [O.make_tensor((r, 5), adapter_dtype, gen, scale=5**-0.5) for r in ranks]
    lora_b = [O.make_tensor((7, r), adapter_dtype, gen, scale=r**-0.5) for r in ranks]
    scaling, dropout = [0.5, 1.75, 2.0][:n], [0.0, 0.25, 0.0][:n]
    masks = [torch.rand((2, 3, 5), generator=gen) >= p for p in dropout if p != 0.0]
    return x, weight, lora_a, lora_b, scaling, dropout, masks


def test_gradcheck_fp64_every_input():
    x, weight, lora_a, lora_b, scaling, dropout, masks = _op_args()
    n = len(lora_a)
    tensors = [t.detach().requires_grad_() for t in (x, weight, *lora_a, *lora_b)]

    def fn(*t):
        return torch.ops.g4ops.lora_linear(t[0], t[1], list(t[2 : 2 + n]), list(t[2 + n :]), scaling, dropout, masks)

    assert torch.autograd.gradcheck(fn, tensors)
    assert torch.autograd.gradcheck(fn, [t.detach() for t in tensors[:2]] + tensors[2:])  # frozen base, x


def test_opcheck():
    args = _op_args(F32)
    for t in (args[0], *args[2], *args[3]):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.g4ops.lora_linear.default, args)
    args = _op_args(BF16, adapter_dtype=F32, n=2)
    torch.library.opcheck(torch.ops.g4ops.lora_linear.default, args, test_utils=("test_schema", "test_faketensor"))


def test_backward_computes_no_full_weight_gradient_when_the_base_is_frozen():
    x, weight, lora_a, lora_b, scaling, dropout, masks = _op_args(F32)
    out, mids = torch.ops.g4ops.lora_linear_forward(x, weight, lora_a, lora_b, scaling, dropout, masks)
    grad_out = torch.randn_like(out)

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                self.shapes.add(tuple(result.shape))
            return result

    for base_mask in ([True, False], [True, True]):
        mode = Shapes()
        with mode:
            grads = lora.lora_linear_backward_math(grad_out, x, weight, lora_a, lora_b, scaling, dropout, masks,
                                                   mids, base_mask, [True] * 6)  # fmt: skip
        assert ((7, 5) in mode.shapes) == base_mask[1]
        assert grads[1].shape == (weight.shape if base_mask[1] else (0,))


def test_bad_input_names_the_argument():
    x, weight, lora_a, lora_b, scaling, dropout, masks = _op_args(F32)
    op = torch.ops.g4ops.lora_linear
    with pytest.raises(RuntimeError, match="`lora_b\\[1\\]` must be \\[7, 3\\]"):
        op(x, weight, lora_a, [lora_b[0], lora_b[1][:, :1], lora_b[2]], scaling, dropout, masks)
    with pytest.raises(RuntimeError, match="`weight` must be \\[out, 5\\]"):
        op(x, weight.t(), lora_a, lora_b, scaling, dropout, masks)
    with pytest.raises(TypeError, match="`weight` is torch.float64 but `x` is torch.float32"):
        op(x, weight.double(), lora_a, lora_b, scaling, dropout, masks)
    with pytest.raises(RuntimeError, match="`scaling` has 2 entries, `lora_a` 3"):
        op(x, weight, lora_a, lora_b, scaling[:2], dropout, masks)
    with pytest.raises(RuntimeError, match="`dropout_mask` has 0 masks but `dropout` has 1"):
        op(x, weight, lora_a, lora_b, scaling, dropout, [])
    with pytest.raises(ValueError, match="adapter 0 must be \\(A, B, scale\\)"):
        lora.lora_linear(x, weight, [(lora_a[0], lora_b[0])])


# ----------------------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph_has_no_graph_breaks_and_matches_eager(device, monkeypatch):
    model = _model(device).train()
    eager_op = _run(model, *_inputs(device, F32, model), True)[3]
    assert all(eager_op.get(op) == 2 for op in TRAIN), eager_op
    monkeypatch.setattr(peft_lora, "EAGER_LINEAR_VIA_OP", False)  # the default: eager runs peft, a compile g4ops' math
    x, grad_out = _inputs(device, F32, model)
    eager = _run(model, x, grad_out, True)
    with g4ops.enable(model):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        code = "".join(g.code for g in explanation.graphs)
        # the op, or its math traced in as an autograd.Function (peft's own forward has neither)
        assert ("autograd_function_apply" if lora.TRACE_UNDER_COMPILE else "lora_linear") in code, code
        compiled = torch.compile(model, fullgraph=True)
        model.zero_grad(set_to_none=True)
        xs = x.detach().clone().requires_grad_()
        out = compiled(xs)
        out.backward(grad_out)
    k = max(HIDDEN, TOKENS[0] * TOKENS[1])
    assert O.rel_err(out, eager[0]) <= _tol(k) and O.rel_err(xs.grad, eager[1]) <= _tol(k)
    params = dict(model.named_parameters())
    for name, g in eager[2].items():
        assert O.rel_err(params[name].grad, g) <= _tol(k), name


def test_past_the_recompile_limit_only_new_signatures_run_eagerly(monkeypatch):
    """The op's inner torch.compile specialises on the adapter count. Past Dynamo's recompile limit, a call with a
    new count runs its math eagerly (one warning naming the limit), while the counts compiled before stay compiled.
    (It used to mark the compilation failed, and every later call of every LoRA op then ran eagerly.)"""
    import warnings

    from g4ops.ops import _fused

    monkeypatch.setattr(lora, "_LORA_COMPILE", "1")
    monkeypatch.setattr(lora, "_compiled", {})
    monkeypatch.setattr(lora, "_compile_failed", [])
    monkeypatch.setattr(_fused, "_past_limit_warned", set())
    eager_counts = []
    math = lora.lora_linear_forward_math

    def counted(x, weight, lora_a, *rest):  # runs as Python only when eager (compiled calls run Inductor's code)
        if not torch.compiler.is_compiling():
            eager_counts.append(len(lora_a))
        return math(x, weight, lora_a, *rest)

    monkeypatch.setattr(lora, "lora_linear_forward_math", counted)
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(5, 7, generator=gen), torch.randn(6, 7, generator=gen)

    def call(n):
        adapters = [(torch.randn(3, 7, generator=gen), torch.randn(6, 3, generator=gen), 0.5) for _ in range(n)]
        with torch.no_grad():
            got = g4ops.ops.lora.lora_linear(x, weight, adapters)
        want = x @ weight.t() + sum(0.5 * (x @ a.t()) @ b.t() for a, b, _ in adapters)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (1, 2, 3, 1, 2, 4):
                call(n)
    finally:
        torch._dynamo.reset()
    assert eager_counts == [3, 4], eager_counts
    assert not lora._compile_failed, lora._compile_failed
    limit = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
    assert len(limit) == 1 and "counted" in limit[0], [str(w.message) for w in caught]
