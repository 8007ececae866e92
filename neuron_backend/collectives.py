"""The two collectives tensor parallelism needs, behind one small interface.

    all_reduce_fp32(x)   sum over ranks, carried out in fp32, returned in x.dtype
                         (row-parallel outputs: each rank holds a partial sum; bf16 sums of 2+ partials lose bits)
    all_gather(x, dim)   concatenate every rank's x along dim, rank order

Implementations:
    SingleRank          TP=1: identity (no casts either, so TP=1 graphs carry no collective at all)
    GlooCollectives     CPU processes over torch.distributed (gloo), the mode AWS uses for CPU runs; eager only
    RankZeroView        another implementation's collectives with rank 0's `rank` (NxD's one traced graph, on CPU)
    XlaCollectives      torch-xla / Neuron: xm.all_reduce / xm.all_gather with explicit replica groups, traceable
                        into the HLO that neuronx-cc compiles (and that the torch-xla CPU proxy runs)
"""

from __future__ import annotations

import torch


class Collectives:
    rank: int = 0
    world_size: int = 1

    def all_reduce_fp32(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        raise NotImplementedError


class SingleRank(Collectives):
    def all_reduce_fp32(self, x):
        return x

    def all_gather(self, x, dim):
        return x


class GlooCollectives(Collectives):
    """torch.distributed over an initialised process group (gloo for CPU tensors)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("GlooCollectives: call torch.distributed.init_process_group('gloo', ...) first")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce_fp32(self, x):
        acc = x.to(torch.float32, copy=True)  # a private fp32 copy: the reduce is in place
        self._dist.all_reduce(acc, op=self._dist.ReduceOp.SUM, group=self.group)
        return acc.to(x.dtype)

    def all_gather(self, x, dim):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


class RankZeroView(Collectives):
    """`comm`'s collectives behind rank 0's Python face: `rank` reads 0 on every rank.

    This is what the module NxD traces sees: ModelBuilder builds and traces it once, as rank 0, and every NeuronCore
    runs that graph with its own weights. A module that reads its rank from Python is then rank 0 on every core;
    running it over gloo with this view shows that on CPU (cpu_tp's "rank0" build).
    """

    rank = 0

    def __init__(self, comm: Collectives):
        self._comm = comm
        self.world_size = comm.world_size

    def all_reduce_fp32(self, x):
        return self._comm.all_reduce_fp32(x)

    def all_gather(self, x, dim):
        return self._comm.all_gather(x, dim)


class XlaCollectives(Collectives):
    """xm.all_reduce / xm.all_gather among `groups` (list of rank lists; NxD's TP replica groups on Neuron).

    `rank` is informational only: under NxD's SPMD tracing one graph serves every rank, so nothing in the model
    may branch on it (rank-dependent constants such as the vocab offset are weights, see parallel.py).
    """

    def __init__(self, world_size: int, groups: list[list[int]] | None = None, rank: int = 0):
        import torch_xla.core.xla_model as xm  # noqa: F401  (fail here, with the import error, if absent)

        self._xm = xm
        self.world_size = world_size
        self.rank = rank
        self.groups = groups if groups is not None else [list(range(world_size))]

    @classmethod
    def from_neuronx_distributed(cls) -> "XlaCollectives":
        from neuronx_distributed.parallel_layers import parallel_state as ps

        return cls(
            world_size=ps.get_tensor_model_parallel_size(),
            groups=ps.get_tensor_model_parallel_replica_groups(),
            rank=ps.get_tensor_model_parallel_rank(),
        )

    def all_reduce_fp32(self, x):
        acc = self._xm.all_reduce(self._xm.REDUCE_SUM, x.to(torch.float32), groups=self.groups)
        return acc.to(x.dtype)

    def all_gather(self, x, dim):
        return self._xm.all_gather(x.contiguous(), dim=dim, groups=self.groups, pin_layout=False)
