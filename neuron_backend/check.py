"""The CPU check behind `python -m neuron_backend check`: stock transformers vs the Neuron-shaped model at TP=1
vs TP=N over gloo (each rank's own build, then the rank-0-built module on every rank, as NxD runs its one traced
graph), plus the per-bucket export hygiene (the mutated buffers are exactly the KV buffers).

Shapes (random weights, norms and layer scalars randomised; built by g4ops.models):
    tiny-e4b   hidden 64, 6 layers [s,s,f,s,s,f], 4/2 heads, head_dim 16/32, PLE 16, 2 KV-shared, window 8
    e4b-mini   E4B's attention exactly (8/2 heads, head_dim 256/512, window 512, proportional RoPE, 5:1 layers)
               with hidden 128, 12 layers (5 KV-shared), PLE 32 and a 1024-token vocab so it runs on a CPU
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .config import BuildSettings, from_hf_config
from .export import export_buckets
from .generate import greedy_generate, module_step
from .loader import build_rank_model

# Random q/k norm weights around 1 with head_dim 512 and attention scaling 1.0 give attention logits with a spread
# of ~20: a softmax so peaked that fp32 reassociation flips near-ties (stock's cached and uncached paths disagree by
# 1e-3 and pick different tokens at some seeds). Trained Gemma-4 q/k norms keep attention logits O(1); e4b-mini
# scales its random q/k norm weights by this factor (still random, not ones), after which stock agrees with itself
# to ~2e-6 and the greedy margins are ~1000x the noise.
QK_NORM_SCALE = {"e4b-mini": 0.15}

SHAPES = {
    # name: (g4ops.models.build_model kwargs, prompt length, new tokens, max_seq, prefill buckets)
    "tiny-e4b": (dict(shape="tiny-e4b"), 6, 24, 64, (4, 16)),  # decode crosses position 8 (the window)
    "e4b-mini": (
        dict(shape="e4b", num_layers=12, hidden_size=128, intermediate_size=256, vocab_size=1024,
             vocab_size_per_layer_input=1024, hidden_size_per_layer_input=32),
        500, 24, 640, (128, 512),
    ),  # fmt: skip
}


def build_stock(shape: str, seed: int = 0):
    from g4ops.models import build_model

    kwargs = dict(SHAPES[shape][0])
    # eager: the attention math the Neuron graph uses (SDPA differs in the last bits)
    model = build_model(kwargs.pop("shape"), seed=seed, attn_implementation="eager", **kwargs)
    if shape in QK_NORM_SCALE:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                    p.mul_(QK_NORM_SCALE[shape])
    return model


@torch.no_grad()
def stock_greedy(hf, prompt: torch.Tensor, new_tokens: int, return_logits: bool = False):
    """Greedy decoding with stock transformers' forward and its DynamicCache (sliding layers and shared KV as stock
    does them), never stopping at EOS (generate() would, and random models emit EOS).

    -> tokens [B, new_tokens] (and the cached-path logits [B, new_tokens, V] fp32 with return_logits).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ids, tokens, logits = prompt, [], []
    for _ in range(new_tokens):
        # the cache is the 4th positional argument in every 5.x (its keyword was renamed past_key_values -> cache)
        step = hf(ids, None, None, cache, use_cache=True).logits[:, -1].float()
        logits.append(step)
        tokens.append(step.argmax(-1))
        ids = tokens[-1][:, None]
    out = torch.stack(tokens, dim=1)
    return (out, torch.stack(logits, dim=1)) if return_logits else out


