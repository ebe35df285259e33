"""The on-disk executable cache across real process restarts (graph/cache.py, PlanCompiler).

Each start is a fresh ``python`` process (this file run as a script) that builds a tiny Llama
ModelRunner (or the tiny Kimi-Linear KimiRunner), compiles it against a cache directory, and
generates a few greedy tokens.
Compiles are counted by jax's own monitoring events (backend compile, tracing, lowering) during
``compile_all``, never by the cache's own report. Starts are compared against the cold start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed_jax import cache as cache_cli
from tokenspeed_jax.graph.cache import SUFFIX, ExecutableCache, package_source_hash
from tokenspeed_jax.graph.trust import load_mac_key

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# Distinct executables of the tiny runner below: embed+qkv, out+qkv, out, the attention break and
# the narrowing (token bucket 16); per request bucket (1, 2): head, resample, penalized resample;
# one decode step (decode buckets 1 and 2 share the two-row executable).
NUM_EXECUTABLES = 5 + 3 * 2 + 1
# Narrow and the resample plans read only their arguments: no model state in their keys.
NUM_STATELESS = 1 + 2 * 2
NEW_DECODE_BUCKET = 3  # decode, resample and penalized resample of one more decode bucket


def llama_runner(options: dict):
    """The tiny random Llama's ModelRunner over ``options['cache_dir']`` (not compiled yet)."""
    import jax.numpy as jnp
    from flax import nnx

    from tokenspeed_jax.config import EngineConfig
    from tokenspeed_jax.engine.model_runner import ModelRunner
    from tokenspeed_jax.models.llama import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=options.get("eps", 1e-5))
    model = LlamaForCausalLM(model_config, dtype=jnp.float32, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(0))
    decode = tuple(options.get("decode", (1, 2)))
    config = EngineConfig(
        prefill_graph_capture_token_sizes=(16,), prefill_graph_max_tokens=16,
        chunked_prefill_size=16, prefill_graph_capture_batch_sizes=(1, 2),
        prefill_graph_max_bs=2, decode_graph_capture_batch_sizes=decode,
        decode_graph_max_bs=max(decode), max_model_len=64, compile_progress=False,
        compile_cache_dir=options["cache_dir"], strict_no_compile=True,
        xla_compiler_options=tuple(options.get("xla", ())))
    return ModelRunner(model, config, num_pages=8, page_size=16)


def kimi_runner(options: dict):
    """test_kimi_runner's module runner over ``options['cache_dir']`` (not compiled yet)."""
    from test_kimi_runner import new_runner

    return new_runner(compile_cache_dir=options["cache_dir"])


# options["model"] -> (runner factory, whether each request needs a KDA state row)
RUNNERS = {"llama": (llama_runner, False), "kimi": (kimi_runner, True)}


def child(options: dict) -> None:
    """One start-up: compile against ``options['cache_dir']``, generate, print a JSON line."""
    from jax import monitoring

    counts = {BACKEND_COMPILE: 0, TRACE: 0, LOWER: 0}
    window = {"open": False}

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        if window["open"] and event in counts:
            counts[event] += 1

    monitoring.register_event_duration_secs_listener(on_event)

    import numpy as np

    from tokenspeed_jax.engine.batch import StepBatch, StepRequest
    from tokenspeed_jax.sampling_params import SamplingParams

    make_runner, state_rows = RUNNERS[options.get("model", "llama")]
    runner = make_runner(options)
    window["open"] = True
    summary = runner.compile_all()
    window["open"] = False

    greedy = SamplingParams(temperature=0.0)
    prompts = {"a": [5, 17, 33, 2, 9], "b": [101, 7, 7, 250, 3, 64, 12, 8, 90]}
    requests = [StepRequest(rid, np.array(ids, np.int32), 0, np.array([row + 1], np.int32), True,
                            greedy, state_slot=row if state_rows else -1)
                for row, (rid, ids) in enumerate(prompts.items())]
    outputs = {rid: [] for rid in prompts}
    logprobs = []
    for _ in range(4):
        out = runner.step(StepBatch(requests))
        logprobs += out.logprobs.tolist()
        for request, token in zip(requests, out.token_ids.tolist()):
            outputs[request.request_id].append(token)
        requests = [dataclasses.replace(r, token_ids=np.array([outputs[r.request_id][-1]],
                                                              np.int32),
                                        start_pos=r.end_pos,
                                        output_token_ids=list(outputs[r.request_id]))
                    for r in requests]
    print(json.dumps({
        "backend_compiles": counts[BACKEND_COMPILE], "traces": counts[TRACE],
        "lowerings": counts[LOWER], "loaded": summary.num_loaded,
        "compiled": summary.num_compiled, "executables": summary.num_executables,
        "direct": summary.num_direct,
        "outputs": outputs, "logprobs": logprobs, "package": package_source_hash(),
        "runtime_compiles": runner.stats()["runtime_compiles"],
    }))


