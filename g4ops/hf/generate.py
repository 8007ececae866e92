"""Routing `model.generate(...)` to g4ops.engine's CUDA-graphed Decoder (installed by g4ops.enable()).

A call goes to the decoder when the decoder reproduces its result: greedy search or sampling (temperature, top-k,
top-p, min-p: transformers' warpers, bit for bit), with transformers' default (dynamic) or a static cache, over
left-padded or unpadded prompts, with EOS ids, `min_new_tokens`, `suppress_tokens`, `repetition_penalty` (unpadded
prompts only), `stop_strings` (with the tokenizer), `max_time`, a streamer, and `return_dict_in_generate` without
scores. Sampled calls draw from torch's
generator, so `torch.manual_seed` before the call reproduces the tokens (not stock's tokens for that seed: the
same distribution). Everything else runs transformers' own generate untouched, and says so once at INFO on the
"g4ops" logger; `generation_route(model, **kwargs)` answers for a call without running it.

What routing does not keep from stock: a returned `GenerateDecoderOnlyOutput` has no cache (stock returns its
DynamicCache/StaticCache; the decoder's cache stays with the decoder). On CUDA the step's model call is compiled
(torch.compile; the step is then captured) for every cache, not only where stock compiles (a static cache): the
first call for a batch size and length bucket pays the compile time (logged once at INFO); `disable_compile=True`
keeps it to the captured graph.
`G4OPS_COMPILE_PREFILL=1` compiles the prefill too (engine.decoder's `compile_prefill`, opt-in until its first-call
time on a GPU is measured).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref

import torch

from ..engine.decoder import PENALTY_WITH_PADDING, Decoder, as_id_list, prefill_width

logger = logging.getLogger("g4ops")

COMPILE_PREFILL = os.environ.get("G4OPS_COMPILE_PREFILL") == "1"  # with a compiled step only (module docstring)
ROUTED_DEVICES = ("cuda",)  # where the graph pays off; the tests add "cpu" to exercise the routing itself
_STOCK_GENERATE = "_g4ops_stock_generate"  # attribute of the wrapper: the generate it wraps
_MAX_EOS_IDS = 8  # the Decoder's limit (its EOS buffer has a fixed size)
_CACHES = (None, "dynamic", "static", "hybrid", "sliding_window")  # all hold the same K/V: the same tokens
# How each GenerationConfig field of the merged config decides a call's routing (any field not named here must be
# unset: None or the fresh default). Handled: the decoder reproduces it. Ignored: no effect on this search.
_HANDLED_FIELDS = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id", "bos_token_id",
    "cache_implementation", "compile_config", "disable_compile", "suppress_tokens", "do_sample", "temperature",
    "top_k", "top_p", "min_p", "stop_strings", "max_time", "return_dict_in_generate", "max_cache_len",
    "cache_config", "repetition_penalty",
}  # fmt: skip
_IGNORED_FIELDS = {
    "early_stopping", "length_penalty", "diversity_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "transformers_version",
    "_from_model_config", "decoder_start_token_id",
}  # fmt: skip
_NEUTRAL_VALUES = {  # fields that must hold a value that changes nothing
    "num_beams": (1,), "num_beam_groups": (1,), "num_return_sequences": (1,), "use_cache": (True,),
    "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,), "remove_invalid_values": (False,), "renormalize_logits": (False,),
    "output_scores": (False,), "output_logits": (False,), "output_attentions": (False,),
    "output_hidden_states": (False,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
    "guidance_scale": (1.0,), "token_healing": (False,), "low_memory": (False,), "is_assistant": (False,),
    "use_mtp": (False,),
}  # fmt: skip
_SAMPLING_ONLY = {"typical_p", "epsilon_cutoff", "eta_cutoff"}  # warpers generate applies only when sampling
_GENERATE_ARGS = {  # generate's own arguments besides the config fields, and when each is one the decoder takes
    "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
    "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "tokenizer",
    "assistant_tokenizer",
}  # fmt: skip
_TEXT_TYPE_IDS = ("token_type_ids", "mm_token_type_ids")  # a processor's text-only outputs: all zeros
_BUCKET = 256  # decoders are sized in multiples of this, so nearby lengths reuse one captured graph
_models_with_decoder: weakref.WeakSet = weakref.WeakSet()
_logged_reasons: set = set()


@dataclasses.dataclass(frozen=True)
class Route:
    """Whether a generate call goes to g4ops' decoder, and if not, which argument kept it on stock's path."""

    routed: bool
    reason: str


@dataclasses.dataclass
class _Plan:
    ids: torch.Tensor
    mask: torch.Tensor | None
    new_tokens: int
    min_new: int
    suppress: list
    eos: list
    pad: int
    compile_step: bool
    sampling: dict  # Decoder.generate's do_sample, temperature, top_k, top_p, min_p, repetition_penalty
    streamer: object
    stop: tuple | None  # (stop_strings, tokenizer)
    max_time: float | None
    return_dict: bool


def release_decoders() -> None:
    """Drop the decoders (KV cache, captured graphs) that routed generate calls left on models."""
    for model in list(_models_with_decoder):
        vars(model).pop("_g4ops_decoder", None)
    _models_with_decoder.clear()


def generation_route(model, inputs=None, generation_config=None, **kwargs) -> Route:
    """Would `model.generate(inputs, generation_config, **kwargs)` run on g4ops' decoder? Route(routed, reason);
    nothing is run. `model` may be a torch.compile'd module (its generate is the original module's)."""
    model = getattr(model, "_orig_mod", model)
    if getattr(getattr(model, "generate", None), _STOCK_GENERATE, None) is None:
        return Route(False, f"g4ops.enable() has not patched {type(model).__name__}.generate (enable() patches "
                            "Gemma-4's causal LM classes; enable(model, decode=False) leaves it alone)")  # fmt: skip
    plan = _plan(model, inputs, generation_config, kwargs)
    return Route(True, "routed to g4ops.engine.decoder.Decoder") if isinstance(plan, _Plan) else Route(False, plan)


def make_generate(stock_generate):
    """A `generate` that sends the calls the decoder reproduces to a Decoder kept on the model."""

    def generate(self, inputs=None, generation_config=None, **kwargs):
        start = time.time()  # stock's max_time counts from here (its criteria are built before prefill)
        plan = _plan(self, inputs, generation_config, kwargs)
        if not isinstance(plan, _Plan):
            if plan not in _logged_reasons:
                _logged_reasons.add(plan)
                logger.info("g4ops: generate() runs transformers' own loop: %s", plan)
            return stock_generate(self, inputs, generation_config, **kwargs)
        ids = plan.ids
        # room for the prompt as the decoder pads it for its captured prefill (engine.decoder.prefill_width)
        max_length = -(-(prefill_width(ids.shape[1], ids.shape[0]) + plan.new_tokens) // _BUCKET) * _BUCKET
        key = (ids.shape[0], max_length, plan.compile_step, tuple(plan.suppress))
        decoder = vars(self).get("_g4ops_decoder")
        if decoder is None or decoder[0] != key:  # one decoder per model, like stock's one static cache
            vars(self).pop("_g4ops_decoder", None)  # let the old one's memory go before the new one takes its own
            if plan.compile_step:
                logger.info("g4ops: compiling the decode step for batch %d, length %d (once per shape; "
                            "disable_compile=True skips it)", ids.shape[0], max_length)  # fmt: skip
            decoder = (key, Decoder(self, batch_size=ids.shape[0], max_length=max_length, compile=plan.compile_step,
                                    suppress_tokens=plan.suppress,
                                    compile_prefill=plan.compile_step and COMPILE_PREFILL))  # fmt: skip
            vars(self)["_g4ops_decoder"] = decoder
            _models_with_decoder.add(self)
        stop = _stop_function(*plan.stop) if plan.stop else None
        out = decoder[1].generate(ids, plan.new_tokens, eos_token_id=plan.eos, pad_token_id=plan.pad,
                                  attention_mask=plan.mask, min_new_tokens=plan.min_new, streamer=plan.streamer,
                                  stop=stop, max_time=plan.max_time, start_time=start, **plan.sampling)  # fmt: skip
        if plan.return_dict:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=out)
        return out

    setattr(generate, _STOCK_GENERATE, stock_generate)
    generate.__doc__ = stock_generate.__doc__
    return generate


def _stop_function(stop_strings, tokenizer):
    """transformers' StopStringCriteria as a host function of the ids so far (the decoder calls it as it reads the
    tokens back); built per call, as stock builds it."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    criteria = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    return lambda seq: criteria(seq, None)


