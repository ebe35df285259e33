"""Tensor parallelism for Kimi Linear and for the Pallas decode attention under ``shard_map``.

Like ``test_tensor_parallel.py``, the sharded runs happen in a subprocess that sees 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): this file run as a script is that
worker and prints one JSON line. Expectations: HF transformers' greedy tokens and the logits of
each greedy step in ``tests/golden/tiny_kimi.npz`` (``golden_checks``), the tp=1 run of the same
engine (itself pinned to the same golden file by ``test_kimi_engine.py``), and for the decode
kernel the plain-JAX reference attention.

The tiny Kimi checkpoint has 2 heads (KDA and MLA) and 8 experts: at tp=2 the engine's greedy
tokens and per-step log-probabilities must be HF's, and tp=4 is an error naming the head count.
tp=4 runs on a 4-head variant with random weights written here in the checkpoint format
(``kimi_weight_map`` gives every tensor's name and shape), on 4 of the 7 layers (each layer kind
and each pair of neighbouring kinds kept). Each engine start-up compiles at one 16-token
prefill bucket, so the worker builds only two engines, and each prefill route runs sharded, the
one it compiles alone: tp=2 the ordinary route (``disable_kda_prefill_graph``: a quarter of the
compile of both routes on 7 layers, whose inline segments each hold their KDA kernels), tp=4
the inline one (``tiny_checkpoints.inline_route_only``: its prompts of 8 and 14 tokens
prefill in chunks of 8 + 8, then 6, never the one-token continuation the ordinary route
takes). tp=4 on the 4-head variant is checked against the plain reference forward
(``LLM.logits``) over its prompts and tokens.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from golden_checks import assert_steps_match_golden, step_logprobs

GOLDEN = Path(__file__).parent / "golden"
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53])
ENGINE = {  # one small bucket per route keeps each start-up compile short
    "strict_no_compile": True, "compile_progress": False, "dtype": "float32",
    "max_model_len": 96, "num_pages": 12, "page_size": 16, "max_num_seqs": 2,
    "prefill_graph_max_tokens": 16, "prefill_graph_capture_token_sizes": (16,),
    "prefill_graph_capture_batch_sizes": (2,), "prefill_graph_max_bs": 2,
    "decode_graph_capture_batch_sizes": (2,), "decode_graph_max_bs": 2,
    "chunked_prefill_size": 16, "enable_prefix_caching": False,
}
SERVED_PROMPT = [7, 30, 31, 32, 33, 34]


# ----------------------------------------------------------------------------- the worker


def _wide_kimi(root: Path) -> Path:
    """tiny_kimi's config with 4 KDA and 4 MLA heads and 4 of its 7 layers (KDA with the dense
    MLP, KDA and MLA with experts, a KDA layer after the MLA one: every layer kind and every
    neighbour of one), random weights in the checkpoint layout."""
    from safetensors.numpy import save_file
    from tiny_checkpoints import save_word_tokenizer

    from tokenspeed_jax.models.kimi_linear import KimiLinearConfig, kimi_weight_map

    raw = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    raw["num_attention_heads"] = raw["num_key_value_heads"] = 4
    raw["linear_attn_config"]["num_heads"] = 4
    raw["num_hidden_layers"] = 4
    raw["linear_attn_config"]["kda_layers"], raw["linear_attn_config"]["full_attn_layers"] = (
        [1, 2, 4], [3])
    rng = np.random.default_rng(0)
    tensors = {}
    for name, weight in kimi_weight_map(KimiLinearConfig.from_hf(raw)).items():
        offset = 1.0 if name.endswith(("norm.weight", "layernorm.weight")) else 0.0
        tensors[name] = (offset + 0.2 * rng.standard_normal(weight.hf_shape)).astype(np.float32)
    path = root / "wide_kimi"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "model.safetensors"))
    save_word_tokenizer(path)
    return path


def _served_text(llm) -> str:
    """One greedy completion of ``SERVED_PROMPT`` through the HTTP server on ``llm``'s engine."""
    import httpx
    from test_server import running_server

    from tokenspeed_jax.engine.async_engine import AsyncEngine
    from tokenspeed_jax.server.app import ServerState

    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        with running_server(ServerState("kimi", engine, llm.runner.stats)) as url:
            reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "kimi", "prompt": SERVED_PROMPT, "max_tokens": 5, "temperature": 0.0})
            reply.raise_for_status()
            return reply.json()["choices"][0]["text"]
    finally:
        engine.shutdown()