@torch.no_grad()
def stock_logits(hf, prompt: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits [B, new, V] (fp32) of stock at every generated position, one full forward."""
    seq = torch.cat([prompt, generated[:, :-1]], dim=1)
    logits = hf(seq).logits.float()
    return logits[:, prompt.shape[1] - 1 :]


@dataclass
class CheckReport:
    shape: str
    tp: int
    positions: tuple[int, int]
    sliding_window: int
    stock_tokens: torch.Tensor
    tp1_tokens: torch.Tensor
    tpn_tokens: torch.Tensor | None
    tp1_vs_stock_logit_diff: float
    tpn_vs_tp1_logit_diff: float | None
    prefill_calls: list
    aliased_buffers: dict[str, list[str]] = field(default_factory=dict)
    kv_names: list[str] = field(default_factory=list)
    graph_breaks: dict[str, int | None] = field(default_factory=dict)
    seconds: float = 0.0
    divergence: str | None = None  # where stock and TP=1 first disagree, with the top-1/top-2 margins there
    dtype: str = "float32"
    tpn_first_divergence: int | None = None
    # every rank running the module built as rank 0 (rank 0's Python attributes) with its own shard: NxD's trace
    rank0_tokens: torch.Tensor | None = None
    rank0_vs_tp1_logit_diff: float | None = None
    rank0_first_divergence: int | None = None
    top1_agreement: float = 1.0  # TP=1's greedy tokens vs stock's argmax, teacher-forced on TP=1's sequence

    @property
    def seq_match_stock(self) -> bool:
        return torch.equal(self.stock_tokens, self.tp1_tokens)

    @property
    def seq_match_tp(self) -> bool | None:
        return None if self.tpn_tokens is None else torch.equal(self.tpn_tokens, self.tp1_tokens)

    @property
    def seq_match_rank0(self) -> bool | None:
        return None if self.rank0_tokens is None else torch.equal(self.rank0_tokens, self.tp1_tokens)

    @property
    def ok(self) -> bool:
        """Tokens: stock == TP=1 == TP=N, per-rank builds and the rank-0-built module alike."""
        return self.seq_match_stock and self.seq_match_tp in (True, None) and self.seq_match_rank0 in (True, None)

    @property
    def exports_ok(self) -> bool:
        return all(sorted(v) == sorted(self.kv_names) for v in self.aliased_buffers.values()) and all(
            b in (0, None) for b in self.graph_breaks.values()
        )

    def lines(self) -> list[str]:
        a, b = self.positions
        out = [
            f"shape {self.shape} ({self.dtype}): generated positions {a}..{b}, sliding window {self.sliding_window} "
            f"(decode past the window: {b >= self.sliding_window}, crosses position {self.sliding_window} during "
            f"decode: {a <= self.sliding_window <= b}); prefill calls (bucket, valid) {self.prefill_calls}",
            f"stock transformers vs TP=1: SEQ_MATCH {self.seq_match_stock}; "
            f"max |logit diff| vs stock teacher-forced {self.tp1_vs_stock_logit_diff:.3g}",
        ]
        if self.divergence:
            out.append(f"  first divergence: {self.divergence}")
        if self.dtype != "float32":
            out.append(f"{self.dtype}: teacher-forced top-1 agreement TP=1 vs stock {self.top1_agreement:.3f}")
        if self.tpn_tokens is not None:
            where = _up_to(self.tpn_first_divergence)
            out.append(
                f"TP={self.tp} (gloo, {self.tp} processes) vs TP=1: SEQ_MATCH {self.seq_match_tp}; "
                f"max |logit diff|{where} {self.tpn_vs_tp1_logit_diff:.3g}"
            )
        if self.rank0_tokens is not None:
            where = _up_to(self.rank0_first_divergence)
            out.append(
                f"TP={self.tp} one graph: every rank runs the module built as rank 0 with its own shard (what NxD "
                f"traces once for all cores) vs TP=1: SEQ_MATCH {self.seq_match_rank0}; max |logit diff|{where} "
                f"{self.rank0_vs_tp1_logit_diff:.3g}"
            )
        for name, bufs in self.aliased_buffers.items():
            out.append(
                f"export {name}: graph breaks {self.graph_breaks.get(name)}, mutated (aliased) buffers "
                f"{len(bufs)} = KV buffers: {sorted(bufs) == sorted(self.kv_names)}"
            )
        out.append(f"aliased KV buffers ({len(self.kv_names)}): {self.kv_names}")
        out.append(f"SEQ_MATCH {self.ok}  ({self.seconds:.1f} s)")
        return out


def _up_to(first_divergence: int | None) -> str:
    return "" if first_divergence is None else f" up to the first divergence (step {first_divergence})"


def _against_tp1(ranks: list[dict], tp1_tokens, tp1_logits) -> tuple[torch.Tensor, float, int | None]:
    """(tokens of the TP run, max |logit diff| to TP=1, first step whose token differs or None)."""
    tokens = ranks[0]["tokens"]
    if not all(torch.equal(r["tokens"], tokens) for r in ranks):
        tokens = torch.full_like(tokens, -1)  # ranks disagree: never a match
    # logits are comparable up to the first differing token (both saw the same prefix until then)
    upto, first = tp1_tokens.shape[1], None
    if not torch.equal(tokens, tp1_tokens):
        first = int((tokens != tp1_tokens).nonzero()[0, 1])
        upto = first + 1
    diff = max((r["logits"][:, :upto] - tp1_logits[:, :upto]).abs().max().item() for r in ranks)
    return tokens, diff, first


def run_check(
    shape: str = "tiny-e4b",
    tp: int = 2,
    seed: int = 0,
    export: bool = True,
    dtype: torch.dtype = torch.float32,
    setup=None,
) -> CheckReport:
    """fp32: tokens must match exactly. bf16: report teacher-forced top-1 agreement and the first divergence
    (stock rounds differently: bf16 softcap, bf16 row-parallel sums; ours keeps those in fp32).

    TP=N runs twice in the same gloo processes: each rank building its own module, and every rank running the
    module built as rank 0 with its own shard (NxD's one traced graph; cpu_tp's "rank0" build). `setup` runs first
    in each rank process (cpu_tp.run_tp), e.g. a test's mutation.
    """
    from .cpu_tp import run_tp

    t0 = time.time()
    _, n_prompt, n_new, max_seq, buckets = SHAPES[shape]
    hf = build_stock(shape, seed).to(dtype)
    cfg = from_hf_config(hf.config)
    gen = torch.Generator().manual_seed(seed + 7)
    prompt = torch.randint(3, cfg.vocab_size, (1, n_prompt), generator=gen)

    stock, stock_cached = stock_greedy(hf, prompt, n_new, return_logits=True)
    sd = hf.state_dict()
    s1 = BuildSettings(tp=1, max_seq=max_seq, prefill_buckets=buckets, return_logits=True, dtype=dtype)
    model, ple, _ = build_rank_model(sd, cfg, s1)
    res = greedy_generate(module_step(model), prompt, n_new, s1, ple, cfg.pad_token_id)
    tp1_logits = torch.stack(res.logits, dim=1)
    ref_logits = stock_logits(hf, prompt, res.tokens)
    report = CheckReport(
        shape=shape, tp=tp, positions=(n_prompt, n_prompt + n_new - 1), sliding_window=cfg.sliding_window,
        stock_tokens=stock, tp1_tokens=res.tokens, tpn_tokens=None,
        tp1_vs_stock_logit_diff=(tp1_logits - ref_logits).abs().max().item(), tpn_vs_tp1_logit_diff=None,
        prefill_calls=res.prefill_calls, kv_names=list(model.kv_names), dtype=str(dtype).replace("torch.", ""),
        top1_agreement=(ref_logits.argmax(-1) == res.tokens).float().mean().item(),
    )  # fmt: skip
    if not report.seq_match_stock:
        i = int((stock != res.tokens).nonzero()[0, 1])
        top = lambda lg: lg[0, i].topk(2)  # noqa: E731
        sc, ou, un = top(stock_cached), top(tp1_logits), top(stock_logits(hf, prompt, stock))
        report.divergence = (
            f"step {i}: stock picks {sc.indices[0].item()} (margin {(sc.values[0] - sc.values[1]).item():.3g}), "
            f"TP=1 picks {ou.indices[0].item()} (margin {(ou.values[0] - ou.values[1]).item():.3g}); stock's own "
            f"uncached forward picks {un.indices[0].item()}"
        )
    if tp > 1:
        sn = BuildSettings(tp=tp, max_seq=max_seq, prefill_buckets=buckets, return_logits=True, dtype=dtype)
        runs = run_tp(sd, cfg, sn, prompt, n_new, builds=("per_rank", "rank0"), setup=setup)
        report.tpn_tokens, report.tpn_vs_tp1_logit_diff, report.tpn_first_divergence = _against_tp1(
            runs["per_rank"], res.tokens, tp1_logits
        )
        report.rank0_tokens, report.rank0_vs_tp1_logit_diff, report.rank0_first_divergence = _against_tp1(
            runs["rank0"], res.tokens, tp1_logits
        )
    if export:
        s_exp = BuildSettings(tp=1, max_seq=max_seq, prefill_buckets=buckets, dtype=dtype)
        m_exp, _, _ = build_rank_model(sd, cfg, s_exp)
        for e in export_buckets(m_exp):
            report.aliased_buffers[e.name] = e.mutated_buffers
            report.graph_breaks[e.name] = e.graph_breaks
    report.seconds = time.time() - t0
    return report
