"""Padded batches and packed sequences through the "g4ops" attention give what each sequence gives alone.

The oracle is the float64 stock model run on each sequence by itself. The batches under test are what users feed a
trainer: right- and left-padded batches with an attention_mask (pad runs longer than the sliding window, so some
pad queries of the sliding layers see no key at all), and packed rows whose position_ids restart, built by the
padding-free collators themselves (transformers' DataCollatorWithFlattening, TRL's padding_free collator with
pad_to_multiple_of). Sequences have odd lengths on both sides of the tiny model's sliding window of 8, so full and
sliding layers both see several sequences in one row. Loss (with num_items_in_batch, as Trainer passes it under
gradient accumulation), the logits of every real token and every parameter gradient are compared:
- in float64 with g4ops enabled: equal to the oracle within fp64 reassociation noise (`EXACT`);
- in float32: g4ops' error against the oracle no larger than stock's on the same batch (tests/oracle.py's bar).

What transformers gets wrong and g4ops must not (g4ops/hf/attention_interface.py): with a cache
(use_cache=True, the config's default outside Trainer) transformers builds no packed mask and the sequences see each
other (`test_stock_packed_with_a_cache_mixes_sequences` shows the bar catches that); fully masked query rows are
reported to give NaN on CUDA sdpa (transformers issue 45201: NaN losses at batch > 1 with padding), so no mask g4ops
hands to sdpa has one. RoPE with packing: every token gets the rotary angles of its position in its own sequence.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import DataCollatorWithFlattening

import g4ops
from g4ops.hf import attention_interface
from g4ops.models import build_model
from g4ops.ops import attention as attention_module

try:
    from . import oracle as O
    from .devices import DEVICES, NEEDS_MASKED_FLEX_TORCH
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import DEVICES, NEEDS_MASKED_FLEX_TORCH

F64 = torch.float64
LENGTHS = (13, 5, 19)  # odd; 13 and 19 cross the tiny model's sliding window of 8, 5 does not
PAD_RUN = 9  # pads after (before) the longest sequence: longer than the window, so some sliding rows see no key
# fp64: the batch and the lone sequences sum the same terms in other orders (GEMM shapes, masks), ~1e-16 relative
# each, amplified by six layers and their backward; measured <= 2.1e-14 here. A leak across sequences moves results
# by far more (test_stock_packed_with_a_cache_mixes_sequences).
EXACT = 2.0**-32
# ... except where the positions themselves differ: transformers computes the RoPE angles position * inv_freq in
# fp32 (autocast off, in every dtype), and a left-padded batch without position_ids (what Trainer feeds) shifts each
# row's positions by its pad count. RoPE is relative, so that is exact in real arithmetic and off by fp32 roundings
# of the angles here (measured 1.6e-6 on the worst gradient): an fp32-level bound, with reductions up to the
# vocabulary long.
SHIFTED_POSITIONS = {"left-padded"}


@pytest.fixture(autouse=True)
def _always_disabled():
    g4ops.disable()
    yield
    g4ops.disable()


def _sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _labels(seq: torch.Tensor) -> torch.Tensor:
    """The sequence as its own labels, its first token unpredicted (-100), as the packing collators mark it."""
    labels = seq.clone()
    labels[0] = -100
    return labels


def _items(seqs) -> int:
    return sum(len(s) - 1 for s in seqs)  # predicted tokens: what Trainer counts as num_items_in_batch


# Each batch builder returns (model kwargs, where[i] = (row, index tensor) of sequence i's tokens in the batch).


def _packed_transformers(seqs):
    batch = DataCollatorWithFlattening()([{"input_ids": s.tolist()} for s in seqs])
    return batch, _packed_places(seqs)


def _packed_trl(seqs):
    collator = pytest.importorskip("trl.trainer.sft_trainer").DataCollatorForLanguageModeling
    # pad_to_multiple_of leaves a tail of pad tokens at position 0 (each its own one-token sequence), the case of
    # LlamaFactory's packing crash (position_ids not padded with input_ids)
    batch = collator(pad_token_id=0, padding_free=True, pad_to_multiple_of=16)([{"input_ids": s.tolist()} for s in seqs])
    assert batch["input_ids"].shape[1] > sum(LENGTHS)
    return batch, _packed_places(seqs)


def _packed_places(seqs):
    starts = [sum(LENGTHS[:i]) for i in range(len(seqs))]
    return [(0, torch.arange(start, start + len(s))) for start, s in zip(starts, seqs)]


def _padded(seqs, side: str, positions: bool = False):
    width = max(LENGTHS) + PAD_RUN
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # pad id 0
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    places = []
    for row, s in enumerate(seqs):
        at = torch.arange(len(s)) + (width - len(s) if side == "left" else 0)
        ids[row, at], labels[row, at], mask[row, at] = s, _labels(s), 1
        places.append((row, at))
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if positions:  # what generate() passes with left padding
        batch["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return batch, places


BATCHES = {
    "packed-transformers": _packed_transformers,
    "packed-trl": _packed_trl,
    "right-padded": lambda seqs: _padded(seqs, "right"),
    "left-padded": lambda seqs: _padded(seqs, "left"),
    "left-padded-positions": lambda seqs: _padded(seqs, "left", positions=True),
}


def _run(model, batch: dict, n_items: int, **call):
    """(loss, logits [rows, len, vocab], grads): loss and grads of one labeled training forward with
    num_items_in_batch, logits of the same batch without labels (g4ops' fused loss returns none)."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch, num_items_in_batch=n_items, **call).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, **call).logits
    return loss.detach(), logits, grads


def _alone(model, seqs):
    """The oracle: each sequence by itself, losses summed (each over the batch's num_items_in_batch)."""
    n_items, total, logits = _items(seqs), 0.0, []
    model.zero_grad(set_to_none=True)
    for s in seqs:
        loss = model(input_ids=s[None], labels=_labels(s)[None], num_items_in_batch=n_items, use_cache=False).loss
        loss.backward()
        total = total + loss.detach()
        with torch.no_grad():
            logits.append(model(input_ids=s[None], use_cache=False).logits[0])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, logits, grads


def _errors(result, oracle, places) -> dict[str, float]:
    """Relative error vs the oracle of the loss, the real tokens' logits and each gradient."""
    loss, logits, grads = result
    loss0, logits0, grads0 = oracle
    ours = torch.cat([logits[row, at] for row, at in places])
    errs = {"loss": O.rel_err(loss.reshape(1), loss0.reshape(1)), "logits": O.rel_err(ours, torch.cat(logits0))}
    assert grads.keys() == grads0.keys(), set(grads) ^ set(grads0)
    errs.update({name: O.rel_err(grads[name], g) for name, g in grads0.items()})
    return errs


@functools.cache
def _built(dtype) -> torch.nn.Module:
    return build_model("tiny-e4b", dtype=dtype)  # building takes seconds on a loaded 2-core machine: once per dtype


def _model(dtype=torch.float32, device="cpu") -> torch.nn.Module:
    """A fresh copy of the tiny model (seed 0: every dtype has the same weights, rounded), in training mode."""
    return copy.deepcopy(_built(dtype)).to(device).train()


_ORACLE: dict = {}


def _oracle(device: str):
    if device not in _ORACLE:  # one fp64 model and its lone-sequence results per device, for every test
        model = _model(F64, device)
        # with the g4ops norms and MLPs, which compute in fp64 for fp64 (stock's RMSNorm computes in fp32, 3e-7 off),
        # and stock sdpa attention: the attention paths under test are not the oracle's
        with g4ops.enable(model):
            seqs = [s.to(device) for s in _sequences(model.config.vocab_size)]
            _ORACLE[device] = seqs, _alone(model, seqs)
    return _ORACLE[device]


def _on(batch: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.fixture
def kernel_masks(monkeypatch):
    """For every g4ops.attention call, whether it got a mask (the integration imports it at call time)."""
    calls, real = [], attention_module.attention

    def spy(*args, mask=None, **kwargs):
        calls.append(mask is not None)
        return real(*args, mask=mask, **kwargs)

    monkeypatch.setattr(attention_module, "attention", spy)
    return calls


def _g4ops_model(dtype, device):
    model = _model(dtype, device)
    g4ops.enable(model, attention=True)
    assert model.config._attn_implementation == attention_interface.ATTENTION
    return model


# use_cache=True only changes the packed cases (transformers' packed mask); padded ones run the config's default
CASES = [(layout, use_cache) for layout in BATCHES for use_cache in ((False, True) if "packed" in layout else (None,))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout, use_cache", CASES, ids=[f"{l}-cache={c}" for l, c in CASES])
def test_batch_in_fp64_equals_each_sequence_alone(device, layout, use_cache, kernel_masks):
    seqs, oracle = _oracle(device)
    batch, places = BATCHES[layout]([s.cpu() for s in seqs])
    model = _g4ops_model(F64, device)
    errs = _errors(_run(model, _on(batch, device), _items(seqs), use_cache=use_cache), oracle, places)
    # the fast path is taken: every full layer of both forwards ran g4ops.attention with the batch's mask
    assert kernel_masks.count(True) == 2 * model.config.layer_types.count("full_attention"), kernel_masks
    bound = O.tolerance(torch.float32, k=model.config.vocab_size) if layout in SHIFTED_POSITIONS else EXACT
    worst = max(errs, key=errs.get)
    assert errs[worst] <= bound, f"{worst}: {errs[worst]:.3e} > {bound:.1e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["packed-transformers", "packed-trl", "right-padded", "left-padded"])
def test_sliding_layers_on_g4ops_attention_with_the_batch_mask_equal_each_sequence_alone(device, layout,
                                                                                         kernel_masks, monkeypatch):
    """attention_interface.MASKED_SLIDING_VIA_G4OPS (G4OPS_MASKED_SLIDING=g4ops, opt-in): a padded or packed
    batch's sliding layers run g4ops.attention with the window and the batch's mask too, so every layer of both
    forwards does; loss, logits and gradients equal each sequence's alone in fp64 (the pad run of 9 leaves sliding
    rows without a key)."""
    seqs, oracle = _oracle(device)
    batch, places = BATCHES[layout]([s.cpu() for s in seqs])
    model = _g4ops_model(F64, device)
    assert not attention_interface.MASKED_SLIDING_VIA_G4OPS or os.environ.get("G4OPS_MASKED_SLIDING") == "g4ops"
    monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_G4OPS", True)
    errs = _errors(_run(model, _on(batch, device), _items(seqs), use_cache=False), oracle, places)
    assert kernel_masks == [True] * 2 * model.config.num_hidden_layers, kernel_masks
    bound = O.tolerance(torch.float32, k=model.config.vocab_size) if layout in SHIFTED_POSITIONS else EXACT
    worst = max(errs, key=errs.get)
    assert errs[worst] <= bound, f"{worst}: {errs[worst]:.3e} > {bound:.1e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(BATCHES))
def test_batch_in_fp32_no_worse_than_stock(device, layout):
    """Stock runs with use_cache=False (without it stock mixes packed sequences); g4ops with the config's default.
    The yardstick is the worst of stock and two stock runs whose norms round the other way (oracle.jittered_norms):
    on the H200 (2026-12-02) layer 4's q_norm weight gradient of the left-padded batch was 1.94x stock's error, a
    spread of that size."""
    seqs, oracle = _oracle(device)
    batch, places = BATCHES[layout]([s.cpu() for s in seqs])
    batch = _on(batch, device)
    stock_model = _model(torch.float32, device)
    stock = [_errors(_run(stock_model, batch, _items(seqs), use_cache=False), oracle, places)]
    for seed in (1, 2):
        with O.jittered_norms(stock_model, seed):
            stock.append(_errors(_run(stock_model, batch, _items(seqs), use_cache=False), oracle, places))
    ours = _errors(_run(_g4ops_model(torch.float32, device), batch, _items(seqs)), oracle, places)
    vocab = stock_model.config.vocab_size
    for name, err in ours.items():
        # reductions up to the vocabulary (the loss) long; n: a handful of independently rounded values per name
        yardstick = max(errs[name] for errs in stock)
        O.assert_no_worse_than_stock(name, err, yardstick, O.floor(torch.float32, k=vocab, n=1))


def test_stock_packed_with_a_cache_mixes_sequences():
    """The leak g4ops closes, and proof that EXACT catches one: stock transformers with a cache (use_cache=True)
    builds no packed mask, so its packed sequences attend to each other."""
    seqs, oracle = _oracle("cpu")
    batch, places = _packed_transformers(seqs)
    stock = _errors(_run(_model(F64), batch, _items(seqs), use_cache=True),
                    oracle, places)  # fmt: skip
    if stock["logits"] <= EXACT:
        pytest.skip("this transformers builds the packed mask with a cache too: nothing for g4ops to add")
    assert stock["logits"] > 1e6 * EXACT, stock["logits"]


def _sdpa_masks(monkeypatch) -> list:
    """Every mask g4ops' attention hands to stock sdpa (the integration imports sdpa_attention_forward at call
    time)."""
    import transformers.integrations.sdpa_attention as sdpa

    masks, real = [], sdpa.sdpa_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", spy)
    return masks


@pytest.mark.parametrize("layout", ["right-padded", "left-padded"])
def test_no_query_row_reaches_sdpa_without_a_key(monkeypatch, layout):
    """transformers issue 45201 (NaN at batch > 1 with padding): the padded batches above give fully masked rows
    (left-pad queries; pad runs longer than the sliding window), which CUDA sdpa kernels are reported to turn into
    NaN. g4ops opens them before sdpa and zeroes their outputs, so no kernel sees one."""
    seqs, _ = _oracle("cpu")
    batch, _ = BATCHES[layout](seqs)
    model = _model()
    with torch.no_grad():
        stock = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    masks = _sdpa_masks(monkeypatch)
    g4ops.enable(model, attention=True)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    bool_masks = [m for m in masks if isinstance(m, torch.Tensor)]
    assert bool_masks and all(m.dtype == torch.bool for m in bool_masks)
    assert all(bool(m.any(-1).all()) for m in bool_masks), "a query row without a visible key reached sdpa"
    # and the batch had such rows: stock's own masks for it leave some rows empty
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    window = model.config.sliding_window
    empty = sdpa_mask(batch_size=len(seqs), q_length=batch["input_ids"].shape[1],
                      kv_length=batch["input_ids"].shape[1], mask_function=sliding_window_causal_mask_function(window),
                      attention_mask=batch["attention_mask"].bool(), allow_is_causal_skip=False)  # fmt: skip
    assert not bool(empty.any(-1).all())
    # every position, pads included, gives stock's CPU logits (CPU sdpa returns 0 for an empty row, as g4ops does)
    assert torch.isfinite(logits).all() and O.rel_err(logits, stock) <= 2e-5  # fp32 reassociation, as test_attention


@pytest.mark.parametrize("device", DEVICES)
def test_padded_bf16_training_stays_finite(device):
    """transformers issue 45201's setting: bf16, batch 3 with left and right padding, a few optimizer steps; with
    g4ops every loss and gradient is finite and the loss tracks fp64 as closely as stock's (when stock's is finite:
    on CUDA it is what the issue reports NaN for)."""
    seqs, oracle = _oracle(device)
    batches = [_on(BATCHES[side]([s.cpu() for s in seqs])[0], device) for side in ("left-padded", "right-padded")]
    losses = {}
    for name in ("stock", "g4ops"):
        model = _model(torch.bfloat16, device)
        if name == "g4ops":
            g4ops.enable(model, attention=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses[name] = []
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            loss = model(**batches[step % 2], num_items_in_batch=_items(seqs)).loss
            loss.backward()
            losses[name].append(loss.detach().float())
            if name == "g4ops":
                assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
                bad = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
                assert not bad, f"step {step}: non-finite gradients in {bad}"
            opt.step()
    first = oracle[0].reshape(1)  # the first step's weights are the oracle's
    err_g4, err_stock = (O.rel_err(losses[n][0].reshape(1), first) for n in ("g4ops", "stock"))
    if math.isfinite(err_stock):
        O.assert_no_worse_than_stock("loss", err_g4, err_stock, O.floor(torch.bfloat16, k=64, n=1))


def test_packed_rotary_angles_are_each_sequences_own():
    """RoPE with packing: the cos/sin every layer type gets at each packed token are those of its position in its
    own sequence (what the sequence alone gets), on both transformers ends."""
    model = _model()
    g4ops.enable(model, attention=True)
    seqs = _sequences(model.config.vocab_size)
    seen = []
    hook = model.model.rotary_emb.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        batch, places = _packed_transformers(seqs)
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            packed, seen[:] = list(seen), []
            alone = []
            for s in seqs:
                model(input_ids=s[None])
                alone.append(list(seen))
                seen[:] = []
    finally:
        hook.remove()
    assert packed and len(packed) == len(alone[0])  # one call per layer type
    for i, (_, at) in enumerate(places):
        for (cos, sin), (cos0, sin0) in zip(packed, alone[i]):
            assert torch.equal(cos[:, at], cos0.expand(cos.shape[0], -1, -1)) and torch.equal(sin[:, at], sin0.expand(
                sin.shape[0], -1, -1)), f"sequence {i}: rotary angles differ from its own"  # fmt: skip


def _compiled_packed_training(device: str, backend: str):
    """Under torch.compile (what Trainer's torch_compile runs) transformers builds the packed mask itself when no
    cache is passed (use_cache=False, as Trainer and TRL pass): the compiled step equals the eager one. With a cache
    it builds none and g4ops cannot read position_ids while tracing: the call fails, on CPU naming the fix (on CUDA
    the device-side assert carries no message and ends the process's CUDA context, so
    `test_compiled_packed_call_with_a_cache_fails_on_cuda` checks that in a child process)."""
    seqs, _ = _oracle(device)
    batch, places = _packed_transformers([s.cpu() for s in seqs])
    batch = _on(batch, device)
    model = _g4ops_model(torch.float32, device)
    eager = _run(model, batch, _items(seqs), use_cache=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss, logits, grads = _run(compiled, batch, _items(seqs), use_cache=False)
    result = (loss, logits, {k.removeprefix("_orig_mod."): v for k, v in grads.items()})
    for name, err in _errors(result, (eager[0], [eager[1][0, at] for _, at in places], eager[2]), places).items():
        assert err <= 1e-4, f"{name}: {err:.2e}"  # fp32 reassociation, as test_attention's model comparisons
    if device == "cpu":
        with pytest.raises(RuntimeError, match="position_ids restart"), torch.no_grad():
            compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)


@pytest.mark.slow  # Dynamo tracing the model's forward and backward: 90 s on the loaded 2-core machine
@pytest.mark.parametrize("masked_g4ops", [False, True], ids=["sdpa-sliding", "g4ops-sliding"])
def test_compiled_packed_training_matches_eager_and_a_cache_is_refused(monkeypatch, masked_g4ops):
    monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_G4OPS", masked_g4ops)
    # aot_eager: Dynamo and AOTAutograd trace what Inductor would get (the masks transformers builds while tracing,
    # the device assert), in seconds instead of the minutes Inductor's CPU codegen takes on 2 cores; Inductor itself
    # runs on CUDA below (and test_attention.py compiles the model with it on CPU)
    _compiled_packed_training("cpu", "aot_eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("masked_flex, masked_g4ops", [(False, False), pytest.param(True, False,
                         marks=NEEDS_MASKED_FLEX_TORCH), (False, True)],
                         ids=["sdpa-sliding", "flex-sliding", "g4ops-sliding"])  # fmt: skip
def test_compiled_packed_training_on_cuda_with_inductor(monkeypatch, flex_masks, masked_flex, masked_g4ops):
    monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_FLEX", masked_flex)
    monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_G4OPS", masked_g4ops)
    _compiled_packed_training("cuda", "inductor")
    # with it on, the sliding layers ran FlexAttention with the packed mask
    assert flex_masks == ([True] * len(flex_masks) if masked_flex else []) and (flex_masks or not masked_flex)


@pytest.fixture
def flex_masks(monkeypatch):
    """For every sliding_window_attention call, whether it got a mask (the integration imports it at call time)."""
    calls, real = [], attention_module.sliding_window_attention

    def spy(*args, mask=None):
        calls.append(mask is not None)
        return real(*args, mask=mask)

    monkeypatch.setattr(attention_module, "sliding_window_attention", spy)
    return calls


@pytest.mark.parametrize("layout", ["packed-transformers", "packed-trl", "right-padded", "left-padded"])
def test_sliding_layers_on_flex_with_the_batch_mask_equal_each_sequence_alone(monkeypatch, flex_masks, layout):
    """Where FlexAttention is usable (compiled CUDA) and MASKED_SLIDING_VIA_FLEX is on, a padded or packed batch's
    sliding layers run it with the batch's mask inside the band. FlexAttention's CPU forward (eager; it has no CPU
    backward) stands in here, in fp64: every sliding layer takes it with the mask, and the real tokens' logits equal
    each sequence's alone (the pad run of 9 leaves sliding rows without a key: they give 0, as on the stock path).
    Compiled with its gradients on CUDA: test_compiled_packed_training_on_cuda_with_inductor and
    tests/test_attention.py."""
    seqs, (_, logits0, _) = _oracle("cpu")
    batch, places = BATCHES[layout]([s.cpu() for s in seqs])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    monkeypatch.setattr(attention_module, "flex_sliding_usable", lambda query: True)
    monkeypatch.setattr(attention_module, "masked_flex_supported", lambda: True)  # as on torch >= 2.12
    model = _g4ops_model(F64, "cpu")
    with torch.no_grad():
        model(**inputs, use_cache=False)
        assert not flex_masks, "MASKED_SLIDING_VIA_FLEX is off by default"
        monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_FLEX", True)
        logits = model(**inputs, use_cache=False).logits
    assert flex_masks == [True] * model.config.layer_types.count("sliding_attention"), flex_masks
    ours = torch.cat([logits[row, at] for row, at in places])
    bound = O.tolerance(torch.float32, k=model.config.vocab_size) if layout in SHIFTED_POSITIONS else EXACT
    assert O.rel_err(ours, torch.cat(logits0)) <= bound


def test_masked_flex_stays_off_under_torch_2_11_and_says_why(monkeypatch, flex_masks):
    """Turned on under a torch whose Inductor failed on it (2.11, attention.MASKED_FLEX_MIN_TORCH), a packed batch's
    sliding layers keep stock SDPA, right, and one warning names the reason."""
    import g4ops.ops._torch_version as versions

    seqs, (_, logits0, _) = _oracle("cpu")
    batch, places = BATCHES["packed-transformers"]([s.cpu() for s in seqs])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    monkeypatch.setattr(attention_module, "flex_sliding_usable", lambda query: True)
    monkeypatch.setattr(versions, "torch_version", lambda: (2, 11))
    monkeypatch.setattr(attention_module, "_masked_flex_warned", False)
    monkeypatch.setattr(attention_interface, "MASKED_SLIDING_VIA_FLEX", True)
    model = _g4ops_model(F64, "cpu")
    with torch.no_grad(), pytest.warns(UserWarning, match=r"needs torch >= 2\.12.*stock SDPA") as caught:
        logits = model(**inputs, use_cache=False).logits
        model(**inputs, use_cache=False)
    assert sum("needs torch" in str(w.message) for w in caught) == 1, "warned once"
    assert flex_masks == []
    ours = torch.cat([logits[row, at] for row, at in places])
    assert O.rel_err(ours, torch.cat(logits0)) <= EXACT


_PACKED_WITH_A_CACHE_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_packing as T
seqs, _ = T._oracle("cuda")
batch, _ = T._packed_transformers([s.cpu() for s in seqs])
batch = T._on(batch, "cuda")
compiled = torch.compile(T._g4ops_model(torch.float32, "cuda"))
with torch.no_grad():
    compiled(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True)
torch.cuda.synchronize()
print("NO ERROR")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_compiled_packed_call_with_a_cache_fails_on_cuda():
    """The refusal above on CUDA: a device-side assert, which leaves the process's CUDA context unusable (the H200
    suite of 2026-12-01 lost the next test of the same xdist worker to it), so it runs in a child process here."""
    child = subprocess.run([sys.executable, "-c", _PACKED_WITH_A_CACHE_CHILD, os.path.dirname(__file__)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode != 0 and "NO ERROR" not in child.stdout, child.stdout[-2000:]
    assert "device-side assert" in child.stderr, child.stderr[-3000:]


def test_packed_positions_are_read_once_per_forward(monkeypatch):
    """Reading position_ids is a host sync: g4ops adds one per forward to transformers' own mask reads, not one per
    layer."""
    import transformers.masking_utils as masking_utils

    reads = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: reads.append(1) or real(p))
    model = build_model("tiny-e4b").train()
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])

    def reads_of_one_forward():
        before = len(reads)
        model(input_ids=ids, position_ids=position_ids.clone(), use_cache=False)
        return len(reads) - before

    stock = reads_of_one_forward()
    with g4ops.enable(model, attention=True):
        assert [reads_of_one_forward() for _ in range(2)] == [stock + 1] * 2
    assert model.config.num_hidden_layers > 2
