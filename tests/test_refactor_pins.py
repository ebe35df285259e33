"""The engine's outputs have not moved from the pins saved before a refactor.

Each family (Llama, Qwen3, the embedded SmolLM2, Kimi-Linear) runs the prompts of
``refactor_pins`` alone and batched; its prompt and greedy token ids, top-logprob token ids,
text and finish reasons must equal ``tests/golden/pins/<family>.npz`` exactly, and its per-step
log-probabilities within ``LOGPROB_ATOL``: XLA compiles the same CPU program to other
instructions on other processors (vector widths, library kernels), so float32 sums may round
differently there, and the differences grow through the layers (up to 3.9e-5 seen between two
x86 machines). A change that moves a token, or a log-probability by more than that, fails.
Those files are written by ``scripts/pin_outputs.py`` from the engine as it stood before the
refactor; the transformers goldens (``test_llm``, ``test_kimi_engine``) say the outputs are
right, these say they have not moved.

Kimi-Linear's engine compiles its inline prefill route alone (``inline_route_only``): its
schedule is fixed (a 64-token step budget, pages to spare, every prefill done before the first
decode-only step) and its prefill chunks (70 = 64 + 6 alone; batched, a prefix hit of 64 + 6,
then 58 + 12) never hold the one-token continuation that takes the ordinary route, so the
outputs are those of the engine with both routes compiled.
"""

import contextlib

import numpy as np
import pytest
from refactor_pins import FAMILIES, load_llm, pin_path, run_family
from tiny_checkpoints import inline_route_only

LOGPROB_ATOL = 1e-4  # log-probabilities of a few units: some hundred float32 ulps


def matches(output: np.ndarray, pin: np.ndarray) -> bool:
    """Floats within ``LOGPROB_ATOL`` of the pin, everything else equal."""
    if output.shape != pin.shape or output.dtype.kind != pin.dtype.kind:
        return False
    if pin.dtype.kind == "f":
        return bool(np.all(np.abs(output - pin) <= LOGPROB_ATOL))
    return bool(np.array_equal(output, pin))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_match_the_pins(family, tmp_path):
    pinned = dict(np.load(pin_path(family)))
    with inline_route_only() if family == "kimi_linear" else contextlib.nullcontext():
        llm = load_llm(family, tmp_path)
    outputs = run_family(family, llm)
    assert sorted(outputs) == sorted(pinned)
    differing = [key for key in pinned if not matches(outputs[key], pinned[key])]
    assert not differing, f"{family}: outputs moved from the pins in {differing}"
    assert llm.stats()["runtime_compiles"] == 0