def _generate(path: Path, tp: int, *, golden: bool = False, **options) -> dict:
    """Greedy runs of ``PROMPTS`` (or with ``golden``, of the golden prompts, plus one request
    through the server and the reference forward's logits of the first golden prompt), on an
    engine of ``ENGINE`` with ``options``."""
    from tokenspeed_jax import LLM, SamplingParams

    data = np.load(GOLDEN / "tiny_kimi.npz")
    llm = LLM(str(path), tensor_parallel_size=tp, **{**ENGINE, **options})
    prompts = data["prompt_ids"].tolist() if golden else list(PROMPTS)
    max_tokens = data["greedy_ids"].shape[1] if golden else 6
    completions = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       logprobs=20, ignore_eos=True))
    runner = llm.runner
    mlp = llm.model.layers[1].mlp
    result = {
        "steps": [step_logprobs(c) for c in completions],
        "runtime_compiles": llm.stats()["runtime_compiles"],
        "routes": {r: llm.stats()[f"{r}_runs"]
                   for r in ("prefill", "ordinary", "decode", "eager")},
        "shards": {
            "state": list(runner.pools["state.0"].addressable_shards[0].data.shape),
            "conv": list(runner.pools["conv.0"].addressable_shards[0].data.shape),
            "latent": list(runner.pools["latent.2"].addressable_shards[0].data.shape),
            "w1": list(mlp.w1[...].addressable_shards[0].data.shape),
            "kda_q_proj": list(llm.model.layers[0].self_attn.q_proj[...]
                               .addressable_shards[0].data.shape),
        },
    }
    if golden:
        (local,) = llm.generate([SERVED_PROMPT], SamplingParams(temperature=0.0, max_tokens=5,
                                                                ignore_eos=True))
        result["logits"] = llm.logits(data["prompt_ids"][0].tolist()).tolist()
        result["local"] = local.text
        result["served"] = _served_text(llm)
        result["runtime_compiles_after_serving"] = llm.stats()["runtime_compiles"]
    else:  # the reference forward's logits at each step of each greedy run
        result["step_logits"] = [
            llm.logits([*prompt, *c.token_ids[:-1]])[len(prompt) - 1:].tolist()
            for prompt, c in zip(prompts, completions, strict=True)]
    runner.guard.disarm()
    return result


def _tp_error(path: Path, tp: int) -> str:
    from tokenspeed_jax import LLM

    try:
        LLM(str(path), tensor_parallel_size=tp, **ENGINE)
    except ValueError as error:
        return str(error)
    return ""


def _decode_kernel(mesh_size: int) -> dict:
    """The Pallas paged decode op (interpreted) per shard of 4 KV heads vs the reference."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax.kernels.attention import paged_decode_attention
    from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, DecodeKernel
    from tokenspeed_jax.parallel import head_spec, make_mesh

    mesh = make_mesh(mesh_size)
    kernel = DecodeKernel(PALLAS, pages_per_compute_block=2, k_splits=2, interpret=True,
                          mesh=mesh)
    rng = np.random.default_rng(3)
    kv_heads, q_heads, pages, page, dim = 4, 8, 10, 8, 16
    q = rng.standard_normal((3, q_heads, dim)).astype(np.float32)
    k_pages, v_pages = (rng.standard_normal((kv_heads, pages, page, dim)).astype(np.float32)
                        for _ in range(2))
    tables = rng.permutation(pages)[:9].reshape(3, 3).astype(np.int32)
    positions = np.array([20, 3, -1], np.int32)
    split = jax.sharding.NamedSharding(mesh, head_spec(4, axis=0))
    heads = jax.sharding.NamedSharding(mesh, head_spec(3))
    args = (jax.device_put(q, heads), jax.device_put(k_pages, split),
            jax.device_put(v_pages, split), tables, positions)
    got = jax.jit(lambda *a: paged_decode_attention(*a, scale=0.25, kernel=kernel),
                  out_shardings=heads)(*args)
    want = paged_decode_attention(*map(jnp.asarray, (q, k_pages, v_pages, tables, positions)),
                                  scale=0.25)
    return {"max_error": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
            "devices": len(got.sharding.device_set)}


def _llama_pallas_decode(tp: int, fused: bool = True) -> dict:
    """tiny_llama (2 KV heads) through LLM with Pallas decode attention per shard (interpreted):
    the fused kernel (the default) or, without ``fused``, JAX's op."""
    import dataclasses

    from tokenspeed_jax import LLM, SamplingParams
    from tokenspeed_jax.kernels.paged_attention_backend import choose_decode_kernel
    from tokenspeed_jax.models.llama import forward as llama_forward

    def pallas_kernel(**options):
        kernel = choose_decode_kernel(**options, platform="gpu")
        return dataclasses.replace(kernel, pages_per_compute_block=2, k_splits=2, interpret=True)

    llama_forward.choose_decode_kernel = pallas_kernel
    llm = LLM(str(GOLDEN / "tiny_llama"), tensor_parallel_size=tp, fused_decode_attention=fused,
              **{**ENGINE, "page_size": 8})
    completions = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=6,
                                                             logprobs=0, ignore_eos=True))
    kernel = llm.runner.forward.decode_kernel
    result = {"steps": [step_logprobs(c) for c in completions],
              "backend": kernel.backend, "kernel_devices": 0 if kernel.mesh is None
              else kernel.mesh.size, "decode_runs": llm.stats()["decode_runs"],
              "runtime_compiles": llm.stats()["runtime_compiles"]}
    llm.runner.guard.disarm()
    return result


