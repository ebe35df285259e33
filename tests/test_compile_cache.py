"""The on-disk executable cache across real process restarts (graph/cache.py, PlanCompiler).

Each start is a fresh ``python`` process (this file run as a script) that builds the
ModelRunner of a tiny Llama (or of the tiny Kimi-Linear), compiles it against a cache directory, and
generates a few greedy tokens;
other starts build a whole engine (``build_engine`` with its KV cache sized from a free-memory
reading the test chooses) or a Kimi runner. Compiles are counted by jax's own monitoring events
(backend compile, tracing, lowering) from the runner's construction (its KV cache allocation)
on, never by the cache's own report. Starts are compared against the cold start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tokenspeed_jax import cache as cache_cli
from tokenspeed_jax.graph import Call, Plan, PlanCompiler, Segment
from tokenspeed_jax.graph import cache as cache_module
from tokenspeed_jax.graph.cache import SUFFIX, ExecutableCache, package_source_hash
from tokenspeed_jax.graph.trust import load_mac_key

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# Distinct executables of the tiny runner below: embed+qkv, out+qkv, out (with the sampled rows'
# gather) and the attention break (token bucket 16); per request bucket (1, 2): head, resample,
# penalized resample; one decode step (decode buckets 1 and 2 share the two-row executable).
NUM_EXECUTABLES = 4 + 3 * 2 + 1
# Made while the runner is built, before its plans: the zero-filled KV pages (graph/arrays.py).
NUM_ALLOCATING = 1
NUM_ENTRIES = NUM_EXECUTABLES + NUM_ALLOCATING
# The resample plans read only their arguments: no model state in their keys.
NUM_STATELESS = 2 * 2
NEW_DECODE_BUCKET = 3  # decode, resample and penalized resample of one more decode bucket


GOLDEN = Path(__file__).parent / "golden"
ENGINE_PROMPTS = [[5, 17, 33, 2, 9], [101, 7, 7, 250, 3, 64, 12, 8, 90]]
# A tiny Llama KV page (tests/golden/tiny_llama, serving.CONFIG's 8-token pages, float32 on the
# CPU): K and V of 2 KV heads x 16 dims per token, 2 layers, 4 bytes each.
TINY_LLAMA_PAGE_BYTES = 2 * 8 * 2 * 16 * 2 * 4
ENGINE_MEM_FRACTION = 0.5


def child(options: dict) -> None:
    """One start-up in the way ``options['mode']`` names (the runner by default) against
    ``options['cache_dir']``; prints a JSON line with the compile counts of its window."""
    from jax import monitoring

    counts = {BACKEND_COMPILE: 0, TRACE: 0, LOWER: 0}
    window = {"open": False}

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        if window["open"] and event in counts:
            counts[event] += 1

    monitoring.register_event_duration_secs_listener(on_event)

    @contextlib.contextmanager
    def counted():
        window["open"] = True
        try:
            yield
        finally:
            window["open"] = False

    starts = {"runner": _runner_start, "engine": _engine_start, "kimi": _kimi_start}
    result = starts[options.get("mode", "runner")](options, counted)
    print(json.dumps({**result, "backend_compiles": counts[BACKEND_COMPILE],
                      "traces": counts[TRACE], "lowerings": counts[LOWER],
                      "package": package_source_hash()}))


def _engine_start(options: dict, counted) -> dict:
    """``build_engine`` on serving.CONFIG with its KV cache sized from free memory, which reads
    ``options['free_bytes']``, then a first ``generate``: both counted."""
    import dataclasses

    from serving import CONFIG

    from tokenspeed_jax.engine import startup
    from tokenspeed_jax.sampling_params import SamplingParams

    startup.free_device_bytes = lambda: (options["free_bytes"], "test")
    config = dataclasses.replace(CONFIG, num_pages=None, mem_fraction=ENGINE_MEM_FRACTION,
                                 compile_cache_dir=options["cache_dir"])
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    with counted():
        bundle = startup.build_engine(config)
        completions = bundle.engine.generate([(p, greedy) for p in ENGINE_PROMPTS])
    summary = bundle.compile_summary
    return {"pages": bundle.engine.block_manager.num_pages,
            "kv_pages_shape": list(bundle.runner.pools["k_pages.0"].shape),
            "loaded": summary.num_loaded, "compiled": summary.num_compiled,
            "executables": summary.num_executables,
            "outputs": [group[0].token_ids for group in completions],
            "runtime_compiles": bundle.runner.stats()["runtime_compiles"]}


def _kimi_start(options: dict, counted) -> dict:
    """A Kimi runner of the tiny checkpoint built (its state pools and latent pages allocated),
    counted; its pools' shapes and dtypes, whether they are zero, and how many buffers."""
    import numpy as np

    from tokenspeed_jax.config import EngineConfig
    from tokenspeed_jax.engine.runner import ModelRunner
    from tokenspeed_jax.models.loader import load_checkpoint

    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    config = EngineConfig(max_model_len=64, compile_progress=False,
                          compile_cache_dir=options["cache_dir"])
    with counted():
        runner = ModelRunner(checkpoint.model, config, num_pages=12, num_state_slots=6,
                            page_size=16)
    pools = runner.pools
    return {"pools": {name: [list(pool.shape), str(pool.dtype)] for name, pool in pools.items()},
            "all_zero": not any(np.any(np.asarray(pool)) for pool in pools.values()),
            "buffers": len({pool.unsafe_buffer_pointer() for pool in pools.values()})}


