"""g4ops' fused LoRA MLP inside an outer torch.compile (g4ops/ops/lora.py's docstring, "Inside an outer
torch.compile"): the trace holds the math, not the opaque op `g4ops::lora_geglu_mlp` (issue 18: the op made a
compiled training step host-bound), with no graph break; loss and adapter gradients equal stock peft's; frozen base
weights get no gradient; dropout, merged and disabled adapters behave as in eager mode.

aot_eager runs the traced graph on ATen's eager kernels (same generator calls as eager: seeded dropout compares
mask for mask); one test compiles through Inductor. The holder MLP and helpers are tests/test_lora.py's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import g4ops
from g4ops.models import build_model
from g4ops.ops import lora

try:
    from . import oracle as O
    from .devices import DEVICES, one_intra_op_thread  # noqa: F401 - an autouse fixture of this module
    from .test_lora import BF16, F32, HIDDEN, INTER, TOKENS, _add_second_adapter, _fp32_tol, _inputs, _mlp_model
    from .test_lora import _nothing
    from .test_lora import _always_disabled, _run  # noqa: F401 - _always_disabled: autouse, g4ops off around each test
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, one_intra_op_thread  # noqa: F401 - an autouse fixture of this module
    from test_lora import BF16, F32, HIDDEN, INTER, TOKENS, _add_second_adapter, _fp32_tol, _inputs, _mlp_model
    from test_lora import _nothing
    from test_lora import _always_disabled, _run  # noqa: F401 - _always_disabled: autouse, g4ops off around each test

peft = pytest.importorskip("peft")
# the traced path is off on older torch (ops/lora.py's docstring says why); G4OPS_LORA_TRACE=1 runs these tests there
pytestmark = pytest.mark.skipif(not lora.TRACE_UNDER_COMPILE, reason="g4ops.ops.lora's traced path is off on this "
                                "torch (tested on >= 2.11; set G4OPS_LORA_TRACE=1 to test it here)")  # fmt: skip

LORA_OPS = ("lora_geglu_mlp", "lora_geglu_mlp_forward", "lora_geglu_mlp_backward")


class _Recorder:
    """A torch.compile backend that keeps every graph Dynamo hands it (their nested graphs too: an autograd.Function
    is a higher-order op whose forward and backward bodies are submodules) and then compiles with `backend`."""

    def __init__(self, backend="aot_eager"):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

    def targets(self) -> set[str]:
        return {str(node.target) for gm in self.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
                for node in sub.graph.nodes if node.op == "call_function"}  # fmt: skip

    def assert_traced_math(self):
        """The graph holds the LoRA math through the autograd.Function, and none of the op's three entry points."""
        targets = self.targets()
        assert self.graphs and not _calls(targets, *LORA_OPS), sorted(targets)
        assert any("autograd_function_apply" in t for t in targets), sorted(targets)


