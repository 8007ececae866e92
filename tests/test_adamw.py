"""Tests of torch.ops.g4ops.adamw_step and g4ops.optim.AdamW.

- hypothesis property: one update against the fp64 oracle (tests/oracle.py), within a bound from the dtype and the
  update's condition, and at least as close to fp64 as torch.optim.AdamW(fused=True), over shapes (odd sizes, below
  and above one 16-byte vector), dtypes, layouts (contiguous, transposed, a view at an odd offset: the CUDA kernel's
  unaligned path), hyperparameters (weight decay on and off) and step numbers;
- the optimizer: a training trajectory next to torch's (param groups, a frozen and an unused parameter), state
  dicts moved both ways between the two, GradScaler (an inf skips the step), torch.compile of the step, version
  counters (autograd notices a parameter updated after a forward saved it);
- opcheck, torch.compile(fullgraph=True) of the op, bad input named in the error;
- on CUDA: the same property and sizes through the kernel's vector and unaligned paths, CUDA-graph capture of the
  step, a tensor of more than 2^31 elements (64-bit indexing) against the oracle.
Inputs are fresh random nonzero draws.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import g4ops.optim
from g4ops import ops
from g4ops.ops import reference

try:
    from . import oracle as O
    from .devices import DEVICES, capture_cuda_graph
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, capture_cuda_graph

OP = torch.ops.g4ops.adamw_step.default
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
LAYOUTS = ("contiguous", "transposed", "offset")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _laid_out(values: torch.Tensor, dtype, device, layout: str) -> torch.Tensor:
    """`values` (fp32, CPU) as a tensor of `dtype` on `device` in `layout`; every tensor of an update gets the same
    layout, so the four share strides as the op requires:
    contiguous  plain
    transposed  the transpose of a contiguous tensor of the reversed shape (dense, not contiguous)
    offset      a contiguous view starting one element into a larger buffer (not 16-byte aligned)"""
    if layout == "contiguous":
        return values.to(device, dtype)
    if layout == "transposed":
        return values.t().contiguous().to(device, dtype).t()
    if layout == "offset":
        buffer = torch.empty(values.numel() + 1, dtype=dtype, device=device)
        view = buffer[1:].view(values.shape)
        view.copy_(values)
        return view
    raise ValueError(layout)


def _state(shape, dtype, gen, device, layout, grad_scale):
    """(param, grad, exp_avg, exp_avg_sq): random, nonzero; exp_avg_sq positive, of the size of grad^2."""
    p = O.nonzero_randn(shape, gen, 0.5)
    g = O.nonzero_randn(shape, gen, grad_scale)
    m = O.nonzero_randn(shape, gen, grad_scale / 2)
    v = (torch.rand(shape, generator=gen) + 0.25) * grad_scale**2
    tensors = [_laid_out(t, dtype, device, layout) for t in (p, g, m, v)]
    assert all((t != 0).all() for t in tensors), "random input underflowed to zero"
    return tensors


def _g4ops_update(p, g, m, v, step, hyper):
    p, m, v = p.clone(), m.clone(), v.clone()
    with torch.no_grad():
        ops.adamw_step([p], [g], [m], [v], [torch.tensor(float(step), device=p.device)], **hyper)
    return p, m, v


def _torch_update(p, g, m, v, step, hyper):
    """torch.optim.AdamW(fused=True) at step `step` from the given state (contiguous copies)."""
    param = p.detach().clone().contiguous().requires_grad_()
    param.grad = g.clone().contiguous()
    opt = torch.optim.AdamW([param], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"], fused=True)  # fmt: skip
    step_t = torch.tensor(float(step - 1), device=p.device)  # fused keeps the count on the parameter's device
    opt.state[param] = dict(step=step_t, exp_avg=m.clone().contiguous(), exp_avg_sq=v.clone().contiguous())
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


def _conditions(p, g, m, step, hyper, ref):
    """kappa of the two sums whose terms can cancel: p' = p (1 - lr wd) - update, and m' = b1 m + (1 - b1) g."""
    p64, g64, m64 = (t.double() for t in (p, g, m))
    ref_p, ref_m, ref_v = ref
    update = (ref_p - p64 * (1 - hyper["lr"] * hyper["weight_decay"])).abs()
    kappa_p = O.condition(p64.abs() * (1 - hyper["lr"] * hyper["weight_decay"]) + update, ref_p)
    kappa_m = O.condition(hyper["beta1"] * m64.abs() + (1 - hyper["beta1"]) * g64.abs(), ref_m)
    return kappa_p, kappa_m, 1.0


def _assert_within_oracle_bound(name: str, out: torch.Tensor, ref: torch.Tensor, kappa: float) -> float:
    """Bound (1) of tests/oracle.py: one rounding to out's dtype, plus a few accumulation-dtype operations amplified
    by the condition of the sum; returns the error."""
    err = O.rel_err(out, ref)
    tol = O.TOLERANCE[out.dtype].u + kappa * O.tolerance(out.dtype, 4, roundings=0)
    assert err <= tol, f"{name}: error vs fp64 {err:.3e} > bound {tol:.3e} (kappa {kappa:.3g})"
    return err


# ----------------------------------------------------------------------------------------------------------------
# Property: within the fp64 bound, and no less accurate than torch's fused AdamW.

DRAWS = 3


def adamw_vs_torch(device, dtype, shape, layout, hyper, step, grad_scale, seed):
    gen = _gen(seed)
    n = shape[0] * shape[1]
    sums = {name: [0.0, 0.0, 0.0] for name in ("param", "exp_avg", "exp_avg_sq")}  # g4ops err, torch err, kappa^2
    context = f"{dtype} {list(shape)} {layout} step {step} {hyper} grad scale {grad_scale}"
    for _ in range(DRAWS):
        p, g, m, v = _state(shape, dtype, gen, device, layout, grad_scale)
        ref = O.adamw_step(p, g, m, v, step, **hyper)
        ours = _g4ops_update(p, g, m, v, step, hyper)
        theirs = _torch_update(p, g, m, v, step, hyper)
        for name, out, stock, ref_t, kappa in zip(sums, ours, theirs, ref, _conditions(p, g, m, step, hyper, ref)):
            assert out.dtype == dtype and out.shape == shape
            err = _assert_within_oracle_bound(f"{name} [{context}]", out, ref_t, kappa)
            sums[name][0] += err
            sums[name][1] += O.rel_err(stock, ref_t)
            sums[name][2] += kappa**2
    for name, (err_g4, err_stock, kappa2) in sums.items():
        kappa = (kappa2 / DRAWS) ** 0.5
        slack = O.floor(dtype, 4, n, kappa, DRAWS, rounded_terms=False)
        O.assert_no_worse_than_stock(f"{name} [{context}]", err_g4 / DRAWS, err_stock / DRAWS, slack)


HYPER = st.fixed_dictionaries(
    dict(
        lr=st.sampled_from([1e-5, 3e-4, 1e-2, 0.1]),
        beta1=st.sampled_from([0.0, 0.5, 0.9]),
        beta2=st.sampled_from([0.9, 0.999, 0.9999]),
        weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
        eps=st.sampled_from([1e-8, 1e-6]),
    )
)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 40),
    cols=st.integers(1, 97),
    layout=st.sampled_from(LAYOUTS),
    hyper=HYPER,
    step=st.sampled_from([1, 2, 3, 17, 1000, 10**5]),
    grad_scale=st.sampled_from([1e-3, 0.1, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_adamw_step_property(device, dtype, rows, cols, layout, hyper, step, grad_scale, seed):
    assume(not (dtype == torch.float16 and grad_scale < 0.1))  # v ~ grad^2 would leave fp16's range
    adamw_vs_torch(device, dtype, (rows, cols), layout, hyper, step, grad_scale, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw_step_e4b_sizes(device, dtype):
    """Sizes of Gemma-4 E4B tensors (a norm weight, a layer scalar, a projection), sizes around one 16-byte vector,
    and a million elements through the kernel's vector and unaligned paths."""
    hyper = dict(lr=3e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    cases = [((1, 1), "contiguous"), ((1, 7), "offset"), ((1, 8), "contiguous"), ((1, 9), "contiguous"),
             ((1, 2560), "contiguous"), ((256, 2560), "contiguous"), ((3, 4101), "transposed"),
             ((1, (1 << 20) + 5), "offset")]  # fmt: skip
    for i, (shape, layout) in enumerate(cases):
        adamw_vs_torch(device, dtype, shape, layout, hyper, 5, 0.1, seed=i)


# ----------------------------------------------------------------------------------------------------------------
# The optimizer


class _Net(torch.nn.Module):
    """A small language model with a frozen parameter and one that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Embedding(50, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 37), torch.nn.GELU(),
            torch.nn.Linear(37, 50),
        )  # fmt: skip
        self.body[1].bias.requires_grad_(False)  # frozen
        self.unused = torch.nn.Linear(3, 3)  # not in the forward: its grad stays None

    def forward(self, ids):
        return self.body(ids)


def _model(device, seed=0):
    torch.manual_seed(seed)
    return _Net().to(device)


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight") and p.requires_grad]
    return [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0, lr=3e-3)]


def _train(model, opt, steps, device, seed=1, scaler=None, inf_at=None):
    gen = torch.Generator(device).manual_seed(seed)
    for i in range(steps):
        ids = torch.randint(0, 50, (4, 9), generator=gen, device=device)
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, -1).flatten())
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if i == inf_at:
                model.body[2].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)


def _assert_params_close(a, b, rtol=1e-5):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert O.rel_err(p, q) <= rtol, f"{name}: {O.rel_err(p, q):.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_trajectory_matches_torch(device):
    ours, theirs = _model(device), _model(device)
    opt_ours = g4ops.optim.AdamW(_groups(ours), lr=1e-2, betas=(0.8, 0.99))
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=(0.8, 0.99), fused=True)
    start = copy.deepcopy(ours.state_dict())
    _train(ours, opt_ours, 6, device)
    _train(theirs, opt_theirs, 6, device)
    _assert_params_close(ours, theirs)
    moved = [n for n, p in ours.named_parameters() if not torch.equal(p, start[n])]
    assert "body.0.weight" in moved and "body.4.bias" in moved
    assert torch.equal(ours.unused.weight, start["unused.weight"]) and ours.unused.weight not in opt_ours.state
    assert torch.equal(ours.body[1].bias, start["body.1.bias"])  # frozen
    for p, q in zip(ours.parameters(), theirs.parameters()):
        mine, ref = opt_ours.state.get(p, {}), opt_theirs.state.get(q, {})
        assert mine.keys() == ref.keys()
        for key in mine:
            assert (mine[key].dtype, mine[key].device, mine[key].shape) == (ref[key].dtype, ref[key].device,
                                                                           ref[key].shape)  # fmt: skip
        if mine:
            assert float(mine["step"]) == float(ref["step"]) == 6.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["torch_to_g4ops", "g4ops_to_torch"])
def test_state_dict_moves_between_torch_and_g4ops(device, direction):
    """Three steps with one optimizer, its state dict loaded into the other, three more: the same as six steps
    with one (torch's side non-fused, so its step count comes and goes on the CPU)."""
    make = {
        "torch": lambda m: torch.optim.AdamW(_groups(m), lr=1e-2, foreach=False),
        "g4ops": lambda m: g4ops.optim.AdamW(_groups(m), lr=1e-2),
    }
    first, second = direction.split("_to_")
    switched, straight = _model(device), _model(device)
    opt = make[first](switched)
    _train(switched, opt, 3, device, seed=5)
    resumed = make[second](switched)
    resumed.load_state_dict(opt.state_dict())
    _train(switched, resumed, 3, device, seed=6)
    straight_opt = make[second](straight)
    _train(straight, straight_opt, 3, device, seed=5)
    _train(straight, straight_opt, 3, device, seed=6)
    _assert_params_close(switched, straight)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_unscales_and_skips_inf_steps(device):
    ours, theirs = _model(device), _model(device)
    opt_ours = g4ops.optim.AdamW(_groups(ours), lr=1e-2)
    opt_theirs = torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=False)
    scalers = [torch.amp.GradScaler(device, init_scale=2.0**10) for _ in range(2)]
    _train(ours, opt_ours, 4, device, scaler=scalers[0], inf_at=2)
    _train(theirs, opt_theirs, 4, device, scaler=scalers[1], inf_at=2)
    _assert_params_close(ours, theirs)
    counts = {float(s["step"]) for s in opt_ours.state.values()}
    assert counts == {3.0}, f"the step with an inf gradient must be skipped: step counts {counts}"


def test_compiled_optimizer_step_matches_eager():
    eager, compiled = _model("cpu"), _model("cpu")
    opt_eager = g4ops.optim.AdamW(_groups(eager), lr=1e-2)
    opt_compiled = g4ops.optim.AdamW(_groups(compiled), lr=1e-2)
    opt_compiled.step = torch.compile(opt_compiled.step, fullgraph=True)
    _train(eager, opt_eager, 3, "cpu")
    _train(compiled, opt_compiled, 3, "cpu")
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(p, q)


def test_version_counter_catches_a_parameter_updated_after_the_forward():
    model = _model("cpu")
    opt = g4ops.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 50, (2, 5))
    model(ids).sum().backward()
    loss = model(ids).sum()  # saves the Linear weights for its backward
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ----------------------------------------------------------------------------------------------------------------
# The op: opcheck, compile, errors


