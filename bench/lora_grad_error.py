"""Which g4ops patch makes a LoRA model's fp32 gradients further from fp64 than stock's (issue 15's CUDA LoRA test).

    python bench/lora_grad_error.py                                   # every patch, LoRA on all seven projections
    python bench/lora_grad_error.py --keep norm --targets q_proj,k_proj,v_proj,o_proj
    python bench/lora_grad_error.py --device cpu
    python bench/lora_grad_error.py --keep norm --stock-norms q_norm,k_norm   # those norms' calls stay stock
    python bench/lora_grad_error.py --per-call      # each Gemma4RMSNorm call alone: g4ops' and stock's error

The tiny-e4b model with peft LoRA (r=4, `init_lora_weights=False`), one forward and backward of 2 x 21 tokens in
fp32: stock peft, then with `g4ops.enable()` patching only the classes in `--keep` (norm: Gemma4RMSNorm, layer:
Gemma4TextDecoderLayer, mlp: Gemma4TextMLP, emb: the scaled embedding, loss: the causal-LM classes), each against
an fp64 run of stock peft on the same weights with its norms in fp64 (tests/oracle.py `fp64_model`). Prints the
five adapter gradients with the largest g4ops/stock error ratio and the mean errors. `--stock-norms`:
Gemma4RMSNorm modules whose name ends in one of these (q_norm, k_norm, v_norm, input_layernorm, ..., "model.norm"
for the final one) keep the stock forward.
`--per-call`: records every Gemma4RMSNorm call's input and output gradient in a stock fp32 step and replays each
through g4ops.rms_norm and through the stock module, each against fp64 on the same tensors (forward output and
input gradient), worst g4ops/stock ratios first, with the shapes and strides the call saw.
H200, 2026-12-01 (bench/results/2026-12-01-h200-session12.md): every call as accurate as stock's or better, the
whole-model mean error 1.8x stock's, which a one-ulp change of each norm's rounding moves by as much.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

import g4ops
import g4ops.hf.patches as patches
from g4ops.models import build_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import oracle as O  # noqa: E402 - tests/oracle.py: rel_err

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
PATCH_NAMES = {"Gemma4RMSNorm": "norm", "Gemma4TextMLP": "mlp", "Gemma4TextDecoderLayer": "layer",
               "Gemma4TextScaledWordEmbedding": "emb"}  # fmt: skip


def only_patches(keep: set[str]):
    """Make enable() patch only the classes named in `keep` (anything not in PATCH_NAMES counts as "loss")."""
    table = patches._patch_table
    patches._patch_table = lambda: {c: f for c, f in table().items() if PATCH_NAMES.get(c.__name__, "loss") in keep}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--targets", default=ALL_TARGETS, help="peft target_modules, comma-separated")
    ap.add_argument("--keep", default="norm,layer,mlp,emb,loss", help="the g4ops patches to keep, comma-separated")
    ap.add_argument("--stock-norms", default="", help="name suffixes of Gemma4RMSNorm modules that stay stock")
    ap.add_argument("--per-call", action="store_true", help="replay each norm call alone (see above)")
    args = ap.parse_args(argv)
    import peft

    only_patches(set(args.keep.split(",")))
    torch.manual_seed(0)
    base = build_model("tiny-e4b").to(args.device)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=args.targets.split(","), init_lora_weights=False)
    model = peft.get_peft_model(base, config).train()
    ids = torch.randint(3, base.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    stock_norm = type(base.model.norm).forward  # the class's own forward, before enable() patches it
    suffixes = tuple(n for n in args.stock_norms.split(",") if n)
    norm_cls = type(base.model.norm)
    kept = [m for n, m in base.named_modules() if suffixes and n.endswith(suffixes) and type(m) is norm_cls]
    if suffixes and not kept:
        raise SystemExit(f"--stock-norms {args.stock_norms}: no Gemma4RMSNorm module name ends so")
    if args.per_call:
        return per_call(model, ids)
    exact = O.fp64_model(model)
    exact(ids, labels=ids).loss.backward()
    grads64 = {n: p.grad for n, p in exact.named_parameters() if p.requires_grad}

    def grads(enabled: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for m in kept:  # an instance attribute wins over the patched class forward
            m.forward = stock_norm.__get__(m)
        try:
            with g4ops.enable() if enabled else torch.enable_grad():
                model(ids, labels=ids).loss.backward()
        finally:
            for m in kept:
                del m.forward
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    stock, ours = grads(False), grads(True)
    rows = sorted(((O.rel_err(ours[n], grads64[n]), O.rel_err(stock[n], grads64[n]), n) for n in stock),
                  key=lambda r: r[0] / max(r[1], 1e-30), reverse=True)  # fmt: skip
    print(f"device {args.device}, patches {args.keep}, LoRA on {args.targets}, stock norms: {len(kept)} modules "
          f"ending in {list(suffixes)}")
    for mine, theirs, name in rows[:5]:
        print(f"  g4ops/stock {mine / theirs:5.2f}  g4ops {mine:.3e}  stock {theirs:.3e}  {name}")
    print(f"  mean error: g4ops {sum(r[0] for r in rows) / len(rows):.3e}, stock {sum(r[1] for r in rows) / len(rows):.3e}")


def per_call(model, ids):
    rows = []
    for name, norm, x, g in O.record_norm_calls(model, ids):
        if g is None:  # its output needed no gradient after all
            continue
        weight, eps = patches._norm_weight(norm), patches.norm_eps(norm)

        def run(fn):
            xin = x.detach().requires_grad_(True)
            y = fn(xin)
            (dx,) = torch.autograd.grad(y, xin, g)
            return y.detach(), dx

        y64, dx64 = O.rms_norm(x, weight, eps), O.rms_norm_grads(g, x, weight, eps)[0]
        ys, dxs = run(norm)
        yg, dxg = run(lambda t: g4ops.rms_norm(t, weight, eps))
        e = [O.rel_err(v, r) for v, r in ((yg, y64), (ys, y64), (dxg, dx64), (dxs, dx64))]
        rows.append((e[2] / max(e[3], 1e-30), e, name, tuple(x.shape), x.stride(), g.stride()))
    rows.sort(key=lambda r: r[0], reverse=True)
    print(f"{len(rows)} norm calls on {ids.device}; rel. error vs fp64 of the forward y and the input gradient dx")
    for ratio, e, name, shape, xs, gs in rows[:12]:
        print(f"  dx g4ops/stock {ratio:6.2f}  dx {e[2]:.2e} / {e[3]:.2e}  y {e[0]:.2e} / {e[1]:.2e}  {name} "
              f"x{list(shape)} strides x{xs} g{gs}")
    for label, i in (("y", 0), ("dx", 2)):
        print(f"  mean {label} error: g4ops {sum(r[1][i] for r in rows) / len(rows):.3e}, "
              f"stock {sum(r[1][i + 1] for r in rows) / len(rows):.3e}")


if __name__ == "__main__":
    main()