def _compiled_run(model, x, grad_out, backend):
    """`_run` through torch.compile(fullgraph=True): a graph break raises."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with g4ops.enable():
        out = compiled(x)
        out.backward(grad_out)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen parameters got gradients: {frozen}"
    return out.detach(), x.grad, grads


def _assert_close_to(stock, ours, weights=False, reductions=TOKENS[0] * TOKENS[1]):
    """Up to fp32 reassociation (a compiled graph may order sums differently, as on CUDA); `weights`: the base
    weights train too; `reductions`: the tokens each weight gradient sums over."""
    (o0, x0, g0), (o1, x1, g1) = stock[:3], ours[:3]
    assert O.rel_err(o1, o0) <= _fp32_tol(INTER)
    assert O.rel_err(x1, x0) <= _fp32_tol(INTER)
    assert g0.keys() == g1.keys() and g0 and weights != all("lora_" in n for n in g0)
    for name in g0:
        assert g1[name] is not None, name
        assert O.rel_err(g1[name], g0[name]) <= _fp32_tol(reductions), name


def _calls(targets, *ops) -> set[str]:
    """The targets that are one of these g4ops ops (Dynamo's graphs name the op, AOTAutograd's the overload)."""
    return {t for t in targets for op in ops if t == f"g4ops.{op}" or t.startswith(f"g4ops.{op}.")}


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("targets", [("gate_proj", "up_proj", "down_proj"), ("up_proj",)])
def test_compiled_mlp_traces_the_math_and_matches_peft(device, targets, fresh_dynamo):
    model = _mlp_model(device, targets=targets).train()
    x, grad_out = _inputs(device, F32)
    stock = _run(model, x, grad_out, enabled=False)
    recorder = _Recorder()
    ours = _compiled_run(model, x, grad_out, recorder)
    recorder.assert_traced_math()
    _assert_close_to(stock, ours)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_dropout_and_two_adapters_draw_peft_masks(device, fresh_dynamo):
    """aot_eager keeps the masks' generator calls, so a seeded compiled step equals seeded eager peft; a second seed
    drops other entries (the masks are drawn per call, not baked into the graph)."""
    model = _add_second_adapter(_mlp_model(device, lora_dropout=0.3)).train()
    model.base_model.set_adapter(["default", "second"])
    x, grad_out = _inputs(device, F32)
    torch.manual_seed(5)
    stock = _run(model, x, grad_out, enabled=False)
    recorder = _Recorder()
    torch.manual_seed(5)
    ours = _compiled_run(model, x, grad_out, recorder)
    recorder.assert_traced_math()
    assert any("native_dropout" in t for t in recorder.targets())
    _assert_close_to(stock, ours)
    torch.manual_seed(6)
    other = _compiled_run(model, x, grad_out, recorder)
    assert O.rel_err(other[0], ours[0]) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_mlp_under_autocast_traces_the_math_like_eager(device, fresh_dynamo, monkeypatch):
    """Under torch.autocast (Trainer's bf16=True) the compiled MLP holds the LoRA math with autocast's casts, no graph
    break, and gives eager g4ops' bf16 results bit for bit when both run ATen's kernels: aot_eager here, and the eager
    op with its math uncompiled (on CUDA the op compiles it by default, and Inductor's fused elementwise kernels round
    the bf16 intermediates differently: 2 ulp apart on an H100, 2026-12-07)."""
    monkeypatch.setattr(lora, "_LORA_COMPILE", "0")
    model = _mlp_model(device).train()
    x, grad_out = _inputs(device, F32)
    eager = _run(model, x, grad_out, enabled=True, autocast=BF16)
    recorder = _Recorder()
    compiled = torch.compile(model, backend=recorder, fullgraph=True)
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with g4ops.enable():
        with torch.autocast(device, dtype=BF16):
            out = compiled(x)
        out.backward(grad_out.to(out.dtype))
    recorder.assert_traced_math()
    assert out.dtype == eager[0].dtype == BF16 and x.grad.dtype == F32
    assert torch.equal(out.detach(), eager[0]) and O.rel_err(x.grad, eager[1]) <= O.TOLERANCE[BF16].u
    for name, g in eager[2].items():
        assert O.rel_err(dict(model.named_parameters())[name].grad, g) <= O.TOLERANCE[BF16].u, name


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_merged_and_disabled_adapters_run_the_base_weights(device, fresh_dynamo):
    """No low-rank term left: the plain geglu_mlp op on the base weights, as in eager mode; no LoRA math traced."""
    model = _mlp_model(device).eval()
    x, _ = _inputs(device, F32)
    with torch.no_grad():
        unmerged = model(x)
        with model.disable_adapter():
            base_only = model(x)
        model.merge_adapter()
        merged = model(x)
        model.unmerge_adapter()
    assert O.rel_err(base_only, unmerged) > 1e-2  # the adapters do change the output
    for state, stock in (("disabled", base_only), ("merged", merged), ("unmerged", unmerged)):
        recorder = _Recorder()
        compiled = torch.compile(model, backend=recorder, fullgraph=True)
        if state == "merged":
            model.merge_adapter()
        with torch.no_grad(), g4ops.enable(), model.disable_adapter() if state == "disabled" else _nothing():
            out = compiled(x)
        if state == "merged":
            model.unmerge_adapter()
        targets = recorder.targets()
        assert not _calls(targets, *LORA_OPS), (state, sorted(targets))
        assert bool(_calls(targets, "geglu_mlp")) == (state != "unmerged"), (state, sorted(targets))
        assert O.rel_err(out, stock) <= _fp32_tol(INTER), state


def test_compiled_backward_computes_no_full_weight_gradient(fresh_dynamo):
    """The traced formula sees which inputs need a gradient (frozen base weights: no [out, in] product in the
    compiled backward); with the base weights trainable it computes theirs, equal to stock autograd's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    x, grad_out = _inputs("cpu", F32)
    for trainable in (False, True):
        torch._dynamo.reset()
        model = _mlp_model().train()
        mlp = model.base_model.model.mlp
        bases = [getattr(mlp, n).get_base_layer().weight for n in ("gate_proj", "up_proj", "down_proj")]
        for w in bases:
            w.requires_grad_(trainable)
        graphs = {}

        def keep(name):
            def compiler(gm, example_inputs):
                graphs[name] = gm
                return make_boxed_func(gm.forward)

            return compiler

        backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
        stock = _run(model, x, grad_out, enabled=False)
        ours = _compiled_run(model, x, grad_out, backend)
        products = {tuple(n.meta["val"].shape) for n in graphs["backward"].graph.nodes
                    if n.op == "call_function" and n.target is torch.ops.aten.mm.default}  # fmt: skip
        weight_shapes = {tuple(w.shape) for w in bases} | {tuple(w.shape)[::-1] for w in bases}
        assert bool(products & weight_shapes) == trainable, products
        _assert_close_to(stock, ours, weights=trainable)


def test_tiny_model_lora_on_every_projection_compiles_without_graph_breaks(fresh_dynamo):
    """Two decoder layers of the tiny E4B shape, LoRA on q/k/v/o and the MLP: one graph, the LoRA math in it, loss
    and every adapter gradient as stock peft's (eager), no gradient on the frozen weights."""
    base = build_model("tiny-e4b", num_layers=2)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels=ids).loss
        loss.backward()
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        assert not frozen, f"frozen parameters got gradients: {frozen}"
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    loss0, grads0 = step(model)
    recorder = _Recorder()
    with g4ops.enable():
        loss1, grads1 = step(torch.compile(model, backend=recorder, fullgraph=True))
    recorder.assert_traced_math()
    applies = [t for gm in recorder.graphs for n in gm.graph.nodes if "autograd_function_apply" in (t := str(n.target))]
    assert len(applies) >= base.config.num_hidden_layers  # one LoRA MLP per layer at least (g4ops has others)
    assert abs(loss1.item() - loss0.item()) <= _fp32_tol(base.config.vocab_size) * abs(loss0.item())
    noise = base.config.num_hidden_layers * _fp32_tol(base.config.hidden_size * ids.numel())
    for proj in targets:
        assert any(f"{proj}.lora_A" in n for n in grads1), proj
    for name, g in grads0.items():
        assert grads1[name] is not None, name
        assert O.rel_err(grads1[name], g) <= noise, name


