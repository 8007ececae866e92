"""A sliding-window attention prototype on flash kernels, checked against fp64 and timed against what g4ops runs.

    python bench/sliding_band.py                                   # E4B's sliding layers, 2048 and 8192, on CUDA
    python bench/sliding_band.py --device cpu --smoke              # seconds: the algorithm against fp64 on CPU

Why: in a compiled 42-layer finetune step on the H200 the sliding layers' FlexAttention backward took ~330 us per
layer for about 19 GFLOP of band work (~57 TFLOP/s; bench/results/2026-12-04-h200-session21.md), against ~0.46 ms of
GEMMs per layer elsewhere. Flash kernels take head_dim 256 but only a causal or no mask, not a band.

The band as two causal flash calls per block of W = window queries, merged by their logsumexps (as ring attention
merges blocks). Query p sees keys (p - W, p]. For the queries of block i (positions iW + r, r in [0, W)):
  A  the keys of block i itself, causal (key iW + c for c <= r): one causal flash call over all blocks at once;
  B  the keys of block i - 1 it still sees: iW - W + c for c > r, a strictly upper triangle. Reversed in both
     queries and keys that is strictly lower; dropping the last query (r = W - 1 sees none of block i - 1) and the
     first key (c = 0 is seen by nobody) leaves an ordinary causal (W - 1) x (W - 1) problem: one more flash call.
out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B), lse = logaddexp(lse_A, lse_B). The backward calls the
flash backward of each part with the merged out and lse (the probabilities of the whole row, and its
rowsum(dO * O)), and adds the parts' gradients. Query heads share kv heads as in transformers (kv repeated, its
gradient summed back). L must be a multiple of W here (a prototype; a tail block would be padded).

Reported per length: fwd+bwd median ms of this band, of g4ops' compiled FlexAttention path
(`g4ops.ops.attention.sliding_window_attention` under torch.compile, what a compiled g4ops step runs) and of stock SDPA
with the dense band mask (what transformers gives sdpa), and each one's relative error against an fp64 reference
(out, dq, dk, dv), on fresh random inputs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from attention import measure_fwd_bwd  # bench/attention.py: this script's own directory is on sys.path


def _flash_fwd(q, k, v, scale):
    """(out, lse, saved) of one causal flash call; `saved` is what its backward needs besides out and lse."""
    if q.is_cuda:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)  # fmt: skip
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_bwd(grad_out, q, k, v, out, lse, saved, scale):
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale)  # fmt: skip
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, True, scale=scale)  # fmt: skip


def _blocks(t, w):
    """[B, H, L, D] -> [B, H, L / w, w, D]."""
    b, h, n, d = t.shape
    return t.view(b, h, n // w, w, d)


def _as_batch(t):
    """[B, H, nb, w, D] (any strides) -> [B * nb, H, w, D], contiguous: a flash call's batch of blocks."""
    b, h, nb, w, d = t.shape
    return t.permute(0, 2, 1, 3, 4).reshape(b * nb, h, w, d).contiguous()


def _from_batch(t, b):
    """Inverse of _as_batch (without the contiguity): [B * nb, H, w, ...] -> [B, H, nb, w, ...]."""
    nb = t.shape[0] // b
    return t.view(b, nb, *t.shape[1:]).transpose(1, 2)


def _part_b(t, w, queries: bool):
    """Part B's operand from [B, H, L, D]: queries of blocks 1.. (rows 0 .. w-2), or keys/values of blocks ..-2
    (rows 1 .. w-1), reversed in time, as a batch of blocks."""
    blocks = _blocks(t, w)
    part = blocks[:, :, 1:, : w - 1] if queries else blocks[:, :, :-1, 1:]
    return _as_batch(part.flip(3))


class _BandFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, w):
        b, h, n, d = q.shape
        nb = n // w
        qa, ka, va = _as_batch(_blocks(q, w)), _as_batch(_blocks(k, w)), _as_batch(_blocks(v, w))
        out_a, lse_a, saved_a = _flash_fwd(qa, ka, va, scale)
        out = _from_batch(out_a, b).float()  # [B, H, nb, w, D]
        lse = _from_batch(lse_a, b).clone()  # [B, H, nb, w]
        saved_b, qb, kb, vb = (), None, None, None
        if nb > 1:
            qb, kb, vb = _part_b(q, w, True), _part_b(k, w, False), _part_b(v, w, False)
            out_b, lse_b, saved_b = _flash_fwd(qb, kb, vb, scale)
            out_b = _from_batch(out_b, b).flip(3).float()  # [B, H, nb-1, w-1, D], rows 0 .. w-2 of blocks 1..
            lse_b = _from_batch(lse_b, b).flip(3)
            rows_out, rows_lse = out[:, :, 1:, : w - 1], lse[:, :, 1:, : w - 1]
            merged = torch.logaddexp(rows_lse, lse_b)
            rows_out.copy_(rows_out * (rows_lse - merged).exp().unsqueeze(-1)
                           + out_b * (lse_b - merged).exp().unsqueeze(-1))  # fmt: skip
            rows_lse.copy_(merged)
        out = out.to(q.dtype).reshape(b, h, n, d)
        lse = lse.reshape(b, h, n)
        ctx.save_for_backward(qa, ka, va, out, lse, *(t for t in (qb, kb, vb) if t is not None))
        ctx.saved_flash = (saved_a, saved_b)
        ctx.scale, ctx.w, ctx.shape = scale, w, (b, h, n, d)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qa, ka, va, out, lse, *part_b = ctx.saved_tensors
        (saved_a, saved_b), scale, w, (b, h, n, d) = ctx.saved_flash, ctx.scale, ctx.w, ctx.shape
        nb = n // w
        grad_out = grad_out.contiguous()
        lse_blocks = lse.view(b, h, nb, w)
        dq_a, dk_a, dv_a = _flash_bwd(_as_batch(_blocks(grad_out, w)), qa, ka, va, _as_batch(_blocks(out, w)),
                                      lse_blocks.permute(0, 2, 1, 3).reshape(b * nb, h, w).contiguous(), saved_a,
                                      scale)  # fmt: skip
        # dk, dv keep the kv heads they came with (fewer than q's when flash took the groups itself)
        dq, dk, dv = (_from_batch(t, b).float().reshape(b, -1, n, d).contiguous() for t in (dq_a, dk_a, dv_a))
        if nb > 1:
            qb, kb, vb = part_b
            lse_b = lse_blocks[:, :, 1:, : w - 1].flip(3).permute(0, 2, 1, 3).reshape(b * (nb - 1), h, w - 1)
            dq_b, dk_b, dv_b = _flash_bwd(_part_b(grad_out, w, True), qb, kb, vb, _part_b(out, w, True),
                                          lse_b.contiguous(), saved_b, scale)  # fmt: skip
            _blocks(dq, w)[:, :, 1:, : w - 1] += _from_batch(dq_b, b).flip(3)
            _blocks(dk, w)[:, :, :-1, 1:] += _from_batch(dk_b, b).flip(3)
            _blocks(dv, w)[:, :, :-1, 1:] += _from_batch(dv_b, b).flip(3)
        return dq.to(qa.dtype), dk.to(qa.dtype), dv.to(qa.dtype), None, None


