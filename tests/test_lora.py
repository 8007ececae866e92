"""peft LoRA on Gemma-4's MLP through g4ops (g4ops/ops/lora.py): exact against stock peft in fp32, no worse than stock
against an fp64 oracle in bf16, peft's adapter states (merged, disabled, several adapters, set_adapter), the op
itself (opcheck, fp64 gradcheck, bad input), the dispatch (the fused op really runs; unsupported LoRA features keep
peft's forward and say why), torch.compile without graph breaks, and attention projections with LoRA.

Most tests use one Gemma4TextMLP of odd width inside a small holder module that peft wraps (fast); two use the tiny
E4B-shaped model end to end. The `cuda` parametrisation runs the same checks on a GPU.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import g4ops
from g4ops.hf import patches, peft_lora
from g4ops.models import build_model, text_config
from g4ops.ops import lora

try:
    from . import oracle as O
    from .devices import DEVICES, G4opsCalls, LoraSplitPath
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, G4opsCalls, LoraSplitPath

peft = pytest.importorskip("peft")
hf = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

HIDDEN, INTER = 37, 53  # odd on purpose
TOKENS = (3, 7)
F32 = torch.float32
BF16 = torch.bfloat16
FUSED_TRAIN = ("g4ops.lora_geglu_mlp_forward.default", "g4ops.lora_geglu_mlp_backward.default")


@pytest.fixture(autouse=True)
def _always_disabled():
    g4ops.disable()
    # enable()'s one-time probe builds modules, whose init draws from the global generator: let it happen here, not
    # between a test's manual_seed and the dropout masks it compares
    with g4ops.enable():
        pass
    yield
    g4ops.disable()


class _Holder(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x)


def _mlp_model(device="cpu", dtype=F32, targets=("gate_proj", "up_proj", "down_proj"), seed=0, **lora_kwargs):
    """peft around one Gemma4TextMLP [HIDDEN -> INTER -> HIDDEN]. init_lora_weights=False: B is random, not zero,
    so every adapter changes the output."""
    config = text_config("tiny-e4b")
    config.hidden_size, config.intermediate_size = HIDDEN, INTER
    torch.manual_seed(seed)
    mlp = hf.Gemma4TextMLP(config, 0)
    holder = _Holder(mlp).to(device=device, dtype=dtype)
    settings = dict(r=3, lora_alpha=5, target_modules=list(targets), init_lora_weights=False)
    settings.update(lora_kwargs)
    model = peft.get_peft_model(holder, peft.LoraConfig(**settings))
    return model.to(device)


def _inputs(device, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = O.make_tensor((*TOKENS, HIDDEN), dtype, gen, device=device)
    grad_out = O.make_tensor((*TOKENS, HIDDEN), dtype, gen, device=device)
    return x, grad_out


def _run(model, x, grad_out, enabled: bool, autocast=None):
    """(output, x's gradient, {trainable parameter: gradient}, g4ops op calls), with g4ops enabled or not; `autocast`:
    a dtype to run the forward under torch.autocast with (the backward outside it, as a training step runs it)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    counter = G4opsCalls()  # only around g4ops (stock under a Python dispatch mode is slow)
    with g4ops.enable() if enabled else _nothing(), counter if enabled else _nothing():
        with torch.autocast(x.device.type, dtype=autocast or BF16, enabled=autocast is not None):
            out = model(x)
        out.backward(grad_out.to(out.dtype))
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen parameters got gradients: {frozen}"
    return out.detach(), x.grad, grads, counter.calls


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fp32_tol(k: int) -> float:
    """fp32 results that differ from stock only by summation order and a few roundings (derived, oracle.py)."""
    return O.tolerance(F32, k, roundings=4)


def _same(out, stock_out, device) -> bool:
    """An fp32 MLP output equal to stock's: bit for bit on CPU (the same ATen kernels in the same order); on CUDA
    g4ops' own kernels (GeGLU, or Inductor's fusion) may round an ulp differently."""
    return torch.equal(out, stock_out) if device == "cpu" else O.rel_err(out, stock_out) <= _fp32_tol(INTER)


def _assert_matches_stock(stock, ours, device):
    (o0, x0, g0, _), (o1, x1, g1, _) = stock, ours
    assert _same(o1, o0, device)
    assert O.rel_err(x1, x0) <= _fp32_tol(INTER)
    assert g0.keys() == g1.keys() and g0 and all("lora_" in n for n in g0)
    for name in g0:
        assert g1[name] is not None, name
        assert O.rel_err(g1[name], g0[name]) <= _fp32_tol(TOKENS[0] * TOKENS[1]), name


# ----------------------------------------------------------------------------------------------------------------
# fp32: exact against stock peft, fused path taken


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("targets", [("gate_proj", "up_proj", "down_proj"), ("gate_proj",), ("up_proj", "down_proj"),
                                     ("down_proj",)])  # fmt: skip
def test_fp32_matches_peft_and_takes_the_fused_path(device, targets):
    model = _mlp_model(device, targets=targets).train()
    x, grad_out = _inputs(device, F32)
    stock = _run(model, x, grad_out, enabled=False)
    ours = _run(model, x, grad_out, enabled=True)
    _assert_matches_stock(stock, ours, device)
    assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN), ours[3]
    assert peft_lora.fallback_reason(model.base_model.model.mlp) is None


@pytest.mark.parametrize("device", DEVICES)
def test_rslora_and_set_scale_use_peft_scaling(device):
    model = _mlp_model(device, use_rslora=True, r=4, lora_alpha=3).train()
    layer = model.base_model.model.mlp.up_proj
    assert layer.scaling["default"] == 3 / 4**0.5  # peft's rsLoRA: alpha / sqrt(r)
    layer.set_scale("default", 0.7)  # then alpha / sqrt(r) * 0.7
    x, grad_out = _inputs(device, F32)
    stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
    _assert_matches_stock(stock, ours, device)
    assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN)


# ----------------------------------------------------------------------------------------------------------------
# bf16: no worse than stock against fp64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adapter_fp32", [True, False], ids=["fp32-adapters", "bf16-adapters"])
@pytest.mark.parametrize("split", ["base_first", "base_last", None],
                         ids=["split-products", "split-products-base-last", "fp32-products"])
