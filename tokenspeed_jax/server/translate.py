"""Pure conversions between wire objects and the engine: prompts, sampling params, responses.

Nothing here touches the engine or the network, so each conversion is testable alone. Bad values
raise ``APIError`` (400) naming the field.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Protocol

from tokenspeed_jax.engine.request import RequestOutput, TokenLogprob
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server.errors import APIError
from tokenspeed_jax.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
    Usage,
)
from tokenspeed_jax.tokenizer import Tokenizer


def _params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
            logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 1 << 30,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            n=body.n,
            logprobs=logprobs,
        )
    except ValueError as error:
        param = str(error).split(" ", 1)[0]
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=param) from error


def chat_params(body: ChatCompletionRequest) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs=true",
                       param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _params(body, max_tokens, logprobs)


def completion_params(body: CompletionRequest) -> SamplingParams:
    return _params(body, body.max_tokens, body.logprobs)


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt
        )
    except ValueError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param="messages") from error
    return tokenizer.encode(text, add_special_tokens=False)


def completion_prompt_ids(tokenizer: Tokenizer, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", param="prompt")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p)
           for p in prompts]
    if any(not p for p in ids):
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", param="prompt")
    return ids


class Formatter(Protocol):
    include_usage: bool

    def opening(self, indices: list[int]) -> list[dict]: ...

    def chunk(self, index: int, output: RequestOutput) -> dict | None: ...

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict: ...

    def full(self, outputs: dict[int, list[RequestOutput]], prompt_tokens: int) -> dict: ...


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _completion_tokens(outputs: dict[int, list[RequestOutput]]) -> int:
    return sum(outs[-1].num_output_tokens for outs in outputs.values() if outs)


class _Base:
    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer,
                 body: ChatCompletionRequest | CompletionRequest):
        self.id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChatFormatter(_Base):
    def opening(self, indices: list[int]) -> list[dict]:
        choices = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                   for i in indices]
        return [ChatCompletionChunk(id=self.id, model=self.model, choices=choices).model_dump()]

    def logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            text = self.token_text(entry.token_id)
            top = [TopLogprob(token=(t := self.token_text(tid)), logprob=lp,
                              bytes=list(t.encode()))
                   for tid, lp in entry.top]
            content.append(ChatTokenLogprob(token=text, logprob=entry.logprob,
                                            bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    def chunk(self, index: int, output: RequestOutput) -> dict | None:
        if not (output.new_text or output.finished or output.logprobs):
            return None
        choice = ChatChunkChoice(
            index=index,
            delta=ChatDelta(content=output.new_text or None),
            logprobs=self.logprobs(output.logprobs),
            finish_reason=output.finish_reason,
        )
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice]).model_dump()

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[],
                                   usage=_usage(prompt_tokens, completion_tokens)).model_dump()

    def full(self, outputs: dict[int, list[RequestOutput]], prompt_tokens: int) -> dict:
        choices = []
        for index, outs in sorted(outputs.items()):
            entries = [e for o in outs for e in (o.logprobs or [])]
            choices.append(ChatChoice(
                index=index,
                message=AssistantMessage(content="".join(o.new_text for o in outs)),
                logprobs=self.logprobs(entries) if any(o.logprobs for o in outs) else None,
                finish_reason=outs[-1].finish_reason if outs else "abort",
            ))
        return ChatCompletion(id=self.id, model=self.model, choices=choices,
                              usage=_usage(prompt_tokens, _completion_tokens(outputs))
                              ).model_dump()


class CompletionFormatter(_Base):
    def opening(self, indices: list[int]) -> list[dict]:
        return []

    def logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self.token_text(t): lp for t, lp in e.top} for e in entries],
            text_offset=offsets,
        )

    def chunk(self, index: int, output: RequestOutput) -> dict | None:
        if not (output.new_text or output.finished or output.logprobs):
            return None
        choice = CompletionChoice(
            index=index,
            text=output.new_text,
            logprobs=self.logprobs(output.logprobs, 0) if output.logprobs else None,
            finish_reason=output.finish_reason,
        )
        return Completion(id=self.id, model=self.model, choices=[choice]).model_dump()

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return Completion(id=self.id, model=self.model, choices=[],
                          usage=_usage(prompt_tokens, completion_tokens)).model_dump()

    def full(self, outputs: dict[int, list[RequestOutput]], prompt_tokens: int) -> dict:
        choices = []
        for index, outs in sorted(outputs.items()):
            entries = [e for o in outs for e in (o.logprobs or [])]
            choices.append(CompletionChoice(
                index=index,
                text="".join(o.new_text for o in outs),
                logprobs=self.logprobs(entries, 0) if any(o.logprobs for o in outs) else None,
                finish_reason=outs[-1].finish_reason if outs else "abort",
            ))
        return Completion(id=self.id, model=self.model, choices=choices,
                          usage=_usage(prompt_tokens, _completion_tokens(outputs))).model_dump()
