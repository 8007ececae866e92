"""Checkpoint directories as users have them: the tiny tokenizer built in code, and (below) the entry points that take
`--model` on both Gemma-4 checkpoint classes."""

from __future__ import annotations

import pytest

from g4ops import models


def test_tiny_tokenizer_covers_the_tiny_vocab_and_round_trips():
    config = models.text_config("tiny-e4b")
    tok = models.tiny_tokenizer()
    assert sorted(tok.get_vocab().values()) == list(range(config.vocab_size))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        config.pad_token_id, config.bos_token_id, config.eos_token_id)
    text = "Héllo, wörld 😀\n\ttabs  and  spaces "
    ids = tok(text).input_ids
    assert ids[0] == config.bos_token_id and all(0 <= i < config.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tiny_tokenizer_chat_template_is_gemma4s():
    tok = models.tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n"
                    "<|turn>user\nAgain<turn|>\n<|turn>model\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok(text, add_special_tokens=False).input_ids  # one bos, turn markers as single tokens
    assert ids.count(tok.convert_tokens_to_ids(models.TURN_END)) == len(messages)


def test_tiny_tokenizer_saves_and_loads(tmp_path):
    from transformers import AutoTokenizer

    tok = models.tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "<|turn>user\nsome text<turn|>"
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.chat_template == tok.chat_template and loaded.eos_token_id == tok.eos_token_id


def test_tiny_tokenizer_rejects_a_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size=300"):
        models.tiny_tokenizer(models.text_config("tiny-e4b", vocab_size=300, vocab_size_per_layer_input=300))


# ---------------------------------------------------------------------------------------------------------------------
# Both checkpoint classes through every entry point that takes --model. google/gemma-4-E4B-it is a
# Gemma4ForConditionalGeneration (towers included), whose Gemma4Config has no pad/eos ids of its own.

# E4B-it's generation config stops at several ids, unlike its text config: saved so the generation config must win.
_GENERATION_EOS = [1, 106]


def _save(path, model, tokenizer=True):
    model.generation_config.eos_token_id = list(_GENERATION_EOS)
    model.save_pretrained(path)
    if tokenizer:
        models.tiny_tokenizer(model.config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{class name: (directory, the model saved there)} for both classes, and a directory without a tokenizer."""
    root = tmp_path_factory.mktemp("checkpoints")
    multimodal, causal = models.build_multimodal_model(seed=3), models.build_model(seed=4)
    dirs = {"Gemma4ForConditionalGeneration": (_save(root / "multimodal", multimodal), multimodal),
            "Gemma4ForCausalLM": (_save(root / "causal", causal), causal)}
    return dirs, _save(root / "no_tokenizer", models.build_model(seed=5), tokenizer=False)


CLASSES = ["Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"]


def test_the_multimodal_checkpoint_is_e4b_its_layout(checkpoints):
    from transformers import AutoConfig

    path, model = checkpoints[0]["Gemma4ForConditionalGeneration"]
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.architectures == ["Gemma4ForConditionalGeneration"]
    assert config.vision_config is not None and config.audio_config is not None
    assert not hasattr(config, "pad_token_id")  # what made the demo crash
    parts = {k.split(".")[1] for k in model.state_dict() if k.startswith("model.")}
    assert {"language_model", "vision_tower", "audio_tower"} <= parts
    # the tiny tokenizer names the multimodal ids the config carries
    tok = models.tiny_tokenizer()
    for name, (token, _) in models.TINY_MULTIMODAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(token) == getattr(config, name), name


@pytest.mark.parametrize("cls", CLASSES)
def test_load_checkpoint_gives_the_saved_class_and_weights(checkpoints, cls):
    import torch

    path, saved = checkpoints[0][cls]
    loaded = models.load_checkpoint(path, dtype=torch.float32)
    assert type(loaded).__name__ == cls
    vocab = saved.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved(ids).logits)


@pytest.mark.parametrize("cls", CLASSES)
def test_special_tokens_read_the_generation_config_first(checkpoints, cls):
    path, saved = checkpoints[0][cls]
    text = saved.config.get_text_config()
    assert text.eos_token_id != _GENERATION_EOS  # else this test could not tell the two sources apart
    expect = models.SpecialTokens(pad_token_id=text.pad_token_id, bos_token_id=text.bos_token_id,
                                  eos_token_id=tuple(_GENERATION_EOS))
    assert models.special_tokens(path) == expect
    assert models.special_tokens(models.load_checkpoint(path)) == expect
    # what generate() itself stops at
    assert list(models.load_checkpoint(path).generation_config.eos_token_id) == _GENERATION_EOS


def test_special_tokens_fall_back_like_generate():
    from transformers import GenerationConfig

    config = models.multimodal_config()
    assert models.special_tokens(config) == models.SpecialTokens(0, 2, (1,))  # from text_config, not the outer one

    class Model:  # a generation config that sets nothing defers to the text config; pad falls back to eos[0]
        pass

    m = Model()
    m.config, m.generation_config = models.multimodal_config(pad_token_id=None), GenerationConfig()
    assert models.special_tokens(m) == models.SpecialTokens(1, 2, (1,))
    m.generation_config = GenerationConfig(pad_token_id=7, eos_token_id=[5, 6])
    assert models.special_tokens(m) == models.SpecialTokens(7, 2, (5, 6))
    with pytest.raises(ValueError, match="pad_token_id nor eos_token_id"):
        models.special_tokens(models.text_config(pad_token_id=None, eos_token_id=None))


@pytest.mark.parametrize("cls", CLASSES)
def test_demo_runs_on_the_checkpoint(checkpoints, cls, capsys):
    from g4ops.__main__ import main

    path, _ = checkpoints[0][cls]
    assert main(["demo", "--model", path, "--no-compile", "--tokens", "4", "--prompt", "Héllo"]) == 0
    out = capsys.readouterr().out
    assert "g4ops decoder" in out
    assert "PARITY: every variant produced the same greedy tokens as stock transformers" in out


def test_a_directory_without_a_tokenizer_is_named(checkpoints, tmp_path):
    from g4ops.__main__ import main

    path = checkpoints[1]
    with pytest.raises(FileNotFoundError, match="no tokenizer") as info:
        main(["demo", "--model", path, "--no-compile", "--tokens", "4"])
    assert path in str(info.value) and "tokenizer.json" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_checkpoint(path + "-missing")


@pytest.mark.parametrize("cls", CLASSES)
def test_neuron_loader_reads_the_checkpoint(checkpoints, cls):
    """The Neuron rank model built from the directory computes the saved model's logits: every text weight came
    through, the towers were dropped by name (a left-over key would be refused)."""
    import torch

    from neuron_backend.config import BuildSettings
    from neuron_backend.loader import build_rank_model, load_hf_checkpoint

    path, saved = checkpoints[0][cls]
    cfg, sd = load_hf_checkpoint(path, torch.float32)
    assert cfg.pad_token_id == models.special_tokens(path).pad_token_id
    settings = BuildSettings(tp=1, max_seq=32, prefill_buckets=(8,), return_logits=True)
    model, ple, report = build_rank_model(sd, cfg, settings)
    assert set(report.consumed) == set(sd)
    ids = torch.randint(3, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids, torch.zeros(1, dtype=torch.int64), torch.full((1,), 8), ple(ids))[1]
        ref = saved(ids).logits[:, -1].float()
    assert (logits - ref).abs().max() < 1e-4


def test_bench_e2e_parity_on_the_multimodal_checkpoint(checkpoints, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path, saved = checkpoints[0]["Gemma4ForConditionalGeneration"]
    out = tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "bench/e2e.py", "--device", "cpu", "--model", path, "--prompt", "the cat",
                           "--smoke", "--parts", "parity", "--json", str(out)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert "errors" not in res, res.get("errors")
    tokenizer = models.load_tokenizer(path)
    assert res["parity"]["prompt_tokens"] == len(tokenizer("the cat").input_ids)
    assert res["parity"]["teacher_forced"]["layers"] == saved.config.get_text_config().num_hidden_layers
    assert res["parity"]["fp32_greedy"]["identical"] is True
