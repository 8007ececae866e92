"""Tests of torch.ops.g4ops.decode_attention: one query token per sequence over a KV cache, grouped-query.

- hypothesis property: against the fp64 oracle (tests/oracle.py), within a bound derived from the dtype and the
  reduction lengths, and at least as close to fp64 as stock (transformers' repeat_kv + torch SDPA), over batch,
  head counts, cache lengths (odd, shorter than a chunk, not a multiple of it), head dims (odd and Gemma-4's 256
  and 512), dtypes, masks (random, static-cache prefix, batch-broadcast, stride-0 expanded, strided) and layouts
  (q as the decoder's transposed view, K/V as views of a larger or misaligned cache, every other batch row);
- exact cases: a row without a visible key is 0, a row with one visible key is that key's value, masked cache
  slots holding NaN are never read;
- opcheck, torch.compile(fullgraph=True), bad input named in the error, no backward;
- on CUDA: CUDA-graph capture and replay on new inputs, Gemma-4 E4B shapes, very long caches, the ATen path for
  shapes beyond the kernels' shared memory, fully written outputs.
Inputs are fresh random nonzero draws.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import g4ops

try:
    from . import oracle as O
    from .devices import DEVICES, capture_cuda_graph
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, capture_cuda_graph

OP = torch.ops.g4ops.decode_attention.default
LOW_AND_FP32 = [torch.bfloat16, torch.float16, torch.float32]
KV_LAYOUTS = ("contiguous", "cache", "offset", "batch_step", "seq_major")
MASK_KINDS = ("batch", "broadcast", "expanded", "strided")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kv(b, hkv, s, d, dtype, gen, device, layout):
    """A [b, hkv, s, d] K or V view, laid out as a decoder's cache may be:
    contiguous  plain
    cache       the first s slots of a longer static cache (slot count s + 7)
    offset      slots 1 .. s of a longer cache: the data does not start on a 16-byte boundary (scalar CUDA path)
    batch_step  every other batch row of a larger cache
    seq_major   [b, s, hkv, d] storage seen as [b, hkv, s, d] (the projection's layout before the transpose)"""
    if layout == "contiguous":
        return O.make_tensor((b, hkv, s, d), dtype, gen, device=device)
    if layout == "cache":
        return O.make_tensor((b, hkv, s + 7, d), dtype, gen, device=device)[:, :, :s]
    if layout == "offset":
        return O.make_tensor((b, hkv, s + 1, d), dtype, gen, device=device)[:, :, 1:]
    if layout == "batch_step":
        return O.make_tensor((2 * b, hkv, s, d), dtype, gen, device=device)[::2]
    if layout == "seq_major":
        return O.make_tensor((b, s, hkv, d), dtype, gen, device=device).transpose(1, 2)
    raise ValueError(layout)


def _visible(b, s, gen, density) -> torch.Tensor:
    """bool [b, s] with at least one True per row: random with P(True) = density, or "prefix" (a static cache
    filled up to a random length)."""
    if density == "prefix":
        lengths = torch.randint(1, s + 1, (b, 1), generator=gen)
        return torch.arange(s) < lengths
    vis = torch.rand(b, s, generator=gen) < density
    vis[torch.arange(b), torch.randint(0, s, (b,), generator=gen)] = True
    return vis


def _mask(b, s, gen, device, kind, density) -> torch.Tensor:
    """The [b, 1, 1, s] (or [1, 1, 1, s]) bool mask: per batch row, shared by the batch ([1, 1, 1, s], or expanded
    to [b, 1, 1, s] with batch stride 0), or a strided view (every other slot of a wider mask)."""
    if kind == "batch":
        return _visible(b, s, gen, density).view(b, 1, 1, s).to(device)
    if kind == "broadcast":
        return _visible(1, s, gen, density).view(1, 1, 1, s).to(device)
    if kind == "expanded":
        return _visible(1, s, gen, density).view(1, 1, 1, s).to(device).expand(b, 1, 1, s)
    if kind == "strided":
        wide = torch.zeros(b, 1, 1, 2 * s, dtype=torch.bool)
        wide[..., ::2] = _visible(b, s, gen, density).view(b, 1, 1, s)
        return wide.to(device)[..., ::2]
    raise ValueError(kind)


def _inputs(b, hkv, groups, s, d, dtype, gen, device, kv_layout="cache", mask_kind="batch", density=0.5):
    """(q, k, v, mask): q is the decoder's [b, 1, Hq, d] projection seen as [b, Hq, 1, d] (non-contiguous)."""
    q = O.make_tensor((b, 1, hkv * groups, d), dtype, gen, device=device).transpose(1, 2)
    k = _kv(b, hkv, s, d, dtype, gen, device, kv_layout)
    v = _kv(b, hkv, s, d, dtype, gen, device, kv_layout)
    return q, k, v, _mask(b, s, gen, device, mask_kind, density)


def _scale(kind, d: int) -> float:
    return d**-0.5 if kind == "rsqrt" else float(kind)


def _check_vs_oracle(q, k, v, mask, scale, out):
    """Within bound (1) of tests/oracle.py against the fp64 oracle."""
    ref = O.decode_attention(q, k, v, mask, scale)
    abs_terms, score_terms = O.decode_attention_abs_terms(q, k, v, mask, scale)
    tol = O.decode_attention_tolerance(out.dtype, k.shape[2], k.shape[3], O.condition(abs_terms, ref), score_terms)
    assert O.rel_err(out, ref) <= tol, (O.rel_err(out, ref), tol)


# ----------------------------------------------------------------------------------------------------------------
# Property: within the fp64 bound, and no less accurate than stock.

SAMPLE = (4096, 16)  # (least output elements compared per configuration, most draws)


def decode_attention_vs_stock(device, dtype, b, hkv, groups, s, d, kv_layout, mask_kind, density, scale, seed):
    gen = _gen(seed)
    n = b * hkv * groups * d
    draws = max(1, min(SAMPLE[1], math.ceil(SAMPLE[0] / n)))
    sums = [0.0, 0.0, 0.0, 0.0]  # g4ops error, stock error, kappa^2, score terms^2
    context = f"{dtype} b{b} hkv{hkv} g{groups} s{s} d{d} {kv_layout} mask {mask_kind}/{density} scale {scale}"
    for _ in range(draws):
        q, k, v, mask = _inputs(b, hkv, groups, s, d, dtype, gen, device, kv_layout, mask_kind, density)
        out = g4ops.decode_attention(q, k, v, mask, scale)
        assert out.shape == (b, hkv * groups, 1, d) and out.dtype == dtype and out.is_contiguous()
        ref = O.decode_attention(q, k, v, mask, scale)
        abs_terms, score_terms = O.decode_attention_abs_terms(q, k, v, mask, scale)
        kappa = O.condition(abs_terms, ref)
        err = O.rel_err(out, ref)
        tol = O.decode_attention_tolerance(dtype, s, d, kappa, score_terms)
        assert err <= tol, f"{context}: error vs fp64 {err:.3e} > bound {tol:.3e} (kappa {kappa:.3g})"
        sums[0] += err
        sums[1] += O.rel_err(O.stock_decode_attention(q, k, v, mask, scale), ref)
        sums[2] += kappa**2
        sums[3] += score_terms**2
    kappa, score_terms = math.sqrt(sums[2] / draws), math.sqrt(sums[3] / draws)
    slack = O.decode_attention_floor(dtype, s, d, n, kappa, score_terms, draws)
    O.assert_no_worse_than_stock(f"out [{context}, {draws} draws]", sums[0] / draws, sums[1] / draws, slack)


@st.composite
def configs(draw):
    dtype = draw(st.sampled_from(LOW_AND_FP32))
    b, hkv, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    s = draw(st.one_of(st.sampled_from([1, 2, 15, 16, 17, 63, 257, 512, 700]), st.integers(1, 700)))
    d = draw(st.sampled_from([1, 3, 8, 24, 33, 64, 80, 256, 512]))
    kv_layout, mask_kind = draw(st.sampled_from(KV_LAYOUTS)), draw(st.sampled_from(MASK_KINDS))
    density = draw(st.sampled_from([0.05, 0.5, 1.0, "prefix"]))
    scale = _scale(draw(st.sampled_from(["rsqrt", 1.0, 0.3])), d)
    return dtype, b, hkv, groups, s, d, kv_layout, mask_kind, density, scale


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_decode_attention_no_less_accurate_than_stock(device, config, seed):
    decode_attention_vs_stock(device, *config, seed)


E4B_LAYERS = {"sliding": (256, 512), "full": (512, 1100)}  # head dim, cache slots; 8 query heads, 2 KV heads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer", list(E4B_LAYERS))
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("density", [1.0, "prefix"], ids=["full-window", "filling-cache"])
def test_decode_attention_e4b_shapes(device, layer, batch, density):
    if device == "cpu" and batch > 1:
        pytest.skip("batch 8 exercises the CUDA grid; on CPU it only costs time")
    d, s = E4B_LAYERS[layer]
    decode_attention_vs_stock(device, torch.bfloat16, batch, 2, 4, s, d, "cache", "batch", density, 1.0, seed=batch)


# ----------------------------------------------------------------------------------------------------------------
# Exact cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [*LOW_AND_FP32, torch.float64], ids=str)
@pytest.mark.parametrize("s", [1, 40, 700])
def test_decode_attention_empty_and_single_key_rows(device, dtype, s):
    """A row without a visible key is 0 (SDPA would give NaN); a row with one visible key is exactly its value (its
    weight is exp(0) / 1); other rows are unaffected by them."""
    gen = _gen(s)
    b, hkv, groups, d = 3, 2, 4, 64
    q, k, v, _ = _inputs(b, hkv, groups, s, d, dtype, gen, device)
    visible = _visible(b, s, gen, 0.5)
    visible[0] = False
    only = s // 2
    visible[1] = False
    visible[1, only] = True
    out = g4ops.decode_attention(q, k, v, visible.view(b, 1, 1, s).to(device), 0.7)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1], v[1, :, only].repeat_interleave(groups, dim=0).unsqueeze(1))
    _check_vs_oracle(q[2:], k[2:], v[2:], visible[2:].view(1, 1, 1, s).to(device), 0.7, out[2:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_AND_FP32, ids=str)
def test_decode_attention_never_reads_masked_slots(device, dtype):
    """Unwritten cache slots may hold anything: NaN there changes nothing, bit for bit."""
    gen = _gen(7)
    q, k, v, mask = _inputs(2, 2, 3, 300, 80, dtype, gen, device, mask_kind="batch", density="prefix")
    out = g4ops.decode_attention(q, k, v, mask, 0.5)
    hidden = ~mask.view(2, 1, 300, 1)
    k_nan, v_nan = k.masked_fill(hidden, math.nan), v.masked_fill(hidden, math.nan)
    assert torch.equal(g4ops.decode_attention(q, k_nan, v_nan, mask, 0.5), out)


# ----------------------------------------------------------------------------------------------------------------
# opcheck and torch.compile


OPCHECK_CASES = [  # (dtype, kv layout, mask kind, groups, head dim)
    (torch.bfloat16, "cache", "batch", 4, 64),
    (torch.float16, "offset", "broadcast", 2, 24),
    (torch.float32, "seq_major", "expanded", 1, 33),
    (torch.float64, "batch_step", "strided", 3, 8),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: "-".join(map(str, c)))
def test_opcheck_decode_attention(device, case):
    dtype, kv_layout, mask_kind, groups, d = case
    args = _inputs(2, 2, groups, 37, d, dtype, _gen(3), device, kv_layout, mask_kind)
    torch.library.opcheck(OP, (*args, d**-0.5))


def _step(q, k, v, mask):
    return g4ops.decode_attention(q, k, v, mask, 0.125) + 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_attention_compile_fullgraph(device, dtype):
    args = _inputs(2, 2, 4, 45, 64, dtype, _gen(4), device, "cache", "broadcast")
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_step)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True)
    assert torch.equal(compiled(*args), _step(*args))


