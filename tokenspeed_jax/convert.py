"""Convert a checkpoint (HF directory, GGUF file, or the embedded default) to an orbax directory.

Usage: ``python -m tokenspeed_jax.convert SRC DST [--dtype auto|float32|bfloat16] [--overwrite]``;
SRC ``default`` is the embedded SmolLM2 GGUF. DST receives config.json, the NNX state saved with
orbax, and the tokenizer files; ``load_model(DST)`` restores it without re-reading SRC.

The command line refuses a missing SRC and an existing non-empty DST (unless ``--overwrite``,
which replaces an earlier conversion's files) before loading anything: one line on stderr
naming the path, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from tokenspeed_jax.models.loader import LoadedModel, load_model
from tokenspeed_jax.models.orbax_checkpoint import STATE_DIR, save_orbax


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


def check_paths(src: str | None, dst: str, *, overwrite: bool) -> str | None:
    """Why ``src`` -> ``dst`` cannot start (one line), or None; with ``overwrite`` an earlier
    conversion's state in ``dst`` is removed."""
    if src is not None and not os.path.exists(src):
        return f"the source {src} does not exist (an HF directory, a GGUF file, or 'default')"
    target = Path(dst)
    if target.exists() and not target.is_dir():
        return f"the destination {dst} is a file, not a directory"
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            return f"the destination {dst} exists and is not empty; pass --overwrite to replace it"
        shutil.rmtree(target / STATE_DIR, ignore_errors=True)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_jax.convert",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF directory, GGUF file, or 'default'")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="weight dtype to write: auto = float32 on the CPU, bfloat16 on an "
                             "accelerator")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the conversion already in DST")
    args = parser.parse_args(argv)
    src = None if args.src == "default" else args.src
    problem = check_paths(src, args.dst, overwrite=args.overwrite)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    convert(src, args.dst, dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