def band_attention(q, k, v, scale: float, window: int, repeat_kv: bool = True):
    """softmax(scale q k^T + band) v, query p seeing keys (p - window, p]; q [B, Hq, L, D], k/v [B, Hkv, L, D].
    repeat_kv=False hands the kv heads to the flash kernel as they are (CUDA's flash kernel groups query heads
    itself; the CPU one does not)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and repeat_kv:  # transformers' repeat_kv order; autograd sums the kv gradient back over the group
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if q.shape[2] % window:
        raise ValueError(f"sliding_band prototype: length {q.shape[2]} is not a multiple of the window {window}")
    return _BandFlash.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, window)


def band_mask(n: int, window: int, device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)


def reference(q, k, v, scale, window):
    """fp64 dense softmax with the band mask (the oracle)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~band_mask(q.shape[2], window, q.device), float("-inf"))
    return torch.softmax(s, -1) @ v


def run(n, heads, kv_heads, dim, window, device, dtype, repeats, variants):
    gen = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = ((torch.randn(1, h, n, dim, generator=gen) * 0.5).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    grad = torch.randn(1, heads, n, dim, generator=gen).to(device, dtype)
    scale = 1.0  # Gemma-4's query norm replaces the 1/sqrt(d) scaling
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = reference(*exact, scale, window)
    ref_out.backward(grad.double())
    refs = [ref_out.detach()] + [t.grad for t in exact]

    def make(name):
        if name == "band":
            return lambda a, b, c: band_attention(a, b, c, scale, window)
        if name == "band-gqa":
            return lambda a, b, c: band_attention(a, b, c, scale, window, repeat_kv=False)
        if name == "flex-compiled":
            from g4ops.ops.attention import sliding_window_attention

            return torch.compile(lambda a, b, c: sliding_window_attention(a, b, c, scale, window))
        mask = band_mask(n, window, device)  # stock sdpa with transformers' dense mask
        return lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
            a, b, c, attn_mask=mask, scale=scale, enable_gqa=True)  # fmt: skip

    rows = []
    for name in variants:
        try:
            errors, ms, _ = measure_fwd_bwd(make(name), q, k, v, grad, refs, repeats, device == "cuda")
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run says why; the others still run
            rows.append(dict(variant=name, seq=n, error=f"{type(exc).__name__}: {exc}"[:300]))
            print(f"seq={n:6d} {name:14s} error: {rows[-1]['error']}", flush=True)
            continue
        flop = 4 * heads * dim * sum(min(p + 1, window) for p in range(n)) * 3.5  # band fwd (2 GEMMs) + 2.5x bwd
        rows.append(dict(variant=name, seq=n, fwd_bwd_ms=ms, band_tflops=flop / ms / 1e9,
                         rel_err=dict(zip(("out", "dq", "dk", "dv"), errors))))  # fmt: skip
        print(f"seq={n:6d} {name:14s} fwd+bwd {ms:8.3f} ms ({flop / ms / 1e9:6.1f} TFLOP/s of band work)  "
              f"rel err out/dq/dk/dv " + " ".join(f"{e:.2e}" for e in errors), flush=True)  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="band,band-gqa,flex-compiled,sdpa-mask")
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes: the algorithm against fp64, in seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.smoke:
        args.seqs, args.dim, args.window, args.repeats = "64,96", 16, 32, 2
        if args.device == "cpu":
            args.variants = "band,sdpa-mask"  # compiled FlexAttention is GPU-only in g4ops (ops/attention.py says why)
    rows = []
    for n in (int(s) for s in args.seqs.split(",") if s):
        rows += run(n, args.heads, args.kv_heads, args.dim, args.window, args.device, dtype, args.repeats,
                    [v for v in args.variants.split(",") if v])  # fmt: skip
    if args.json:
        meta = dict(torch=torch.__version__, dtype=str(dtype), window=args.window, dim=args.dim,
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
