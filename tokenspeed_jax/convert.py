"""Convert a checkpoint (HF directory, GGUF file, or the embedded default) to an orbax directory.

Usage: ``python -m tokenspeed_jax.convert SRC DST [--dtype auto|float32|bfloat16]``; SRC
``default`` is the embedded SmolLM2 GGUF. DST receives config.json, the NNX state saved with
orbax, and the tokenizer files; ``load_model(DST)`` restores it without re-reading SRC.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tokenspeed_jax.models.loader import LoadedModel, load_model
from tokenspeed_jax.models.orbax_checkpoint import save_orbax


def convert(
    src: str | os.PathLike | None, dst: str | os.PathLike, *, dtype: str = "auto"
) -> LoadedModel:
    """Load ``src`` (None = embedded default) and write it to ``dst``; returns the loaded model."""
    start = time.perf_counter()
    print(f"loading {src or 'the embedded default model'} ...", file=sys.stderr, flush=True)
    loaded = load_model(src, dtype=dtype)
    print(f"loaded {loaded.format} in {time.perf_counter() - start:.1f}s; writing {dst} ...",
          file=sys.stderr, flush=True)
    save_orbax(loaded.model, dst)
    loaded.tokenizer.save(dst)
    print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return loaded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_jax.convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF directory, GGUF file, or 'default'")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args(argv)
    convert(None if args.src == "default" else args.src, args.dst, dtype=args.dtype)


if __name__ == "__main__":
    main()