def llama_runner(options: dict):
    """Builds the tiny random Llama's ModelRunner over ``options['cache_dir']`` (not compiled
    yet); the model is made now."""
    import jax.numpy as jnp
    from flax import nnx

    from tokenspeed_jax.config import EngineConfig
    from tokenspeed_jax.engine.runner import ModelRunner
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
    return functools.partial(ModelRunner, model, config, num_pages=8, page_size=16)


def kimi_runner(options: dict):
    """test_kimi_runner's module runner over ``options['cache_dir']`` (not compiled yet), on the
    ordinary prefill route alone (``disable_kda_prefill_graph``): every kind of Kimi executable
    in half the compile."""
    from test_kimi_runner import runner_builder

    return runner_builder(compile_cache_dir=options["cache_dir"], disable_kda_prefill_graph=True)


# options["model"] -> (what makes a builder of the runner, whose model is made outside the
# counted window; whether each request needs a KDA state row)
RUNNERS = {"llama": (llama_runner, False), "kimi": (kimi_runner, True)}


def _runner_start(options: dict, counted) -> dict:
    """A tiny runner (``options['model']``, Llama by default) built and compiled (counted),
    then four greedy steps."""
    import numpy as np

    from tokenspeed_jax.engine.batch import StepBatch, StepRequest
    from tokenspeed_jax.sampling_params import SamplingParams

    builder, state_rows = RUNNERS[options.get("model", "llama")]
    build = builder(options)
    with counted():
        runner = build()
        summary = runner.compile_all()

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
    return {"loaded": summary.num_loaded, "compiled": summary.num_compiled,
            "executables": summary.num_executables, "direct": summary.num_direct,
            "outputs": outputs, "logprobs": logprobs,
            "runtime_compiles": runner.stats()["runtime_compiles"]}


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
    assert result["backend_compiles"] == NUM_ENTRIES
    assert len(list(directory.glob(f"*{SUFFIX}"))) == NUM_ENTRIES
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


def plan_entries(directory: Path) -> list[Path]:
    """The entries of plan executables (not of the start-up allocation), by name."""
    infos = ExecutableCache(directory, None).scan()
    return sorted(i.path for i in infos if not i.header["segment"].startswith("zeros"))