# ----------------------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, from the real kernel and the fake kernel alike; no backward.


def _bad_cases(device):
    q, k, v, mask = _inputs(2, 2, 4, 10, 16, torch.float32, _gen(5), device)
    wide = torch.randn(2, 2, 10, 32, device=device)
    return {
        "int mask": ((q, k, v, mask.to(torch.int64), 1.0), "`mask` must be bool"),
        "float mask": ((q, k, v, mask.float(), 1.0), "`mask` must be bool"),
        "int q": ((q.to(torch.int32), k, v, mask, 1.0), "`q` must be float16"),
        "k dtype": ((q, k.double(), v, mask, 1.0), "`k` is torch.float64 but `q` is torch.float32"),
        "heads": ((q[:, :3], k, v, mask, 1.0), "the 3 query heads of `q` must be a multiple of the 2 KV heads"),
        "two tokens": ((torch.cat([q, q], 2), k, v, mask, 1.0), r"`q` must hold one query token"),
        "3-D q": ((q[:, :, 0], k, v, mask, 1.0), "`q` must be 4-D"),
        "head dim": ((q, wide, wide, mask, 1.0), r"`k` must be \[2, Hkv >= 1, S >= 1, 16\]"),
        "batch": ((q, k[:1], v[:1], mask[:1], 1.0), r"`k` must be \[2, Hkv >= 1, S >= 1, 16\]"),
        "v shape": ((q, k, v[:, :, :9], mask, 1.0), r"`v` must have the shape of `k`"),
        "mask length": ((q, k, v, mask[..., :9], 1.0), r"`mask` must be \[2, 1, 1, 10\] or \[1, 1, 1, 10\]"),
        "mask heads": ((q, k, v, mask.expand(2, 8, 1, 10), 1.0), r"`mask` must be \[2, 1, 1, 10\]"),
        "k last stride": ((q, wide[..., ::2], v, mask, 1.0), "`k` must have a contiguous last dim"),
        "v on another device": ((q, k, torch.empty(v.shape, device="meta"), mask, 1.0), "`v` is on meta but `q`"),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "inference_mode", "fake"])
