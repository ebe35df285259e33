"""Pure conversions between wire objects and the engine: prompts, sampling params, responses.

Nothing here touches the engine or the network, so each conversion is testable alone. Bad values
raise ``APIError`` (400) naming the field, and so do values of OpenAI fields that ask for what
this server cannot do (``check_chat_supported``, ``check_completion_supported``: audio, images,
insertion, the deprecated ``functions``); the fields that have no meaning here are listed by
``ignored_fields`` for the log. Caps hold before any costly work: a request asks for at most ``MAX_CHOICES`` completions
(prompts x n), gives at most ``max_stop_strings`` stop strings of at most ``MAX_STOP_CHARS``
characters, and a text that cannot fit the context even at the tokenizer's most characters per
token is refused before it is tokenized. A chat request's tools go through ``tool_requests``
(prompt, grammar) and ``tool_parsers`` (the answer's ``tool_calls``, whole or streamed).
"""

from __future__ import annotations

import uuid
from http import HTTPStatus
from typing import Protocol

import jinja2

from tokenspeed_jax.engine.request import RequestOutput
from tokenspeed_jax.outputs import TokenLogprob
from tokenspeed_jax.sampling_params import SamplingParams, SamplingParamsError
from tokenspeed_jax.server.errors import APIError
from tokenspeed_jax.server.protocol import (
    GUIDED_FIELDS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCallOut,
    TextCompletion,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tokenspeed_jax.server.tool_parsers import CallStream
from tokenspeed_jax.server.tool_requests import FormatParser, template_messages, tool_plan
from tokenspeed_jax.structured.specs import GrammarSpec, GrammarSpecError, spec_from_request
from tokenspeed_jax.tokenizer import Tokenizer

MAX_CHOICES = 128  # completions one request may ask for: prompts x n (OpenAI's n <= 128)
MAX_STOP_CHARS = 1024  # characters of one stop string


def _bad(message: str, param: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def _logit_bias(body: ChatCompletionRequest | CompletionRequest) -> tuple[tuple[int, float], ...]:
    """The wire's {"token id": bias} as (id, bias) pairs; ``SamplingParams`` checks the rest."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise _bad(f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                       "logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)


def _params(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None,
            logprobs: int | None, max_stop_strings: int,
            tool_grammar: GrammarSpec | None = None) -> SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options is only allowed with stream=true", "stream_options")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > max_stop_strings:
        raise APIError(HTTPStatus.BAD_REQUEST, f"stop holds {len(stop)} strings; this server "
                       f"takes at most {max_stop_strings}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(HTTPStatus.BAD_REQUEST, f"a stop string is longer than {MAX_STOP_CHARS} "
                       "characters", param="stop")
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
            logit_bias=_logit_bias(body),
            grammar=_grammar(body, tool_grammar),
        )
    except SamplingParamsError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.param) from error


def _grammar(body: ChatCompletionRequest | CompletionRequest,
             tool_grammar: GrammarSpec | None) -> GrammarSpec | None:
    """The request's output constraint: ``response_format`` (chat), a vLLM-style field, or the
    one a ``required`` or named ``tool_choice`` sets."""
    fields = {name: getattr(body, name) for name in GUIDED_FIELDS}
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        fields["response_format"] = response_format.model_dump(exclude_none=True)
    try:
        spec = spec_from_request(fields)
    except GrammarSpecError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.field) from error
    if spec is not None and tool_grammar is not None:
        raise _bad(f"tool_choice {body.tool_choice!r} constrains the output, so it cannot be "
                   f"combined with {spec.field}", "tool_choice")
    return spec or tool_grammar


def chat_params(body: ChatCompletionRequest, max_stop_strings: int) -> SamplingParams:
    check_chat_supported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise _bad("top_logprobs needs logprobs=true", "top_logprobs")
    both = (body.max_tokens, body.max_completion_tokens)
    if None not in both and both[0] != both[1]:
        raise _bad(f"max_completion_tokens ({both[1]}) and its older name max_tokens "
                   f"({both[0]}) disagree; give one", "max_completion_tokens")
    max_tokens = body.max_tokens if body.max_completion_tokens is None \
        else body.max_completion_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    plan = tool_plan(body)
    try:
        tool_grammar = plan.grammar() if plan is not None else None
    except GrammarSpecError as error:
        raise _bad(str(error), error.field) from error
    return _params(body, max_tokens, logprobs, max_stop_strings, tool_grammar)


def completion_params(body: CompletionRequest, max_stop_strings: int) -> SamplingParams:
    check_completion_supported(body)
    return _params(body, body.max_tokens, body.logprobs, max_stop_strings)


def _unless_none(value: object) -> bool:
    return value is not None


def _unless_empty(value: object) -> bool:
    return bool(value)


def _unless_none_choice(value: object) -> bool:
    return value not in (None, "none")


DEPRECATED = "is OpenAI's deprecated form of tool calling; send tools and tool_choice instead"
# field -> (whether a value is refused, why), for each OpenAI field whose values this server
# serves only in part
CHAT_REFUSED = {
    "audio": (_unless_none, "audio output is not supported: this server generates text"),
    "functions": (_unless_empty, DEPRECATED),
    "function_call": (_unless_none_choice, DEPRECATED),
    "modalities": (lambda m: m is not None and m != ["text"],
                   'only the "text" output modality is supported'),
    "web_search_options": (_unless_none, "web search is not supported"),
}
MESSAGE_REFUSED = {
    "audio": (_unless_none, "audio in messages is not supported"),
    "function_call": (_unless_none, f"{DEPRECATED} (tool_calls)"),
}
COMPLETION_REFUSED = {
    "suffix": (_unless_empty, ("suffix (insertion between a prompt and a suffix) is not "
                              "supported")),
}


def _refuse(refused: dict, item: object, prefix: str = "") -> None:
    for field, (is_refused, why) in refused.items():
        if is_refused(getattr(item, field)):
            raise _bad(f"{prefix}{field}: {why}", f"{prefix}{field}")


def check_chat_supported(body: ChatCompletionRequest) -> None:
    """Refuse, naming the field, a chat request that asks for more than text in, text out."""
    _refuse(CHAT_REFUSED, body)
    for i, message in enumerate(body.messages):
        _refuse(MESSAGE_REFUSED, message, f"messages.{i}.")
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            where = f"messages.{i}.content.{j}"
            if part.type != "text":
                raise _bad(f"{where}: {part.type} content parts are not supported: this server "
                           f"serves a text-only model", where)
            if part.text is None:
                raise _bad(f"{where}: a text content part needs its text", where)


def check_completion_supported(body: CompletionRequest) -> None:
    """Refuse, naming the field, a completion request this server cannot serve as asked."""
    _refuse(COMPLETION_REFUSED, body)
    if body.best_of is not None and body.best_of != body.n:
        raise _bad(f"best_of={body.best_of} other than n={body.n} is not supported (each "
                   "sample is returned)", "best_of")
    if body.echo and body.logprobs is not None:
        raise _bad("echo with logprobs is not supported (prompt log-probabilities are not "
                   "computed)", "echo")


def ignored_fields(body: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The fields ``body`` sets that have no meaning on this server (accepted, then ignored)."""
    return [name for name in body.IGNORED if name in body.model_fields_set]


def check_fits(tokenizer: Tokenizer, chars: int, max_model_len: int, param: str) -> None:
    """Refuse text of ``chars`` characters that cannot fit ``max_model_len`` tokens, without
    tokenizing it (at least chars / ``max_token_chars`` tokens)."""
    if chars > max_model_len * tokenizer.max_token_chars:
        raise APIError(HTTPStatus.BAD_REQUEST,
                       f"the {param} text ({chars} characters) cannot fit this model's context "
                       f"length of {max_model_len} tokens", param=param,
                       code="context_length_exceeded")


def chat_prompt_ids(tokenizer: Tokenizer, body: ChatCompletionRequest, *, max_model_len: int,
                    special_tokens_in_content: bool, parser: FormatParser) -> list[list[int]]:
    """The one prompt of a chat request, its tools rendered for ``parser``'s format where the
    template does not render them; special-token text in message content stays text unless
    ``special_tokens_in_content``."""
    messages, context = template_messages(tokenizer, body, parser)
    # every chat template renders at least one token per message (its role marker)
    check_fits(tokenizer, sum(len(m["content"]) for m in messages), max_model_len, "messages")
    if len(messages) > max_model_len:
        raise APIError(HTTPStatus.BAD_REQUEST, f"{len(messages)} messages cannot fit this "
                       f"model's context length of {max_model_len} tokens", param="messages",
                       code="context_length_exceeded")
    try:
        return [tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt,
                                      special_tokens_in_content=special_tokens_in_content,
                                      **context)]
    except (ValueError, TypeError, jinja2.TemplateError) as error:
        raise APIError(HTTPStatus.BAD_REQUEST, f"the chat template cannot render these "
                       f"messages: {error}", param="messages") from error


def completion_prompt_ids(tokenizer: Tokenizer, body: CompletionRequest, *,
                          max_model_len: int) -> list[list[int]]:
    """The prompts of a completion request (a string, token ids, or a list of either)."""
    prompts = _prompt_list(body)
    if not prompts:
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", param="prompt")
    check_choices(len(prompts), body.n)
    for p in prompts:
        if isinstance(p, str):
            check_fits(tokenizer, len(p), max_model_len, "prompt")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p)
           for p in prompts]
    if any(not p for p in ids):
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", param="prompt")
    return ids