def _command(options: dict) -> list[str]:
    return [sys.executable, __file__, json.dumps(options)]


def _result(process: subprocess.CompletedProcess) -> dict:
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    result["stderr"] = process.stderr
    return result


def start(cache_dir: Path, **options) -> dict:
    """One start-up in a fresh process."""
    process = subprocess.run(_command({"cache_dir": str(cache_dir), **options}),
                             capture_output=True, text=True, timeout=300, check=False)
    return _result(process)


def same_code(*results: dict) -> bool:
    """The package source did not change between these starts (it is shared with other work in
    progress; a change keys every executable anew, correctly, but defeats the comparison)."""
    return len({r["package"] for r in results}) == 1


def retried(body, attempts: int = 3) -> None:
    """Run ``body`` (which returns its starts) until all its starts saw the same package."""
    for _ in range(attempts):
        if same_code(*body()):
            return
    pytest.fail("the package source kept changing during the test")


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> tuple[Path, dict]:
    """A cache filled by one cold start, and that start's result."""
    directory = tmp_path_factory.mktemp("cold")
    result = start(directory)
    assert result["loaded"] == 0
    assert result["compiled"] == result["executables"] == NUM_EXECUTABLES
    assert result["direct"] == NUM_EXECUTABLES  # every replay skips Compiled.__call__
    assert result["backend_compiles"] == NUM_EXECUTABLES
    assert len(list(directory.glob(f"*{SUFFIX}"))) == NUM_EXECUTABLES
    return directory, result


def _copy(cold: tuple[Path, dict], tmp_path: Path) -> tuple[Path, dict]:
    """A private copy of the cold cache and the start that filled it: the cold start, or a
    refill when the package source changed since (so its entries match the current code)."""
    directory, result = cold
    target = tmp_path / "cache"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(directory, target)
    if package_source_hash.__wrapped__() != result["package"]:
        result = start(target)
    return target, result


def test_warm_start_compiles_nothing_and_gives_identical_outputs(cold, tmp_path):
    def body():
        directory, first = _copy(cold, tmp_path)
        warm = start(directory)
        if not same_code(first, warm):
            return first, warm
        assert (warm["backend_compiles"], warm["traces"], warm["lowerings"]) == (0, 0, 0)
        assert warm["loaded"] == NUM_EXECUTABLES and warm["compiled"] == 0
        assert warm["direct"] == NUM_EXECUTABLES  # deserialized executables too
        assert warm["outputs"] == first["outputs"]
        assert warm["logprobs"] == first["logprobs"]
        assert warm["runtime_compiles"] == 0
        return first, warm

    retried(body)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 16])
                         + data[middle + 16:])


def test_corrupt_entries_are_logged_recompiled_and_replaced(cold, tmp_path):
    def body():
        directory, first = _copy(cold, tmp_path)
        truncated, flipped = sorted(directory.glob(f"*{SUFFIX}"))[:2]
        _damage(truncated, "truncate")
        _damage(flipped, "flip")
        damaged = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (truncated, flipped)}
        result = start(directory)
        if not same_code(first, result):
            return first, result
        assert result["backend_compiles"] == 2 and result["compiled"] == 2
        assert result["loaded"] == NUM_EXECUTABLES - 2
        assert result["outputs"] == first["outputs"]
        assert result["stderr"].count("is unusable") == 2
        for path, digest in damaged.items():
            assert hashlib.sha256(path.read_bytes()).hexdigest() != digest  # replaced
        infos = list(ExecutableCache(directory, load_mac_key()).scan(verify=True))
        assert len(infos) == NUM_EXECUTABLES and all(i.problem is None for i in infos)
        return first, result

    retried(body)


def test_changed_bucket_list_compiles_only_the_new_bucket(cold, tmp_path):
    def body():
        directory, first = _copy(cold, tmp_path)
        result = start(directory, decode=(1, 2, 4))
        if not same_code(first, result):
            return first, result
        assert result["executables"] == NUM_EXECUTABLES + NEW_DECODE_BUCKET
        assert result["backend_compiles"] == result["compiled"] == NEW_DECODE_BUCKET
        assert result["loaded"] == NUM_EXECUTABLES
        return first, result

    retried(body)


def test_changed_model_config_misses_only_entries_that_read_it(cold, tmp_path):
    def body():
        directory, first = _copy(cold, tmp_path)
        result = start(directory, eps=1e-6)
        if not same_code(first, result):
            return first, result
        assert result["backend_compiles"] == result["compiled"] == NUM_EXECUTABLES - NUM_STATELESS
        assert result["loaded"] == NUM_STATELESS
        # the first model's entries are kept beside the new ones
        assert len(list(directory.glob(f"*{SUFFIX}"))) == 2 * NUM_EXECUTABLES - NUM_STATELESS
        return first, result

    retried(body)


