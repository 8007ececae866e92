"""g4ops.ops.embedding and its backward op `g4ops::embedding_backward` against an fp64 oracle and stock
F.embedding, and the reason the op exists: under torch.compile its backward stays one opaque op instead of
Inductor's fp32 zero-filled [rows, dim] table (tests below read the compiled backward graph). On CUDA the op is
ATen's own kernel (what stock eager runs); on CPU it sums in fp32 (ops/reference.py says why)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from g4ops import ops

try:
    from . import oracle as O
    from .devices import DEVICES
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES

F64 = torch.float64


def oracle_weight_grad(grad_out, indices, num_weights, padding_idx):
    """fp64: row r of the weight gradient is the sum of grad_out's rows whose index is r; the padding row gets 0.
    Written from the definition with index_add (not with embedding_dense_backward)."""
    dim = grad_out.shape[-1]
    flat_idx = indices.reshape(-1).cpu()
    flat = grad_out.detach().reshape(-1, dim).to(F64).cpu()
    keep = flat_idx != padding_idx if padding_idx is not None else torch.ones_like(flat_idx, dtype=torch.bool)
    return torch.zeros(num_weights, dim, dtype=F64).index_add_(0, flat_idx[keep], flat[keep])


# ATen's CUDA kernel for at most this many indices (and no scale_grad_by_freq) sums each chunk of 32 indices in fp32
# and adds it into the weight gradient in its own dtype: one rounding per chunk that touches a row. Past it, ATen
# sorts the indices and rounds each row once, as g4ops' CPU kernel does.
ATEN_CUDA_CHUNKED_MAX_INDICES = 3072
ATEN_CUDA_CHUNK = 32


def rounding_bound(grad_out, indices, num_weights, padding_idx, dtype, chunk):
    """Bound (1) for a weight gradient whose running sum is rounded to `dtype` after every `chunk` indices:
    elementwise |error| <= u * (sum over the chunks touching the row of |running sum after that chunk|), in fp64,
    plus fp32 accumulation noise; returned relative to ||oracle||_2 like O.rel_err."""
    dim = grad_out.shape[-1]
    flat_idx = indices.reshape(-1).cpu()
    flat = grad_out.detach().reshape(-1, dim).to(F64).cpu()
    running = torch.zeros(num_weights, dim, dtype=F64)
    rounding_sum = torch.zeros(num_weights, dim, dtype=F64)
    for start in range(0, flat_idx.numel(), chunk):
        idx, rows = flat_idx[start : start + chunk], flat[start : start + chunk]
        keep = idx != padding_idx if padding_idx is not None else torch.ones_like(idx, dtype=torch.bool)
        running.index_add_(0, idx[keep], rows[keep])
        touched = idx[keep].unique()
        rounding_sum[touched] += running[touched].abs()
    ref_norm = torch.linalg.vector_norm(running).item()
    repeats = int(torch.bincount(flat_idx, minlength=num_weights).max())
    noise = O.tolerance(dtype, repeats) - O.TOLERANCE[dtype].u
    if ref_norm == 0.0:
        return noise
    return O.TOLERANCE[dtype].u * torch.linalg.vector_norm(rounding_sum).item() / ref_norm + noise


def grads(indices, weight, grad_out, padding_idx, fn):
    w = weight.detach().requires_grad_()
    out = fn(indices, w, padding_idx)
    out.backward(grad_out)
    return out.detach(), w.grad


@st.composite
def configs(draw):
    rows = draw(st.sampled_from([1, 3, 50, 257]))
    dim = draw(st.sampled_from([1, 7, 64, 129]))
    index_shape = draw(st.sampled_from([(5,), (3, 11), (2, 4, 9), (1, 300)]))
    distinct = min(rows, draw(st.sampled_from([1, 2, rows])))  # few distinct indices: long sums per row
    padding = draw(st.one_of(st.none(), st.integers(-rows, rows - 1)))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, F64]))
    layout = draw(st.sampled_from(["contiguous", "transposed"]))
    return rows, dim, index_shape, distinct, padding, dtype, layout


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_gradient_is_stock_and_within_bound_of_fp64(device, config, seed):
    rows, dim, index_shape, distinct, padding, dtype, layout = config
    gen = torch.Generator().manual_seed(seed)
    weight = O.make_tensor((rows, dim), dtype, gen, device=device)
    indices = torch.randint(0, distinct, index_shape, generator=gen).to(device)
    if padding is not None:
        indices.view(-1)[0] = padding % rows  # the padding row is looked up at least once
    grad_out = O.make_tensor((*index_shape, dim), dtype, gen, layout=layout, device=device)

    out, grad_w = grads(indices, weight, grad_out, padding, ops.embedding)
    stock_out, stock_grad_w = grads(indices, weight, grad_out, padding, lambda i, w, p: F.embedding(i, w, p))
    assert torch.equal(out, stock_out)
    if device == "cuda":
        # the same ATen kernel as stock eager: bit-identical, including the zeroed padding row
        assert torch.equal(grad_w, stock_grad_w)
    padding_row = None if padding is None else padding % rows
    ref = oracle_weight_grad(grad_out, indices, rows, padding_row)
    # CPU: fp32 sums and one rounding (stock's CPU kernel sums bf16/fp16 in bf16/fp16 and can miss this bound);
    # CUDA: ATen's chunked kernel rounds once per 32-index chunk
    chunked = device == "cuda" and indices.numel() <= ATEN_CUDA_CHUNKED_MAX_INDICES
    chunk = ATEN_CUDA_CHUNK if chunked else indices.numel()
    assert O.rel_err(grad_w, ref) <= rounding_bound(grad_out, indices, rows, padding_row, dtype, chunk)
    assert O.rel_err(grad_w, ref) <= O.rel_err(stock_grad_w, ref) * O.STOCK_MARGIN + O.tolerance(dtype, 1) / 10


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_fp64(device):
    # without padding_idx: by nn.Embedding's convention the padding row gets no gradient although the lookup reads
    # it, so the numerical Jacobian differs there by design (the property test checks that row against stock)
    gen = torch.Generator().manual_seed(3)
    weight = O.make_tensor((6, 5), F64, gen, device=device).detach().requires_grad_()
    indices = torch.tensor([[0, 2, 5, 2], [5, 5, 1, 2]], device=device)
    assert torch.autograd.gradcheck(lambda w: ops.embedding(indices, w), (weight,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_embedding_backward(device):
    gen = torch.Generator().manual_seed(4)
    grad_out = O.make_tensor((3, 7, 9), torch.float32, gen, device=device)
    indices = torch.randint(0, 40, (3, 7), generator=gen).to(device)
    for padding_idx in (-1, 0, 39):
        torch.library.opcheck(
            torch.ops.g4ops.embedding_backward.default, (grad_out, indices, 40, padding_idx),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_embedding(device):
    gen = torch.Generator().manual_seed(8)
    weight = O.make_tensor((40, 9), torch.float32, gen, device=device).detach().requires_grad_()
    indices = torch.randint(0, 40, (3, 7), generator=gen).to(device)
    for padding_idx in (-1, 0, 39):
        torch.library.opcheck(torch.ops.g4ops.embedding.default, (indices, weight, padding_idx))


def _backward_graph_targets(fn, *args):
    """The call targets of the backward graph AOTAutograd builds for fn (what Inductor would compile)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.aot_autograd import make_boxed_func

    targets = []

    def backward_compiler(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward), bw_compiler=backward_compiler
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.sum().backward()
    return targets