def _prompt_list(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each a string or a list of token ids."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]
    return list(prompt)


def check_choices(num_prompts: int, n: int) -> None:
    """Refuse a request for more than ``MAX_CHOICES`` completions."""
    if num_prompts * n > MAX_CHOICES:
        raise APIError(HTTPStatus.BAD_REQUEST,
                       f"{num_prompts} prompts x n={n} asks for more than {MAX_CHOICES} "
                       f"completions in one request", param="n" if num_prompts == 1 else "prompt")


class Formatter(Protocol):
    id: str
    include_usage: bool

    def opening(self, indices: list[int]) -> list[dict]: ...

    def chunks(self, index: int, output: RequestOutput) -> list[dict]: ...

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


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatFormatter(_Base):
    """With tools to call (``tool_choice`` other than ``none``), each choice's text is read for
    tool calls by the request's output parser: the answer's ``tool_calls``, or in a stream
    ``delta.tool_calls`` pieces; finish reason ``tool_calls`` when a call was made and the model
    stopped by itself."""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer,
                 body: ChatCompletionRequest, *, parser: FormatParser):
        super().__init__(response_id, model, tokenizer, body)
        plan = tool_plan(body)
        self.output_parser = plan.output_parser(parser) if plan is not None else None
        self.limit = plan.limit if plan is not None else None
        self.streams: dict[int, CallStream] = {}

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

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def _deltas(self, index: int, output: RequestOutput) -> list[ChatDelta]:
        if self.output_parser is None:
            return [ChatDelta(content=output.new_text)] if output.new_text else []
        stream = self.streams.setdefault(
            index, CallStream(self.output_parser, _new_call_id, self.limit))
        content, calls = stream.feed(output.new_text, output.finished)
        return ([ChatDelta(content=content)] if content else []) + [
            ChatDelta(tool_calls=[ToolCallDelta.model_validate(call)]) for call in calls]

    def chunks(self, index: int, output: RequestOutput) -> list[dict]:
        deltas = self._deltas(index, output)
        if not (deltas or output.finished or output.logprobs):
            return []
        choices = [ChatChunkChoice(index=index, delta=delta) for delta in deltas or [ChatDelta()]]
        choices[0].logprobs = self.logprobs(output.logprobs)
        called = index in self.streams and self.streams[index].called
        choices[-1].finish_reason = self.finish_reason(output.finish_reason, called)
        return [ChatCompletionChunk(id=self.id, model=self.model, choices=[c]).model_dump()
                for c in choices]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[],
                                   usage=_usage(prompt_tokens, completion_tokens)).model_dump()

    def message(self, text: str) -> AssistantMessage:
        """The answer of a choice: its text, or the tool calls it holds and the text outside
        them (None when only whitespace)."""
        scan = self.output_parser.scan(text, final=True) if self.output_parser else None
        if scan is None or not scan.calls:
            return AssistantMessage(content=text)
        calls = [ToolCall(id=_new_call_id(), function=FunctionCallOut(name=c.name,
                                                                      arguments=c.arguments))
                 for c in scan.calls[:self.limit]]
        return AssistantMessage(content=scan.content if scan.content.strip() else None,
                                tool_calls=calls)

    def full(self, outputs: dict[int, list[RequestOutput]], prompt_tokens: int) -> dict:
        choices = []
        for index, outs in sorted(outputs.items()):
            entries = [e for o in outs for e in (o.logprobs or [])]
            message = self.message("".join(o.new_text for o in outs))
            choices.append(ChatChoice(
                index=index,
                message=message,
                logprobs=self.logprobs(entries) if any(o.logprobs for o in outs) else None,
                finish_reason=self.finish_reason(outs[-1].finish_reason if outs else "abort",
                                                 message.tool_calls is not None),
            ))
        return ChatCompletion(id=self.id, model=self.model, choices=choices,
                              usage=_usage(prompt_tokens, _completion_tokens(outputs))
                              ).model_dump()


