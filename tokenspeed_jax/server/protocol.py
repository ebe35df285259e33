"""Wire schemas of the OpenAI-compatible API, one pydantic model per wire object.

Request fields follow the order of OpenAI's API reference; engine-only extras (vLLM-style) sit in
a labelled block after them (``ENGINE_EXTRAS``). A request model accepts every field OpenAI's
request schema defines: ``translate`` serves it, refuses it by name where the value asks for what
this server cannot do (audio, images), or ignores it with a note in the log where it has
no meaning here (``IGNORED``). Requests forbid every other field, so a typo is a 400 rather than a
silently ignored knob, and a body whose text is not valid Unicode (a lone surrogate from a
``\\udXXX`` escape) is a 400 before any of it reaches a tokenizer. A known top-level field sent
as null takes its default. Responses are plain models
serialised as-is.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _unix_time() -> int:
    """Seconds since the epoch, the `created` stamp of every response object."""
    return int(time.time())


MAX_STOP_TOKEN_IDS = 256  # each generated token is checked against every one of them


def _first_lone_surrogate(value: Any) -> str | None:
    """The path of the first string (or key) in a JSON value holding a lone surrogate, which
    JSON's ``\\udXXX`` escapes can produce but no tokenizer or UTF-8 encoder accepts."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                where = f"{path}.{key}" if path else str(key)
                stack += [(where, key), (where, child)]
        elif isinstance(item, list):
            stack += [(f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item)]
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Body(_Request):
    """A whole request body: its text must be valid Unicode (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _first_lone_surrogate(data)
        if path is not None:
            raise ValueError(f"{path or 'the body'} holds a lone surrogate, which is not valid "
                             f"Unicode text")
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A known field sent as null takes its default, as OpenAI's API reads it."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; chunks carry no obfuscation padding


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are served (``translate`` refuses
    the others by name), so the other kinds' own fields are let through unparsed."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None


class MessageFunction(_Request):
    name: str
    arguments: str  # JSON text, as the API returned it


class MessageToolCall(_Request):
    """A tool call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # an assistant message as the API returned it (``message.model_dump()``); ``translate``
    # refuses non-null audio and the deprecated function_call
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[MessageToolCall] | None = None
    # a tool message
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


# Output constraints beside OpenAI's ``response_format`` (``structured.specs.GRAMMAR_FIELDS``).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Body):
    # Fields the API defines that have no meaning on this server: accepted, noted in the log.
    IGNORED: ClassVar[tuple[str, ...]] = (
        "moderation", "prediction", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "service_tier",
        "store", "verbosity")
    ENGINE_EXTRAS: ClassVar[frozenset[str]] = frozenset({
        "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
        "add_generation_prompt", *GUIDED_FIELDS})

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    audio: Any = None
    frequency_penalty: float = 0.0
    function_call: Any = None
    functions: list[Any] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    moderation: Any = None
    n: int = 1
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    presence_penalty: float = 0.0
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    seed: int | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    tool_choice: Any = None
    tools: list[Any] | None = None
    top_logprobs: int | None = None
    top_p: float = 1.0
    user: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    # engine extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    add_generation_prompt: bool = True
    # engine extras: output constraints as vLLM takes them (``structured.specs``)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Body):
    IGNORED: ClassVar[tuple[str, ...]] = ()
    ENGINE_EXTRAS: ClassVar[frozenset[str]] = frozenset({
        "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
        *GUIDED_FIELDS})

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: str | None = None
    # engine extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # engine extras: output constraints as vLLM takes them (``structured.specs``)
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_unix_time)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first of a call carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_unix_time)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class TextCompletion(BaseModel):
    """A ``text_completion`` object: both the full response and each streamed chunk (OpenAI uses
    one shape for both). Named apart from ``tokenspeed_jax.Completion``, what ``LLM`` returns."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_unix_time)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_unix_time)
    owned_by: str = "tokenspeed_jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
