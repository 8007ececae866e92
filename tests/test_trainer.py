"""HF `Trainer` and TRL `SFTTrainer` end to end with g4ops enabled, on the tiny model, on CPU.

Each case trains the same tiny model from the same weights on the same in-code data twice, stock and with g4ops
(`g4ops.enable()` plus `enable(model, attention=True)`), and asserts:
- the loss curve (every optimizer step's logged loss) equals stock's within `CURVE_RTOL` (why that bound: below);
- what the trainer saved (a full checkpoint, or a peft adapter) loads into stock transformers with g4ops disabled,
  into a fresh model, and gives the trained model's logits.
Features on, as users run them: gradient accumulation (so Trainer passes num_items_in_batch), gradient
checkpointing, packing (transformers' DataCollatorWithFlattening; TRL's packing=True, bfd into padding-free rows),
padded batches, full finetune and LoRA through peft, fp32 and TRL's default bf16 autocast. report_to="none",
nothing saved outside tmp_path.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

import g4ops
from g4ops.hf import attention_interface, patches, peft_lora
from g4ops.models import build_model, tiny_tokenizer

try:
    from . import oracle as O
    from .devices import G4opsCalls
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    import oracle as O
    from devices import G4opsCalls

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

STEPS = 8  # optimizer steps per run, each of GRAD_ACCUM micro-batches: 16 forward/backward passes (g4ops' CPU path,
# the reference kernels, is ~8x slower than stock's on the tiny model: the file has to stay near 90 s on 2 cores)
GRAD_ACCUM = 2
LR = 1e-3
# Stock and g4ops compute the same fp32 model with sums in other orders (the ops' fp32 reductions, the fused loss,
# the masks), 1e-7 to 1e-6 relative on a step's loss and gradients (test_packing.py). AdamW divides each gradient by
# its own running RMS, so a reordering difference in a near-zero gradient entry becomes an O(lr) weight change and
# the curves drift apart step by step: over STEPS steps at LR the largest relative difference measured was 1.0e-6
# (2026-12-01, transformers 5.24: Trainer packed 2.6e-7, TRL LoRA 1.6e-7, TRL full padded 1.0e-6). 2e-5 leaves 20x
# room; a real difference (a dropped gradient, a leaking mask, a wrong num_items_in_batch) moves the curve by 1e-2
# or more within a few steps.
CURVE_RTOL = 2e-5
LOGITS_RTOL = 2e-5  # the trained model (g4ops on) vs the reloaded stock model: fp32 reassociation, as test_attention


@pytest.fixture(autouse=True)
def _always_disabled():
    g4ops.disable()
    yield
    g4ops.disable()


@functools.cache
def _built() -> torch.nn.Module:
    return build_model("tiny-e4b")  # building takes seconds on a loaded 2-core machine: once


def _texts(n: int = 48, seed: int = 0) -> list[str]:
    """Short in-code sentences of odd, varied lengths (byte-level tiny tokenizer: one token per character)."""
    words = "the a cat dog sat ran on in under over mat log sun rain quick slow red blue".split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 7))) for _ in range(n)]


def _args(cls, tmp_path, **extra):
    settings = dict(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=GRAD_ACCUM,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0, gradient_checkpointing=True,
        disable_tqdm=True, bf16=False,  # fp32, for an exact comparison (TRL defaults to bf16: the last test)
    )
    return cls(**{**settings, **extra})


def _curve(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _run(make_trainer, with_g4ops: bool):
    """Train a fresh copy of the tiny model; (trainer, loss curve)."""
    model = copy.deepcopy(_built())
    if with_g4ops:
        g4ops.enable()
        g4ops.enable(model, attention=True)
        assert model.config._attn_implementation == attention_interface.ATTENTION
    trainer = make_trainer(model)
    if with_g4ops:  # after the trainer wrapped the model (TRL applies peft_config): what a LoRA user calls
        g4ops.enable(trainer.model)
        _assert_attention_lora_routed(trainer.model)
    trainer.train()
    return trainer, _curve(trainer)


def _assert_attention_lora_routed(model) -> None:
    """Every peft LoRA layer on an attention projection is routed to g4ops.lora_linear (g4ops/ops/lora.py: a compiled
    model runs it; eager calls, as here, run peft's forward)."""
    layers = [getattr(m, name) for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
              for name in patches._ATTENTION_PROJECTIONS
              if peft_lora.is_peft_lora_layer(getattr(m, name, None))]  # fmt: skip
    routed = [p for p in layers if peft_lora.runs_lora_linear(p)]
    if any(peft_lora.is_peft_lora_layer(m) for m in model.modules()):  # a LoRA run: its attention has adapters
        assert layers, "no peft LoRA layer found on the attention projections"
    assert len(routed) == len(layers), f"{len(layers) - len(routed)} of {len(layers)} attention LoRA layers on peft"


def _assert_same_curve(stock: list[float], ours: list[float]) -> None:
    assert len(stock) == len(ours) == STEPS, (len(stock), len(ours))
    assert all(torch.isfinite(torch.tensor(stock + ours))), (stock, ours)
    assert stock[-1] < stock[0], f"stock did not learn: {stock}"  # so the comparison is of a curve that moves
    for step, (a, b) in enumerate(zip(stock, ours)):
        assert abs(a - b) <= CURVE_RTOL * abs(a), f"step {step}: stock {a:.7f} vs g4ops {b:.7f}\n{stock}\n{ours}"


def _probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 21), generator=torch.Generator().manual_seed(7))  # crosses the window of 8


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train_like_stock_and_save(make_trainer, saved) -> tuple[torch.Tensor, torch.Tensor]:
    """Train stock, then with g4ops; the loss curves agree. The g4ops run is saved to `saved`, then g4ops is
    disabled: (probe ids, the trained model's logits on them, computed with g4ops still on)."""
    _, stock_curve = _run(make_trainer, with_g4ops=False)
    trainer, curve = _run(make_trainer, with_g4ops=True)
    _assert_same_curve(stock_curve, curve)
    trainer.save_model(str(saved))
    ids = _probe_ids(trainer.model.config.vocab_size)
    trained = _logits(trainer.model, ids)
    g4ops.disable()
    return ids, trained


