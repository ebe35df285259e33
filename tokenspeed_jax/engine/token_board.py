"""The token board: a decode step's sampled token ids kept on the device for the next step.

The engine's overlap schedule launches decode step N+1 before step N's tokens reach the host, so
step N+1 cannot be handed those tokens as host input. Instead every decode step writes its
sampled ids to the *board* (an int32 device array, a row per sequence the engine may hold) and a
row of step N+1 whose ``StepRequest.token_row`` is set reads its input token from that row of
step N's board. Both runners' decode routes use the functions here.

Invariants:

* A board has ``board_rows(...)`` rows: at least every decode executable's rows and
  ``max_num_seqs``, so its shape (and the executables' cache keys) does not follow the bucket list.
* ``write_board`` returns a whole new board: rows past the step's are zero, so a row never reads
  a token older than the step before it.
* ``token_rows`` is -1 for rows that take their token from the host (and for padding rows).
* A step left running (``pending_decode``) has its token copy queued when it is launched, so
  the copy waits for that step only and not for a step launched after it; its ``result()``
  fetches once, so the device buffer may be reused after it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.engine.batch import PendingStep, StepRequest
from tokenspeed_jax.engine.sampling_plans import fetch_sampled, needs_full_sampler, step_output


def board_rows(max_num_seqs: int, decode_executables: Sequence[int]) -> int:
    """Rows of a runner's token board (see the invariants)."""
    return max(max_num_seqs, *decode_executables, 1)


def device_zeros(shape: int | tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """Zeros in a device buffer of their own, which a call that donates it updates in place from
    the first call on. On the CPU, ``device_put`` of a numpy array may return a view of the
    array's memory (jax ignores ``may_alias`` for numpy arrays), which cannot be donated: the
    first call would move it. A copy of the device array owns its buffer, and costs no compile
    (a warm start compiles nothing)."""
    return jax.device_put(jax.device_put(np.zeros(shape, dtype)), may_alias=False)


def new_board(rows: int) -> jax.Array:
    return device_zeros(rows, np.int32)


def token_rows(requests: Sequence[StepRequest], rows: int) -> np.ndarray:
    """int32 [rows]: each request's ``token_row``, -1 for the padding rows."""
    out = np.full(rows, -1, np.int32)
    out[:len(requests)] = [r.token_row for r in requests]
    return out


def read_tokens(token_ids: jax.Array, rows: jax.Array, board: jax.Array) -> jax.Array:
    """The step's input tokens: ``board[rows]`` where ``rows >= 0``, else ``token_ids``."""
    return jnp.where(rows >= 0, board[jnp.maximum(rows, 0)], token_ids)


def write_board(board: jax.Array, sampled: jax.Array) -> jax.Array:
    """A board holding the sampled ids (column 0 of the sampler's packed rows) in its first rows."""
    return jnp.zeros_like(board).at[:sampled.shape[0]].set(sampled[:, 0])


def can_stay_on_board(requests: Sequence[StepRequest]) -> bool:
    """Whether a decode step's tokens are final on the device: only the in-step sampler runs
    (no penalties, truncation or top log-probabilities, which resample on the host side)."""
    return not any(needs_full_sampler(r.params) for r in requests)


def check_no_token_rows(requests: Sequence[StepRequest]) -> None:
    """Token rows are only for a decode step that can stay on the board."""
    if any(r.token_row >= 0 for r in requests):
        raise ValueError("token_row needs a decode step on the decode route whose requests "
                         "need only the in-step sampler")


def pending_decode(sampled: jax.Array, count: int) -> PendingStep:
    """A launched decode step of ``count`` requests whose sampler rows are ``sampled``; its
    ``result()`` fetches them once (later calls return the same output)."""
    sampled.copy_to_host_async()
    return PendingStep(functools.cache(lambda: step_output([fetch_sampled(sampled, count)])),
                       on_board=True)
