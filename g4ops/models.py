"""Gemma-4 text configs and models built in code (no downloads): the tiny test/demo models and the real E4B/E2B
shapes for benchmarks. Configs are built from keyword arguments, because a config file saved by one transformers
version can load wrongly in another (design.md section 5). `load_checkpoint` loads a real one from a local path.
`tiny_tokenizer` is a byte-level tokenizer built in code whose vocabulary is the tiny models' (ids 0..vocab_size-1),
with Gemma-4's chat format, for the demo and the server when no checkpoint is given."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

SLIDING, FULL = "sliding_attention", "full_attention"

# The real text decoders (design.md section 5). E4B: 42 layers of (5 sliding + 1 full), last 18 reuse KV.
E4B = dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, global_head_dim=512, num_kv_shared_layers=18, hidden_size_per_layer_input=256,
    vocab_size=262144, vocab_size_per_layer_input=262144, sliding_window=512, use_double_wide_mlp=False,
)
E2B = dict(
    E4B, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=1, num_kv_shared_layers=20, use_double_wide_mlp=True,
)
# Tiny E4B-shaped model for tests and the demo; the E2B-shaped one has the double-wide MLP on KV-shared layers.
TINY_E4B = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
    vocab_size=512, vocab_size_per_layer_input=512, sliding_window=8, use_double_wide_mlp=False,
)
TINY_E2B = dict(TINY_E4B, num_key_value_heads=1, use_double_wide_mlp=True)
SHAPES = {"e4b": E4B, "e2b": E2B, "tiny-e4b": TINY_E4B, "tiny-e2b": TINY_E2B}


def layer_types(num_layers: int, period: int = 6) -> list[str]:
    """(period - 1) sliding layers then one full layer, repeated; the last layer is always full."""
    types = [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]
    types[-1] = FULL
    return types


def text_config(shape: str = "tiny-e4b", num_layers: int | None = None, **overrides):
    """A `Gemma4TextConfig` of one of SHAPES, optionally with fewer layers (KV sharing scaled to keep its ratio)."""
    from transformers import Gemma4TextConfig

    kwargs = dict(SHAPES[shape])
    period = 3 if shape.startswith("tiny") else 6  # tiny: [s, s, f, s, s, f]
    if num_layers is not None and num_layers != kwargs["num_hidden_layers"]:
        shared = round(kwargs["num_kv_shared_layers"] * num_layers / kwargs["num_hidden_layers"])
        kwargs.update(num_hidden_layers=num_layers, num_kv_shared_layers=min(shared, max(num_layers - period, 0)))
    kwargs.update(
        layer_types=layer_types(kwargs["num_hidden_layers"], period),
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        tie_word_embeddings=True, attention_k_eq_v=False, enable_moe_block=False, pad_token_id=0,
        bos_token_id=2, eos_token_id=1,
    )
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


@torch.no_grad()
def randomize_norms_and_scalars(model: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """All-ones init hides weight bugs: give every norm weight and every `layer_scalar` a random value."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "_norm." in name or name.endswith("layernorm.weight"):
            param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator, dtype=torch.float32))
    for name, buf in model.named_buffers():
        if name.endswith("layer_scalar"):
            buf.copy_(0.5 + torch.rand(buf.shape, generator=generator, dtype=torch.float32))


