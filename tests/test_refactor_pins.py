"""The engine's outputs are bit-identical to the pins saved before a refactor.

Each family (Llama, Qwen3, the embedded SmolLM2, Kimi-Linear) runs the prompts of
``refactor_pins`` alone and batched; its greedy tokens, text, finish reasons and per-step
log-probabilities must equal ``tests/golden/pins/<family>.npz`` exactly (``np.array_equal``, no
tolerance). Those files are written by ``scripts/pin_outputs.py`` from the engine as it stood before
the refactor; the transformers goldens (``test_llm``, ``test_kimi_engine``) say the outputs are
right, these say they have not moved.
"""

import numpy as np
import pytest
from refactor_pins import FAMILIES, load_llm, pin_path, run_family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_are_bit_identical_to_the_pins(family, tmp_path):
    pinned = dict(np.load(pin_path(family)))
    llm = load_llm(family, tmp_path)
    outputs = run_family(family, llm)
    assert sorted(outputs) == sorted(pinned)
    differing = [key for key in pinned if not np.array_equal(outputs[key], pinned[key])]
    assert not differing, f"{family}: outputs moved from the pins in {differing}"
    assert llm.stats()["runtime_compiles"] == 0
