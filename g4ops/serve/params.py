"""What a request asks the engine for: the checkpoint's generation defaults, overridden by the fields it sets.

Defaults follow transformers' `generate()` on the checkpoint's generation_config: `do_sample` false (or unset) is
greedy; sampling settings the config leaves unset take transformers' global defaults (temperature 1, top_k 50,
top_p 1; read from transformers, not copied). So a request that sets only `temperature` on a greedy checkpoint
samples with transformers' top_k, as `generate(do_sample=True, temperature=...)` would. The config's eos ids are the
stop tokens (`ignore_eos` drops them)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.batch import SamplingParams
from .protocol import ChatCompletionRequest, CompletionRequest

_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def _transformers_defaults() -> dict:
    """transformers' values for unset generation fields (5.24 keeps them apart; older releases set them in init)."""
    from transformers import GenerationConfig

    table = getattr(GenerationConfig, "_get_default_generation_params", None)
    if table is not None:
        return table()
    plain = GenerationConfig()
    return {name: getattr(plain, name, None) for name in ("do_sample", *_SAMPLING_FIELDS)}


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling for fields a request leaves unset. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 are off."""

    greedy: bool = True  # the checkpoint's do_sample is false: an unset temperature means greedy
    temperature: float = 1.0  # used when the request samples without setting it
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_generation_config(cls, generation_config, stop_token_ids: tuple[int, ...] = ()) -> GenerationDefaults:
        """From a transformers GenerationConfig (None: transformers' defaults); `stop_token_ids` are added to its
        eos ids."""
        fallback = _transformers_defaults()

        def read(name):
            value = getattr(generation_config, name, None) if generation_config is not None else None
            return fallback.get(name) if value is None else value

        eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        stops = tuple(dict.fromkeys(int(i) for i in [*eos, *stop_token_ids]))
        return cls(greedy=not read("do_sample"), temperature=float(read("temperature") or 1.0),
                   top_k=int(read("top_k") or 0), top_p=float(1.0 if read("top_p") is None else read("top_p")),
                   min_p=float(read("min_p") or 0.0), stop_token_ids=stops)


class PromptTooLong(ValueError):
    """The prompt, or the prompt plus the requested tokens, does not fit the context."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def sampling_params(request: ChatCompletionRequest | CompletionRequest, defaults: GenerationDefaults,
                    prompt_len: int, max_context: int) -> SamplingParams:  # fmt: skip
    """The request's SamplingParams; unset max tokens (chat) means up to the end of the context, as vLLM does."""
    prompt_field = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    tokens_field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    if prompt_len >= max_context:
        raise PromptTooLong(f"the prompt is {prompt_len} tokens; this model's context is {max_context} tokens, "
                            f"which leaves no room for a completion", prompt_field)  # fmt: skip
    asked = request.requested_tokens()
    new_tokens = max_context - prompt_len if asked is None else asked
    if prompt_len + new_tokens > max_context:
        raise PromptTooLong(f"this model's context is {max_context} tokens; the request asks for "
                            f"{prompt_len + new_tokens} ({prompt_len} in the prompt, {new_tokens} to generate)",
                            tokens_field)  # fmt: skip
    if request.temperature is not None:
        temperature = request.temperature
    else:
        temperature = 0.0 if defaults.greedy else defaults.temperature
    top_k = defaults.top_k if request.top_k is None else max(request.top_k, 0)
    return SamplingParams(
        max_new_tokens=new_tokens, temperature=temperature, top_k=top_k,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        min_p=defaults.min_p if request.min_p is None else request.min_p,
        seed=request.seed, stop_token_ids=() if request.ignore_eos else defaults.stop_token_ids,
    )
