"""Wire schemas of the OpenAI-compatible API, one pydantic model per wire object.

Request fields follow the order of OpenAI's API reference; engine-only extras (vLLM-style) sit in
a labelled block after them. Requests forbid unknown fields, so a typo is a 400 rather than a
silently ignored knob, and a body whose text is not valid Unicode (a lone surrogate from a
``\\udXXX`` escape) is a 400 before any of it reaches a tokenizer. Responses are plain models
serialised as-is.
"""

from __future__ import annotations

import time
from typing import Any, Literal

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


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float = 0.0
    logprobs: bool = False
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_logprobs: int | None = None
    top_p: float = 1.0
    user: str | None = None
    # engine extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    add_generation_prompt: bool = True


class CompletionRequest(_Body):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    user: str | None = None
    # engine extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
