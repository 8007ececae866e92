"""The OpenAI wire format the server speaks, as pydantic v2 models: requests (validated strictly, so a field of the
wrong type is an error rather than a silent coercion), responses, streaming chunks and the error body.

Fields g4ops does not implement are declared so a request that sets them to anything but their neutral value gets a
400 naming the field instead of being answered as if they were honoured; other unknown fields are ignored, as
OpenAI's and vLLM's servers do. `top_k`, `min_p` and `ignore_eos` are vLLM's extra sampling fields."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(value: Any, neutral: tuple) -> Any:
    """A not-implemented field passes only when unset or at a value that changes nothing."""
    if value is not None and value not in neutral:
        raise ValueError(f"is not supported by this server (got {value!r})")
    return value


class _Sampling(_Strict):
    """Fields common to both generate endpoints. Unset sampling fields take the checkpoint's generation config."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM accepts both)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)  # an int64 that is not negative
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Declared only to refuse them (see the module docstring).
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if "" in ([stop] if isinstance(stop, str) else stop or []):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        return _neutral(value, (False, 0))

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value):
        return _neutral(value, (0, 0.0))

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        return _neutral(value, ({},))

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return options

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; Gemma's template knows system/user/assistant.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens; wins when both set
    top_logprobs: Any = None
    tools: Any = None
    response_format: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value):
        return _neutral(value, (0,))

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        return _neutral(value, ([],))

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        return _neutral(value, ({"type": "text"},))

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        """The messages as the chat template reads them."""
        return [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else [p.model_dump() for p in m.content]}
                for m in self.messages]


# OpenAI's legacy completions default: 16 new tokens when max_tokens is unset.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(union_mode="left_to_right")  # a text, or token ids
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _ids(cls, prompt):
        if isinstance(prompt, list) and (not prompt or min(prompt) < 0):
            raise ValueError("a token-id prompt must be a non-empty list of ids >= 0")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        return _neutral(value, (False,))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        return _neutral(value, ("",))

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value):
        return _neutral(value, (1,))

    def requested_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


# --- responses ----------------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(_Response):
    """Both the whole answer and, with `stream`, each chunk (OpenAI uses one object type for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "g4ops"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(kind: Literal["chat", "completion"]) -> str:
    return _id("chatcmpl" if kind == "chat" else "cmpl")


# pydantic's union members appear in an error's location as their type names ("str", "list[TextPart]"); they are not
# fields, so they are left out of the field path an error names.
def _is_field(part) -> bool:
    return isinstance(part, int) or (part.isidentifier() and part[:1].islower() and part not in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def field_path(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'; None for the body as a whole."""
    path = ""
    for part in loc:
        if not _is_field(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or None


def validation_error(exc: ValidationError) -> ErrorResponse:
    """The first problem pydantic found, as OpenAI's invalid_request_error with `param` the field's path."""
    first = exc.errors(include_url=False)[0]
    param = field_path(first["loc"])
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first['msg']}"
    else:
        message = f"{param or 'body'}: {first['msg']}"
    return ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", param=param))
