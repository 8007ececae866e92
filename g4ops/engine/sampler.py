"""Token sampling on the device with one row of settings per sequence: `warp`, `sample`, `seeded_exponential`.

Semantics are transformers' sampling, row by row (transformers/generation/logits_process.py and utils.py
`_get_logits_processor` / `_sample`, 5.6 to 5.24): on the fp32 logits (softcapped, after any other processor),
TemperatureLogitsWarper, then TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper, in that order, each with
`min_tokens_to_keep`; filtered entries become -inf; the token is drawn from softmax of what is left. A row's
`top_k <= 0`, `top_p >= 1` and `min_p <= 0` switch that warper off, as generate leaves it out of the list; a
parameter given as None switches it off for every row and skips its work (a host decision, e.g. a graph per set).

`warp` runs transformers' own tensor operations on the same values, so its output equals the warpers' bit for bit on
the same device, ties included: top-p sorts the top-k-filtered scores with the same (unstable) `torch.sort` call,
min-p takes its softmax over the unsorted scores, temperature divides on CPU and multiplies by the fp32 reciprocal
on CUDA (what `scores / temperature` does for a Python float there), `1 - top_p` is formed in fp64 and rounded
once, as the Python float would be. The per-row parameters replace Python scalars, so nothing depends on the data
on the host: fixed shapes, no sync, no Python branch on values, so the function can be captured in a CUDA graph.
The k-th largest value (top-k's threshold) is a per-row gather from a sort of the scores, or, with `k_cap` (every
row's top_k in 1..k_cap, known to the caller), from `torch.topk(scores, k_cap)`: its values are the same whatever
the tie order, so both give the same threshold.

With `k_cap`, `sample` runs the warpers on each row's CANDIDATES_PER_CAP * k_cap largest logits (`top_candidates`,
in vocabulary order), not on the vocabulary: every token top-k keeps is among them unless more than
(CANDIDATES_PER_CAP - 1) * k_cap + 1 tokens tie with the k-th value, and everything else is -inf after top-k. So the
token is the vocabulary-wide draw's (the same noise per token id), up to the fp32 rounding of softmax and cumsum
over fewer -inf entries (a tie in the last bit at a top-p or min-p boundary is the only way to differ). Top-p's sort
of the candidates is stable, so tokens of equal score enter it in vocabulary order, as CUDA's radix sort of a whole
row orders them in practice (torch promises no order for an unstable sort, and the CPU's reorders ties: there the
token top-p drops from a tied pair can differ). A row past the tie bound is counted in `ties_overflow`: its draw
leaves out the tied tokens beyond the candidates. On the H200 (2026-12-02, E4B's 262144 entries) the
vocabulary-wide card took 0.42 / 0.83 / 1.17 ms per step at batch 1 / 4 / 16, nearly half of it top-p's pass over the
sorted vocabulary.

`sample` draws by the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with probability p_i
(the Gumbel-max trick in exp form). Noise comes from torch's current generator (`torch.manual_seed(s)` reproduces
it, and under CUDA-graph capture `exponential_` advances the philox offset on every replay), or from the caller:
`seeded_exponential` gives a row noise from its own (seed, counter), independent of what else is in the batch.
"""

from __future__ import annotations

import torch

__all__ = ["warp", "sample", "top_candidates", "seeded_exponential", "noise_at", "check_params", "divide_as_by_float",
           "CANDIDATES_PER_CAP", "TIES_OVERFLOW"]

CANDIDATES_PER_CAP = 2  # candidates per unit of k_cap: room for k_cap + 1 tokens tied with the k-th value
TIES_OVERFLOW = ("g4ops: a sampled step had more tokens tied with its top-k threshold than the sampler's candidates "
                 "hold (CANDIDATES_PER_CAP * k_cap); its draw left out the tied tokens beyond them, where "
                 "transformers draws among all (degenerate logits: many equal scores)")