def test_inductor_compiled_mlp_matches_peft(fresh_dynamo):
    """Inductor's own kernels for the traced math (fused across the MLP), on CPU: equal to peft within fp32
    reassociation."""
    model = _mlp_model("cpu").train()
    x, grad_out = _inputs("cpu", F32)
    stock = _run(model, x, grad_out, enabled=False)
    recorder = _Recorder("inductor")
    ours = _compiled_run(model, x, grad_out, recorder)
    recorder.assert_traced_math()
    _assert_close_to(stock, ours)


def test_inductor_compiled_split_products_no_worse_than_peft(fresh_dynamo, monkeypatch):
    """The split path (fp32 adapters of a bf16 model on bf16 parts, the low-rank terms folded into the base GEMMs)
    traced and compiled by Inductor, on CPU: no worse than stock peft against an fp64 oracle."""
    monkeypatch.setattr(lora, "SPLIT_DEVICES", {"cpu"})
    model = _mlp_model("cpu", BF16).train()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {F32}
    truth = _run(copy.deepcopy(model).double(), *(t.double() for t in _inputs("cpu", BF16)), enabled=False)
    x, grad_out = _inputs("cpu", BF16)
    stock = _run(model, x, grad_out, enabled=False)
    recorder = _Recorder("inductor")
    ours = _compiled_run(model, x, grad_out, recorder)
    recorder.assert_traced_math()
    pairs = [("out", 0, None, INTER), ("grad_x", 1, None, INTER)]
    pairs += [(name, 2, name, TOKENS[0] * TOKENS[1]) for name in truth[2]]
    for name, slot, key, k in pairs:
        ref, st, g4 = ((r[slot] if key is None else r[slot][key]) for r in (truth, stock, ours))
        O.assert_no_worse_than_stock(name, O.rel_err(g4, ref), O.rel_err(st, ref), O.floor(BF16, k, ref.numel()))