def test_compiled_backward_is_the_opaque_op_not_an_fp32_table():
    gen = torch.Generator().manual_seed(5)
    indices = torch.randint(0, 100, (4, 33), generator=gen)

    def leaf():
        return O.make_tensor((100, 16), torch.bfloat16, gen).detach().requires_grad_()

    ours = _backward_graph_targets(lambda i, w: ops.embedding(i, w, 0) * 3.0, indices, leaf())
    assert "g4ops.embedding_backward.default" in ours, ours
    assert not any("index_put" in t or "embedding_dense_backward" in t for t in ours), ours
    # what stock compiles to (the fp32 table this op avoids); if torch stops decomposing it, this op can go
    stock = _backward_graph_targets(lambda i, w: F.embedding(i, w, 0) * 3.0, indices, leaf())
    assert any("index_put" in t for t in stock) or any("embedding_dense_backward" in t for t in stock), stock


def test_compiled_matches_eager():
    gen = torch.Generator().manual_seed(6)
    indices = torch.randint(0, 30, (2, 17), generator=gen)
    weight = O.make_tensor((30, 12), torch.bfloat16, gen)
    grad_out = O.make_tensor((2, 17, 12), torch.bfloat16, gen)
    eager = grads(indices, weight, grad_out, 1, ops.embedding)
    torch._dynamo.reset()
    compiled = grads(indices, weight, grad_out, 1, torch.compile(ops.embedding, fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_no_grad_and_frozen_weight_take_the_plain_lookup():
    weight = torch.randn(10, 4)
    indices = torch.tensor([1, 0, 9])
    assert torch.equal(ops.embedding(indices, weight, 0), F.embedding(indices, weight, 0))
    with torch.no_grad():
        w = weight.clone().requires_grad_()
        assert ops.embedding(indices, w).grad_fn is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "fake"])
