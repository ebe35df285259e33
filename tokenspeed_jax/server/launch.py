"""Run the HTTP server around an engine: start-up, readiness, failure and shutdown.

``serve(config)`` is what ``scripts/serve.py`` runs; it returns the process's exit status.
Invariants:

* The API answers 503 while the model loads and compiles; then one ``ready:`` line is printed,
  with the executables ready and, with background compile, the buckets still compiling (each
  request meanwhile takes the best bucket that is ready: ``engine/ladders.py``).
* SIGTERM or SIGINT drains: the listening socket closes, new requests on open connections get
  503, requests in flight run to their end for up to ``shutdown_timeout`` seconds, and those
  still running then end with a clean error (a stream's error event and ``[DONE]``, or a 503).
  The status is 0. A second SIGINT stops at once.
* An engine loop that fails (a fault of no single request) has logged its traceback and failed
  every request in flight with a 503; the server then shuts down as above and the status is 1, so
  a supervisor restarts it. A start-up failure is status 1 as well.
* uvicorn's access log is off: the app logs one info line per finished request instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import uvicorn

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.async_engine import AsyncEngine
from tokenspeed_jax.engine.startup import EngineBundle, build_engine
from tokenspeed_jax.server.app import ServerState, create_app

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# After the drain deadline has ended the last requests, the seconds their connections get to
# send the error and close before uvicorn cancels them.
CLOSE_GRACE_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose shutdown drains requests up to a deadline and whose signals end
    the process normally (uvicorn's own re-raises the signal after shutting down)."""

    def __init__(self, config: uvicorn.Config, *, drain_seconds: float,
                 on_drain: Callable[[], None], on_deadline: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.on_drain = on_drain
        self.on_deadline = on_deadline

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: object) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list | None = None) -> None:
        self.on_drain()
        deadline = asyncio.get_running_loop().call_later(self.drain_seconds, self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def usage_hint(config: EngineConfig, model_name: str) -> str:
    url = f"http://{config.host}:{config.port}"
    return (
        f"serving {model_name!r} at {url}\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", "
        f"\"content\": \"Hello!\"}}]}}'\n"
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='x'); "
        f"print(c.chat.completions.create(model='{model_name}', "
        f"messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)\"\n"
        f"  metrics: {url}/metrics   health: {url}/health"
    )


def served_name(config: EngineConfig) -> str:
    """The model name the API serves: the configured one, else the model's file or directory."""
    return config.served_model_name or (
        os.path.basename(os.path.normpath(config.model)) if config.model else DEFAULT_MODEL_NAME
    )


def serve(config: EngineConfig, *, log_level: str = "warning",
          build: Callable[[EngineConfig], EngineBundle] = build_engine) -> int:
    """Serve until a signal or an engine failure; the process's exit status (module docstring).
    ``build`` makes the engine from ``config`` (on a thread, while the API answers 503)."""
    name = served_name(config)
    state = ServerState(served_model_name=name)
    failure: list[BaseException] = []

    def drain() -> None:
        state.draining = True

    def end_in_flight() -> None:
        if state.engine is not None and state.engine.num_in_flight:
            print(f"shutdown: ending {state.engine.num_in_flight} requests still running after "
                  f"{config.shutdown_timeout:g}s", file=sys.stderr, flush=True)
            state.engine.cancel_all("the server shut down before this request finished")

    server = DrainingServer(
        uvicorn.Config(create_app(state, config), host=config.host, port=config.port,
                       log_level=log_level, access_log=False,
                       timeout_graceful_shutdown=config.shutdown_timeout + CLOSE_GRACE_SECONDS),
        drain_seconds=config.shutdown_timeout, on_drain=drain, on_deadline=end_in_flight)

    def fail(error: BaseException) -> None:
        failure.append(error)
        server.should_exit = True

    def start_engine() -> None:
        try:
            bundle = build(config)
        except Exception as error:  # noqa: BLE001 - start-up failure is fatal: stop the server
            fail(error)
            return
        engine = AsyncEngine(bundle.engine, on_failure=fail)
        engine.start()
        state.runner_stats = bundle.runner.stats
        state.engine = engine
        summary = bundle.compile_summary
        background = ""
        if summary.num_deferred:
            stats, plans = bundle.runner.stats(), summary.num_deferred
            background = (f"; {stats['buckets_ready']} of {stats['buckets_total']} buckets "
                          f"ready, {plans} bucket plan{'s' * (plans != 1)} left to load or "
                          f"compile in the background")
        print(f"ready: {summary.num_executables} executables in {bundle.seconds:.1f}s "
              f"({summary.describe()}; {bundle.engine.block_manager.num_pages} KV pages of "
              f"{config.page_size} tokens){background}", flush=True)
        print(usage_hint(config, name), flush=True)

    print(f"loading {name} and compiling (the API answers 503 until ready) ...", flush=True)
    threading.Thread(target=start_engine, name="engine-start", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.shutdown()
    if failure:
        print(f"stopped: {failure[0]!r}", file=sys.stderr, flush=True)
        return 1
    return 0
