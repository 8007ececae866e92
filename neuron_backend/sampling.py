"""Vocab-parallel token choice: greedy argmax and transformers-exact sampling without gathering the vocabulary.

Each TP rank holds a vocab shard of the fp32 softcapped logits [B, V/tp]. Sampling never gathers them:

    1. every rank takes its `cap` largest logits and their global ids            (local_candidates: [B, cap] each)
    2. the ranks all-gather those                                                ([B, tp * cap]: 2 * tp * cap values)
    3. every rank runs g4ops.engine.sampler.sample on the merged candidates, with the noise of each candidate's
       global id (sampler.noise_at), and takes the winner's id                     (sample_candidates)

Step 3 is transformers' warpers (temperature, top-k, top-p, min-p, in that order, fp32) through sampler.py's own
`sample`/`warp`, so the semantics live in one place. The merged candidates hold the global top `cap` tokens, so
for any row with 1 <= top_k <= cap, everything TopKLogitsWarper keeps is among them and everything outside them
is -inf after top-k anyway: the token equals `sample(full logits, noise=seeded_exponential(seed, counter, V))`
up to the fp32 rounding of the softmax sum over fewer -inf entries (a tie at that last bit is the only way to
differ). Limits, by construction:
- top_k = 0 (off) samples from the candidates only: at least the global top `cap` tokens, whatever top-p/min-p
  then keep of them. Transformers would draw from the whole vocabulary; the probability mass of the tokens left
  out is lost (and top-p's cumulative sums miss it). The engine refuses top_k > cap.
- tokens tied with the k-th value beyond a rank's `cap` candidates are left out (transformers keeps every tie).
Every rank computes the same token from the same gathered candidates and the same counter-based noise (no RNG
state in the graph): that is what keeps the ranks of NxD's one traced graph in step.

Greedy rows (temperature <= 0) take the distributed argmax of parallel.VocabParallelLMHead (ties to the lowest id,
as torch.argmax on the full row), not the candidates' argmax.

Where torch-neuronx is importable and the logits live on an XLA device, the per-rank top-k and argmax are its TopK
and Argmax operators (what NxD's distributed topk / argmax call per shard, because neuronx-cc wants them);
elsewhere torch.topk and torch.argmax. Neither the
Neuron operator nor this module on a NeuronCore has been run here (no SDK).
"""

from __future__ import annotations

import torch

from g4ops.engine.sampler import noise_at, sample

__all__ = ["local_topk", "local_argmax", "local_candidates", "sample_candidates", "SAMPLING_INPUTS"]

# the per-row tensors a sampling bucket takes after (input_ids, start_pos, n_valid, ple_tokens), in order
SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "min_p", "seed", "counter")


def _neuron_op(name: str):
    """torch-neuronx's operator `name` (TopK, Argmax) when it is importable, else None."""
    try:
        from torch_neuronx.xla_impl import ops
    except ImportError:
        return None
    return getattr(ops, name, None)


def local_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) (values descending, indices), through torch-neuronx's TopK on an XLA device."""
    op = _neuron_op("TopK") if x.device.type == "xla" else None
    return op.apply(x, k, dim=-1) if op is not None else torch.topk(x, k, dim=-1)


def local_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (first maximum), through torch-neuronx's Argmax on an XLA device (NxD's distributed argmax
    runs it per shard)."""
    op = _neuron_op("Argmax") if x.device.type == "xla" else None
    return op.apply(x, dim=-1, keepdim=False) if op is not None else x.argmax(dim=-1)


def local_candidates(local_logits: torch.Tensor, vocab_start: torch.Tensor, cap: int):
    """A rank's [B, V/tp] logits -> (values [B, c], global ids [B, c]), c = min(cap, V/tp): its largest logits."""
    values, idx = local_topk(local_logits, min(cap, local_logits.shape[-1]))
    return values, idx + vocab_start


def sample_candidates(values, ids, temperature, top_k, top_p, min_p, seed, counter, cap: int) -> torch.Tensor:
    """Merged candidates (values [B, N] fp32, global ids [B, N]) -> [B] sampled token ids (rows with temperature
    <= 0 get the candidates' argmax; callers replace those with the distributed argmax). top_k [B] in 0..cap."""
    greedy = temperature <= 0
    noise = noise_at(seed, counter, ids)
    k_cap = min(cap, values.shape[-1])
    pick = sample(values, temperature, top_k.clamp(max=k_cap), top_p, min_p, greedy, noise, k_cap=k_cap)
    return ids.gather(1, pick[:, None]).squeeze(1)

