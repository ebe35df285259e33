"""What the server tests share: the tiny model's serving config, a real uvicorn server on
loopback in a thread, and the reference generator that gives expected outputs.

The config runs the tiny HF checkpoint with a deliberately small KV cache (24 pages of 8 tokens),
so concurrent traffic forces preemption. Every module that serves it uses this one config, so the
executables compiled by the first are loaded from the session's executable cache by the rest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import openai
import uvicorn

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.models.loader import load_model
from tokenspeed_jax.reference import ReferenceGenerator
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server.app import ServerState, create_app

MODEL_DIR = "tests/golden/tiny_llama"
MODEL_NAME = "tiny"
CONFIG = EngineConfig(
    model=MODEL_DIR,
    served_model_name=MODEL_NAME,
    max_model_len=96,
    num_pages=24,
    page_size=8,
    max_num_seqs=8,
    prefill_graph_max_tokens=64,
    prefill_graph_capture_token_sizes=(32, 64),
    prefill_graph_capture_batch_sizes=(4,),
    decode_graph_capture_batch_sizes=(8,),
    compile_progress=False,
    strict_no_compile=True,
    overlap_schedule="on",  # "auto" may or may not run ahead on a CPU; these tests need it to
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(state: ServerState, config: EngineConfig = CONFIG) -> Iterator[str]:
    """Serve ``state`` with ``config``'s server settings; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state, config), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving(bundle) -> Iterator[tuple[str, AsyncEngine]]:
    """``bundle``'s (``build_engine``) engine on its thread, served with CONFIG's settings:
    (base URL, the running ``AsyncEngine``); shut down afterwards."""
    engine = AsyncEngine(bundle.engine)
    engine.start()
    try:
        with running_server(ServerState(MODEL_NAME, engine, bundle.runner.stats)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def schema_replies(chat, schema: dict, seeds: int = 20) -> list:
    """``chat(**fields)`` (one request, its first choice) sampled at temperature 1 under
    ``response_format`` ``json_schema`` (strict) for seeds ``0 .. seeds-1``, 8 at a time."""
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda seed: chat(temperature=1.0, seed=seed,
                                               response_format=response_format), range(seeds)))


def openai_client(url: str) -> openai.OpenAI:
    """The official client on the server at ``url``, with no retries."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


class Reference:
    """The expected outputs: the plain dense-cache generator on the same checkpoint, sharing no
    code with the engine's scheduler, paged KV cache or compiled plans."""

    def __init__(self, path: str) -> None:
        loaded = load_model(path)
        self.tokenizer = loaded.tokenizer
        self._generator = ReferenceGenerator(loaded.model, loaded.tokenizer)

    def generate(self, prompts, params):
        prompts = [prompts] if isinstance(prompts, str) else prompts
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._generator.generate(ids, [params] * len(ids))

    def log_probs(self, token_ids) -> np.ndarray:
        """f32[len(token_ids), V]: the next-token log-probabilities after each prefix."""
        logits = self._generator.logits(list(token_ids)).astype(np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    def chat(self, messages, params):
        return self.generate(
            [self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)], params)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)