def _op_args(device, dtype=torch.float32, layout="contiguous", shapes=((5, 3), (1, 7)), seed=0):
    gen = _gen(seed)
    lists = [[], [], [], [], []]
    for i, shape in enumerate(shapes):
        for dest, t in zip(lists, _state(shape, dtype, gen, device, layout, 0.1)):
            dest.append(t)
        lists[4].append(torch.tensor(float(i + 2), device=device))
    return lists


HYPER_ARGS = (1e-3, 0.9, 0.999, 0.01, 1e-8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "offset"), (torch.float32, "transposed"),
                                          (torch.float64, "contiguous")])  # fmt: skip
def test_opcheck_adamw_step(device, dtype, layout):
    torch.library.opcheck(OP, (*_op_args(device, dtype, layout), *HYPER_ARGS))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_op_matches_eager(device):
    eager, compiled = _op_args(device, torch.bfloat16), _op_args(device, torch.bfloat16)

    def update(params, grads, exp_avgs, exp_avg_sqs, steps):
        ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=1e-3, beta1=0.9, beta2=0.999,
                       weight_decay=0.01, eps=1e-8)  # fmt: skip

    with torch.no_grad():
        update(*eager)
        torch.compile(update, fullgraph=True)(*compiled)
    for a, b in zip(eager, compiled):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_reference_matches_the_fp64_oracle_for_fp64():
    """In fp64 the reference has nothing to round to but fp64: it is the oracle up to a few fp64 ulps."""
    p, g, m, v = _state((7, 11), torch.float64, _gen(4), "cpu", "contiguous", 0.1)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8)
    ref = O.adamw_step(p, g, m, v, 3, **hyper)
    reference.adamw_step([p], [g], [m], [v], [torch.tensor(3.0)], **hyper)
    for out, r in zip((p, m, v), ref):
        assert O.rel_err(out, r) <= 1e-14