def test_bad_input_names_the_problem(device, mode):
    grad_out = torch.randn(3, 5, device=device)
    good = torch.tensor([0, 1, 2], device=device)
    cases = [
        ((grad_out, good.float(), 4, -1), TypeError, "indices"),
        ((grad_out.int(), good, 4, -1), TypeError, "grad_out"),
        ((grad_out, good[:2], 4, -1), RuntimeError, "grad_out"),
        ((grad_out, good, 0, -1), RuntimeError, "num_weights"),
        ((grad_out, good, 4, 4), RuntimeError, "padding_idx"),
        ((grad_out, good, 4, -2), RuntimeError, "padding_idx"),
    ]
    for args, exc, name in cases:
        with pytest.raises(exc, match=name):
            if mode == "eager":
                torch.ops.g4ops.embedding_backward(*args)
            else:
                from torch._subclasses.fake_tensor import FakeTensorMode

                with FakeTensorMode(allow_non_fake_inputs=True) as fake:
                    torch.ops.g4ops.embedding_backward(*(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                         for a in args))  # fmt: skip
    weight = torch.randn(4, 5)
    with pytest.raises(ValueError, match="padding_idx"):
        ops.embedding(good.cpu(), weight, 4)
    with pytest.raises(ValueError, match="weight"):
        ops.embedding(good.cpu(), torch.randn(4))


def test_enable_routes_both_gemma4_embeddings(monkeypatch):
    """enable() sends the token and per-layer-input embeddings through ops.embedding, with stock's gradients."""
    import g4ops
    from g4ops.models import build_model

    calls = []
    real = ops.embedding
    monkeypatch.setattr(ops, "embedding", lambda i, w, p=None: calls.append(tuple(w.shape)) or real(i, w, p))
    model = build_model("tiny-e4b").train()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))

    def embedding_grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "embed_tokens" in n}

    stock = embedding_grads()
    with g4ops.enable():
        calls.clear()  # the first enable() in a process probes the embedding on a toy table
        ours = embedding_grads()
    cfg = model.config
    per_layer = (cfg.vocab_size_per_layer_input, cfg.num_hidden_layers * cfg.hidden_size_per_layer_input)
    assert sorted(calls) == sorted([(cfg.vocab_size, cfg.hidden_size), per_layer]), calls
    assert set(ours) == set(stock) and len(stock) == 2
    for name, g in stock.items():
        # fp32; the norm/MLP ops upstream reassociate fp32 sums (tests/test_integration.py's bound)
        assert O.rel_err(ours[name], g) <= 1e-4, name