def _worker(mode: str) -> dict:
    if mode == "kimi":
        from tiny_checkpoints import inline_route_only, tiny_kimi

        with tempfile.TemporaryDirectory() as directory:
            tiny, wide = tiny_kimi(Path(directory) / "tiny_kimi"), _wide_kimi(Path(directory))
            with inline_route_only():
                wide_run = _generate(wide, 4)
            return {"tiny": _generate(tiny, 2, golden=True, disable_kda_prefill_graph=True),
                    "wide": wide_run, "tiny_tp4_error": _tp_error(tiny, 4)}
    if mode == "decode":
        from tokenspeed_jax.kernels.paged_attention_backend import choose_decode_kernel
        from tokenspeed_jax.parallel import make_mesh

        def choice(kv_heads: int) -> str:
            kernel = choose_decode_kernel(head_dim=64, page_size=16, dtype="bfloat16",
                                          platform="gpu", mesh=make_mesh(4),
                                          num_kv_heads=kv_heads)
            return f"{kernel.backend} {0 if kernel.mesh is None else kernel.mesh.size}"

        return {"kernel": _decode_kernel(2), "choice": {"8": choice(8), "2": choice(2)},
                "llama": {tp: _llama_pallas_decode(tp) for tp in (1, 2)},
                "llama_op": _llama_pallas_decode(2, fused=False)}
    raise ValueError(f"unknown worker mode {mode!r}")


def run_worker(*args: str) -> dict:
    """Run this file as a 4-device worker; its JSON result."""
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, *args, timeout=900)


# float32 log-probabilities whose sums are split over the devices: a few ulps of a value near 4
LOGPROB_ATOL = 5e-5


def assert_same_run(run: dict, base: dict, label: str) -> None:
    for got, want in zip(run["steps"], base["steps"], strict=True):
        assert got["token_ids"] == want["token_ids"], label
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=LOGPROB_ATOL,
                                   err_msg=label)
        for got_top, want_top in zip(got["top"], want["top"], strict=True):
            np.testing.assert_allclose([v for _, v in got_top], [v for _, v in want_top],
                                       atol=LOGPROB_ATOL, err_msg=label)


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def kimi() -> dict:
    return run_worker("kimi")


def test_kimi_tp2_gives_the_transformers_tokens_and_logprobs(kimi):
    golden = np.load(GOLDEN / "tiny_kimi.npz")
    for row, steps in enumerate(kimi["tiny"]["steps"]):
        label = f"tp=2 prompt {row}"
        assert steps["token_ids"] == golden["greedy_ids"][row].tolist(), label
        assert_steps_match_golden(steps, golden["greedy_logits"][row], label=label)
    # LLM.logits: the reference forward over the same sharded weights
    np.testing.assert_allclose(kimi["tiny"]["logits"], golden["logits"][0], atol=1e-4)


def test_kimi_tp2_serves_what_it_generates(kimi):
    assert kimi["tiny"]["served"] == kimi["tiny"]["local"]
    assert len(kimi["tiny"]["served"].split()) == 5


def test_kimi_tp4_matches_the_reference_forward_on_four_heads(kimi):
    wide = kimi["wide"]
    for row, (steps, logits) in enumerate(zip(wide["steps"], wide["step_logits"], strict=True)):
        assert_steps_match_golden(steps, np.asarray(logits), label=f"wide kimi tp=4 prompt {row}")