def _bad_cases():
    def edit(index, i, value):
        def make(args):
            args[index][i] = value(args[index][i])
            return args

        return make

    return {
        "`grads` has 1 tensors": lambda a: [a[0], a[1][:1], *a[2:]],
        "`grads\\[1\\]` is torch.float16": edit(1, 1, lambda t: t.half()),
        "`exp_avgs\\[0\\]` must have the shape and strides": edit(2, 0, lambda t: t.reshape(3, 5)),
        "`exp_avg_sqs\\[0\\]` must have the shape and strides": edit(3, 0, lambda t: t.t().contiguous().t()),
        "`params\\[0\\]` must be non-overlapping and dense": lambda a: [
            [torch.randn(10, 3)[::2], *a[0][1:]], [torch.randn(10, 3)[::2], *a[1][1:]],
            [torch.randn(10, 3)[::2], *a[2][1:]], [torch.randn(10, 3)[::2], *a[3][1:]], a[4]],  # fmt: skip
        "`steps\\[1\\]` must be a float32 scalar": edit(4, 1, lambda t: t.long()),
        "`steps\\[0\\]` must be a float32 scalar tensor \\(the step number\\), got torch.float32 with 2": edit(
            4, 0, lambda t: t.repeat(2)
        ),
        "`params\\[0\\]` must be float16, bfloat16": lambda a: [[a[0][0].int(), *a[0][1:]], *a[1:]],
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_is_named(case):
    args = _bad_cases()[case](_op_args("cpu"))
    with torch.no_grad(), pytest.raises((RuntimeError, TypeError), match=case):
        OP(*args, *HYPER_ARGS)


@pytest.mark.parametrize("name,index,value", [("lr", 0, -1.0), ("beta1", 1, 1.0), ("beta2", 2, -0.1),
                                              ("weight_decay", 3, -0.5), ("eps", 4, -1e-8)])  # fmt: skip
def test_bad_hyperparameter_is_named(name, index, value):
    hyper = list(HYPER_ARGS)
    hyper[index] = value
    with torch.no_grad(), pytest.raises(RuntimeError, match=f"`{name}` must be"):
        OP(*_op_args("cpu"), *hyper)


def test_op_refuses_grad_mode_on_parameters_that_require_grad():
    args = _op_args("cpu")
    args[0] = [p.requires_grad_() for p in args[0]]
    with pytest.raises(RuntimeError, match="call it under torch.no_grad"):
        OP(*args, *HYPER_ARGS)


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), "amsgrad"), (dict(maximize=True), "maximize"), (dict(lr=torch.tensor(1e-3)), "`lr`"),
])  # fmt: skip
def test_optimizer_refuses_what_it_does_not_support(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        g4ops.optim.AdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_optimizer_refuses_sparse_gradients():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        g4ops.optim.AdamW(emb.parameters()).step()


@cuda_only
@pytest.mark.cuda
def test_device_mismatch_is_named():
    args = _op_args("cpu")
    args[1][0] = args[1][0].cuda()
    with torch.no_grad(), pytest.raises(RuntimeError, match="`grads\\[0\\]` is on cuda"):
        OP(*args, *HYPER_ARGS)


# ----------------------------------------------------------------------------------------------------------------
# CUDA: CUDA graphs, 64-bit indexing


@cuda_only
@pytest.mark.cuda
def test_cuda_graph_captures_the_optimizer_step():
    """Replays of a captured `opt.step()` on new gradients give the eager optimizer's parameters, bit for bit."""
    eager, graphed = _model("cuda"), _model("cuda")
    opt_eager = g4ops.optim.AdamW(_groups(eager), lr=1e-2)
    opt_graphed = g4ops.optim.AdamW(_groups(graphed), lr=1e-2)
    gen = torch.Generator("cuda").manual_seed(0)
    trained = [p for p in graphed.parameters() if p.requires_grad and p is not graphed.unused.weight
               and p is not graphed.unused.bias]  # fmt: skip
    for p in trained:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    opt_graphed.step()  # creates the state, which capture must not allocate
    for p, q in zip(eager.parameters(), graphed.parameters()):
        if q.grad is not None:
            p.grad = q.grad.clone()
    opt_eager.step()
    graph, _ = capture_cuda_graph(lambda: opt_graphed.step())  # capture_cuda_graph steps twice before capturing
    for _ in range(2):
        opt_eager.step()
    for _ in range(3):
        for p, q in zip(eager.parameters(), graphed.parameters()):
            if q.grad is not None:
                q.grad.copy_(torch.randn(q.shape, device="cuda", generator=gen))
                p.grad.copy_(q.grad)
        graph.replay()
        opt_eager.step()
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p, q)
    # 1 + the 2 warm-up steps of capture_cuda_graph + 3 replays (capturing runs nothing)
    assert {float(s["step"]) for s in opt_graphed.state.values()} == {6.0}