def _is_absent(name: str, value, config_fields) -> bool:
    """An argument that is not a generation setting, given its "nothing" value (`streamer=None`, an empty
    `logits_processor`, `synced_gpus=False`): stock generate treats it as not given, and so do we."""
    if hasattr(config_fields, name):
        return False  # a GenerationConfig field: even None overrides the model's default
    return value is None or value is False or (isinstance(value, (list, tuple)) and not value)


def _left_padding_reason(mask, ids) -> str | None:
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return f"attention_mask must be a tensor of input_ids' shape {list(ids.shape)}"
    pad = ids.shape[1] - mask.bool().sum(dim=1)
    left = torch.arange(ids.shape[1], device=mask.device)[None, :] >= pad[:, None]
    if not torch.equal(mask.bool(), left):
        return "attention_mask has right or inner padding (the decoder takes left padding only)"
    if bool((pad >= ids.shape[1]).any()):
        return "attention_mask: a row is all padding"
    return None


def _plan(model, inputs, generation_config, kwargs):
    """A _Plan when the decoder reproduces the call, else the reason (a string naming the argument)."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return "input_ids: no token-id tensor given (inputs_embeds or other inputs)"
    if not (ids.dim() == 2 and ids.dtype == torch.long and ids.numel()):
        return f"input_ids must be a non-empty [batch, length] int64 tensor, got {ids.dtype} {list(ids.shape)}"
    if ids.device.type not in ROUTED_DEVICES:
        return f"input_ids on {ids.device.type}: the decoder runs on {', '.join(ROUTED_DEVICES)}"
    config_fields = generation_config or model.generation_config
    given = {k: v for k, v in kwargs.items() if k != "input_ids" and not _is_absent(k, v, config_fields)}
    config_kwargs, streamer, tokenizer = {}, None, None
    for name, value in given.items():
        if name == "attention_mask":
            reason = _left_padding_reason(value, ids)
            if reason:
                return reason
        elif name in _TEXT_TYPE_IDS:
            if not (isinstance(value, torch.Tensor) and value.shape == ids.shape and not bool(value.any())):
                return f"{name}: not all zeros (image or audio tokens) or not input_ids' shape"
            try:
                model._validate_model_kwargs({name: value})
            except Exception:  # noqa: BLE001 - stock refuses it for this model: let stock say so
                return f"{name}: not an input of {type(model).__name__} (stock generate refuses it)"
        elif name == "streamer":
            from transformers.generation.streamers import BaseStreamer

            if not isinstance(value, BaseStreamer):
                return f"streamer of type {type(value).__name__} is not a transformers BaseStreamer"
            streamer = value
        elif name == "tokenizer":
            tokenizer = value
        elif name in _GENERATE_ARGS:
            return f"{name} given (the decoder runs no custom processors, criteria, assistants or GPU sync)"
        elif hasattr(config_fields, name):
            config_kwargs[name] = value
        else:
            return f"{name}: a model input the decoder does not take (text-only input_ids and attention_mask)"
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **config_kwargs)
    except Exception as e:  # noqa: BLE001 - whatever stock would say about the call, let stock say it
        return f"the generation config does not validate ({type(e).__name__}: {e}); stock reports it"
    if model_kwargs:
        return f"{', '.join(model_kwargs)}: not generation settings the decoder knows"
    if config.cache_implementation not in _CACHES:
        return f"cache_implementation={config.cache_implementation!r} (the decoder's cache stands for dynamic/static)"
    default = type(config)()
    do_sample = bool(config.do_sample)
    for name, value in config.to_dict().items():
        if name in _HANDLED_FIELDS or name in _IGNORED_FIELDS or value is None:
            continue
        if name in _SAMPLING_ONLY and not do_sample:
            continue
        if name in _NEUTRAL_VALUES:
            if value not in _NEUTRAL_VALUES[name]:
                return f"{name}={value!r}"
        elif value != getattr(default, name, None):
            return f"{name}={value!r}"  # a logits processor, criterion or output option the decoder does not have
    sampling = _sampling(config) if do_sample else dict(do_sample=False)
    if isinstance(sampling, str):
        return sampling
    penalty = config.repetition_penalty
    if penalty is not None and penalty != 1.0:
        if not (isinstance(penalty, float) and penalty > 0):
            return f"repetition_penalty={penalty!r} (RepetitionPenaltyLogitsProcessor takes a float > 0; stock raises)"
        mask = given.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            return PENALTY_WITH_PADDING
        sampling = dict(sampling, repetition_penalty=penalty)
    prompt = ids.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 0) - prompt
    if new < 1:
        return f"max_length={config.max_length} leaves no new token after a prompt of {prompt}"
    min_new = max(config.min_new_tokens or 0, (config.min_length or 0) - prompt)
    eos = as_id_list(config.eos_token_id)
    if len(set(eos)) > _MAX_EOS_IDS:
        return f"eos_token_id: {len(set(eos))} ids, the decoder holds at most {_MAX_EOS_IDS}"
    if config.stop_strings is not None and tokenizer is None:
        return "stop_strings without tokenizer= (stock raises)"
    stop = (config.stop_strings, tokenizer) if config.stop_strings is not None else None
    suppress = sorted(set(as_id_list(config.suppress_tokens)))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    compile_step = ids.device.type == "cuda" and not config.disable_compile
    return _Plan(ids=ids, mask=given.get("attention_mask"), new_tokens=new, min_new=min_new, suppress=suppress,
                 eos=eos, pad=int(pad), compile_step=compile_step, sampling=sampling, streamer=streamer, stop=stop,
                 max_time=config.max_time, return_dict=bool(config.return_dict_in_generate))  # fmt: skip


def _sampling(config):
    """Decoder.generate's sampling arguments for a do_sample config, or the reason stock must run it. Values stock's
    warpers would refuse go to stock (which raises); the warpers generate leaves out map to "off"."""
    t, k, p, m = config.temperature, config.top_k, config.top_p, config.min_p
    if getattr(config, "top_h", None) is not None:
        return f"top_h={config.top_h!r}"
    if t is not None and t != 1.0 and not (isinstance(t, float) and t > 0):
        return f"temperature={t!r} (TemperatureLogitsWarper takes a float > 0; stock raises)"
    if k is not None and k != 0 and not (isinstance(k, int) and k > 0):
        return f"top_k={k!r} (TopKLogitsWarper takes an int > 0; stock raises)"
    if p is not None and p < 1.0 and not (0 <= float(p)):
        return f"top_p={p!r}"
    if m is not None and not (0 <= m <= 1.0):
        return f"min_p={m!r}"
    return dict(do_sample=True, temperature=1.0 if t is None else float(t), top_k=int(k or 0),
                top_p=1.0 if p is None or p >= 1.0 else float(p), min_p=0.0 if m is None else float(m))  # fmt: skip