def test_compiler_options_are_part_of_the_key(cold, tmp_path):
    """Other XLA options miss every entry (and, harmless on the CPU, give the same outputs); a
    second start with them loads what the first compiled."""
    serialize = ["xla_gpu_command_buffer_scheduling_mode=SERIALIZE"]

    def body():
        directory, first = _copy(cold, tmp_path)
        other = start(directory, xla=serialize)
        again = start(directory, xla=serialize)
        if not same_code(first, other, again):
            return first, other, again
        assert other["compiled"] == other["backend_compiles"] == NUM_EXECUTABLES
        assert other["loaded"] == 0
        assert (other["outputs"], other["logprobs"]) == (first["outputs"], first["logprobs"])
        assert again["loaded"] == NUM_EXECUTABLES and again["backend_compiles"] == 0
        return first, other, again

    retried(body)


def test_two_processes_starting_at_once_on_an_empty_cache(cold, tmp_path):
    def body():
        directory = tmp_path / "shared"
        shutil.rmtree(directory, ignore_errors=True)
        command = _command({"cache_dir": str(directory)})
        processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2)]
        results = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            results.append(_result(subprocess.CompletedProcess(
                process.args, process.returncode, stdout, stderr)))
        third = start(directory)
        if not same_code(*results, third):
            return [*results, third]
        assert all(r["outputs"] == cold[1]["outputs"] for r in results)
        assert third["backend_compiles"] == 0 and third["loaded"] == NUM_EXECUTABLES
        assert third["outputs"] == cold[1]["outputs"]
        assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []
        infos = list(ExecutableCache(directory, load_mac_key()).scan(verify=True))
        assert len(infos) == NUM_EXECUTABLES and all(i.problem is None for i in infos)
        return [*results, third]

    retried(body)


def test_kimi_executables_load_in_a_second_process():
    """Kimi Linear's executables (KDA chunk scans and recurrent step, MLA, routed experts, state
    restore) load in a fresh process as the Llama ones do. The starts use the session's cache
    (conftest.py) and test_kimi_runner's runner, so that module loads what they compiled; the
    first start loads too when the cache already holds them, from another process either way."""
    from tokenspeed_jax.config import EngineConfig

    directory = EngineConfig().compile_cache_path

    def body():
        first = start(directory, model="kimi")
        second = start(directory, model="kimi")
        if not same_code(first, second):
            return first, second
        assert first["compiled"] + first["loaded"] == first["executables"] > 10
        assert (second["backend_compiles"], second["traces"], second["lowerings"]) == (0, 0, 0)
        assert second["loaded"] == second["direct"] == first["executables"]
        assert second["compiled"] == 0 and second["runtime_compiles"] == 0
        assert (second["outputs"], second["logprobs"]) == (first["outputs"], first["logprobs"])
        return first, second

    retried(body)


def test_cli_lists_verifies_and_clears(cold, tmp_path, capsys):
    directory, _ = _copy(cold, tmp_path)
    assert cache_cli.main(["list", "--dir", str(directory)]) == 0
    listing = capsys.readouterr().out
    assert f"{NUM_EXECUTABLES} entries" in listing
    for segment, bucket in (("embed+qkv", "prefill T=16"), ("decode", "decode B=2"),
                            ("narrow", "narrow T=16"), ("head", "head B=1"),
                            ("sample", "resample B=2")):
        assert any(segment in line and bucket in line for line in listing.splitlines())
    assert cache_cli.main(["verify", "--dir", str(directory)]) == 0
    assert f"{NUM_EXECUTABLES} ok, 0 bad" in capsys.readouterr().out
    broken = min(directory.glob(f"*{SUFFIX}"))
    _damage(broken, "flip")
    assert cache_cli.main(["verify", "--dir", str(directory), "--delete"]) == 1
    report = capsys.readouterr().out
    assert "MAC mismatch" in report and "1 bad (deleted)" in report
    assert not broken.exists()
    assert cache_cli.main(["clear", "--dir", str(directory)]) == 0
    assert f"removed {NUM_EXECUTABLES - 1} entries" in capsys.readouterr().out
    assert list(directory.iterdir()) == []


def test_compile_cache_flags_and_default_directory(monkeypatch, tmp_path):
    from tokenspeed_jax.config import EngineConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert EngineConfig().compile_cache_path == os.path.join(
        str(tmp_path), "tokenspeed_jax", "executables")
    assert EngineConfig(compile_cache_dir="/x").compile_cache_path == "/x"
    assert EngineConfig(compile_cache=False).compile_cache_path is None


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
