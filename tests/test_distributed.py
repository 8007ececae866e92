"""Finetuning with g4ops under PyTorch's own distributed engines: FSDP2 (`fully_shard`) and DDP, two CPU processes
over gloo, on the tiny E4B-shaped Gemma-4, against one process on the same data.

The global batch (4 sequences, some labels ignored) is split 2 + 2 over the ranks. Each rank's loss uses
`num_items_in_batch` = the global count of counted labels, times the world size, as HF's Trainer does with
`average_tokens_across_devices`: the ranks' gradients, averaged by DDP / FSDP2, then equal one process's gradients of
the global mean loss. Checked: the first loss (all-reduced), every parameter gradient (FSDP2 shards gathered back to
full tensors), the loss after one AdamW step, and that the g4ops ops (norm, MLP, fused loss, and their backward ops)
really ran on every rank (a dispatch-mode counter), so a silent fallback to stock cannot pass.
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

import pytest
import torch

pytestmark = pytest.mark.slow

WORLD = 2
IGNORE = -100
G4OPS_OPS = (
    "g4ops.rms_norm.default",
    "g4ops.rms_norm_backward.default",
    "g4ops.geglu_mlp_forward.default",
    "g4ops.geglu_mlp_backward.default",
    "g4ops.linear_cross_entropy_forward.default",
    "g4ops.linear_cross_entropy_backward.default",
)


def global_batch():
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(3, 512, (4, 16), generator=gen)
    labels = ids.clone()
    labels[0, :5] = IGNORE  # masked prompt
    labels[3, -4:] = IGNORE  # padding
    return ids, labels


def counted_items(labels) -> int:
    return int((labels[:, 1:] != IGNORE).sum())  # after the causal shift


def build():
    import g4ops
    from g4ops.models import build_model

    model = build_model("tiny-e4b", seed=0).train()
    g4ops.enable(model)
    return model


def train_step(model, ids, labels, num_items, scale):
    """One fwd + bwd + AdamW step, then the loss of a second forward: (loss1, grads, loss2)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(num_items)).loss * scale
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # FSDP2: a DTensor shard -> the full gradient
        grads[name] = None if g is None else g.detach().clone()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        loss2 = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(num_items)).loss * scale
    return loss.detach(), grads, loss2.detach()


def _counter():
    from devices import G4opsCalls  # in the spawned workers too (spawn gives them this sys.path)

    return G4opsCalls()


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _stock_fsdp2_error(ids):
    """When the g4ops run fails under FSDP2: does stock transformers fail the same way? (transformers 5.6 does:
    its KV-shared layers read a dict that earlier layers fill, and FSDP2's per-layer input handling copies it.)"""
    from g4ops.models import build_model

    try:
        _fsdp2(build_model("tiny-e4b", seed=0).train())(input_ids=ids, labels=ids).loss.backward()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids, labels = global_batch()
        num_items = counted_items(labels)
        mine = slice(2 * rank, 2 * rank + 2)
        results = {}
        for mode in ("ddp", "fsdp2"):
            model = build()
            try:
                # broadcast_buffers=False: both ranks build the same buffers (seeded), and with transformers 5.6 on
                # torch 2.13 DDP's per-forward buffer broadcast over gloo races on a loaded CPU: rank 1's first loss
                # then comes out 3.1213 or 3.1255 instead of 3.1241, for the stock model too (2026-12-01)
                wrapped = DDP(model, broadcast_buffers=False) if mode == "ddp" else _fsdp2(model)
                counter = _counter()
                with counter:
                    loss, grads, loss2 = train_step(wrapped, ids[mine], labels[mine], num_items, WORLD)
            except Exception as exc:  # noqa: BLE001 - both ranks fail alike (same model, same code path)
                if mode != "fsdp2":
                    raise
                results[mode] = dict(error=f"{type(exc).__name__}: {exc}", stock_error=_stock_fsdp2_error(ids[mine]))
                continue
            for t in (loss, loss2):
                dist.all_reduce(t)
                t /= WORLD
            results[mode] = dict(loss=loss, loss2=loss2, grads=grads, calls=counter.calls)
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_results():
    import torch.multiprocessing as mp

    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=True)
            except mp.ProcessExitedException as exc:
                # A rank killed by a signal, not by a Python error (those raise ProcessRaisedException and fail
                # here): once in CI (2026-12-07, 2 cores, torch 2.13) rank 1 aborted with "terminate called without
                # an active exception" from C++ during the DDP step, and the same test then passed 3 runs of 3.
                # One fresh try; a second abort fails the test.
                if attempt == 2 or exc.signal_name is None:
                    raise
                warnings.warn(f"test_distributed: {exc}; spawning the ranks once more", stacklevel=1)
                continue
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process():
    """One process, the whole batch, g4ops enabled; and stock for a sanity bound."""
    import g4ops

    ids, labels = global_batch()
    num_items = counted_items(labels)
    model, counter = build(), _counter()  # build (and enable's one-time probe) outside the counter
    with counter:
        ours = (*train_step(model, ids, labels, num_items, 1), counter.calls)
    from g4ops.models import build_model

    stock_model = build_model("tiny-e4b", seed=0).train()
    assert not g4ops.is_enabled(stock_model)
    stock = train_step(stock_model, ids, labels, num_items, 1)
    return ours, stock


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_single_process_g4ops_matches_stock(single_process):
    (loss, grads, loss2, _), (s_loss, s_grads, s_loss2) = single_process
    torch.testing.assert_close(loss, s_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss2, s_loss2, rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        assert (g is None) == (s_grads[name] is None), name
        if g is not None:
            assert _rel(g, s_grads[name]) < 1e-4, name


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed_matches_single_process(distributed_results, single_process, mode):
    loss, grads, loss2, calls = single_process[0]
    for op in G4OPS_OPS:
        assert calls.get(op, 0) > 0, f"one process: {op} never ran"
    for rank, result in enumerate(distributed_results):
        r = result[mode]
        if "error" in r:
            if r["stock_error"] is not None:
                import transformers

                pytest.skip(f"stock transformers {transformers.__version__} fails under {mode} too: {r['stock_error']}")
            pytest.fail(f"{mode} rank {rank}: g4ops fails where stock runs: {r['error']}")
        # the same g4ops calls as one process: no module fell back to stock under DDP / FSDP2
        assert r["calls"] == calls, f"{mode} rank {rank}"
        # fp32; only the order of the reductions differs (per-rank partial sums, gloo all-reduce)
        torch.testing.assert_close(r["loss"], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["loss2"], loss2, rtol=1e-4, atol=1e-5)
        names = {n.removeprefix("module.") for n in r["grads"]}
        assert names == set(grads), mode
        for name, g in r["grads"].items():
            ref = grads[name.removeprefix("module.")]
            assert (g is None) == (ref is None), name
            if ref is not None:
                assert g.shape == ref.shape, name
                assert _rel(g, ref) < 1e-5, f"{mode} rank {rank}: {name}"