class CompletionFormatter(_Base):
    """With ``echo``, each choice's text starts with its prompt's text: the prompt as given, or
    its token ids decoded."""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer,
                 body: CompletionRequest):
        super().__init__(response_id, model, tokenizer, body)
        self.n = body.n
        self.echoed = [p if isinstance(p, str) else tokenizer.decode(p)
                       for p in _prompt_list(body)] if body.echo else None

    def echo(self, index: int) -> str:
        return "" if self.echoed is None else self.echoed[index // self.n]

    def opening(self, indices: list[int]) -> list[dict]:
        if self.echoed is None:
            return []
        return [TextCompletion(id=self.id, model=self.model,
                               choices=[CompletionChoice(index=i, text=self.echo(i))]).model_dump()
                for i in indices]

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

    def chunks(self, index: int, output: RequestOutput) -> list[dict]:
        if not (output.new_text or output.finished or output.logprobs):
            return []
        choice = CompletionChoice(
            index=index,
            text=output.new_text,
            logprobs=self.logprobs(output.logprobs, 0) if output.logprobs else None,
            finish_reason=output.finish_reason,
        )
        return [TextCompletion(id=self.id, model=self.model, choices=[choice]).model_dump()]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return TextCompletion(id=self.id, model=self.model, choices=[],
                              usage=_usage(prompt_tokens, completion_tokens)).model_dump()

    def full(self, outputs: dict[int, list[RequestOutput]], prompt_tokens: int) -> dict:
        choices = []
        for index, outs in sorted(outputs.items()):
            entries = [e for o in outs for e in (o.logprobs or [])]
            choices.append(CompletionChoice(
                index=index,
                text=self.echo(index) + "".join(o.new_text for o in outs),
                logprobs=self.logprobs(entries, 0) if any(o.logprobs for o in outs) else None,
                finish_reason=outs[-1].finish_reason if outs else "abort",
            ))
        return TextCompletion(id=self.id, model=self.model, choices=choices,
                              usage=_usage(prompt_tokens, _completion_tokens(outputs))).model_dump()
