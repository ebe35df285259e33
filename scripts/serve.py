"""Serve a model over the OpenAI-compatible HTTP API.

    python scripts/serve.py                       # embedded SmolLM2-135M-Instruct on :8000
    python scripts/serve.py --model path/to/hf_dir_or.gguf --max-num-seqs 32 --port 9000

Every EngineConfig field is a flag (``--max-num-seqs`` for ``max_num_seqs``); ``--help`` explains
each with the comment that documents the field. The server answers 503 while the model loads and
compiles, prints one "ready" line, then serves. SIGTERM (or Ctrl-C) stops accepting requests,
finishes the ones in flight (up to ``--shutdown-timeout`` seconds), then exits 0; an engine
failure exits 1 (``tokenspeed_jax/server/launch.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import re
import sys
import types
import typing

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.server.launch import serve

# Short spellings other servers use for the same settings.
FLAG_ALIASES = {"tensor_parallel_size": ("--tp",)}


def field_help() -> dict[str, str]:
    """Each EngineConfig field's documenting comment (the ``#`` lines right above it)."""
    helps: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(EngineConfig).splitlines():
        stripped = line.strip()
        if stripped.startswith("# ----"):
            comment = []
        elif stripped.startswith("#"):
            comment.append(stripped.lstrip("# "))
        elif match := re.match(r"(\w+): ", stripped):
            helps[match.group(1)] = " ".join(comment)
            comment = []
        else:
            comment = []
    return helps


def _parser_for(annotation: typing.Any) -> tuple[typing.Callable[[str], typing.Any], bool]:
    """(string -> value, is_bool) for a field's type annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if isinstance(annotation, types.UnionType) and args else annotation
    optional = type(None) in typing.get_args(annotation)
    if base is bool:
        return bool, True
    if typing.get_origin(base) is tuple and typing.get_args(base)[0] is str:
        return str.split, False  # space-separated: XLA option values may hold commas
    if typing.get_origin(base) is tuple:
        def parse(text: str) -> tuple[int, ...] | None:
            return None if optional and text.lower() == "none" else tuple(
                int(x) for x in text.split(",") if x)
        return parse, False
    scalar = {int: int, float: float, str: str}[base]

    def parse_scalar(text: str):
        return None if optional and text.lower() == "none" else scalar(text)
    return parse_scalar, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    helps = field_help()
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        parse, is_bool = _parser_for(hints[field.name])
        flags = ["--" + field.name.replace("_", "-"), *FLAG_ALIASES.get(field.name, ())]
        text = helps.get(field.name) or field.name
        if is_bool:
            parser.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=field.default, help=text)
        else:
            shown = ",".join(map(str, field.default)) if isinstance(field.default, tuple) \
                else field.default
            parser.add_argument(*flags, dest=field.name, type=parse, default=field.default,
                                metavar=type(shown).__name__.upper() if shown is not None
                                else "VALUE", help=text)
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    log_level = args.pop("log_level")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(**args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return serve(config, log_level=log_level)


if __name__ == "__main__":
    sys.exit(main())
