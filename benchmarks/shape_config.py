"""Write the config.json of a benchmark shape (``bench_kimi.SHAPES``) into a directory, so the
server serves that shape with random weights, no checkpoint needed (``--load-format dummy``):

    python benchmarks/shape_config.py --shape kimi-linear --layers 27 --out /tmp/kimi-linear-48b
    python scripts/serve.py --model /tmp/kimi-linear-48b --load-format dummy --tokenizer DIR_OR_GGUF

Invariants: config.json is the shape's checkpoint form (``to_hf``), checked to read back to the
same config before it is written; nothing else is written and no weight is made.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench_kimi import SHAPES  # a sibling script

from tokenspeed_jax.models.registry import family_of


def shape_json(shape: str, layers: int) -> str:
    """The config.json text of ``SHAPES[shape]`` with ``layers`` layers."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    config = SHAPES[shape](layers)
    text = json.dumps(config.to_hf(), indent=2)
    if family_of(config).config_from_hf(json.loads(text)) != config:
        raise ValueError(f"the {shape} shape's config.json does not read back to its config")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--layers", type=int, required=True,
                        help="decoder layers (Kimi-Linear-48B-A3B has 27, DeepSeek-V3 61)")
    parser.add_argument("--out", type=Path, required=True, help="directory (created)")
    args = parser.parse_args()
    text = shape_json(args.shape, args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(text + "\n")
    print(f"wrote {args.out / 'config.json'}")


if __name__ == "__main__":
    main()
