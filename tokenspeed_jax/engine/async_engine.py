"""The asyncio front of the serving loop: ``AsyncEngine`` runs ``Engine.step`` in one background
thread and streams each request's outputs to an asyncio consumer; request-side host work (HTTP,
tokenisation, JSON) runs on the event loop while the engine thread waits on the device.

Invariants:

* Only the engine thread touches the ``Engine``; the asyncio side talks to it through a queue.
* Faults stay with their cause: anything that goes wrong while adding one request fails that
  request alone (a ``ValueError`` is its caller's bad input) and the loop goes on; a failure of a
  step, which belongs to no single request, stops the loop: it logs the traceback once, ends
  every request in flight with ``EngineDeadError``, reports itself dead (``alive``) and calls
  ``on_failure`` so its owner can exit.
* Every request in flight ends with exactly one finished output or one error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence

from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.request import RequestOutput
from tokenspeed_jax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight ends with this error."""


class RequestCancelledError(RuntimeError):
    """The engine's owner ended a request before it finished (``AsyncEngine.cancel_all``)."""


class AsyncEngine:
    """Runs ``Engine.step`` in a background thread; ``generate`` streams one request's outputs.

    ``on_failure`` is called once, on the engine thread, with the error that stopped the loop.
    """

    def __init__(self, engine: Engine,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_failure = on_failure
        self._inbox: queue.SimpleQueue[tuple[str, tuple]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests being streamed to a consumer."""
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving early (or cancellation) aborts the request.

        Raises ValueError when the engine refuses the request, ``EngineDeadError`` when the loop
        failed, ``RequestCancelledError`` when ``cancel_all`` ended it."""
        self.engine.check_prompt(prompt_token_ids)
        self.engine.check_params(params)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        try:
            # Checked once the stream is registered: a loop that fails from here on delivers
            # its error to this stream, one that failed before is seen here.
            if self.error is not None:
                raise EngineDeadError(f"the engine loop failed: {self.error!r}")
            self._send("add", request_id, list(prompt_token_ids), params)
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send("abort", request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def cancel_all(self, reason: str) -> None:
        """End every request in flight now with ``RequestCancelledError(reason)``."""
        for request_id in list(self._streams):
            self._deliver(request_id, RequestCancelledError(reason))

    def _send(self, kind: str, *args) -> None:
        self._inbox.put((kind, args))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id = args[0]
                try:
                    self.engine.add_request(*args)
                except ValueError as error:
                    self._deliver(request_id, error)
                except Exception as error:
                    logger.exception("could not add request %s", request_id)
                    self._deliver(request_id, RuntimeError(f"the request failed: {error!r}"))
            else:
                output = self.engine.abort(args[0])
                if output is not None:
                    self._deliver(output.request_id, output)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox()
                if not engine.has_unfinished:
                    if self._stopping:
                        return
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for output in engine.step():
                    self._deliver(output.request_id, output)
        except BaseException as error:
            logger.critical("the engine loop failed; ending every request in flight",
                            exc_info=error)
            self.error = error
            dead = EngineDeadError(f"the engine loop failed: {error!r}")
            for request_id in list(self._streams):
                self._deliver(request_id, dead)
            if self.on_failure is not None:
                self.on_failure(error)
