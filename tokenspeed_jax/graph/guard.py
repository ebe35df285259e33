"""The no-compile-while-serving guard.

Every executable a request can reach is compiled at start-up; afterwards an XLA compile means a
shape escaped the buckets. Once a guard is ``arm()``-ed it counts every backend compile in the
process (``runtime_compiles``), logs the compiled function and its argument shapes, and in strict
mode raises ``RuntimeCompileError`` from inside the offending call. Compiles inside
``allowed(reason)`` (a declared eager fallback, on the calling thread) are counted as
``allowed_compiles`` and never raise; compiles inside ``startup()`` (a start-up compile, e.g. a
second engine built in the same process) are not counted at all. Invariants: a disarmed guard
counts nothing; the listener is registered once per process and only reaches live guards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterator

from jax import monitoring

logger = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_JAX_COMPILE_LOGGER = "jax._src.interpreters.pxla"  # logs "Compiling <fn> with global shapes..."
_guards: weakref.WeakSet[CompileGuard] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False
_last_shapes = threading.local()
_thread_state = threading.local()  # .allowed_reason, .startup: what the calling thread declared


class RuntimeCompileError(RuntimeError):
    """An XLA compile happened while serving under a strict guard."""


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    fun_name: str
    shapes: str
    seconds: float
    allowed_reason: str | None


class _ShapeRecorder(logging.Filter):
    """Keeps the shapes of the compile that is about to happen; drops records nobody asked for."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Compiling") and record.args:
            _last_shapes.value = str(record.args[1])
        return record.levelno >= self.threshold


def _on_event(event: str, duration: float, **kwargs: object) -> None:
    if event != _BACKEND_COMPILE_EVENT:
        return
    fun_name = str(kwargs.get("fun_name", "?"))
    shapes = getattr(_last_shapes, "value", "?")
    for guard in list(_guards):
        guard._record(fun_name, shapes, duration)


@contextlib.contextmanager
def _declare(name: str, value: object) -> Iterator[None]:
    previous = getattr(_thread_state, name, None)
    setattr(_thread_state, name, value)
    try:
        yield
    finally:
        setattr(_thread_state, name, previous)


def allowed(reason: str) -> contextlib.AbstractContextManager[None]:
    """Compiles on this thread inside are a declared fallback: counted apart, never raised."""
    return _declare("allowed_reason", reason)


def startup() -> contextlib.AbstractContextManager[None]:
    """Compiles on this thread inside are start-up work: no guard counts them."""
    return _declare("startup", True)


def disarm_all() -> None:
    """Disarm every live guard (a process that is done serving, or a test suite between modules)."""
    for guard in list(_guards):
        guard.disarm()


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        jax_logger = logging.getLogger(_JAX_COMPILE_LOGGER)
        jax_logger.addFilter(_ShapeRecorder(jax_logger.getEffectiveLevel()))
        jax_logger.setLevel(logging.DEBUG)
        monitoring.register_event_duration_secs_listener(_on_event)
        _installed = True


class CompileGuard:
    """Counts (and in strict mode forbids) XLA compiles after start-up."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self.armed = False
        self.runtime_compiles = 0
        self.allowed_compiles = 0
        self.events: list[CompileEvent] = []
        _install()
        _guards.add(self)

    def arm(self) -> None:
        """Start-up is over: from now on every compile is counted."""
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    @staticmethod
    def allowed(reason: str) -> contextlib.AbstractContextManager[None]:
        """Compiles on this thread inside are a declared fallback: counted apart, never raised."""
        return allowed(reason)

    def _record(self, fun_name: str, shapes: str, seconds: float) -> None:
        if not self.armed or getattr(_thread_state, "startup", None):
            return
        reason = getattr(_thread_state, "allowed_reason", None)
        self.events.append(CompileEvent(fun_name, shapes, seconds, reason))
        if reason is not None:
            self.allowed_compiles += 1
            logger.info("compile during %s: %s %s", reason, fun_name, shapes)
            return
        self.runtime_compiles += 1
        logger.warning("runtime compile of %s with shapes %s (%.3fs)", fun_name, shapes, seconds)
        if self.strict:
            raise RuntimeCompileError(
                f"compile after start-up of {fun_name} with shapes {shapes}; every shape a "
                f"request can reach must be compiled at start-up"
            )
