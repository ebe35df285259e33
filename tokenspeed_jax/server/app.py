"""The OpenAI-compatible HTTP app: routes, request flow, streaming and disconnect handling.

One path for every generation request: validate the body (pydantic), turn it into prompts and
``SamplingParams`` with the pure functions of ``translate``, start one engine request per
(prompt, sample), then either stream Server-Sent Events or collect one JSON response.

Invariants:

* Until the engine is attached (start-up compilation), once it has stopped, and while the server
  drains for shutdown, every API route answers 503.
* A client that disconnects, mid-stream or while waiting for a full response, aborts its engine
  requests, so their KV pages are freed at the next engine step.
* Every engine request is named ``{response id}-{choice index}`` and logs one info line when it
  ends (tokens, time to first token, latency, finish reason); a field with no meaning on this
  server is noted in the log the first time a request sets it.
* Bad input is answered with a 4xx in the one error shape of ``errors``; it never reaches the
  engine loop, so other requests are unaffected. A request that fails after it started fails
  alone: a stream ends with an error event and ``[DONE]``, a full response is an error.
* Prompts are rendered and tokenized on a worker thread (the tokenizer releases the GIL), so a
  long prompt never stalls the event loop, health checks or other streams.
* ``RequestGuard`` checks the API key and the body size before anything is parsed; the
  interactive docs are served only with ``enable_docs``.
* The app serves the engine but does not own it: whoever started the engine shuts it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.async_engine import AsyncEngine, EngineDeadError, RequestCancelledError
from tokenspeed_jax.engine.engine import child_params
from tokenspeed_jax.engine.request import RequestOutput
from tokenspeed_jax.sampling_params import SamplingParams, SamplingParamsError
from tokenspeed_jax.server import translate
from tokenspeed_jax.server.errors import APIError, error_body, install_error_handlers
from tokenspeed_jax.server.guards import RequestGuard, resolve_api_key
from tokenspeed_jax.server.metrics import EngineReading, ServerMetrics
from tokenspeed_jax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from tokenspeed_jax.server.tool_parsers import select_parser
from tokenspeed_jax.structured.specs import GrammarSpecError

logger = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.2


@dataclasses.dataclass
class ServerState:
    """What the routes serve from; ``engine`` stays None while the model compiles, and
    ``draining`` turns new requests away while the server shuts down."""

    served_model_name: str
    engine: AsyncEngine | None = None
    runner_stats: Callable[[], dict] | None = None
    draining: bool = False


@dataclasses.dataclass
class _Choice:
    """One engine request behind one choice of the response."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    first_token: float | None = None


def create_app(state: ServerState, config: EngineConfig | None = None) -> FastAPI:
    """The app serving ``state``, with the serving settings of ``config`` (limits, API key,
    docs, special tokens in content; the defaults when None)."""
    config = config or EngineConfig()
    metrics = ServerMetrics(lambda: _engine_reading(state))

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None,
                                          "openapi_url": None}
    app = FastAPI(title="tokenspeed_jax", **docs)
    app.state.server = state
    app.state.metrics = metrics
    app.add_middleware(RequestGuard, max_request_bytes=config.max_request_bytes,
                       api_key=resolve_api_key(config.api_key))
    install_error_handlers(app)

    def ready_engine(model: str | None = None) -> AsyncEngine:
        if state.engine is None:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                           "the server is starting (compiling executables); retry shortly")
        if not state.engine.alive:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine has stopped")
        if state.draining:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")
        if model is not None and model != state.served_model_name:
            raise APIError(HTTPStatus.NOT_FOUND,
                           f"the model {model!r} does not exist; this server serves "
                           f"{state.served_model_name!r}", param="model", code="model_not_found")
        return state.engine

    @app.get("/health")
    async def health() -> dict:
        ready_engine()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        engine = ready_engine()
        card = ModelCard(id=state.served_model_name, max_model_len=engine.engine.max_model_len)
        return ModelList(data=[card])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    noted: set[str] = set()  # ignored fields already noted in the log

    async def generate(body, request: Request, prompts_of, params_of, formatter_type,
                       id_prefix: str, prompt_field: str):
        engine = ready_engine(body.model)
        tokenizer = engine.engine.tokenizer
        params = params_of(body, config.max_stop_strings)
        for name in translate.ignored_fields(body):
            if name not in noted:
                noted.add(name)
                logger.info("ignoring the field %r: it has no meaning on this server (noted "
                            "once)", name)
        prompts = await asyncio.to_thread(prompts_of, tokenizer, body,
                                          max_model_len=engine.engine.max_model_len)
        formatter = formatter_type(
            f"{id_prefix}-{uuid.uuid4().hex}", state.served_model_name, tokenizer, body
        )
        return await _respond(request, engine, metrics, prompts, params, body.stream,
                              formatter, prompt_field)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        parser = select_parser(config.tool_call_parser,
                               ready_engine().engine.tokenizer.chat_template)
        prompts_of = functools.partial(
            translate.chat_prompt_ids, parser=parser,
            special_tokens_in_content=config.allow_special_tokens_in_content)
        return await generate(body, request, prompts_of, translate.chat_params,
                              functools.partial(translate.ChatFormatter, parser=parser),
                              "chatcmpl", "messages")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(
            body, request, translate.completion_prompt_ids, translate.completion_params,
            translate.CompletionFormatter, "cmpl", "prompt",
        )

    return app


