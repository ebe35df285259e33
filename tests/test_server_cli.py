"""scripts/serve.py as a user runs it: flags, the ready line, and a graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

MODEL_DIR = "tests/golden/tiny_llama"
SERVE = [sys.executable, "scripts/serve.py"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_documents_every_config_flag():
    out = subprocess.run([*SERVE, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--prefill-graph-max-tokens", "--chunked-prefill-size", "--max-num-seqs",
                 "--decode-graph-max-bs", "--enforce-eager", "--num-pages", "--mem-fraction",
                 "--no-enable-prefix-caching"):
        assert flag in out
    assert "Most requests running" in out  # the field's own comment is the help text


def test_bad_flag_value_is_reported():
    result = subprocess.run([*SERVE, "--max-model-len", "0"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2
    assert "max_model_len must be >= 1, got 0" in result.stderr


def test_sigterm_finishes_in_flight_requests_then_exits():
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, "--model", MODEL_DIR, "--port", str(port), "--served-model-name", "tiny",
         "--max-model-len", "96", "--num-pages", "32", "--page-size", "8",
         "--prefill-graph-capture-token-sizes", "32", "--prefill-graph-capture-batch-sizes", "2",
         "--decode-graph-capture-batch-sizes", "2", "--max-num-seqs", "2",
         "--no-compile-progress"],
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
        ready = next(line for line in lines if line.startswith("ready:"))
        assert "executables in" in ready and "compiled in" in ready
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True,
                "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    process.send_signal(signal.SIGTERM)
                events.append(line[6:])
        assert events[-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"
        # uvicorn re-raises the signal once it has shut down gracefully
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