def test_hf_trainer_full_finetune_packed(tmp_path):
    """HF Trainer, full finetune, DataCollatorWithFlattening (packed rows, position_ids restart), gradient
    accumulation and checkpointing; the saved checkpoint reloads into a fresh stock Gemma4ForCausalLM."""
    from transformers import DataCollatorWithFlattening, Gemma4ForCausalLM, Trainer, TrainingArguments

    tok = tiny_tokenizer()
    data = datasets.Dataset.from_dict({"input_ids": [tok(t)["input_ids"] for t in _texts()]})

    def make(model):
        return Trainer(model=model, args=_args(TrainingArguments, tmp_path / "run"), train_dataset=data,
                       data_collator=DataCollatorWithFlattening())  # fmt: skip

    ids, trained = _train_like_stock_and_save(make, tmp_path / "saved")
    fresh = Gemma4ForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert not g4ops.is_enabled() and not g4ops.is_enabled(fresh)
    assert O.rel_err(_logits(fresh, ids), trained) <= LOGITS_RTOL
    # and training moved the weights: the reloaded model is not the untrained one
    assert O.rel_err(_logits(copy.deepcopy(_built()), ids), trained) > 100 * LOGITS_RTOL


def _sft(tmp_path, packing: bool, peft_config=None, **extra):
    from trl import SFTConfig, SFTTrainer

    data = datasets.Dataset.from_dict({"text": _texts()})
    args = _args(SFTConfig, tmp_path / "run", packing=packing, max_length=64, dataset_num_proc=None, **extra)

    def make(model):
        return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer(),
                          peft_config=peft_config)  # fmt: skip

    return make