@pytest.mark.parametrize("case", list(_bad_cases("cpu")))
def test_decode_attention_bad_input(device, mode, case):
    args, message = _bad_cases(device)[case]
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        if mode == "eager":
            g4ops.decode_attention(*args)
        elif mode == "inference_mode":
            with torch.inference_mode():
                g4ops.decode_attention(*args)
        else:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
                g4ops.decode_attention(*(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                         for a in args))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", range(3), ids=["q", "k", "v"])
def test_decode_attention_refuses_grad(device, which):
    """Inference only: an input that requires grad raises instead of returning a result without a gradient; under
    no_grad the op runs."""
    args = list(_inputs(1, 1, 2, 5, 8, torch.float32, _gen(6), device))
    args[which] = args[which].detach().requires_grad_()
    with pytest.raises(RuntimeError, match=r"g4ops.decode_attention has no backward \(inference only\)"):
        g4ops.decode_attention(*args, 1.0)
    with torch.no_grad():
        assert not g4ops.decode_attention(*args, 1.0).requires_grad


# ----------------------------------------------------------------------------------------------------------------
# CUDA only


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_attention_cuda_graph_replay(dtype):
    """Captured once, replayed after the inputs changed in place (new cache contents, new mask): each replay gives
    what an eager call gives on the new inputs, bit for bit (the kernels are deterministic)."""
    gen = _gen(8)
    b, hkv, groups, s, d = 4, 2, 4, 300, 256
    q, k, v, mask = _inputs(b, hkv, groups, s, d, dtype, gen, "cuda", "cache", "batch", "prefix")
    graph, static_out = capture_cuda_graph(lambda: g4ops.decode_attention(q, k, v, mask, d**-0.5))
    for density in (0.5, "prefix"):
        fresh = _inputs(b, hkv, groups, s, d, dtype, gen, "cuda", "cache", "batch", density)
        for t, new in zip((q, k, v, mask), fresh):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, g4ops.decode_attention(q, k, v, mask, d**-0.5))
        _check_vs_oracle(q, k, v, mask, d**-0.5, static_out)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize(
    "dtype, groups, s, d",
    [
        (torch.bfloat16, 4, 40000, 256),  # long cache: the largest chunk (256 keys); 157 splits on an H200
        (torch.bfloat16, 12, 100, 128),  # more than 8 query heads per KV head: two head groups
        (torch.float64, 8, 50, 512),  # double math in the kernels
        (torch.float32, 8, 9, 8192),  # q of 8 heads exceeds shared memory: the ATen path
        (torch.bfloat16, 1, 33, 3000),  # multi-head attention, a head dim wider than the block
    ],
)
def test_decode_attention_cuda_shapes(dtype, groups, s, d):
    gen = _gen(s + d)
    q, k, v, mask = _inputs(2, 2, groups, s, d, dtype, gen, "cuda", "cache", "batch", 0.5)
    numel = q.numel() + 2 * k.numel()
    torch.full((numel,), math.nan, dtype=torch.float32, device="cuda")  # freed blocks now hold NaN
    out = g4ops.decode_attention(q, k, v, mask, d**-0.5)
    assert torch.isfinite(out).all()
    _check_vs_oracle(q, k, v, mask, d**-0.5, out)
