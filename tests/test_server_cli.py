"""scripts/serve.py as a user runs it: flags, the ready line, and a graceful SIGTERM."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
from serving import Reference, free_port, greedy

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.models.loader import DTYPES

MODEL_DIR = "tests/golden/tiny_llama"
SERVE = [sys.executable, "scripts/serve.py"]


def help_sections(text: str) -> dict[str, dict[str, str]]:
    """``--help`` output as section title -> flag -> help text (the usage block left out)."""
    sections: dict[str, dict[str, str]] = {}
    flags: dict[str, str] = {}
    flag = None
    for line in text.split("\n\n", 2)[2].splitlines():
        if line and not line.startswith(" "):
            flags = sections.setdefault(line.rstrip(":"), {})
        elif match := re.match(r"  (--?[\w-]+)(.*?)(?:  +(\S.*))?$", line):
            flag = match.group(1)
            flags[flag] = f"{match.group(2)} || {match.group(3) or ''}"
        elif line.strip() and flag is not None:
            flags[flag] += " " + line.strip()
    return sections


def test_help_lists_every_config_flag_in_sections_with_typed_placeholders():
    out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, check=True).stdout
    sections = help_sections(out)
    titles = list(sections)
    assert titles[:3] == ["options", "model", "server"]
    assert titles.index("scheduling and KV cache") < titles.index("kernels") < \
        titles.index("executable cache") < titles.index("parallelism")
    flags = {flag: text for section in sections.values() for flag, text in section.items()}
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        assert flag in flags, flag
        placeholder, description = flags[flag].split(" || ")
        assert len(description.replace("(default:", "").split()) > 3, flag  # help, not a name
        assert "VALUE" not in placeholder.split(), flag  # the old untyped placeholder
    assert "--model" in sections["model"] and "--port" in sections["server"]
    assert "--max-num-seqs" in sections["scheduling and KV cache"]
    assert "Most requests running" in flags["--max-num-seqs"]  # the field's own comment
    assert "--no-disable" not in out and "--no-enforce" not in out
    assert "--disable-prefill-graph" in out and "--no-compile-cache" in out
    # the dtype choices are the loader's, and its help says what "auto" picks
    assert flags["--dtype"].startswith(" {auto," + ",".join(DTYPES) + "}")
    assert "CPU" in flags["--dtype"] and "bfloat16" in flags["--dtype"]
    assert "--log-level" in sections["server"] and "(default: info)" in flags["--log-level"]


def test_bad_flag_value_is_reported():
    result = subprocess.run([*SERVE, "--max-model-len", "0"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2
    assert "max_model_len must be >= 1, got 0" in result.stderr


SERVE_TINY = ["--model", MODEL_DIR, "--served-model-name", "tiny", "--max-model-len", "96",
              "--num-pages", "32", "--page-size", "8", "--prefill-graph-capture-token-sizes", "32",
              "--prefill-graph-capture-batch-sizes", "2", "--decode-graph-capture-batch-sizes", "2",
              "--max-num-seqs", "2", "--no-compile-progress"]


@contextlib.contextmanager
def serving(*flags: str) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """scripts/serve.py on the tiny model in a process of its own, once it printed ``ready:``;
    yields the process, its base URL and its output up to the ready line (the last line), and
    kills it if the test left it running."""
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, *SERVE_TINY, "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("ready:") for line in lines):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(process.stdout.readline())
        assert "executables in" in lines[-1]
        yield process, f"http://127.0.0.1:{port}", "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stream_with_sigterm(process: subprocess.Popen, url: str, body: dict) -> list[str]:
    """Stream ``body``; SIGTERM the server when the first event arrives; every event after."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                process.send_signal(signal.SIGTERM)
            events.append(line[6:])
    return events


def test_sigterm_finishes_in_flight_requests_then_exits_0():
    with serving() as (process, url, _):
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        events = stream_with_sigterm(process, url, body)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 40
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
        # the default log level shows one line per finished request
        assert re.search(r"request cmpl-\w+-0 finished: 3 prompt tokens, 40 output tokens, "
                         r"TTFT [\d.]+s, latency [\d.]+s, finish reason length",
                         process.stdout.read())


def test_sigterm_ends_requests_still_running_at_the_deadline_then_exits_0():
    """With no time to drain, the request in flight ends with an error event and [DONE]: 32
    samples of the whole context on two rows take over a thousand decode steps, far longer than
    the signal's handling."""
    with serving("--shutdown-timeout", "0") as (process, url, _):
        body = {"model": "tiny", "prompt": [5, 6, 7], "n": 32, "ignore_eos": True,
                "temperature": 0}
        events = stream_with_sigterm(process, url, body)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"]
        assert process.wait(timeout=60) == 0
        assert re.search(r"ending \d+ requests still running", process.stdout.read())


def test_ready_line_counts_the_buckets_left_to_the_background_compile(tmp_path):
    """Token buckets 16, 48 and 64: the skeleton leaves 48 (its encoder) to the
    background, and the ready line says so (an empty cache of its own: a cache holding them
    would make them ready at once). A request at once gets the reference generator's tokens,
    and SIGTERM exits 0 whether or not the background compile is done."""
    with serving("--prefill-graph-capture-token-sizes", "16,48,64",
                 "--prefill-graph-max-tokens", "64", "--chunked-prefill-size", "64",
                 "--compile-cache-dir", str(tmp_path)) as (
            process, url, ready):
        assert ready.rstrip().endswith(
            "; 4 of 5 buckets ready, 1 bucket plan left to load or compile in the background")
        prompt = list(range(5, 25))
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        expected = Reference(MODEL_DIR).generate([prompt], greedy(6, ignore_eos=True))[0].text
        assert response.json()["choices"][0]["text"] == expected
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