def test_trl_sft_lora_packed(tmp_path):
    """TRL SFTTrainer with a peft LoRA adapter on attention and MLP projections, packing=True (bfd into padding-free
    rows: position_ids restart, no attention_mask), gradient accumulation and checkpointing; the attention projections'
    adapters are routed to g4ops.lora_linear (`_run` enables the wrapped model; eager, they run peft's forward); the
    saved adapter loads onto a fresh stock base model."""
    pytest.importorskip("trl")
    from peft import LoraConfig, PeftModel

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    ids, trained = _train_like_stock_and_save(_sft(tmp_path, packing=True, peft_config=config), tmp_path / "adapter")
    base = copy.deepcopy(_built())  # the same base weights, never patched
    fresh = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert not g4ops.is_enabled() and not g4ops.is_enabled(fresh)
    assert O.rel_err(_logits(fresh, ids), trained) <= LOGITS_RTOL
    assert O.rel_err(_logits(copy.deepcopy(_built()), ids), trained) > 100 * LOGITS_RTOL  # the adapter trained


def test_trl_sft_full_finetune_padded(tmp_path):
    """TRL SFTTrainer, full finetune, no packing: right-padded batches with an attention_mask, gradient
    accumulation; the saved checkpoint reloads into a fresh stock Gemma4ForCausalLM."""
    pytest.importorskip("trl")
    from transformers import Gemma4ForCausalLM

    make = _sft(tmp_path, packing=False, gradient_checkpointing=False)  # the other two cases checkpoint
    ids, trained = _train_like_stock_and_save(make, tmp_path / "saved")
    fresh = Gemma4ForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert O.rel_err(_logits(fresh, ids), trained) <= LOGITS_RTOL


def test_trl_sft_with_its_default_bf16_autocast(tmp_path):
    """TRL's default precision, bf16 autocast over fp32 weights (Trainer's bf16=True): g4ops trains like stock, to
    bf16 rounding (8 units of it on the loss). Until e8b8226 g4ops' decoder-layer patch raised here: sandwich_norm
    refused the bf16 attention output beside the fp32 residual."""
    pytest.importorskip("trl")
    make = _sft(tmp_path, packing=True, bf16=True, max_steps=2)
    _, stock_curve = _run(make, with_g4ops=False)
    _, curve = _run(make, with_g4ops=True)
    assert len(curve) == len(stock_curve) == 2 and all(torch.isfinite(torch.tensor(curve)))
    bf16 = O.TOLERANCE[torch.bfloat16].u
    assert all(abs(a - b) <= 8 * bf16 * abs(a) for a, b in zip(stock_curve, curve)), (stock_curve, curve)


def test_trl_sft_lora_under_its_default_bf16_autocast(tmp_path):
    """TRL's default bf16=True with a LoRA adapter on every projection, padded batches: accelerate runs the forward
    under autocast, where the MLP's adapters run g4ops' LoRA op (they kept peft's forward there before: no LoRA op
    ran) and the attention projections', routed, run peft's forward, as eager calls do
    (`peft_lora.EAGER_LINEAR_VIA_OP`); the curve is stock's to bf16 rounding (8 units of it on the loss)."""
    pytest.importorskip("trl")
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    make = _sft(tmp_path, packing=False, peft_config=config, bf16=True, max_steps=2, gradient_checkpointing=False)
    _, stock_curve = _run(make, with_g4ops=False)
    with G4opsCalls() as counter:
        _, curve = _run(make, with_g4ops=True)
    for op in ("lora_geglu_mlp_forward", "lora_geglu_mlp_backward"):
        assert counter.calls.get(f"g4ops.{op}.default", 0) > 0, (op, sorted(counter.calls.items()))
    assert not [op for op in counter.calls if "lora_linear" in op], sorted(counter.calls.items())
    assert len(curve) == len(stock_curve) == 2 and all(torch.isfinite(torch.tensor(curve)))
    bf16 = O.TOLERANCE[torch.bfloat16].u
    assert all(abs(a - b) <= 8 * bf16 * abs(a) for a, b in zip(stock_curve, curve)), (stock_curve, curve)