def test_corrupt_entries_are_logged_recompiled_and_replaced(cold, tmp_path):
    def body():
        directory, first = _copy(cold, tmp_path)
        truncated, flipped = plan_entries(directory)[:2]
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
        assert len(infos) == NUM_ENTRIES and all(i.problem is None for i in infos)
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
        # the first model's entries are kept beside the new ones (the KV pages' allocation,
        # which reads no model state, is shared)
        assert (len(list(directory.glob(f"*{SUFFIX}")))
                == NUM_ENTRIES + NUM_EXECUTABLES - NUM_STATELESS)
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
        assert other["compiled"] == NUM_EXECUTABLES
        assert other["backend_compiles"] == NUM_ENTRIES  # the allocation takes the options too
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
        assert len(infos) == NUM_ENTRIES and all(i.problem is None for i in infos)
        return [*results, third]

    retried(body)


def test_cli_lists_verifies_and_clears(cold, tmp_path, capsys):
    directory, _ = _copy(cold, tmp_path)
    assert cache_cli.main(["list", "--dir", str(directory)]) == 0
    listing = capsys.readouterr().out
    assert f"{NUM_ENTRIES} entries" in listing
    for segment, bucket in (("embed+qkv", "prefill T=16"), ("decode", "decode B=2"),
                            ("out", "prefill T=16"), ("head", "head B=1"),
                            ("sample", "resample B=2")):
        assert any(segment in line and bucket in line for line in listing.splitlines())
    assert cache_cli.main(["verify", "--dir", str(directory)]) == 0
    assert f"{NUM_ENTRIES} ok, 0 bad" in capsys.readouterr().out
    broken = min(directory.glob(f"*{SUFFIX}"))
    _damage(broken, "flip")
    assert cache_cli.main(["verify", "--dir", str(directory), "--delete"]) == 1
    report = capsys.readouterr().out
    assert "MAC mismatch" in report and "1 bad (deleted)" in report
    assert not broken.exists()
    assert cache_cli.main(["clear", "--dir", str(directory)]) == 0
    assert f"removed {NUM_ENTRIES - 1} entries" in capsys.readouterr().out
    assert list(directory.iterdir()) == []


def test_compile_cache_flags_and_default_directory(monkeypatch, tmp_path):
    from tokenspeed_jax.config import EngineConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert EngineConfig().compile_cache_path == os.path.join(
        str(tmp_path), "tokenspeed_jax", "executables")
    assert EngineConfig(compile_cache_dir="/x").compile_cache_path == "/x"
    assert EngineConfig(compile_cache=False).compile_cache_path is None


def engine_free_bytes(pages: int) -> int:
    """A free-memory reading in which ``_engine_start``'s sizing affords ``pages`` KV pages."""
    return int((pages + 0.5) * TINY_LLAMA_PAGE_BYTES / ENGINE_MEM_FRACTION)


def test_warm_engine_with_other_free_memory_loads_everything_and_compiles_nothing(tmp_path):
    """The KV page count of a first start is kept by the next one although more memory is
    free (sized anew it would be 60 pages, every executable's shapes would change and each
    would compile), so the warm start builds the engine, allocates its KV cache and runs a
    first generate without one XLA compile."""

    def body():
        directory = tmp_path / "engine"
        shutil.rmtree(directory, ignore_errors=True)
        cold = start(directory, mode="engine", free_bytes=engine_free_bytes(40))
        warm = start(directory, mode="engine", free_bytes=engine_free_bytes(60))
        if not same_code(cold, warm):
            return cold, warm
        assert cold["pages"] == warm["pages"] == 40  # fewer than max_num_seqs' 8 x 12 pages
        assert cold["kv_pages_shape"] == warm["kv_pages_shape"] == [2, 40, 8, 16]
        assert cold["loaded"] == 0
        assert cold["backend_compiles"] == cold["executables"] + NUM_ALLOCATING
        assert warm["loaded"] == cold["executables"] and warm["compiled"] == 0
        # (loading the checkpoint traces the model's init abstractly: no lowering, no compile)
        assert (warm["backend_compiles"], warm["lowerings"]) == (0, 0)
        assert warm["outputs"] == cold["outputs"]
        assert all(len(tokens) == 6 for tokens in warm["outputs"])
        assert warm["runtime_compiles"] == 0
        return cold, warm

    retried(body)