def build_model(shape: str = "tiny-e4b", num_layers: int | None = None, dtype=torch.float32, device="cpu",
                seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A `Gemma4ForCausalLM` with random weights (norms and layer scalars randomised too), in eval mode."""
    from transformers import Gemma4ForCausalLM

    config = text_config(shape, num_layers, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma4ForCausalLM(config)
    randomize_norms_and_scalars(model, torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval()


def load_checkpoint(path: str, dtype=torch.bfloat16, device="cpu"):
    """A Gemma-4 model from a local checkpoint directory, in eval mode; never downloads. What
    `AutoModelForCausalLM` gives: a `Gemma4ForCausalLM` for a text-only checkpoint, a `Gemma4ForConditionalGeneration`
    (text decoder plus vision and audio towers) for google/gemma-4-E4B-it; read its ids with `special_tokens`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(path), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def checkpoint_dir(path) -> str:
    """`path` as a string after checking it is a checkpoint directory (one with a config.json)."""
    from pathlib import Path

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist (or is not a directory)")
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json: not a saved checkpoint")
    return str(path)


# A directory holds a tokenizer if it has tokenizer.json (fast), tokenizer.model (sentencepiece) or a config naming one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path):
    """The tokenizer saved in checkpoint directory `path`; an error naming the directory and the files looked for
    when it has none (transformers' own message for that case does not say a tokenizer is what is missing)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    checkpoint_dir(path)
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): save one "
            f"beside the weights with tokenizer.save_pretrained({str(path)!r})")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@dataclass(frozen=True)
class SpecialTokens:
    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]  # generation stops at any of them; may be empty


def special_tokens(model) -> SpecialTokens:
    """pad/bos/eos ids as `generate()` reads them: the model's generation_config first (a checkpoint's
    generation_config.json: E4B-it stops at several eos ids), then its text config (a `Gemma4Config` keeps them on
    `text_config`, not on itself), pad falling back to the first eos id. `model`: a model, or a checkpoint directory."""
    from transformers import AutoConfig, GenerationConfig, PretrainedConfig

    if isinstance(model, (str, os.PathLike)):
        path = checkpoint_dir(model)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        has_file = os.path.isfile(os.path.join(path, "generation_config.json"))
        generation = GenerationConfig.from_pretrained(path, local_files_only=True) if has_file else None
    elif isinstance(model, PretrainedConfig):
        config, generation = model, None
    else:
        config, generation = model.config, getattr(model, "generation_config", None)
    text = config.get_text_config(decoder=True)

    def read(name):
        value = getattr(generation, name, None) if generation is not None else None
        return getattr(text, name, None) if value is None else value

    eos = read("eos_token_id")
    eos = () if eos is None else tuple(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = read("pad_token_id")
    if pad is None and not eos:
        raise ValueError(f"{type(config).__name__}: neither pad_token_id nor eos_token_id is set (generation_config "
                         "or text config), so no id can pad finished rows")
    bos = read("bos_token_id")
    return SpecialTokens(pad_token_id=int(eos[0] if pad is None else pad),
                         bos_token_id=None if bos is None else int(bos), eos_token_id=eos)


# Tiny vision and audio towers (sizes near those of transformers' own Gemma-4 tests) for a multimodal checkpoint like
# E4B-it's; the real shapes use the tower configs' defaults. Clipped linears off: their +-inf bounds make
# saved-vs-loaded comparisons NaN (transformers' test says the same).
TINY_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[16, 8],
                  conv_kernel_size=3, attention_chunk_size=4, attention_context_left=5, attention_context_right=0,
                  output_proj_dims=32, use_clipped_linears=False)


def multimodal_config(shape: str = "tiny-e4b", num_layers: int | None = None, **overrides):
    """A `Gemma4Config` (the class of google/gemma-4-E4B-it): `text_config(shape, num_layers, **overrides)` plus vision
    and audio towers, tiny ones for the tiny shapes, with the multimodal token ids the tiny tokenizer has."""
    from transformers import Gemma4Config

    tiny = shape.startswith("tiny")
    ids = {name: token_id for name, (_, token_id) in TINY_MULTIMODAL_TOKENS.items()} if tiny else {}
    return Gemma4Config(text_config=text_config(shape, num_layers, **overrides),
                        vision_config=dict(TINY_VISION) if tiny else {}, audio_config=dict(TINY_AUDIO) if tiny else {},
                        **ids)


def build_multimodal_model(shape: str = "tiny-e4b", num_layers: int | None = None, dtype=torch.float32, device="cpu",
                           seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A `Gemma4ForConditionalGeneration` with towers and random weights (norms and layer scalars randomised), in eval
    mode: what `load_checkpoint` returns for a checkpoint like google/gemma-4-E4B-it."""
    from transformers import Gemma4ForConditionalGeneration

    config = multimodal_config(shape, num_layers, **overrides)
    config.text_config._attn_implementation = attn_implementation  # the towers keep their own (audio has no sdpa)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Gemma4ForConditionalGeneration(config)
    randomize_norms_and_scalars(model, torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval()


# Gemma-4's chat format (ai.google.dev "Gemma 4 prompt formatting"): a turn is `<|turn>{role}\n{text}<turn|>\n`,
# roles system/user/model (OpenAI's "assistant" is "model"), and the generation prompt opens a model turn.
TURN_START, TURN_END = "<|turn>", "<turn|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
# The tiny tokenizer's control tokens below its 256 byte tokens; pad/bos/eos ids come from the text config. The turn
# ids are E4B's (its generation config stops at [1, 106, 50]: <eos>, <turn|>, ...); the multimodal placeholders are
# named by the Gemma4Config arguments that carry their ids.
TINY_CONTROL_TOKENS = {"<unk>": 3, "<mask>": 4, TURN_START: 105, TURN_END: 106}
TINY_MULTIMODAL_TOKENS = {
    "image_token_id": ("<|image|>", 200), "boi_token_id": ("<|image>", 201), "eoi_token_id": ("<image|>", 202),
    "audio_token_id": ("<|audio|>", 203), "boa_token_id": ("<|audio>", 204), "eoa_token_index": ("<audio|>", 205),
    "video_token_id": ("<|video|>", 206),
}
_BYTES = 256


def _byte_chars() -> list[str]:
    """The printable character that GPT-2's byte-level scheme (`tokenizers`' ByteLevel) maps each byte to."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(_BYTES):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(_BYTES + extra)
            extra += 1
    return [chars[b] for b in range(_BYTES)]


def tiny_tokenizer(config=None):
    """A `PreTrainedTokenizerFast` whose vocabulary is exactly ids 0..vocab_size-1 of `config` (default: the tiny-e4b
    text config): bos/eos/pad at the config's ids, Gemma-4's turn tokens and multimodal placeholders, `<unusedN>`
    fillers, and the 256 bytes as the last ids (byte-level, no merges: any text encodes and decodes back exactly).
    It prepends bos as Gemma's tokenizer does and carries Gemma-4's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    config = text_config("tiny-e4b") if config is None else config.get_text_config(decoder=True)
    ids = special_tokens(config)
    if ids.bos_token_id is None or not ids.eos_token_id:
        raise ValueError(f"tiny_tokenizer: the config needs bos_token_id and eos_token_id, got {ids}")
    named = {"<pad>": ids.pad_token_id, "<bos>": ids.bos_token_id, "<eos>": ids.eos_token_id[0]}
    named.update(TINY_CONTROL_TOKENS)
    named.update(dict(TINY_MULTIMODAL_TOKENS.values()))
    first_byte = config.vocab_size - _BYTES
    if len(set(named.values())) != len(named) or max(named.values()) >= first_byte or min(named.values()) < 0:
        raise ValueError(f"tiny_tokenizer: config vocab_size={config.vocab_size} and special ids {named} leave no "
                         f"room for {len(named)} distinct control tokens below the {_BYTES} byte tokens")
    by_id = {i: token for token, i in named.items()}
    vocab = {by_id.get(i, f"<unused{i}>"): i for i in range(first_byte)}
    vocab.update({char: first_byte + b for b, char in enumerate(_byte_chars())})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    # use_regex=False: no word splitting, bytes are the tokens; no prefix space so decode(encode(s)) == s.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", ids.bos_token_id)])
    control = [TURN_START, TURN_END, "<mask>", *dict(TINY_MULTIMODAL_TOKENS.values())]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=control, chat_template=CHAT_TEMPLATE, padding_side="left",
    )