@cuda_only
@pytest.mark.cuda
def test_cuda_tensor_beyond_2_to_the_31_elements():
    """E4B's per-layer-input table has 2.8 B elements: 64-bit indexing, checked on windows at the start, across
    element 2^31 and at the end (the tail that is not a whole vector) against the fp64 oracle."""
    n = (1 << 31) + 13
    if torch.cuda.get_device_properties(0).total_memory < 4 * n * 2 * 1.2:
        pytest.skip("needs about 21 GB of GPU memory")
    gen = torch.Generator("cuda").manual_seed(0)
    p, g, m = (torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.1 for _ in range(3))
    v = torch.rand(n, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01 + 1e-4
    windows = [slice(0, 4096), slice((1 << 31) - 4096, (1 << 31) + 4096), slice(n - 4096, n)]
    before = [[t[w].clone() for t in (p, g, m, v)] for w in windows]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
    with torch.no_grad():
        ops.adamw_step([p], [g], [m], [v], [torch.tensor(4.0, device="cuda")], **hyper)
    for w, (wp, wg, wm, wv) in zip(windows, before):
        ref = O.adamw_step(wp, wg, wm, wv, 4, **hyper)
        kappas = _conditions(wp, wg, wm, 4, hyper, ref)
        for name, out, ref_t, kappa in zip(("param", "exp_avg", "exp_avg_sq"), (p[w], m[w], v[w]), ref, kappas):
            _assert_within_oracle_bound(f"{name} at {w}", out, ref_t, kappa)
