"""Tensor-parallel layers. Each module holds only its rank's shard; loader.py cuts the shards from the HF weights.

    ColumnParallelLinear   W [out/tp, in]    y_r = x @ W_r.T                 output stays sharded (no collective)
    RowParallelLinear      W [out, in/tp]    y = all_reduce_fp32(x_r @ W_r.T)  input is the column-sharded output
    VocabParallelEmbedding W [V/tp, H]       masked local lookup, then all_reduce (exact: one rank is non-zero)
    VocabParallelLMHead    W [V/tp, H]       fp32 logits of the shard, softcap, then a distributed argmax or
                                             vocab-parallel sampling (sampling.py: top-k candidates per rank)

Rank-dependent constants (the first vocab id of the shard) are persistent buffers filled by the loader, not Python
ints: NxD's ModelBuilder traces one graph for all ranks and feeds each rank its own weights, so anything that
differs between ranks has to arrive as a weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import Collectives
from .sampling import local_argmax, local_candidates, sample_candidates


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_local: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x):  # [..., in] -> [..., out/tp]
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, in_local: int, out_features: int, dtype: torch.dtype, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype), requires_grad=False)
        self.comm = comm

    def forward(self, x):  # [..., in/tp] -> [..., out], summed over ranks in fp32
        return self.comm.all_reduce_fp32(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_local: int, hidden: int, dtype: torch.dtype, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden, dtype=dtype), requires_grad=False)
        self.register_buffer("vocab_start", torch.zeros((), dtype=torch.int64))  # rank * vocab_local
        self.comm = comm

    def forward(self, ids):  # [B, T] int64 -> [B, T, H]
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return self.comm.all_reduce_fp32(rows)


class VocabParallelLMHead(nn.Module):
    """lm_head over a vocab shard: fp32 logits, softcap in fp32, greedy token by a distributed argmax.

    Ties resolve to the lowest token id, like torch.argmax on the full row: ranks hold ascending vocab ranges and
    the argmax over the gathered per-rank maxima also picks the first (lowest-rank) maximum.
    """

    def __init__(
        self,
        embedding: VocabParallelEmbedding | None,
        vocab_local: int,
        hidden: int,
        vocab_size: int,
        softcap: float | None,
        dtype: torch.dtype,
        comm: Collectives,
    ):
        super().__init__()
        self.tied = embedding is not None
        if self.tied:
            self._embedding = [embedding]  # a list: not a submodule, so the weight is registered once
        else:
            self.weight = nn.Parameter(torch.empty(vocab_local, hidden, dtype=dtype), requires_grad=False)
            self.register_buffer("vocab_start", torch.zeros((), dtype=torch.int64))
        self.vocab_local = vocab_local
        self.vocab_size = vocab_size
        self.padded = vocab_local * comm.world_size != vocab_size
        self.softcap = softcap
        self.comm = comm

    def _weight_and_start(self):
        if self.tied:
            emb = self._embedding[0]
            return emb.weight, emb.vocab_start
        return self.weight, self.vocab_start

    def local_logits(self, h):  # [B, H] -> [B, V/tp] fp32, softcapped, padded columns at -inf
        weight, start = self._weight_and_start()
        logits = F.linear(h, weight).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.padded:
            col = start + torch.arange(self.vocab_local, device=logits.device)
            logits = logits.masked_fill(col >= self.vocab_size, float("-inf"))
        return logits

    def forward(self, h, return_logits: bool = False, sampling: tuple | None = None, cap: int = 0):
        """[B, H] -> tokens [B] int64 (, logits [B, V] fp32). `sampling`: the per-row tensors of
        sampling.SAMPLING_INPUTS; rows with temperature > 0 then sample from the merged top-`cap` candidates of
        every rank (sampling.py), the others keep the distributed argmax."""
        _, start = self._weight_and_start()
        logits = self.local_logits(h)
        tokens, full = self._argmax(logits, start, return_logits)
        if sampling is not None:
            values, ids = local_candidates(logits, start, cap)
            if self.comm.world_size > 1:  # tp * cap values and ids per row cross the ranks, never the vocabulary
                values, ids = self.comm.all_gather(values, dim=-1), self.comm.all_gather(ids, dim=-1)
            drawn = sample_candidates(values, ids, *sampling, cap=cap)
            tokens = torch.where(sampling[0] > 0, drawn, tokens)
        return tokens, full

    def _argmax(self, logits, start, return_logits):
        local_idx = local_argmax(logits)  # first maximum
        tokens = local_idx + start
        if self.comm.world_size > 1:
            local_max = logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
            maxima = self.comm.all_gather(local_max.unsqueeze(0), dim=0)  # [tp, B]
            candidates = self.comm.all_gather(tokens.unsqueeze(0), dim=0)  # [tp, B]
            winner = maxima.argmax(dim=0, keepdim=True)  # [1, B], lowest rank on ties
            tokens = candidates.gather(0, winner).squeeze(0)
        if not return_logits:
            return tokens, None
        full = self.comm.all_gather(logits, dim=-1)[..., : self.vocab_size]
        return tokens, full
