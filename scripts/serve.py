"""Serve a model over the OpenAI-compatible HTTP API.

    python scripts/serve.py                       # embedded SmolLM2-135M-Instruct on :8000
    python scripts/serve.py --model path/to/hf_dir_or.gguf --max-num-seqs 32 --port 9000
    python scripts/serve.py --model dir/with/config.json --load-format dummy --tokenizer tok/dir

Every EngineConfig field is a flag (``--max-num-seqs`` for ``max_num_seqs``); ``--help`` lists
them in sections (model and server first) and explains each with the comment that documents the
field. The server answers 503 while the model loads and
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

from tokenspeed_jax.config import (
    KDA_STATE_DTYPES,
    LOAD_FORMATS,
    OVERLAP_SCHEDULES,
    TOOL_CALL_PARSERS,
    EngineConfig,
)
from tokenspeed_jax.models.loader import DTYPES
from tokenspeed_jax.server.launch import serve

# Short spellings other servers use for the same settings.
FLAG_ALIASES = {"tensor_parallel_size": ("--tp",)}

# The --help sections in the order a new user reads them; every EngineConfig field is in one.
FLAG_GROUPS = {
    "model": ("model", "dtype", "load_format", "tokenizer", "served_model_name",
              "max_model_len"),
    "server": ("host", "port", "api_key", "max_request_bytes", "max_stop_strings",
               "enable_docs", "allow_special_tokens_in_content", "tool_call_parser",
               "shutdown_timeout"),
    "scheduling and KV cache": ("max_num_seqs", "chunked_prefill_size", "overlap_schedule",
                                "page_size", "num_pages", "mem_fraction",
                                "enable_prefix_caching", "prefix_granularity"),
    "buckets and start-up compile": (
        "prefill_graph_max_tokens", "prefill_graph_capture_token_sizes",
        "prefill_graph_capture_batch_sizes", "prefill_graph_max_bs", "decode_graph_max_bs",
        "decode_graph_capture_batch_sizes", "disable_prefill_graph", "enforce_eager",
        "background_compile", "quick_skeleton", "prefill_autotune", "compile_threads",
        "compile_progress", "strict_no_compile", "xla_compiler_options"),
    "kernels": ("fused_decode_attention", "inline_prefill_attention", "stack_decode_weights",
                "alternate_decode_executables", "disable_kda_prefill_graph", "kda_state_dtype"),
    "executable cache": ("compile_cache", "compile_cache_dir", "compile_cache_key_file"),
    "parallelism": ("tensor_parallel_size",),
}

# Placeholders that say what a value is, where its type alone would not.
METAVARS = {"model": "PATH", "tokenizer": "PATH", "compile_cache_dir": "DIR",
            "compile_cache_key_file": "FILE", "host": "ADDRESS", "served_model_name": "NAME",
            "api_key": "KEY", "xla_compiler_options": "'NAME=VALUE ...'"}
CHOICES = {"dtype": ("auto", *DTYPES), "load_format": LOAD_FORMATS,
           "overlap_schedule": OVERLAP_SCHEDULES,
           "kda_state_dtype": KDA_STATE_DTYPES, "tool_call_parser": TOOL_CALL_PARSERS}


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


def _parser_for(annotation: typing.Any) -> tuple[typing.Callable[[str], typing.Any], str]:
    """(string -> value, placeholder) for a field's type annotation; placeholder "" for a
    bool."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if isinstance(annotation, types.UnionType) and args else annotation
    optional = type(None) in typing.get_args(annotation)
    if base is bool:
        return bool, ""
    if typing.get_origin(base) is tuple and typing.get_args(base)[0] is str:
        return str.split, "TEXT"  # space-separated: XLA option values may hold commas
    if typing.get_origin(base) is tuple:
        def parse(text: str) -> tuple[int, ...] | None:
            return None if optional and text.lower() == "none" else tuple(
                int(x) for x in text.split(",") if x)
        return parse, "INT,INT,..."
    scalar = {int: int, float: float, str: str}[base]

    def parse_scalar(text: str):
        return None if optional and text.lower() == "none" else scalar(text)
    return parse_scalar, {int: "INT", float: "FLOAT", str: "TEXT"}[base]


def _add_flag(group: argparse._ArgumentGroup, field: dataclasses.Field, hint: typing.Any,
              text: str) -> None:
    """One field's flag: a bool off by default that is named for turning something off
    (``disable_*``, ``enforce_*``) is one switch, other bools are ``--x`` / ``--no-x``."""
    parse, metavar = _parser_for(hint)
    flags = ["--" + field.name.replace("_", "-"), *FLAG_ALIASES.get(field.name, ())]
    if not metavar and field.default is False:
        group.add_argument(*flags, dest=field.name, action="store_true", help=text)
    elif not metavar:
        group.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction,
                           default=field.default, help=text)
    else:
        group.add_argument(*flags, dest=field.name, type=parse, default=field.default,
                           metavar=None if field.name in CHOICES else
                           METAVARS.get(field.name, metavar),
                           choices=CHOICES.get(field.name), help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    helps = field_help()
    hints = typing.get_type_hints(EngineConfig)
    fields = {field.name: field for field in dataclasses.fields(EngineConfig)}
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    if sorted(grouped) != sorted(fields):
        odd = sorted(n for n in grouped if grouped.count(n) > 1 or n not in fields)
        raise RuntimeError(f"FLAG_GROUPS must hold every EngineConfig field once: missing "
                           f"{sorted(set(fields) - set(grouped))}, unknown or repeated {odd}")
    for title, names in FLAG_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, fields[name], hints[name], helps[name])
        if title == "server":
            group.add_argument("--log-level", default="info",
                               choices=("debug", "info", "warning", "error"),
                               help="Least severe log messages shown; info shows one line per "
                                    "finished request.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    log_level = args.pop("log_level")
    # force: an imported library may have given the root logger a handler already
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    try:
        config = EngineConfig(**args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return serve(config, log_level=log_level)


if __name__ == "__main__":
    sys.exit(main())