def _engine_reading(state: ServerState) -> EngineReading | None:
    """What a /metrics scrape reads from the engine; None until it is attached."""
    if state.engine is None:
        return None
    runner = state.runner_stats() if state.runner_stats is not None else {}
    return EngineReading(state.engine.alive, {**runner, **state.engine.engine.stats()})


def _start(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
           param_name: str, response_id: str) -> list[_Choice]:
    """One engine request per (prompt, sample), ``{response_id}-{choice index}`` each."""
    try:
        engine.engine.check_params(params)  # compiles a grammar (milliseconds; cached)
    except SamplingParamsError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.param) from error
    except GrammarSpecError as error:
        raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=error.field) from error
    choices = []
    for i, prompt_ids in enumerate(prompts):
        try:
            engine.engine.check_prompt(prompt_ids)
        except ValueError as error:
            code = "context_length_exceeded" if "context length" in str(error) else None
            raise APIError(HTTPStatus.BAD_REQUEST, str(error), param=param_name,
                           code=code) from error
        for j in range(params.n):
            choices.append(_Choice(
                index=i * params.n + j,
                request_id=f"{response_id}-{i * params.n + j}",
                prompt_ids=prompt_ids,
                params=child_params(params, j),
                arrival=time.monotonic(),
            ))
    return choices


async def _merged(
    engine: AsyncEngine, choices: list[_Choice], metrics: ServerMetrics
) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
    """Every choice's outputs as they come; leaving early cancels (and so aborts) them all."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        last: RequestOutput | None = None
        try:
            async for output in engine.generate(choice.request_id, choice.prompt_ids,
                                                choice.params):
                if choice.first_token is None and output.new_token_ids:
                    choice.first_token = time.monotonic()
                last = output
                await events.put((choice, output))
        except Exception as error:  # noqa: BLE001 - handed to the consumer below
            await events.put(error)
        finally:
            finished = last is not None and last.finished
            record = {
                "finish_reason": last.finish_reason if finished else "abort",
                "num_prompt_tokens": len(choice.prompt_ids),
                "num_output_tokens": last.num_output_tokens if last is not None else 0,
                "arrival": choice.arrival,
                "first_token": choice.first_token,
                "end": time.monotonic(),
            }
            metrics.observe_request(**record)
            _log_finished(choice.request_id, **record)
            events.put_nowait(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            event = await events.get()
            if event is None:
                remaining -= 1
            elif isinstance(event, Exception):
                raise _api_error(event) from event
            else:
                yield event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_finished(request_id: str, *, finish_reason: str, num_prompt_tokens: int,
                  num_output_tokens: int, arrival: float, first_token: float | None,
                  end: float) -> None:
    """The one log line of a finished engine request."""
    ttft = "-" if first_token is None else f"{first_token - arrival:.3f}s"
    logger.info("request %s finished: %d prompt tokens, %d output tokens, TTFT %s, latency "
                "%.3fs, finish reason %s", request_id, num_prompt_tokens, num_output_tokens,
                ttft, end - arrival, finish_reason)


def _api_error(error: Exception) -> APIError:
    """The client-facing error of a request that failed after it started."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (EngineDeadError, RequestCancelledError)):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(error))
    if isinstance(error, ValueError):  # the engine refused the request's input
        return APIError(HTTPStatus.BAD_REQUEST, str(error))
    logger.error("request failed: %r", error)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "internal server error")


async def _respond(
    request: Request,
    engine: AsyncEngine,
    metrics: ServerMetrics,
    prompts: list[list[int]],
    params: SamplingParams,
    stream: bool,
    formatter: translate.Formatter,
    param_name: str,
):
    choices = _start(engine, prompts, params, param_name, formatter.id)
    usage_prompt = sum(len(p) for p in prompts)
    if stream:
        return StreamingResponse(
            _sse(_merged(engine, choices, metrics), formatter, choices, usage_prompt),
            media_type="text/event-stream",
        )
    collect = asyncio.ensure_future(_collect(_merged(engine, choices, metrics), formatter,
                                             choices, usage_prompt))
    while not collect.done():
        await asyncio.wait({collect}, timeout=DISCONNECT_POLL_SECONDS)
        if not collect.done() and await request.is_disconnected():
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return JSONResponse({}, status_code=499)
    return JSONResponse(collect.result())


async def _collect(events, formatter, choices: list[_Choice], usage_prompt: int) -> dict:
    per_choice: dict[int, list[RequestOutput]] = {c.index: [] for c in choices}
    async with contextlib.aclosing(events):
        async for choice, output in events:
            per_choice[choice.index].append(output)
    return formatter.full(per_choice, usage_prompt)


async def _sse(events, formatter, choices: list[_Choice], usage_prompt: int):
    """Server-Sent Events of a stream; a failure mid-stream is one error event, then
    ``[DONE]``."""
    completion_tokens = 0
    try:
        async with contextlib.aclosing(events):
            for chunk in formatter.opening([c.index for c in choices]):
                yield _event(chunk)
            async for choice, output in events:
                completion_tokens += len(output.new_token_ids)
                for chunk in formatter.chunks(choice.index, output):
                    yield _event(chunk)
    except APIError as error:
        yield _event(error_body(error.status, error.message, error.param, error.code))
        yield "data: [DONE]\n\n"
        return
    if formatter.include_usage:
        yield _event(formatter.usage_chunk(usage_prompt, completion_tokens))
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
