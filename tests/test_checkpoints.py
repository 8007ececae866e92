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
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
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