def test_warm_kimi_runner_allocates_its_pools_without_compiling(tmp_path):
    """The state pools and latent pages of a Kimi runner come from cached executables: one per
    distinct pool shape at the first start, none at the next; every pool zero, in a buffer of
    its own, with the shapes the checkpoint's config gives."""
    config = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    linear = config["linear_attn_config"]
    heads, head_dim = linear["num_heads"], linear["head_dim"]
    state = [[6, heads, head_dim, head_dim], "float32"]
    conv = [[6, linear["short_conv_kernel_size"] - 1, 3 * heads * head_dim], "float32"]
    latent = [[12, 16, config["kv_lora_rank"] + config["qk_rope_head_dim"]], "float32"]
    expected = sorted([state, conv] * len(linear["kda_layers"])
                      + [latent] * len(linear["full_attn_layers"]))

    def body():
        directory = tmp_path / "kimi"
        shutil.rmtree(directory, ignore_errors=True)
        cold = start(directory, mode="kimi")
        warm = start(directory, mode="kimi")
        if not same_code(cold, warm):
            return cold, warm
        assert cold["backend_compiles"] == 3  # state, conv, latent
        assert warm["backend_compiles"] == warm["traces"] == warm["lowerings"] == 0
        for result in (cold, warm):
            assert sorted(result["pools"].values()) == expected
            assert result["all_zero"] and result["buffers"] == len(expected)
        return cold, warm

    retried(body)


def _double(params, x):
    return x * 2


def misses_logged(directory: Path, caplog, shape: tuple[int, ...], *, stage: str = "double",
                  options: dict | None = None) -> list[str]:
    """Compile a one-stage plan on ``shape`` against the cache in ``directory``: the cache-miss
    explanations it logged."""
    compiler = PlanCompiler(progress=False, cache=ExecutableCache(directory, load_mac_key()),
                            compiler_options=options)
    segment = Segment(stage, _double, ("x",), ("y",))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=cache_module.__name__):
        compiler.add("x", Plan([Call(segment)], ("x",), ("y",)),
                     {"x": jax.ShapeDtypeStruct(shape, jnp.float32)})
        compiler.compile_all()
    return [r.getMessage() for r in caplog.records if "compile cache miss" in r.getMessage()]


def test_a_cache_miss_logs_which_parts_of_the_key_differ(tmp_path, caplog, monkeypatch):
    serialize = {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}
    assert misses_logged(tmp_path, caplog, (4,)) == []  # nothing to compare with yet
    (message,) = misses_logged(tmp_path, caplog, (8,))
    assert "double @ x" in message and "argument shapes" in message
    assert "float32[4] -> float32[8]" in message
    assert "compiler options" not in message and "package" not in message
    # closest: the (4,) entry, which differs in the options alone
    (message,) = misses_logged(tmp_path, caplog, (4,), options=serialize)
    assert "compiler options" in message and "SERIALIZE" in message
    assert "argument shapes" not in message
    assert misses_logged(tmp_path, caplog, (8,)) == []  # a hit
    assert misses_logged(tmp_path, caplog, (8,), stage="other") == []  # no entry of the stage
    edited = tuple((name, "0" * 64 if name == "package" else value)
                   for name, value in cache_module.environment())
    monkeypatch.setattr(cache_module, "environment", lambda: edited)
    (message,) = misses_logged(tmp_path, caplog, (8,))
    assert "executable source hash" in message and "argument shapes" not in message


def test_kimi_executables_load_in_a_second_process():
    """Kimi Linear's executables (KDA chunk scans and recurrent step, MLA, routed experts, state
    restore) load in a fresh process as the Llama ones do. The starts use the session's cache
    (conftest.py) and test_kimi_runner's runner on its ordinary route, so that module loads what
    they compiled (all but its inline route's); the first start loads too when the cache already
    holds them, from another process either way."""
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


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