def test_bf16_no_worse_than_peft_against_fp64(device, adapter_fp32, split, monkeypatch):
    """`split` (a fold order, lora.FOLD_ORDER): fp32 adapters take their products with bf16 tensors through
    lora._split_mm (opt-in on CUDA, G4OPS_LORA_SPLIT=1; on CPU the same arithmetic in fp32) and fold them into the base
    GEMMs in that order; None: through fp32 copies as peft does."""
    path = LoraSplitPath(monkeypatch, device, split)
    # peft's default (autocast_adapter_dtype=True) keeps a bf16 model's adapters in fp32
    model = _mlp_model(device, BF16).train()
    if not adapter_fp32:
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(BF16)
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {F32 if adapter_fp32 else BF16}
    exact = copy.deepcopy(model).double()
    x, grad_out = _inputs(device, BF16)
    truth = _run(exact, x.double(), grad_out.double(), enabled=False)
    stock = _run(model, x, grad_out, enabled=False)
    ours = _run(model, x, grad_out, enabled=True)
    assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN)
    # per projection dY @ B and dB in the backward; A(x) in the forward and dA in the backward, one call each for
    # down and one for gate and up together (they read the same x)
    assert len(path.split_mm) == (2 * 3 + 2 * 2 if split and adapter_fp32 else 0), len(path.split_mm)
    # and per projection, B's products in the forward and A's in dx fold into the base GEMMs' outputs
    assert len(path.folds) == (3 + 2 if split and adapter_fp32 else 0), len(path.folds)
    assert len(path.base_last) == (len(path.folds) if split == "base_last" else 0)
    O.assert_run_no_worse_than_stock(ours, stock, truth, INTER, TOKENS[0] * TOKENS[1], BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_dtype", [F32, BF16], ids=["fp32-weights", "bf16-weights"])
def test_autocast_takes_the_fused_path_no_worse_than_peft(device, model_dtype):
    """Under torch.autocast (HF Trainer's and TRL's bf16=True, over fp32 weights as TRL loads them or over bf16 ones)
    peft's layers run every product in bf16; the fused path casts as autocast does and is taken (it used to keep
    peft's forward there). Output and gradients have stock's dtypes, and each is no worse than stock's against fp64
    (the same model in fp64, without autocast)."""
    model = _mlp_model(device, model_dtype).train()
    exact = copy.deepcopy(model).double()
    x, grad_out = _inputs(device, model_dtype)
    truth = _run(exact, x.double(), grad_out.double(), enabled=False)
    stock = _run(model, x, grad_out, enabled=False, autocast=BF16)
    ours = _run(model, x, grad_out, enabled=True, autocast=BF16)
    assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN), ours[3]
    with g4ops.enable(), torch.autocast(device, dtype=BF16):
        assert peft_lora.fallback_reason(model.base_model.model.mlp) is None
    assert (ours[0].dtype, ours[1].dtype) == (stock[0].dtype, stock[1].dtype) == (BF16, model_dtype)
    assert all(ours[2][name].dtype == g.dtype for name, g in stock[2].items())
    O.assert_run_no_worse_than_stock(ours, stock, truth, INTER, TOKENS[0] * TOKENS[1], BF16)


def _through(run: str, fn):
    """fn itself, or fn compiled by Inductor: how the op's math runs on CUDA (Inductor drops intermediate bf16
    roundings in fused code, so math that relies on one breaks only there)."""
    return fn if run == "eager" else torch.compile(fn, fullgraph=True)


@pytest.mark.parametrize("run", ["eager", "inductor"])
def test_bf16_parts_sum_to_the_fp32_value_exactly(run):
    """The three parts hold every bit of the fp32 value, on a strided view too."""
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(4099, 2, generator=gen) * torch.exp2(torch.randint(-60, 60, (4099, 2), generator=gen).float())
    t = t[:, 1]
    hi, mid, lo = _through(run, lora._bf16_parts)(t)
    assert {hi.dtype, mid.dtype, lo.dtype} == {BF16}
    assert torch.equal(hi.float() + mid.float() + lo.float(), t)
    assert (mid != 0).sum() > 4000  # the parts below hi carry bits (not a trivially exact hi alone)