def test_kimi_sharded_runs_take_the_compiled_routes_and_compile_nothing(kimi):
    """tp=2 prefills on the ordinary route (KDA kernel at a break), tp=4 on the inline one,
    each the only route its engine compiles."""
    for run in (kimi["tiny"], kimi["wide"]):
        assert run["runtime_compiles"] == 0
        assert run["routes"]["prefill"] > 0 and run["routes"]["decode"] > 0
        assert run["routes"]["eager"] == 0
    assert kimi["tiny"]["routes"]["ordinary"] == kimi["tiny"]["routes"]["prefill"]
    assert kimi["wide"]["routes"]["ordinary"] == 0
    assert kimi["tiny"]["runtime_compiles_after_serving"] == 0


def test_kimi_weights_and_pools_are_split(kimi):
    # heads of 16 (KDA), conv window 3 x (heads x 3 x 16), 8 experts of [64, 32], latent rows
    # of 16 + 8 in 12 pages of 16
    # (run, tp, heads per device): tiny has 2 heads, wide 4
    for run, tp, heads in ((kimi["tiny"], 2, 1), (kimi["wide"], 4, 1)):
        assert run["shards"]["state"][1] == heads
        assert run["shards"]["conv"][2] == heads * 3 * 16
        assert run["shards"]["kda_q_proj"] == [64, heads, 16]
        assert run["shards"]["w1"] == [8 // tp, 64, 32]
        assert run["shards"]["latent"] == [12, 16, 24]  # replicated


def test_kimi_heads_that_do_not_split_are_an_error(kimi):
    assert kimi["tiny_tp4_error"] == "tensor_parallel_size=4 must divide num_attention_heads=2"


@pytest.fixture(scope="module")
def decode() -> dict:
    return run_worker("decode")


def test_pallas_decode_attention_per_shard_matches_reference(decode):
    assert decode["kernel"]["devices"] == 2
    assert decode["kernel"]["max_error"] < 1e-5


def test_replicated_kv_heads_take_the_reference_decode_declared_at_start_up(decode):
    # 8 KV heads split over 4 devices: the op per shard; 2 KV heads replicated 4 ways: reference
    assert decode["choice"] == {"8": "pallas 4", "2": "reference 0"}


def test_pallas_decode_attention_in_the_tp2_runner(decode):
    """The fused kernel (the default) on 1 and 2 devices, and JAX's op on 2: the same run."""
    one, two, op = decode["llama"]["1"], decode["llama"]["2"], decode["llama_op"]
    assert one["backend"] == two["backend"] == "fused" and op["backend"] == "pallas"
    assert [one["kernel_devices"], two["kernel_devices"], op["kernel_devices"]] == [0, 2, 2]
    assert_same_run(two, one, "tiny_llama tp=2, fused decode per shard")
    assert_same_run(op, one, "tiny_llama tp=2, Pallas op per shard")
    for run in (one, two, op):
        assert run["decode_runs"] > 0 and run["runtime_compiles"] == 0


@pytest.mark.parametrize(("change", "message"), [
    ({"linear_num_heads": 3}, "must divide linear_num_heads=3"),
    ({"num_experts": 9, "num_expert_group": 1}, "must divide num_experts=9"),
    ({"moe_intermediate_size": 5}, r"must divide moe_intermediate_size \* num_shared_experts=5"),
])
def test_kimi_counts_that_do_not_split_are_errors(change, message):
    import dataclasses

    from tokenspeed_jax.models.kimi_linear import KimiLinearConfig
    from tokenspeed_jax.models.kimi_linear.sharding import check_split

    raw = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    config = dataclasses.replace(KimiLinearConfig.from_hf(raw), **change)
    with pytest.raises(ValueError, match=message):
        check_split(config, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_kimi_parameter_has_a_rule_that_splits_evenly(tp):
    from flax import nnx
    from parallel_checks import splits_by_name

    from tokenspeed_jax.models.kimi_linear import KimiLinearConfig
    from tokenspeed_jax.models.kimi_linear.sharding import param_spec
    from tokenspeed_jax.models.loader import abstract_model

    raw = json.loads((GOLDEN / "tiny_kimi" / "config.json").read_text())
    raw["num_attention_heads"] = raw["num_key_value_heads"] = 4
    raw["linear_attn_config"]["num_heads"] = 4
    raw["q_lora_rank"] = 8  # q_a_proj / q_b_proj instead of q_proj
    config = KimiLinearConfig.from_hf(raw)
    state = nnx.state(abstract_model(config, "float32"))
    split = splits_by_name(state, lambda name: param_spec(name, config, tp), tp)
    replicated = {"low_proj", "o_norm", "q_a_proj", "kv_a_proj", "gate",
                  "e_score_correction_bias", "weight"}
    assert {n for n, s in split.items() if not s} == replicated
    with pytest.raises(ValueError, match="no tensor-parallel rule for Kimi Linear parameter"):
        param_spec("rotary", config, tp)


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