def divide_as_by_float(scores: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """`scores / d` as transformers computes it for a Python float d, with d held in an fp32 device tensor
    (broadcast against scores): CUDA multiplies by the fp32 reciprocal of a CPU scalar, the CPU divides."""
    return scores * (1.0 / divisor) if scores.device.type == "cuda" else scores / divisor


def _row(t: torch.Tensor, b: int, name: str, dtype: torch.dtype, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != b:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a [batch={b}] tensor, got {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")
    return t.to(dtype)


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
         min_p: torch.Tensor | None, min_tokens_to_keep: int = 1, *, k_cap: int | None = None,
         stable: bool = False) -> torch.Tensor:  # fmt: skip
    """logits [B, V] (fp32) -> fp32 [B, V]: the warped logits, filtered entries -inf (HF's warpers, row by row).
    `stable`: top-p sorts stably (equal scores in column order), where TopPLogitsWarper's sort is unstable.

    temperature [B] (> 0), top_k [B] int (<= 0: off), top_p [B] float (>= 1: off; fp64 keeps a Python float's
    `1 - top_p` exact), min_p [B] float (<= 0: off); None: off on every row. `k_cap`: a static bound with 1 <= top_k <= k_cap on every
    row that uses top-k (rows beyond it are the caller's error and get the k_cap-th value as threshold)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [batch, vocab] tensor, got {logits.dtype} {list(logits.shape)}")
    if not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be an int >= 1, got {min_tokens_to_keep!r}")
    if k_cap is not None and (not isinstance(k_cap, int) or k_cap < 1):
        raise ValueError(f"k_cap must be an int >= 1 or None, got {k_cap!r}")
    b, v = logits.shape
    dev = logits.device
    temperature = _row(temperature, b, "temperature", torch.float32, dev)
    top_k = None if top_k is None else _row(top_k, b, "top_k", torch.long, dev)
    top_p64 = None if top_p is None else _row(top_p, b, "top_p", torch.float64, dev)
    min_p = None if min_p is None else _row(min_p, b, "min_p", torch.float32, dev)
    scores = logits.float()
    keep = min(min_tokens_to_keep, v)

    # temperature: as `scores / float` computes on each device (CUDA multiplies by the reciprocal of a CPU scalar)
    scores = divide_as_by_float(scores, temperature[:, None])

    # top-k: keep every score >= the k-th largest, k = max(top_k, min_tokens_to_keep) clipped to the vocabulary
    if top_k is not None:
        k = top_k.clamp(min=keep, max=v)
        if k_cap is not None:
            top = torch.topk(scores, min(k_cap, v), dim=-1).values  # descending
            kth = top.gather(1, (k.clamp(max=top.shape[1]) - 1)[:, None])
        else:
            kth = torch.sort(scores, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill((scores < kth) & (top_k > 0)[:, None], float("-inf"))

    # top-p: TopPLogitsWarper's own operations on the top-k-filtered scores
    if top_p64 is not None:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False, stable=stable)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p64).to(torch.float32)[:, None]
        remove[..., -keep:] = False
        remove &= (top_p64 < 1)[:, None]
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))

    # min-p: MinPLogitsWarper's (threshold 0 removes nothing, so no switch is needed)
    if min_p is not None:
        probs = scores.softmax(dim=-1)
        remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, keep, dim=-1).indices, False)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def top_candidates(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] -> (values [B, n], ids [B, n], top [B, n + 1]), n < V: each row's n largest entries in vocabulary
    order, and its n + 1 largest values, descending (the last is the largest value left out)."""
    top, ids = torch.topk(logits, n + 1, dim=-1)
    ids, order = torch.sort(ids[:, :n], dim=-1)
    return top[:, :n].gather(1, order), ids, top


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
           min_p: torch.Tensor | None, greedy: torch.Tensor, noise=None, *, min_tokens_to_keep: int = 1,
           k_cap: int | None = None, ties_overflow: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """logits [B, V] -> [B] int64 tokens. Rows with `greedy` [B] bool take the first argmax of `logits` (as greedy
    search does; their temperature may be 0); the others draw from softmax(warp(...)). `noise`: Exp(1) samples per
    token id, [B, V] (e.g. `seeded_exponential`) or a function of ids [B, c] -> [B, c] (e.g. `noise_at`, which only
    computes the candidates' noise); None draws them from torch's current generator. `k_cap`: every sampling row's
    top_k is in 1..k_cap; the warpers then run on the candidates (module docstring). `ties_overflow`: a [1] device
    tensor, OR-ed (logical_or_) with whether a sampling row had more tokens tied with its k-th value than candidates
    hold."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {list(logits.shape)}")
    b, v = logits.shape
    greedy = _row(greedy, b, "greedy", torch.bool, logits.device)
    logits = logits.float()
    temperature = torch.where(greedy, 1.0, _row(temperature, b, "temperature", torch.float32, logits.device))
    n = CANDIDATES_PER_CAP * k_cap if k_cap is not None else v
    if n < v and top_k is not None and min_tokens_to_keep <= k_cap:
        scores, ids, top = top_candidates(logits, n)
        if ties_overflow is not None:
            # top-k keeps every score >= its k-th largest after temperature, a monotone map of the logits: more than
            # the candidates iff the largest logit left out scales to that threshold as well
            k = top_k.to(torch.long).clamp(min=min_tokens_to_keep, max=k_cap)
            scaled = divide_as_by_float(torch.cat([top.gather(1, (k - 1)[:, None]), top[:, n:]], dim=1),
                                        temperature[:, None])  # fmt: skip
            kth, left_out = scaled[:, 0], scaled[:, 1]
            ties_overflow.logical_or_(((left_out >= kth) & kth.isfinite() & ~greedy).any())
    else:
        scores, ids, k_cap = logits, None, None if k_cap is None else min(k_cap, v)
    probs = warp(scores, temperature, top_k, top_p, min_p, min_tokens_to_keep, k_cap=k_cap,
                 stable=ids is not None).softmax(dim=-1)  # fmt: skip
    if noise is None:
        noise = torch.empty_like(probs).exponential_()
    elif callable(noise):
        noise = noise(ids if ids is not None else torch.arange(v, device=logits.device).expand(b, v))
    elif noise.shape != (b, v) or noise.device != probs.device:
        raise ValueError(f"noise must be [batch, vocab] = {[b, v]} on {probs.device}, got {list(noise.shape)} on "
                         f"{noise.device}")  # fmt: skip
    elif ids is not None:
        noise = noise.gather(1, ids)
    # a zero draw would make 0/0 for a filtered entry; the clamp changes no draw torch can give otherwise
    drawn = (probs / noise.float().clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    if ids is not None:
        drawn = ids.gather(1, drawn[:, None])[:, 0]
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


# -- counter-based noise ------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) held in int64, without int64 overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) whose output bits each depend on every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_exponential(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """[B] int64 seeds and counters -> [B, n] fp32 Exp(1) noise, a pure function of (seed, counter, column):
    `noise_at` at columns 0..n-1.

    For a server: a request's (seed, token index) gives its noise wherever its row sits and whatever shares the
    batch. Integer tensor ops only (CPU and CUDA, graph-safe). The uniform has 23 bits, in (0, 1) exclusive."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if seed.dim() != 1 or counter.shape != seed.shape:
        raise ValueError(f"seed and counter must be [batch] tensors of one shape, got {list(seed.shape)} and "
                         f"{list(counter.shape)}")  # fmt: skip
    if seed.dtype.is_floating_point or counter.dtype.is_floating_point:
        raise ValueError("seed and counter must be integer tensors")
    return noise_at(seed, counter, torch.arange(n, device=seed.device, dtype=torch.long)[None, :])


def noise_at(seed: torch.Tensor, counter: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """seeded_exponential's noise at the columns `ids` ([B, n] or [1, n], any int64 ids): what a sampler that
    looks only at some tokens (candidates) draws for them, the same as the whole row's noise at those ids."""
    seed, counter = seed.long()[:, None], counter.long()[:, None]
    h = _fmix32((ids.long() * 0x9E3779B9 + 0x7F4A7C15) & _M32)  # the column, then each 32-bit word of the key
    for word in (counter & _M32, (counter >> 32) & _M32, seed & _M32, (seed >> 32) & _M32):
        h = _fmix32(h ^ _fmix32(word ^ 0x27D4EB2F))
    # 23 bits: (2^23 - 1 + 0.5) * 2^-23 = 1 - 2^-24 is an fp32 number; with 24 bits the top value rounded to 1.0,
    # and its noise -log(1) to -0.0 (one id in 2^24)
    uniform = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23  # (0, 1): never 0, never 1
    return -torch.log(uniform)


def check_params(temperature, top_k, top_p, min_p, greedy=None) -> None:
    """Raise ValueError naming the first out-of-range parameter (syncs: call once per request, not per token).
    temperature > 0 (greedy rows excepted), top_k >= 0, 0 <= top_p <= 1, 0 <= min_p <= 1, as transformers' warpers
    check their Python arguments."""
    sampled = ~greedy.bool() if greedy is not None else torch.ones_like(temperature, dtype=torch.bool)
    checks = (
        ("temperature", ~(temperature > 0) & sampled, "> 0"), ("top_k", top_k < 0, ">= 0"),
        ("top_p", ~((top_p >= 0) & (top_p <= 1)), "in [0, 1]"), ("min_p", ~((min_p >= 0) & (min_p <= 1)), "in [0, 1]"),
    )  # fmt: skip
    for name, bad, want in checks:
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}[name]
            raise ValueError(f"{name} must be {want}, row {row} has {values[row].item()}")