@pytest.mark.parametrize("run", ["eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp32_side", ["left", "right"])
def test_split_mm_is_an_fp32_gemm_against_fp64(device, fp32_side, run):
    """_split_mm (bf16 parts, one bf16 GEMM with fp32 accumulation) is within an fp32 GEMM's error of fp64, for
    odd shapes and a transposed bf16 operand; the bf16 operand holds fresh random values, the fp32 one values
    that bf16 cannot hold."""
    gen = torch.Generator().manual_seed(4)
    m, k, n = 37, 301, 11
    if fp32_side == "left":
        a = O.make_tensor((m, k), F32, gen, device=device)
        b = O.make_tensor((n, k), BF16, gen, device=device).t()  # [k, n], transposed layout
        fp32_operand = a
    else:
        a = O.make_tensor((k, m), BF16, gen, device=device).t()  # [m, k], transposed layout
        b = O.make_tensor((k, n), F32, gen, device=device)
        fp32_operand = b
    assert not torch.equal(fp32_operand, fp32_operand.to(BF16).float())
    out = _through(run, lora._split_mm)(a, b)
    assert out.dtype == F32 and out.shape == (a.shape[0], b.shape[1])
    truth = a.double() @ b.double()
    fp32_gemm = a.float() @ b.float()
    # 3x an fp32 GEMM's own error (a reordered fp32 sum); dropping the lo parts would be ~10x (2**-17 per value)
    assert O.rel_err(out, truth) <= 3 * O.rel_err(fp32_gemm, truth), (
        O.rel_err(out, truth), O.rel_err(fp32_gemm, truth))


@pytest.mark.parametrize("run", ["eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp32_side", ["left", "right"])
def test_split_mm_of_a_list_is_each_product(device, fp32_side, run):
    """A list of fp32 operands against one bf16 operand (gate's and up's adapters against x) is one GEMM whose
    products come back in order, each within an fp32 GEMM's error of fp64, with odd sizes that differ per entry."""
    gen = torch.Generator().manual_seed(6)
    k = 301
    shared = O.make_tensor((37, k) if fp32_side == "right" else (k, 37), BF16, gen, device=device)
    sizes = (3, 11, 5)
    if fp32_side == "left":
        fp32 = [O.make_tensor((m, k), F32, gen, device=device) for m in sizes]
        outs = _through(run, lora._split_mm)(fp32, shared)
        pairs = [(t, shared) for t in fp32]
    else:
        fp32 = [O.make_tensor((k, n), F32, gen, device=device) for n in sizes]
        outs = _through(run, lora._split_mm)(shared, fp32)
        pairs = [(shared, t) for t in fp32]
    assert isinstance(outs, list) and len(outs) == len(sizes)
    for out, (a, b) in zip(outs, pairs):
        assert out.dtype == F32 and out.shape == (a.shape[0], b.shape[1])
        truth = a.double() @ b.double()
        assert O.rel_err(out, truth) <= 3 * O.rel_err(a.float() @ b.float(), truth)


@pytest.mark.parametrize("run", ["eager", "inductor"])
def test_split_pairs_hold_the_exact_product(run):
    """The nine bf16 part products sum (in fp64, where each is exact) to the fp32 product itself."""
    gen = torch.Generator().manual_seed(5)
    left, right = O.make_tensor((29, 5), F32, gen), O.make_tensor((13, 5), F32, gen)
    lhs, rhs = _through(run, lora._split_pairs)(left, right)
    assert lhs.dtype == rhs.dtype == BF16 and lhs.shape == (29, 45) and rhs.shape == (13, 45)
    truth = left.double() @ right.double().t()
    assert O.rel_err(lhs.double() @ rhs.double().t(), truth) < 1e-14
    # hi parts alone would be off by ~2**-9: the parts below them count
    assert O.rel_err(left.to(BF16).double() @ right.to(BF16).double().t(), truth) > 1e-4


@pytest.mark.parametrize("gemm", ["device's", "baddbmm"])
@pytest.mark.parametrize("device", DEVICES)
def test_plus_low_rank_rounds_once(device, gemm, monkeypatch):
    """bf16 out + two fp32 low-rank products, one of them on strided rows: the exact sum rounded once to bf16, up to
    an fp32 accumulator's rounding (a result may sit one bf16 ulp off where the exact sum is near a tie). "baddbmm":
    the CUDA formula wherever the test runs (on CPU too, so CI executes it: CPU's bf16 baddbmm rounds once as well)."""
    if gemm == "baddbmm":
        monkeypatch.setattr(lora, "_gemm_adds_c_unrounded", lambda c: True)
        calls = []
        real_baddbmm_ = torch.Tensor.baddbmm_
        monkeypatch.setattr(torch.Tensor, "baddbmm_", lambda *a, **kw: calls.append(a) or real_baddbmm_(*a, **kw))
    gen = torch.Generator().manual_seed(6)
    t, n = (3, 11), 41
    out = O.make_tensor((*t, n), BF16, gen, device=device)
    pairs = [(O.make_tensor((*t, 4), F32, gen, device=device, scale=0.7), O.make_tensor((n, 4), F32, gen,
                                                                                          device=device)),
             (O.make_tensor((*t, 2), F32, gen, device=device, layout="sliced"),
              O.make_tensor((2, n), F32, gen, device=device).t())]  # fmt: skip
    exact = out.double() + sum(left.double() @ right.double().t() for left, right in pairs)
    got = lora._plus_low_rank(out.clone(), pairs)  # it writes into its `out`
    assert got.dtype == BF16 and got.shape == out.shape
    rounded = exact.to(BF16)
    ulp = (rounded.double().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert ((got.double() - rounded.double()).abs() <= ulp).all()
    assert (got == rounded).float().mean() > 0.98
    assert lora._plus_low_rank(out, []) is out
    if gemm == "baddbmm":
        assert len(calls) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_low_rank_plus_base_rounds_the_low_rank_term_then_the_sum(device):
    """The "base_last" fold (G4OPS_LORA_FOLD): two fp32 low-rank products, one on strided rows, summed and rounded
    once to bf16, then the base GEMM z @ W^T (z of 3-D strided rows, W a transposed view, as the backward passes it)
    added and the sum rounded once, up to an fp32 accumulator's rounding (one bf16 ulp near a tie)."""
    gen = torch.Generator().manual_seed(16)
    t, k, n = (3, 11), 24, 41
    z = O.make_tensor((*t, k), BF16, gen, device=device, layout="sliced")
    weight = O.make_tensor((k, n), BF16, gen, device=device).t()
    pairs = [(O.make_tensor((*t, 4), F32, gen, device=device, scale=0.1), O.make_tensor((n, 4), F32, gen,
                                                                                          device=device)),
             (O.make_tensor((*t, 2), F32, gen, device=device, layout="sliced", scale=0.1),
              O.make_tensor((2, n), F32, gen, device=device).t())]  # fmt: skip
    low_rank = sum(left.double() @ right.double().t() for left, right in pairs)
    exact = z.double() @ weight.double().t() + low_rank.to(BF16).double()
    got = lora._low_rank_plus_base(z, weight, pairs)
    assert got.dtype == BF16 and got.shape == (*t, n)
    rounded = exact.to(BF16)
    ulp = (rounded.double().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert ((got.double() - rounded.double()).abs() <= ulp).all()
    assert (got == rounded).float().mean() > 0.98


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_add_product_rounded(device):
    """The fold's op: its schema says it writes c, its fake kernel matches, and it traces (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(9)
    c = O.make_tensor((7, 12), BF16, gen, device=device)
    a, b = O.make_tensor((7, 18), BF16, gen, device=device), O.make_tensor((18, 12), BF16, gen, device=device)
    torch.library.opcheck(torch.ops.g4ops.add_product_rounded, (c, a, b))


@pytest.mark.parametrize("order", lora.FOLD_ORDERS)
def test_fold_adds_into_the_first_gemms_output_under_inductor(order, monkeypatch):
    """Compiled, the fold writes into the first GEMM's output buffer (the base GEMM's, or base_last's low-rank one),
    with no copy of it first: the op that mutates it is re-inplaced by Inductor (out-of-place, ATen's baddbmm copies
    c into its result: one [T, n] memcpy per fold on the GPU). The generated code hands the mm's own output buffer to
    the op; the result is eager's, bitwise."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(8)
    x, w = O.make_tensor((2, 5, 16), BF16, gen), O.make_tensor((24, 16), BF16, gen)
    left, right = O.make_tensor((2, 5, 4), F32, gen), O.make_tensor((24, 4), F32, gen)

    monkeypatch.setattr(lora, "FOLD_ORDER", order)

    def fold(x, w, left, right):
        return lora._linear_plus_low_rank(x, w, [(left, right)])

    torch._dynamo.reset()
    try:
        got, (code,) = run_and_get_code(torch.compile(fold, fullgraph=True), x, w, left, right)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, fold(x, w, left, right))
    (mm_out,) = re.findall(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code)
    (op_arg,) = re.findall(r"g4ops\.add_product_rounded\.default\((buf\d+),", code)
    assert op_arg == mm_out, code


# ----------------------------------------------------------------------------------------------------------------
# peft's adapter states


def _add_second_adapter(model):
    second = peft.LoraConfig(r=2, lora_alpha=7, use_rslora=True, target_modules=["gate_proj", "down_proj"],
                             init_lora_weights=False)  # fmt: skip
    model.add_adapter("second", second)
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_several_active_adapters_and_set_adapter(device):
    model = _add_second_adapter(_mlp_model(device)).train()
    x, grad_out = _inputs(device, F32)
    for active in (["default", "second"], ["second"], "default"):
        model.base_model.set_adapter(active)
        stock, ours = _run(model, x, grad_out, False), _run(model, x, grad_out, True)
        _assert_matches_stock(stock, ours, device)
        names = [active] if isinstance(active, str) else active
        assert {n.split(".")[-2] for n in ours[2]} == set(names)  # the active adapters train, the others not
        assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN)


def _forward_calls(model, x):
    counter = G4opsCalls()
    with torch.no_grad(), g4ops.enable(), counter:
        out = model(x)
    return out, counter.calls


@pytest.mark.parametrize("device", DEVICES)
def test_merged_disabled_and_unmerged_adapters(device, caplog):
    model = _add_second_adapter(_mlp_model(device)).eval()
    model.base_model.set_adapter(["default", "second"])
    x, _ = _inputs(device, F32)
    with torch.no_grad():
        unmerged = model(x)
        with model.disable_adapter():
            base_only = model(x)
    assert O.rel_err(base_only, unmerged) > 1e-2  # the adapters do change the output

    out, calls = _forward_calls(model, x)
    assert calls == {"g4ops.lora_geglu_mlp.default": 1} and O.rel_err(out, unmerged) <= _fp32_tol(INTER)
    with model.disable_adapter():
        out, calls = _forward_calls(model, x)
    assert calls == {"g4ops.geglu_mlp.default": 1} and _same(out, base_only, device)

    model.merge_adapter()
    with torch.no_grad():
        merged_stock = model(x)
    out, calls = _forward_calls(model, x)
    assert calls == {"g4ops.geglu_mlp.default": 1}  # the base weights hold the deltas
    assert _same(out, merged_stock, device)
    assert O.rel_err(out, unmerged) <= 1e-4  # merging reassociates fp32 sums only

    # merged and disabled: peft unmerges inside its forward, so that call is peft's (and says so)
    caplog.set_level(logging.INFO, logger="g4ops")
    with model.disable_adapter():
        out, calls = _forward_calls(model, x)
        assert not calls and O.rel_err(out, base_only) <= 1e-5
        assert "merged but disabled" in caplog.text
        out, calls = _forward_calls(model, x)  # now unmerged: fused again
        assert calls == {"g4ops.geglu_mlp.default": 1}
    out, calls = _forward_calls(model, x)
    assert calls == {"g4ops.lora_geglu_mlp.default": 1} and O.rel_err(out, unmerged) <= 1e-4


# ----------------------------------------------------------------------------------------------------------------
# What the fused path does not implement falls back to peft, and says why


@pytest.mark.parametrize(
    "settings, reason",
    [
        (dict(use_dora=True), "LoRA variant (DoraLinearVariant)"),
        (dict(lora_bias=True), "lora_bias=True"),
        (dict(hook=True), "has hooks"),  # e.g. peft's mixed-batch `adapter_names`, a pre-hook
    ],
    ids=["dora", "lora_bias", "hooked"],
)
def test_unsupported_variants_keep_peft_forward_and_log(settings, reason, caplog):
    caplog.set_level(logging.INFO, logger="g4ops")
    peft_lora._logged.clear()
    hook = settings.pop("hook", False)
    model = _mlp_model(**settings).train()
    if hook:
        model.base_model.model.mlp.up_proj.register_forward_pre_hook(lambda module, args: None)
    x, grad_out = _inputs("cpu", F32)
    stock = _run(model, x, grad_out, False)
    ours = _run(model, x, grad_out, True)
    assert torch.equal(stock[0], ours[0]) and ours[3] == {}  # peft's own forward, not g4ops'
    for name in stock[2]:
        assert torch.equal(stock[2][name], ours[2][name]), name
    assert reason in caplog.text and reason in peft_lora.fallback_reason(model.base_model.model.mlp)
    records = [r for r in caplog.records if r.name == "g4ops" and reason in r.getMessage()]
    assert len(records) == 1, "the reason is logged once"
    ours = _run(model, x, grad_out, True)
    assert len([r for r in caplog.records if r.name == "g4ops" and reason in r.getMessage()]) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_as_peft_draws_it(device):
    """Training-mode dropout: the same generator calls as peft's forward give the same masks, so with the same
    seed the fused path equals peft (on CPU bit for bit in the forward); and two adapters, eval mode."""
    model = _add_second_adapter(_mlp_model(device, lora_dropout=0.3))
    model.base_model.set_adapter(["default", "second"])
    for layer in (model.base_model.model.mlp.gate_proj, model.base_model.model.mlp.down_proj):
        layer.lora_dropout["second"] = nn.Dropout(0.2)  # p differs per adapter
    x, grad_out = _inputs(device, F32)
    for train in (True, False):
        model.train(train)
        torch.manual_seed(5)
        stock = _run(model, x, grad_out, False)
        torch.manual_seed(5)
        ours = _run(model, x, grad_out, True)
        _assert_matches_stock(stock, ours, device)
        assert all(ours[3].get(op) == 1 for op in FUSED_TRAIN)
    torch.manual_seed(6)
    model.train()
    other = _run(model, x, grad_out, True)
    assert O.rel_err(other[0], ours[0]) > 1e-3  # training mode does drop: its output is not eval mode's


# ----------------------------------------------------------------------------------------------------------------
# The op: low-rank gradients only, opcheck, gradcheck, bad input


def _op_args(dtype=torch.float64, adapter_dtype=None, counts=(1, 2, 1), device="cpu", seed=2):
    gen = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    x = O.make_tensor((2, 3, 5), dtype, gen, device=device)
    wg, wu, wd = O.make_mlp_weights(5, 7, dtype, gen, device=device)
    dims = [(5, 7)] * (counts[0] + counts[1]) + [(7, 5)] * counts[2]
    ranks = [2, 3, 1, 2][: len(dims)]
    lora_a = [O.make_tensor((r, i), adapter_dtype, gen, device=device, scale=i**-0.5) for r, (i, _) in zip(ranks, dims)]
    lora_b = [O.make_tensor((o, r), adapter_dtype, gen, device=device, scale=r**-0.5) for r, (_, o) in zip(ranks, dims)]
    scaling = [0.5, 1.75, 2.0, 0.3][: len(dims)]
    dropout = [0.0, 0.25, 0.0, 0.5][: len(dims)]  # adapters 1 and 3 drop part of their input
    masks = [torch.rand((2, 3, i), generator=gen) >= p for p, (i, _) in zip(dropout, dims) if p != 0.0]
    return x, wg, wu, wd, lora_a, lora_b, scaling, list(counts), dropout, [m.to(device) for m in masks]


_PRODUCTS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


def test_backward_computes_no_full_weight_gradient_when_the_base_is_frozen():
    x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks = _op_args(F32)
    out, gate, up, mids = torch.ops.g4ops.lora_geglu_mlp_forward(x, wg, wu, wd, lora_a, lora_b, scaling, counts,
                                                                 dropout, masks)  # fmt: skip
    grad_out = torch.randn_like(out)
    weight_shapes = {tuple(w.shape) for w in (wg, wu, wd)} | {tuple(w.shape)[::-1] for w in (wg, wu, wd)}

    class Shapes(TorchDispatchMode):  # the shapes of every matrix product
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.overloadpacket in _PRODUCTS:
                self.shapes.add(tuple(result.shape))
            return result

    n = len(lora_a)
    for base_mask in ([True, False, False, False], [True, True, True, True]):
        mode = Shapes()
        with mode:
            grads = lora.lora_geglu_mlp_backward_math(grad_out, x, gate, up, wg, wu, wd, lora_a, lora_b, scaling,
                                                      counts, dropout, masks, mids, base_mask,
                                                      [True] * (2 * n))  # fmt: skip
        full = mode.shapes & weight_shapes
        assert bool(full) == any(base_mask[1:]), f"weight-sized tensors computed: {full}"
        for g, wanted, w in zip(grads[1:4], base_mask[1:], (wg, wu, wd)):
            assert g.shape == (w.shape if wanted else (0,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    args = _op_args(F32, device=device)
    for t in (args[0], *args[4], *args[5]):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.g4ops.lora_geglu_mlp.default, args)
    # bf16 activations with fp32 adapters (peft's default for a bf16 model); the cheap subsets
    args = _op_args(BF16, adapter_dtype=F32, counts=(0, 1, 2), device=device)
    torch.library.opcheck(torch.ops.g4ops.lora_geglu_mlp.default, args,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_outputs_have_the_fake_kernels_layout_whatever_the_compiled_math_returns(monkeypatch):
    """Inductor may hand the compiled math's results back in a padded layout (on the H200, torch 2.11, 2026-12-02:
    a rank-3 adapter's A(z) [3, 7, 3] with row stride 4, and an outer torch.compile's stride check failed); the ops'
    outputs keep the fake kernels' layout whatever the math returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves, tree_map_only

    real = lora._fused

    def padded(fn, *args):
        def pad(t):  # the same values, each row one element wider in memory
            if t.dim() == 0 or t.numel() == 0:
                return t
            wide = t.new_empty((*t.shape[:-1], t.shape[-1] + 1))[..., : t.shape[-1]]
            return wide.copy_(t)

        return tree_map_only(torch.Tensor, pad, real(fn, *args))

    monkeypatch.setattr(lora, "_fused", padded)
    args = _op_args(F32)
    forward = torch.ops.g4ops.lora_geglu_mlp_forward
    out, gate, up, mids = forward(*args)
    x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks = args
    n = len(lora_a)
    backward_args = (torch.randn_like(out), x, gate, up, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks,
                     mids, [True] * 4, [True] * (2 * n))  # fmt: skip
    calls = [(torch.ops.g4ops.lora_geglu_mlp, args), (forward, args),
             (torch.ops.g4ops.lora_geglu_mlp_backward, backward_args)]  # fmt: skip
    for op, op_args in calls:
        with FakeTensorMode() as mode:
            fakes = op(*tree_map_only(torch.Tensor, mode.from_tensor, op_args))
        for got, want in zip(tree_leaves(op(*op_args)), tree_leaves(fakes), strict=True):
            assert (got.shape, got.stride()) == (want.shape, want.stride()), op


def test_gradcheck_fp64_every_input():
    x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks = _op_args()
    n = len(lora_a)
    tensors = [t.detach().requires_grad_() for t in (x, wg, wu, wd, *lora_a, *lora_b)]

    def fn(*t):
        return torch.ops.g4ops.lora_geglu_mlp(*t[:4], list(t[4 : 4 + n]), list(t[4 + n :]), scaling, counts, dropout,
                                              masks)  # fmt: skip

    assert torch.autograd.gradcheck(fn, tensors)
    # frozen base weights and x without grad (LoRA on the first layer): only the adapters
    frozen = [t.detach() for t in tensors[:4]] + tensors[4:]
    assert torch.autograd.gradcheck(fn, frozen)


def test_bad_input_names_the_argument():
    x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks = _op_args(F32)
    op = torch.ops.g4ops.lora_geglu_mlp
    with pytest.raises(RuntimeError, match="`lora_b\\[1\\]` must be"):
        op(x, wg, wu, wd, lora_a, [lora_b[0], lora_b[1][:, :1], *lora_b[2:]], scaling, counts, dropout, masks)
    with pytest.raises(RuntimeError, match="`lora_a` has 3 entries"):
        op(x, wg, wu, wd, lora_a[:3], lora_b[:3], scaling[:3], counts, dropout[:3], masks[:1])
    with pytest.raises(RuntimeError, match="`lora_a\\[3\\]` must be \\[r, 7\\]"):
        op(x, wg, wu, wd, lora_a[:3] + [lora_a[0]], lora_b, scaling, counts, dropout, masks)
    with pytest.raises(TypeError, match="`lora_b\\[0\\]` is torch.float64 but `lora_a\\[0\\]` is torch.float32"):
        op(x, wg, wu, wd, lora_a, [lora_b[0].double(), *lora_b[1:]], scaling, counts, dropout, masks)
    with pytest.raises(RuntimeError, match="`dropout_mask` has 1 masks but `dropout` has 2"):
        op(x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, masks[:1])
    with pytest.raises(RuntimeError, match="`dropout_mask\\[1\\]` must have the shape of adapter 3's input"):
        op(x, wg, wu, wd, lora_a, lora_b, scaling, counts, dropout, [masks[0], masks[0]])
    with pytest.raises(RuntimeError, match="`dropout` must be in \\[0, 1\\)"):
        op(x, wg, wu, wd, lora_a, lora_b, scaling, counts, [0.0, 1.0, 0.0, 0.5], masks)
    with pytest.raises(ValueError, match="adapter 0 must be \\(A, B, scale\\)"):
        lora.lora_geglu_mlp(x, wg, wu, wd, [(lora_a[0], lora_b[0])])


# ----------------------------------------------------------------------------------------------------------------
# torch.compile


def _assert_traced_not_opaque(graphs):
    """Inside a compiled trace the LoRA MLP is its math in the graph (an autograd.Function), not the opaque op
    (tests/test_lora_compile.py checks this node by node); on a torch where that path is off (ops/lora.py's docstring),
    the op."""
    if not lora.TRACE_UNDER_COMPILE:
        assert any("lora_geglu_mlp" in g.code for g in graphs)
        return
    assert not any("lora_geglu_mlp" in g.code for g in graphs)
    assert any("autograd_function_apply" in g.code for g in graphs)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph_has_no_graph_breaks_and_matches_eager(device):
    model = _mlp_model(device).train()
    x, grad_out = _inputs(device, F32)
    eager = _run(model, x, grad_out, True)
    with g4ops.enable():
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        _assert_traced_not_opaque(explanation.graphs)
        compiled = torch.compile(model, fullgraph=True)
        model.zero_grad(set_to_none=True)
        xs = x.detach().clone().requires_grad_()
        out = compiled(xs)
        out.backward(grad_out)
    assert O.rel_err(out, eager[0]) <= _fp32_tol(INTER)
    assert O.rel_err(xs.grad, eager[1]) <= _fp32_tol(INTER)
    for name, g in eager[2].items():
        p = dict(model.named_parameters())[name]
        assert O.rel_err(p.grad, g) <= _fp32_tol(TOKENS[0] * TOKENS[1]), name


_DEFAULT_TRACE = lora.TRACE_UNDER_COMPILE


@pytest.mark.parametrize(
    "traced, graphed", [(False, False), (True, False), (True, True), (False, True)],
    ids=["opaque", "traced", "graphed-calls-the-ops", "opaque-graphed"],
)
def test_compiled_graph_traces_the_lora_math_unless_graphed_and_warns_once_when_opaque(traced, graphed, monkeypatch):
    """Inside torch.compile the LoRA math is traced into the graph (TRACE_UNDER_COMPILE), except where the compile
    replays CUDA graphs: there the graph calls the ops (their graphed step is faster). Where it calls them outside
    CUDA graphs (the traced path off: torch < 2.11 or G4OPS_LORA_TRACE=0), each call costs host time on every step:
    the trace says so, once, and stays one graph (the warning runs while tracing, not in the graph)."""
    if traced and not _DEFAULT_TRACE:
        pytest.skip("the traced path is off on this torch (tests/test_lora_compile.py tests it with G4OPS_LORA_TRACE=1)")
    monkeypatch.setattr(lora, "TRACE_UNDER_COMPILE", traced)
    monkeypatch.setattr(lora, "TRACE_WHEN_GRAPHED", False)
    monkeypatch.setattr(lora, "_outer_compile_replays_graphs", lambda: graphed)
    monkeypatch.setattr(lora, "_opaque_warned", False)
    base = build_model("tiny-e4b", num_layers=2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with g4ops.enable(base), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(model, backend=recorder, fullgraph=True)
            for _ in range(2):
                compiled(ids, labels=ids).loss.backward()
    finally:
        torch._dynamo.reset()
    opaque = [w for w in caught if "calls g4ops' LoRA ops opaquely" in str(w.message)]
    code = "".join(g.code for g in graphs)
    assert len(graphs) == 1  # fullgraph: a break would have raised; one compile for both steps
    if traced and not graphed:
        assert "lora_geglu_mlp" not in code and "lora_linear" not in code
    else:
        assert "lora_geglu_mlp" in code and "lora_linear" in code
    assert len(opaque) == (0 if traced or graphed else 1), [str(w.message) for w in caught]
    assert all("reduce-overhead" in str(w.message) for w in opaque)


@pytest.mark.parametrize("setting", [None, "0"], ids=["split-unset", "G4OPS_LORA_SPLIT=0"])
@pytest.mark.parametrize("graphed", [False, True], ids=["default-mode", "graphed"])
def test_graphed_compile_asks_the_ops_for_split_products(setting, graphed, monkeypatch):
    """A compile that replays CUDA graphs calls the LoRA ops with split=True (the split products pay only there:
    SPLIT_DEVICES' comment), one that does not with split=False, and G4OPS_LORA_SPLIT=0 never asks; the flag reaches
    the math: a bf16 model's fp32 adapters then take their products through `_split_mm` (on CPU in fp32 arithmetic),
    and the step still matches stock peft's."""
    monkeypatch.setattr(lora, "TRACE_UNDER_COMPILE", False)  # the ops in both modes, so their flag is in the graph
    monkeypatch.setattr(lora, "TRACE_WHEN_GRAPHED", False)
    monkeypatch.setattr(lora, "SPLIT_DEVICES", set())
    monkeypatch.setattr(lora, "SPLIT_WHEN_GRAPHED", setting != "0")
    monkeypatch.setattr(lora, "_outer_compile_replays_graphs", lambda: graphed)
    split_calls, split_mm = [], lora._split_mm
    monkeypatch.setattr(lora, "_split_mm", lambda a, b: split_calls.append(1) or split_mm(a, b))
    base = build_model("tiny-e4b", num_layers=1, dtype=BF16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()  # peft keeps the adapters of a bf16 model in fp32
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {F32}
    ids = torch.randint(3, base.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    stock_loss = model(ids, labels=ids).loss
    torch._dynamo.reset()
    try:
        with g4ops.enable(base), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the default mode's "calls the ops opaquely" (tested above)
            compiled = torch.compile(model, backend=recorder, fullgraph=True)
            loss = compiled(ids, labels=ids).loss
            loss.backward()
    finally:
        torch._dynamo.reset()
    lora_ops = ("g4ops.lora_", "g4ops::lora_")
    calls = [node for gm in graphs for node in gm.graph.nodes
             if node.op == "call_function" and str(node.target).startswith(lora_ops)]  # fmt: skip
    flags = {node.kwargs.get("split", node.args[-1] if isinstance(node.args[-1], bool) else False) for node in calls}
    expected = graphed and setting != "0"
    # q, k, v, o and the MLP
    assert len(calls) == 5 and flags == {expected}, [(str(n.target), n.args[-1], n.kwargs) for n in calls]
    assert bool(split_calls) == expected
    assert O.rel_err(loss.detach().float(), stock_loss.detach().float()) <= 1e-2  # bf16 model, reordered sums


_GRAPHED_COMPILES = [
    ({}, False),
    ({"mode": "reduce-overhead"}, True),
    ({"mode": "max-autotune-no-cudagraphs"}, False),
    ({"options": {"triton.cudagraphs": True}}, True),
    ({"backend": "cudagraphs"}, True),
    ({"backend": "aot_eager"}, False),
]


@pytest.mark.parametrize("compile_kwargs, expected", _GRAPHED_COMPILES, ids=lambda v: str(v))
def test_outer_compile_replays_graphs_reads_the_compile_being_traced(compile_kwargs, expected):
    """The mode check reads Dynamo's tracing state (a private API): it must tell reduce-overhead (and CUDA graphs
    asked for any other way) from the default mode on this torch, or the default mode would call the ops."""
    seen = []

    @torch.compiler.assume_constant_result
    def probe() -> bool:
        seen.append(lora._outer_compile_replays_graphs())
        return True

    def fn(x):
        return x * 2 if probe() else x

    torch._dynamo.reset()
    try:
        torch.compile(fn, **compile_kwargs)(torch.randn(3))
    finally:
        torch._dynamo.reset()
    assert seen == [expected]


def test_outer_compile_replays_graphs_says_when_it_cannot_tell(monkeypatch, caplog):
    """On a torch whose tracing state reads differently, the check answers "not graphed" (the traced path, the
    default mode's faster one) and says so once, not silently."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    def unreadable():
        raise AttributeError("no current_tx here")

    monkeypatch.setattr(InstructionTranslator, "current_tx", staticmethod(unreadable))
    monkeypatch.setattr(lora, "_logged", set())
    with caplog.at_level(logging.INFO, logger="g4ops"):
        assert lora._outer_compile_replays_graphs() is False
        assert lora._outer_compile_replays_graphs() is False
    said = [r for r in caplog.records if "cannot tell whether this torch.compile replays CUDA graphs" in r.message]
    assert len(said) == 1 and "no current_tx here" in said[0].message


# ----------------------------------------------------------------------------------------------------------------
# The whole tiny model: LoRA on every projection, attention's included


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", [False, True], ids=["sdpa", "g4ops-attention"])
def test_tiny_model_lora_on_all_projections_matches_stock(device, attention, monkeypatch):
    """The attention projections are module calls inside Gemma4TextAttention: enable(model) gives their peft layers
    g4ops' forward (`g4ops::lora_linear`, tests/test_lora_linear.py); the class-wide enable() leaves them to peft.
    Eager calls of the op are turned on here (by default they run peft's forward: `peft_lora.EAGER_LINEAR_VIA_OP`)."""
    monkeypatch.setattr(peft_lora, "EAGER_LINEAR_VIA_OP", True)
    base = build_model("tiny-e4b").to(device)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0)).to(device)

    def step(enabled):
        model.zero_grad(set_to_none=True)
        counter = G4opsCalls()
        patches = (g4ops.enable(base, attention=True) if attention else g4ops.enable()) if enabled else _nothing()
        with patches, counter if enabled else _nothing():
            implementations.append(base.model.layers[0].self_attn.config._attn_implementation)
            loss = model(ids, labels=ids).loss
            loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, counter.calls

    implementations = []
    exact = O.fp64_model(model)  # stock peft in fp64 (norms too) on the same weights: the oracle
    exact.zero_grad(set_to_none=True)
    exact(ids, labels=ids).loss.backward()
    grads64 = {n: p.grad for n, p in exact.named_parameters() if p.requires_grad}
    loss0, grads0, _ = step(False)
    loss1, grads1, calls = step(True)
    used = implementations[-1]
    layers = base.config.num_hidden_layers
    assert all(calls.get(op) == layers for op in FUSED_TRAIN), calls
    projections = sum(peft_lora.is_peft_lora_layer(getattr(layer.self_attn, name, None))
                      for layer in base.model.layers for name in ("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
    assert projections > 2 * layers  # KV-shared layers have no k/v_proj
    linear = ("g4ops.lora_linear_forward.default", "g4ops.lora_linear_backward.default")
    assert all(calls.get(op) == (projections if attention else None) for op in linear), calls
    assert used == ("g4ops" if attention else "sdpa")
    assert base.config._attn_implementation == "sdpa"  # the switch was undone
    assert abs(loss1.item() - loss0.item()) <= _fp32_tol(base.config.vocab_size) * abs(loss0.item())
    for proj in targets:  # every projection's adapters train, attention's too
        assert any(f"{proj}.lora_A" in n for n in grads1), proj
    # The yardstick: the worst of stock and two stock runs whose norms round the other way (oracle.jittered_norms);
    # each norm call's own accuracy is test_norm_calls_of_the_model_are_no_worse_than_stock's.
    jittered = [_stock_grads_with_jittered_norms(model, base, ids, seed) for seed in (1, 2)]
    noise = layers * _fp32_tol(base.config.hidden_size * 21)
    for name, g in grads0.items():
        assert grads1[name] is not None, name
        yardstick = max(O.rel_err(grads[name], grads64[name]) for grads in (grads0, *jittered))
        O.assert_no_worse_than_stock(name, O.rel_err(grads1[name], grads64[name]), yardstick, noise)
        if device == "cpu":  # the same ATen kernels in the same order: that close to stock's too
            assert O.rel_err(grads1[name], g) <= noise, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_lora_step_replays_cuda_graphs():
    """The fastest LoRA step (README): torch.compile(mode="reduce-overhead") captures the whole step, the LoRA op
    and the fused loss included (Inductor leaves no graph uncaptured), and a replayed step gives the eager step's
    loss and adapter gradients (fp32, two layers, LoRA on every projection)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    base = build_model("tiny-e4b", num_layers=2).cuda()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0)).cuda()

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels=ids).loss
        loss.backward()  # copies below: a graph's outputs are overwritten by its next replay
        return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    with g4ops.enable():
        loss0, grads0 = step(model)
        compiled = torch.compile(model, mode="reduce-overhead")
        skips = counters["inductor"]["cudagraph_skips"]
        for _ in range(3):  # warm-up, recording, replay
            torch.compiler.cudagraph_mark_step_begin()
            loss1, grads1 = step(compiled)
        assert counters["inductor"]["cudagraph_skips"] == skips, "a graph of the step was not captured"
    torch._dynamo.reset()
    assert abs(loss1.item() - loss0.item()) <= _fp32_tol(base.config.vocab_size) * abs(loss0.item())
    noise = base.config.num_hidden_layers * _fp32_tol(base.config.hidden_size * ids.numel())
    assert grads1.keys() == grads0.keys() and all("lora_" in n for n in grads0)
    for name, g in grads0.items():
        assert O.rel_err(grads1[name], g) <= noise, name


def _stock_grads_with_jittered_norms(model, base, ids, seed: int) -> dict[str, torch.Tensor]:
    with O.jittered_norms(base, seed):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", DEVICES)
def test_norm_calls_of_the_model_are_no_worse_than_stock(device):
    """Every Gemma4RMSNorm call of a LoRA step (q/k/v norms on head_dim rows, v_norm's strided gradient, the layer
    and final norms), replayed on the tensors it saw: g4ops.rms_norm's output and input gradient are no further
    from fp64 than stock's on the same call."""
    base = build_model("tiny-e4b").to(device)
    targets = ["q_proj", "v_proj", "gate_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0)).to(device)
    calls = O.record_norm_calls(model, ids)
    assert len(calls) >= 6 * base.config.num_hidden_layers and all(g is not None for *_, g in calls)
    assert any(not g.is_contiguous() for *_, g in calls)  # v_norm's gradient comes strided from the attention

    def y_and_dx(fn, x, g):
        x = x.detach().requires_grad_(True)
        y = fn(x)
        return y.detach(), torch.autograd.grad(y, x, g)[0]

    for _, module, x, g in calls:
        weight, eps = (module.weight if module.with_scale else None), patches.norm_eps(module)
        exact = O.rms_norm(x, weight, eps), O.rms_norm_grads(g, x, weight, eps)[0]
        ours = y_and_dx(lambda t: g4ops.rms_norm(t, weight, eps), x, g)
        stock = y_and_dx(module, x, g)
        n = x.shape[-1]
        for what, mine, theirs, ref in zip(("y", "dx"), ours, stock, exact):
            slack = O.floor(F32, n, x.numel(), rounded_terms=False)
            O.assert_no_worse_than_stock(f"{what} {list(x.shape)}", O.rel_err(mine, ref), O.rel_err(theirs, ref), slack)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_tiny_model_lora_compiled_fullgraph_matches_eager():
    """The whole peft model compiled in one graph (on CPU this compile takes minutes; the MLP-level compile test
    covers the dispatch there): no graph break, the LoRA math traced into the graph, loss and adapter gradients as
    eager."""
    base = build_model("tiny-e4b").to("cuda")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0)).to("cuda")

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    with g4ops.enable():
        loss0, grads0 = step(model)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(ids, labels=ids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        _assert_traced_not_opaque(explanation.graphs)
        loss1, grads1 = step(torch.compile(model, fullgraph=True))
    layers = base.config.num_hidden_layers
    assert abs(loss1.item() - loss0.item()) <= _fp32_tol(base.config.vocab_size) * abs(loss0.item())
    for name, g in grads0.items():
        assert O.rel_err(grads1[name], g) <= layers * _fp32_tol(base.config.hidden_size * 21), name


@pytest.mark.slow  # about a minute of Inductor C++ compilation on 2 cores; on a GPU every cuda test runs this path
def test_compiled_kernel_math_matches_peft(monkeypatch):
    """The op's kernels as CUDA runs them, through torch.compile (forced on CPU here): dropout and two adapters,
    equal to peft up to fp32 reassociation."""
    monkeypatch.setattr(lora, "_LORA_COMPILE", "1")
    monkeypatch.setattr(lora, "_compiled", {})
    monkeypatch.setattr(lora, "_compile_failed", [])
    model = _add_second_adapter(_mlp_model(lora_dropout=0.3)).train()
    model.base_model.set_adapter(["default", "second"])
    x, grad_out = _inputs("cpu", F32)
    torch.manual_seed(5)
    stock = _run(model, x, grad_out, False)
    torch.manual_seed(5)
    ours = _run(model, x, grad_out, True)
    assert not lora._compile_failed, lora._compile_failed
    assert set(lora._compiled) == {lora.lora_geglu_mlp_forward_math, lora.lora_geglu_mlp_backward_math}
    assert O.rel_err(ours[0], stock[0]) <= _fp32_tol(INTER)  # Inductor may fuse differently: not bit for bit
    _assert_matches_stock(stock, (stock[0], *ours[1:]), "cpu")


def test_saves_gate_up_and_low_rank_products_only():
    """Activation memory (design claim in g4ops/ops/lora.py): for backward the fused path keeps gate and up (bf16) and
    the [T, r] products (fp32 adapters), besides x and the weights; peft keeps fp32 copies of x and h as well."""
    model = _mlp_model("cpu", BF16).train()
    x, _ = _inputs("cpu", BF16)

    def saved_bytes(enabled):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        xs = x.detach().requires_grad_()
        with g4ops.enable() if enabled else _nothing(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(xs)
        known = {p.untyped_storage().data_ptr() for p in model.parameters()} | {xs.untyped_storage().data_ptr()}
        return sum(n for ptr, n in storages.items() if ptr not in known)

    tokens = TOKENS[0] * TOKENS[1]
    ranks = [p.shape[0] for n, p in model.named_parameters() if "lora_A" in n]
    expected = 2 * tokens * INTER * BF16.itemsize + sum(tokens * r * F32.itemsize for r in ranks)
    ours, stock = saved_bytes(True), saved_bytes(False)
    assert ours == expected, (ours, expected)
    assert stock > ours + tokens * (HIDDEN + INTER) * F32.itemsize  # at least peft's fp32 copies of x and h more


# ----------------------------------------------------------------------------------------------------------------
# peft configurations users pick, on the whole tiny model: g4ops (enable(model, attention=True)) equals stock in fp32


_USER_CONFIGS = {
    "all-linear": dict(target_modules="all-linear"),  # the per-layer-input projections too (they stay on peft)
    "dora-mlp": dict(target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=True),  # DoRA everywhere: peft's
    "layers-to-transform": dict(target_modules=["q_proj", "gate_proj", "down_proj"], layers_to_transform=[1, 2]),
    "rank-alpha-pattern": dict(target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                               rank_pattern={"gate_proj": 2}, alpha_pattern={"down_proj": 3}),  # fmt: skip
    "dropout-checkpointing": dict(target_modules=["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"],
                                  lora_dropout=0.2),  # masks redrawn in the recomputed forward, as peft's are
    "trainable-tokens": dict(target_modules=["q_proj", "gate_proj"], trainable_token_indices={"embed_tokens": [5, 6]}),
    "modules-to-save": dict(target_modules=["q_proj", "gate_proj"], modules_to_save=["input_layernorm"]),
}


@pytest.mark.parametrize("name", sorted(_USER_CONFIGS))
def test_user_peft_configs_train_like_stock(name, monkeypatch):
    """Loss and every trainable gradient of a 4-layer tiny model equal stock peft's up to fp32 reassociation, with
    the fused path taken wherever a config leaves plain LoRA on an MLP."""
    monkeypatch.setattr(peft_lora, "_logged", set())  # its fallback reasons are said once: not on behalf of later tests
    model = build_model("tiny-e4b", num_layers=4).train()
    if name == "dropout-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    settings = dict(r=4, lora_alpha=8, init_lora_weights=False, **_USER_CONFIGS[name])
    model = peft.get_peft_model(model, peft.LoraConfig(**settings)).train()
    ids = torch.randint(3, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))

    def step(enabled: bool):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # the same dropout draws either way
        counter = G4opsCalls()
        with g4ops.enable(model, attention=True) if enabled else _nothing(), counter if enabled else _nothing():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, counter.calls

    stock_loss, stock_grads, _ = step(False)
    loss, grads, calls = step(True)
    assert abs(loss - stock_loss) <= _fp32_tol(model.config.vocab_size) * abs(stock_loss)
    assert grads.keys() == stock_grads.keys() and grads
    for n, g in stock_grads.items():
        assert O.rel_err(grads[n], g) <= 4 * _fp32_tol(64 * 40), n
    fused = calls.get("g4ops.lora_geglu_mlp_forward.default", 0)
    assert (fused > 0) == (name != "dora-mlp"), calls  # a DoRA MLP keeps peft's forward
