"""Serve a model over the OpenAI-compatible HTTP API.

    python scripts/serve.py                       # embedded SmolLM2-135M-Instruct on :8000
    python scripts/serve.py --model path/to/hf_dir_or.gguf --max-num-seqs 32 --port 9000

Every EngineConfig field is a flag (``--max-num-seqs`` for ``max_num_seqs``); ``--help`` explains
each with the comment that documents the field. The server answers 503 while the model loads and
compiles, prints one "ready" line, then serves. SIGTERM (or Ctrl-C) stops accepting requests,
finishes the ones in flight, then exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import re
import sys
import threading
import types
import typing

import uvicorn

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.engine import AsyncEngine, build_engine
from tokenspeed_jax.server.app import ServerState, create_app

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
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


def usage_hint(config: EngineConfig, model_name: str) -> str:
    url = f"http://{config.host}:{config.port}"
    return (
        f"serving {model_name!r} at {url}\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", "
        f"\"content\": \"Hello!\"}}]}}'\n"
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='x'); "
        f"print(c.chat.completions.create(model='{model_name}', "
        f"messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)\"\n"
        f"  metrics: {url}/metrics   health: {url}/health"
    )


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    log_level = args.pop("log_level")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = EngineConfig(**args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    name = config.served_model_name or (
        os.path.basename(os.path.normpath(config.model)) if config.model else DEFAULT_MODEL_NAME
    )
    state = ServerState(served_model_name=name)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=config.host, port=config.port,
                                           log_level=log_level))
    failure: list[BaseException] = []

    def start_engine() -> None:
        try:
            bundle = build_engine(config)
        except Exception as error:  # noqa: BLE001 - start-up failure is fatal: stop the server
            failure.append(error)
            server.should_exit = True
            return
        engine = AsyncEngine(bundle.engine)
        engine.start()
        state.runner_stats = bundle.runner.stats
        state.engine = engine
        summary = bundle.compile_summary
        print(f"ready: {summary.num_executables} executables in {bundle.seconds:.1f}s "
              f"({summary.describe()}; {bundle.engine.block_manager.num_pages} KV pages of "
              f"{config.page_size} tokens)", flush=True)
        print(usage_hint(config, name), flush=True)

    print(f"loading {name} and compiling (the API answers 503 until ready) ...", flush=True)
    threading.Thread(target=start_engine, name="engine-start", daemon=True).start()
    server.run()
    if failure:
        print(f"start-up failed: {failure[0]!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