def test_bad_input_is_refused_at_trace_time(fresh_dynamo):
    """The op's input checks hold in the traced path too: evaluated while tracing, naming the argument (Dynamo
    raises its own error about the traced call, caused by the check's)."""
    x, grad_out = _inputs("cpu", F32)
    model = _mlp_model().train()
    mlp = model.base_model.model.mlp
    weights = [getattr(mlp, n).get_base_layer().weight for n in ("gate_proj", "up_proj", "down_proj")]
    a, b = mlp.up_proj.lora_A["default"].weight, mlp.up_proj.lora_B["default"].weight

    def call(b_up):
        return lora.lora_geglu_mlp(x, *weights, [], [(a, b_up, 0.5)])

    torch.compile(call, backend="aot_eager", fullgraph=True)(b)  # well-formed: traces
    with pytest.raises(Exception) as info:
        torch.compile(call, backend="aot_eager", fullgraph=True)(b[:, :2])
    causes, exc = [], info.value
    while exc is not None:
        causes.append(exc)
        exc = exc.__cause__ or exc.__context__
    expected = f"`lora_b[0]` must be [{INTER}, {a.shape[0]}] ([out, r] of `lora_a[0]`), got [{INTER}, 2]"
    assert any(type(e) is RuntimeError and expected in str(e) for e in causes), causes


def test_compiled_mlp_at_a_second_length_recompiles_dynamic_and_matches_peft(fresh_dynamo):
    """A new sequence length makes Dynamo recompile with symbolic shapes: the trace-time checks and the mask draws
    then see symbolic sizes; the traced path still runs and matches peft."""
    model = _mlp_model(lora_dropout=0.2).train()
    recorder = _Recorder()
    for tokens, seed in ((TOKENS, 1), ((TOKENS[0], TOKENS[1] + 4), 2), ((TOKENS[0], TOKENS[1] + 9), 3)):
        gen = torch.Generator().manual_seed(seed)
        x = O.make_tensor((*tokens, HIDDEN), F32, gen)
        grad_out = O.make_tensor(x.shape, F32, gen)
        torch.manual_seed(seed)
        stock = _run(model, x, grad_out, enabled=False)
        torch.manual_seed(seed)
        ours = _compiled_run(model, x, grad_out, recorder)
        _assert_close_to(stock, ours, reductions=x.shape[:-1].numel())
    recorder.assert_traced_math()
    assert len(recorder.graphs) == 2  # the static first trace, then one dynamic one for every other length


@pytest.mark.slow  # two Inductor compilations of a training step (about 40 s on 2 cores)
def test_inductor_dropout_draws_the_masks_of_compiled_peft(fresh_dynamo):
    """Under Inductor the masks come from its generator, not ATen's (module docstring): a seeded compiled step
    then equals seeded compiled stock peft, not eager peft."""
    model = _add_second_adapter(_mlp_model(lora_dropout=0.3)).train()
    model.base_model.set_adapter(["default", "second"])
    x, grad_out = _inputs("cpu", F32)

    def compiled_step(enabled):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with g4ops.enable() if enabled else _nothing():
            out = compiled(x)
            out.backward(grad_out)
        return out.detach(), None, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    torch.manual_seed(5)
    eager = _run(model, x, grad_out, enabled=False)
    stock = compiled_step(False)
    ours = compiled_step(True)
    assert O.rel_err(stock[0], eager[0]) > 1e-3  # Inductor's masks are not eager mode's
    assert O.rel_err(ours[0], stock[0]) <= _fp32_tol(INTER)
    for name, g in stock[2].items():
        assert O.rel_err(ours[2][name], g) <= _fp32_tol(TOKENS[0] * TOKENS[1]), name
