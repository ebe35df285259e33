"""Save the engine's current outputs as the pins ``tests/test_refactor_pins.py`` compares against.

Run before a refactor that must not change any output, then commit the files it writes:

    PYTHONPATH=. .venv/bin/python scripts/pin_outputs.py [family ...]

For each family (all by default: llama, qwen3, smollm2, kimi_linear) it loads the model with the
tests' small buckets, runs the prompts of ``tests/refactor_pins.py`` and writes
``tests/golden/pins/<family>.npz``: greedy tokens, text, finish reasons and the engine's own
per-step log-probabilities (the chosen token's and the top 20), alone and batched. It then runs
the same prompts on a second engine and refuses to keep a file whose outputs are not reproduced
bit for bit. The log-probabilities depend on the processor XLA's CPU backend compiles for (the
test allows for that, ``LOGPROB_ATOL``); ids, text and finish reasons must not.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(TESTS_DIR))
    import refactor_pins

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", choices=[*refactor_pins.FAMILIES, []],
                        help="families to pin (default: all)")
    families = parser.parse_args(argv).families or list(refactor_pins.FAMILIES)
    refactor_pins.PIN_DIR.mkdir(parents=True, exist_ok=True)
    for family in families:
        with tempfile.TemporaryDirectory() as scratch:
            first, second = (refactor_pins.run_family(
                family, refactor_pins.load_llm(family, Path(scratch) / run)) for run in "ab")
        differing = sorted(key for key in first if not np.array_equal(first[key], second[key]))
        if differing:
            raise SystemExit(f"{family}: two engines disagree on {differing}; nothing written")
        np.savez(refactor_pins.pin_path(family), **first)
        print(f"{family}: {len(first)} arrays -> {refactor_pins.pin_path(family)}")


if __name__ == "__main__":
    main()
