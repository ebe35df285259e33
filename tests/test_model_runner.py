"""ModelRunner on a tiny random Llama: every route equals the dense-cache reference forward.

Reference: ``LlamaForCausalLM.__call__`` over a dense KV cache on the full token sequence; the
runner's greedy token and its log-probability, and the K/V it wrote into the pages, must match
(``FP32``; ``BF16`` states how far bfloat16 may move them).

Two shared runners: ``runner`` with the settings this CPU resolves (segmented prefill, per-layer
weights, one decode copy, reference attention), and ``gpu_runner`` with those a GPU resolves for
the same model (``runner_settings``: every fast path at once), its Pallas kernels interpreted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine import compilers
from tokenspeed_jax.engine import runner as runner_module
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.decode_turns import DecodeTurns
from tokenspeed_jax.engine.runner import ModelRunner, split_requests
from tokenspeed_jax.engine.token_board import new_board
from tokenspeed_jax.graph import CompileError
from tokenspeed_jax.graph.guard import startup
from tokenspeed_jax.kernels.paged_attention_backend import FUSED, PALLAS, DecodeKernel
from tokenspeed_jax.kernels.paged_prefill_attention import PrefillBlocks, PrefillKernel
from tokenspeed_jax.models.llama import DenseKVCache, LlamaConfig, LlamaForCausalLM
from tokenspeed_jax.models.llama import forward as llama_forward
from tokenspeed_jax.models.llama.forward import runner_settings
from tokenspeed_jax.models.loader import resolve_dtype
from tokenspeed_jax.reference import ReferenceGenerator
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.tokenizer import Tokenizer

# head_dim 16: the smallest for which a GPU runs the Pallas attention kernels (gpu_runner)
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PAGE = 4
MAX_LEN = 64
GREEDY = SamplingParams(temperature=0.0)
ENGINE = EngineConfig(
    prefill_graph_capture_token_sizes=(16,), prefill_graph_max_tokens=32,
    prefill_graph_capture_batch_sizes=(1,), prefill_graph_max_bs=2,
    decode_graph_capture_batch_sizes=(1,), decode_graph_max_bs=2,
    chunked_prefill_size=32, strict_no_compile=True, max_model_len=MAX_LEN,
    compile_progress=False,
)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def runner(model):
    runner = ModelRunner(model, ENGINE, num_pages=64, page_size=PAGE)
    runner.compile_all()
    yield runner
    runner.guard.disarm()


def interpreted(settings):
    """``settings`` with every Pallas kernel it names run by the interpreter (on the CPU)."""
    kernels = {field.name: dataclasses.replace(value, interpret=True)
               for field in dataclasses.fields(settings)
               if hasattr(value := getattr(settings, field.name), "interpret")}
    return dataclasses.replace(settings, **kernels)


def compiled_gpu_runner(model, config=ENGINE):
    """A compiled runner of ``model`` with the settings a GPU resolves for it, through the code
    that resolves them for every runner (``runner_settings``), its kernels interpreted."""
    settings = runner_settings(config, model, page_size=PAGE, platform="gpu")
    runner = ModelRunner(model, config, 64, PAGE, settings=interpreted(settings))
    runner.compile_all()
    return runner


@pytest.fixture(scope="module")
def gpu_runner(model):
    runner = compiled_gpu_runner(model)
    yield runner
    runner.guard.disarm()


class Pages:
    """A trivial page allocator for tests: each request gets fresh pages."""

    def __init__(self, first: int = 1):
        self.next = first

    def take(self, num_tokens: int) -> np.ndarray:
        count = -(-num_tokens // PAGE)
        table = np.arange(self.next, self.next + count, dtype=np.int32)
        self.next += count
        return table


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a runner must come to the reference forward."""

    greedy: float  # the sampled token's reference log-prob may be this far below the best one's
    logprob: tuple[float, float]  # (rtol, atol): the sampled token's log-prob, the reference's
    kv: tuple[float, float]  # (rtol, atol): the K/V written into the pages, the reference's


FP32 = Tolerance(greedy=0.0, logprob=(1e-4, 1e-4), kv=(1e-4, 1e-5))
# bfloat16 keeps 8 significant bits, so a value that the runner and the reference round at
# different points (the kernels accumulate in float32 and round once; XLA fuses each program its
# own way) may differ by a unit in its last place: at most 2^-7 of its size. The K/V pages hold
# such values, all below 0.5 in this model (a last place of at most 2^-9, allowed twice). The
# log-probs are float32 but follow logits that the head rounds to bfloat16, also below 0.5 here:
# a log-prob moves with its logit and with their log-sum-exp, each by up to 2^-9, and a near-tie
# within that may be broken either way.
BF16 = Tolerance(greedy=2**-8, logprob=(0.0, 2**-8), kv=(2**-7, 2**-8))


@nnx.jit
def dense_forward(model, token_ids, positions):
    cache = DenseKVCache.create(CONFIG, 1, MAX_LEN, model.dtype)
    logits, cache = model(token_ids, positions, cache)
    return jax.nn.log_softmax(logits, axis=-1), cache.k, cache.v


def reference(model, runner, tokens):
    """(next-token log-probs [vocab], K [L, n, Hkv, Dh], V), float32, from the dense forward,
    run on the sequence padded to MAX_LEN (position -1) so it compiles once."""
    n = len(tokens)
    ids = np.zeros((1, MAX_LEN), np.int32)
    ids[0, :n] = tokens
    positions = np.full((1, MAX_LEN), -1, np.int32)
    positions[0, :n] = np.arange(n)
    with runner.guard.allowed("reference forward"):
        logprobs, k, v = dense_forward(model, ids, positions)
    k, v = (np.asarray(x, np.float32)[:, 0, :n] for x in (k, v))
    return np.asarray(logprobs)[0, n - 1], k, v


def paged_kv(runner, table, length):
    """The K and V ``[L, length, Hkv, Dh]`` float32 that the runner's pages hold for a request."""
    slots = np.arange(length)
    pages, rows = table[slots // PAGE], slots % PAGE
    return tuple(np.stack([np.asarray(p, np.float32)[:, pages, rows].transpose(1, 0, 2)
                           for p in caches]) for caches in kv_pools(runner))


def kv_pools(runner) -> tuple[list, list]:
    """The runner's K pools and V pools, each in layer order."""
    layers = runner.model_config.num_hidden_layers
    return tuple([runner.pools[f"{kind}_pages.{i}"] for i in range(layers)] for kind in "kv")


def check_kv(runner, table, k_ref, v_ref, tol=FP32):
    k, v = paged_kv(runner, table, k_ref.shape[1])
    rtol, atol = tol.kv
    np.testing.assert_allclose(k, k_ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(v, v_ref, rtol=rtol, atol=atol)


def request(rid, tokens, start, table, sample=True, outputs=()):
    return StepRequest(rid, np.asarray(tokens, np.int32), start, table, sample, GREEDY,
                       list(outputs))


def check(model, runner, out_token, out_logprob, tokens, table, tol=FP32):
    """The runner's greedy token and log-prob after ``tokens``, and the K/V it wrote for them
    into the pages of ``table``, against the reference forward (``FP32``: the exact argmax)."""
    logprobs, k_ref, v_ref = reference(model, runner, tokens)
    assert logprobs[out_token] >= logprobs.max() - tol.greedy
    rtol, atol = tol.logprob
    np.testing.assert_allclose(out_logprob, logprobs[out_token], rtol=rtol, atol=atol)
    check_kv(runner, table, k_ref, v_ref, tol)


def prompts(seed, *lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CONFIG.vocab_size, n).astype(np.int32) for n in lengths]


def generate(model, runner, pages, prompt_list, steps, tol=FP32):
    """Prefill all prompts in one step, then decode ``steps`` tokens; check each against the
    reference. Returns the tables and the full token lists."""
    tables = [pages.take(len(p) + steps) for p in prompt_list]
    batch = [request(str(i), p, 0, t) for i, (p, t) in enumerate(zip(prompt_list, tables))]
    out = runner.step(StepBatch(batch))
    seqs = [list(p) for p in prompt_list]
    for i, seq in enumerate(seqs):
        check(model, runner, out.token_ids[i], out.logprobs[i], seq, tables[i], tol)
        seq.append(int(out.token_ids[i]))
    for _ in range(steps):
        batch = [request(str(i), [s[-1]], len(s) - 1, tables[i], outputs=s[len(p):])
                 for i, (s, p) in enumerate(zip(seqs, prompt_list))]
        out = runner.step(StepBatch(batch))
        for i, seq in enumerate(seqs):
            check(model, runner, out.token_ids[i], out.logprobs[i], seq, tables[i], tol)
            seq.append(int(out.token_ids[i]))
    return tables, seqs


def test_buckets_come_from_the_config(runner):
    assert runner.buckets.tokens == (16, 32)
    assert runner.buckets.prefill_requests == (1, 2)
    assert runner.buckets.decode_requests == (1, 2)
    # one request decodes on the two-row executable: a padding row keeps the GEMMs two rows tall
    assert runner.buckets.decode_executables == (2,) == tuple(runner._decode_turns)
    assert [runner.buckets.decode_rows(n) for n in (1, 2)] == [2, 2]


@pytest.mark.parametrize("lengths", [(5,), (16,), (23,), (7, 9), (3, 29)])
def test_prefill_and_decode_match_reference_in_every_bucket(model, runner, lengths):
    before = runner.stats()
    generate(model, runner, Pages(), prompts(sum(lengths), *lengths), steps=2)
    after = runner.stats()
    assert after["prefill_runs"] == before["prefill_runs"] + 1
    assert after["decode_runs"] == before["decode_runs"] + 2
    assert after["runtime_compiles"] == 0 and after["eager_runs"] == 0


def test_long_prompt_is_chunked_across_buckets(model, runner):
    before = runner.stats()["chunked_prefill_splits"]
    generate(model, runner, Pages(), prompts(7, 45, 20), steps=1)  # 65 tokens > 32: 3 chunks
    assert runner.stats()["chunked_prefill_splits"] == before + 2


def test_prefix_pages_written_earlier_are_read(model, runner):
    """A second request reuses the first one's prompt pages (a prefix-cache hit) and only
    computes its new tokens."""
    pages = Pages()
    (prompt,) = prompts(11, 12)
    table = pages.take(12)
    runner.step(StepBatch([request("a", prompt, 0, table)]))
    suffix = prompts(12, 9)[0]
    table_b = np.concatenate([table, pages.take(9)])  # 12 tokens = 3 full pages shared
    out = runner.step(StepBatch([request("b", suffix, 12, table_b)]))
    check(model, runner, out.token_ids[0], out.logprobs[0], [*prompt, *suffix], table_b)


def test_padding_never_writes_other_pages(model, runner):
    """Every page starts this test filled with a marker (whatever earlier tests wrote): after a
    padded prefill and decode, only the request's own pages have changed."""
    marker = -7.0
    runner.pools = {name: jax.device_put(np.full(cache.shape, marker, cache.dtype))
                    for name, cache in runner.pools.items()}
    tables, _ = generate(model, runner, Pages(first=40), prompts(3, 3), steps=1)
    others = [i for i in range(runner.pools["k_pages.0"].shape[1])
              if i not in set(tables[0].tolist())]
    for name, cache in runner.pools.items():
        assert np.all(np.asarray(cache)[:, others] == marker), name


def test_padded_batch_rows_do_not_change_real_rows(model, runner):
    """The same request alone (padded to bucket B=1) and next to another (B=2) gives the same
    logprob: dummy tokens and dummy requests are invisible."""
    (prompt,) = prompts(21, 6)
    alone = runner.step(StepBatch([request("a", prompt, 0, Pages(1).take(6))]))
    other = prompts(22, 10)[0]
    pair = runner.step(StepBatch([request("a", prompt, 0, Pages(10).take(6)),
                                  request("b", other, 0, Pages(20).take(10))]))
    assert alone.token_ids[0] == pair.token_ids[0]
    np.testing.assert_allclose(alone.logprobs[0], pair.logprobs[0], rtol=1e-5, atol=1e-6)


def test_decode_metadata_pads_every_step_from_scratch(runner):
    """A one-request step after a two-request step in the same bucket: its padding row holds
    the padding values, not the earlier step's request, and its real row holds its own token,
    position, slot, page table and sampling settings (written out by hand here)."""
    seeded = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2**40 + 3)
    pair = [StepRequest("a", np.array([11], np.int32), 9, np.array([4, 6, 8], np.int32), True,
                        seeded, [1, 2], token_row=1),
            StepRequest("b", np.array([12], np.int32), 2, np.array([5], np.int32), True,
                        GREEDY, [3])]
    rows = runner.buckets.decode_rows(2)
    assert rows == runner.buckets.decode_rows(1) == 2
    runner.decode_inputs(pair)
    _, meta = runner.decode_inputs(pair[:1])
    words = runner.pages_per_request
    page_tables = np.zeros((rows, words), np.int32)
    page_tables[0, :3] = [4, 6, 8]
    expected = {
        "token_ids": np.array([11, 0], np.int32),
        "token_rows": np.array([1, -1], np.int32),
        "positions": np.array([9, -1], np.int32),
        "slot_mapping": np.array([8 * PAGE + 1, -1], np.int32),  # position 9: page 2, row 1
        "page_tables": page_tables,
        "sampling.temperature": np.array([0.7, 0.0], np.float32),
        "sampling.top_p": np.array([0.9, 1.0], np.float32),
        "sampling.top_k": np.array([5, 0], np.int32),
        "sampling.min_p": np.zeros(2, np.float32),
        "sampling.presence_penalty": np.zeros(2, np.float32),
        "sampling.frequency_penalty": np.zeros(2, np.float32),
        "sampling.repetition_penalty": np.ones(2, np.float32),
        "sampling.key": np.array([[256, 3], [0, 0]], np.uint32),
        "sampling.step": np.array([2, 0], np.int32),
    }
    packed = meta["decode"]  # read with numpy: unpacking with jax would compile while serving
    assert [field.name for field in packed.layout.fields] == list(expected)
    for field in packed.layout.fields:
        value = packed.buffer[field.offset:field.offset + field.size].view(field.dtype)
        np.testing.assert_array_equal(value.reshape(field.shape), expected[field.name],
                                      err_msg=field.name)


def test_mixed_workload_never_compiles_at_runtime(model, runner):
    pages = Pages()
    a, b, c, d = prompts(31, 6, 40, 3, 2)
    ta, tb, tc, td = (pages.take(len(x) + 4) for x in (a, b, c, d))
    runner.step(StepBatch([request("a", a, 0, ta)]))
    # mixed: a decodes while b (chunked), c, d prefill; 4 requests > max prefill bs 2
    out = runner.step(StepBatch([
        request("a", [1], len(a), ta, outputs=[1]), request("b", b, 0, tb),
        request("c", c, 0, tc), request("d", d, 0, td)]))
    seqs = [[*a, 1], list(b), list(c), list(d)]
    tables = [ta, tb, tc, td]
    assert len(out.token_ids) == 4
    for i, (seq, table) in enumerate(zip(seqs, tables)):
        check(model, runner, out.token_ids[i], out.logprobs[i], seq, table)
    # decode of 4 requests > largest decode bucket 2: split, still compiled, every row exact
    before = runner.stats()["decode_splits"]
    decode = [request(n, [5], len(seq), table, outputs=[5])
              for n, seq, table in zip("abcd", seqs, tables)]
    out = runner.step(StepBatch(decode))
    for i, (seq, table) in enumerate(zip(seqs, tables)):
        check(model, runner, out.token_ids[i], out.logprobs[i], [*seq, 5], table)
    stats = runner.stats()
    assert stats["decode_splits"] == before + 1
    assert stats["runtime_compiles"] == 0 and stats["eager_runs"] == 0
    assert 0.0 < stats["padding_waste"] < 1.0


def test_a_mixed_step_runs_its_decode_rows_on_the_decode_graph(model, runner):
    """The decode row of a mixed step takes the decode graph, the prompts the prefill graph,
    and the sampled rows come back in the order of the batch."""
    pages = Pages()
    a, b, c = prompts(41, 9, 20, 5)
    ta, tb, tc = (pages.take(len(x) + 2) for x in (a, b, c))
    runner.step(StepBatch([request("a", a, 0, ta)]))
    before = runner.stats()
    out = runner.step(StepBatch([
        request("c", c, 0, tc), request("b", b[:12], 0, tb, sample=False),
        request("a", [7], len(a), ta, outputs=[7])]))
    after = runner.stats()
    runs = {key: after[key] - before[key]
            for key in ("mixed_splits", "decode_runs", "prefill_runs", "eager_runs")}
    assert runs == {"mixed_splits": 1, "decode_runs": 1, "prefill_runs": 1,
                    "eager_runs": 0}
    assert len(out.token_ids) == 2
    check(model, runner, out.token_ids[0], out.logprobs[0], list(c), tc)
    check(model, runner, out.token_ids[1], out.logprobs[1], [*a, 7], ta)
    check_kv(runner, tb, *reference(model, runner, list(b[:12]))[1:])


def test_kv_cache_is_donated_not_copied(runner):
    old = runner.pools["k_pages.0"]
    table = Pages(50).take(4)
    runner.step(StepBatch([request("z", [1, 2, 3], 0, table)]))
    assert old.is_deleted()
    attention = runner.compiled_plan(("prefill", 16, None)).calls[1]
    assert attention.name == "attention"
    cache_bytes = 2 * old.size * old.dtype.itemsize
    assert attention.executable.memory_analysis().alias_size_in_bytes >= cache_bytes


def test_batch_one_decode_updates_the_cache_in_place(runner):
    """A one-row KV write must stay an in-place scatter: XLA turns a one-row scatter into a
    dynamic-update-slice plus whole-cache copies, which made batch-1 decode 10x slower. The token
    board and the turn's sampled-rows buffer are donated too, so a step's buffers keep their
    addresses from step to step."""
    slot = runner._decode_turns[2].slots[0]
    decode = slot.plan.calls[0].executable
    cache = runner.pools["k_pages.0"]
    cache_bytes = cache.size * cache.dtype.itemsize
    all_caches = 2 * runner.forward.num_layers * cache_bytes
    analysis = decode.memory_analysis()
    assert analysis.alias_size_in_bytes >= all_caches + runner.board.nbytes + slot.sampled.nbytes
    assert analysis.temp_size_in_bytes < all_caches  # copies would need at least this much


def test_split_requests_keeps_positions_and_samples_last_piece():
    reqs = [request("a", np.arange(10), 3, np.arange(4)), request("b", np.arange(5), 0,
                                                                  np.arange(2), sample=False)]
    groups = split_requests(reqs, 4, 8)
    pieces = [(r.request_id, r.start_pos, r.num_tokens, r.sample) for g in groups for r in g]
    assert pieces == [("a", 3, 4, False), ("a", 7, 4, False), ("a", 11, 2, True),
                      ("b", 0, 2, False), ("b", 2, 3, False)]
    assert [sum(r.num_tokens for r in g) for g in groups] == [4, 4, 4, 3]


@pytest.fixture(scope="module")
def eager_runner(model):
    runner = ModelRunner(model, dataclasses.replace(ENGINE, enforce_eager=True), 64, PAGE)
    yield runner
    runner.guard.disarm()


def test_eager_route_matches_reference(model, eager_runner):
    assert eager_runner.buckets.tokens == () and eager_runner.buckets.decode_requests == ()
    generate(model, eager_runner, Pages(), prompts(41, 5, 18), steps=1)
    assert eager_runner.stats()["eager_runs"] == 2
    assert eager_runner.stats()["runtime_compiles"] == 0


def test_a_kimi_only_setting_is_logged_as_ignored(model, caplog):
    """``disable_kda_prefill_graph`` names a Kimi Linear route: this runner says it ignores it
    and stays silent without it."""
    with caplog.at_level(logging.WARNING, logger=llama_forward.__name__):
        ModelRunner(model, ENGINE, 64, PAGE)
        assert not caplog.records
        ModelRunner(model, dataclasses.replace(ENGINE, disable_kda_prefill_graph=True), 64, PAGE)
    (record,) = caplog.records
    assert "disable_kda_prefill_graph=True does not apply to Llama-family models" in record.message


def test_prefill_graph_off_prefills_eagerly_and_decodes_on_the_graph(model):
    runner = ModelRunner(model, dataclasses.replace(ENGINE, disable_prefill_graph=True), 64, PAGE)
    runner.compile_all()
    try:
        assert runner.buckets.tokens == () and runner.buckets.decode_requests
        generate(model, runner, Pages(), prompts(43, 7, 12), steps=2)
        stats = runner.stats()
        assert stats["eager_runs"] == 1 and stats["decode_runs"] == 2
        assert stats["runtime_compiles"] == 0
    finally:
        runner.guard.disarm()


def test_no_chunking_runs_long_prompts_eagerly(model):
    config = dataclasses.replace(ENGINE, chunked_prefill_size=0, decode_graph_max_bs=1,
                                 decode_graph_capture_batch_sizes=(1,),
                                 prefill_graph_capture_batch_sizes=(1,), prefill_graph_max_bs=1)
    runner = ModelRunner(model, config, 64, PAGE)
    runner.compile_all()
    try:
        (prompt,) = prompts(51, 40)
        table = Pages().take(40)
        out = runner.step(StepBatch([request("a", prompt, 0, table)]))
        check(model, runner, out.token_ids[0], out.logprobs[0], list(prompt), table)
        assert runner.stats()["eager_runs"] == 1 and runner.stats()["runtime_compiles"] == 0
    finally:
        runner.guard.disarm()


def fail_attention_outputs_at(model, monkeypatch, rows: int) -> None:
    """Make tracing the model's layers fail (``RuntimeError``) for ``rows``-row hidden states."""
    layer_type = type(model.layers[0])
    original = layer_type.attention_outputs

    def failing(self, hidden, attn):
        if hidden.shape[0] == rows:
            raise RuntimeError("injected failure")
        return original(self, hidden, attn)

    monkeypatch.setattr(layer_type, "attention_outputs", failing)


def test_injected_compile_failure_aborts_start_up(model, monkeypatch):
    fail_attention_outputs_at(model, monkeypatch, 32)
    runner = ModelRunner(model, ENGINE, 64, PAGE)
    with pytest.raises(CompileError, match=r"'out\+qkv'.*T=32"):
        runner.compile_all()


def test_declared_unsupported_prefill_graph_is_honoured(model):
    class NoPrefillGraph(LlamaForCausalLM):
        supports_prefill_graph = False

    graphdef, state = nnx.split(model)
    stripped = nnx.merge(graphdef, state)
    stripped.__class__ = NoPrefillGraph
    runner = ModelRunner(stripped, ENGINE, 64, PAGE)
    assert runner.buckets.tokens == ()
    assert runner.buckets.decode_requests == (1, 2)


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer over the tiny vocabulary (the reference generator detokenizes)."""
    vocab = {f"w{i}": i for i in range(CONFIG.vocab_size)}
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")))


def run_steps(runner, prompt_list, params_list, steps):
    """Prefill then ``steps - 1`` decode steps of each (prompt, params); each request's tokens."""
    pages = Pages()
    tables = [pages.take(len(p) + steps) for p in prompt_list]
    outputs: list[list[int]] = [[] for _ in prompt_list]
    for step in range(steps):
        batch = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            seq = [*prompt, *outputs[i]]
            start = 0 if step == 0 else len(seq) - 1
            batch.append(StepRequest(str(i), np.asarray(seq[start:], np.int32), start, tables[i],
                                     True, params, list(outputs[i])))
        for i, token in enumerate(runner.step(StepBatch(batch)).token_ids.tolist()):
            outputs[i].append(token)
    return outputs


@pytest.mark.parametrize("penalties", [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5, "presence_penalty": 0.7},
], ids=["repetition", "frequency+presence"])
def test_penalties_match_reference_generator(model, runner, penalties):
    """A penalized greedy request beside a plain one, prefill then five decode steps: the
    runner's tokens equal ReferenceGenerator's (host counts through the same sampler)."""
    steps = 6
    penalized_params = SamplingParams(temperature=0.0, max_tokens=steps, **penalties)
    plain_params = SamplingParams(temperature=0.0, max_tokens=steps)
    prompt_list = prompts(64, 7, 12)
    generator = ReferenceGenerator(model, word_tokenizer())
    expected = [c.token_ids for c in generator.generate(prompt_list,
                                                        [penalized_params, plain_params])]
    unpenalized = generator.generate(prompt_list[:1], [plain_params])[0].token_ids
    assert unpenalized != expected[0]  # the penalty changes this request's tokens

    before = runner.stats()
    assert run_steps(runner, prompt_list, [penalized_params, plain_params], steps) == expected
    after = runner.stats()
    # Every step (the prefill's head, then each decode step) resamples its logits.
    assert after["decode_runs"] == before["decode_runs"] + steps - 1
    assert after["resample_runs"] == before["resample_runs"] + steps
    assert after["runtime_compiles"] == 0 and after["eager_runs"] == before["eager_runs"]


@pytest.mark.parametrize("truncated", [False, True], ids=["in-step", "resampled"])
def test_sampling_tiers_match_reference_generator(model, runner, truncated):
    """Seeded sampling beside greedy rows, prefill then decode: the same tokens as
    ReferenceGenerator (the full sampler on a dense cache). Without top-k/top-p the in-step
    sampler serves every step (no resample); with them every step resamples the logits."""
    steps = 5
    sampled = {"temperature": 0.8, "max_tokens": steps, "seed": 11}
    if truncated:
        sampled.update({"top_k": 7, "top_p": 0.9})
    params_list = [SamplingParams(temperature=0.0, max_tokens=steps), SamplingParams(**sampled),
                   SamplingParams(**{**sampled, "seed": 12, "min_p": 0.05})]
    prompt_list = prompts(5, 6, 9, 14)
    expected = [c.token_ids for c in ReferenceGenerator(model, word_tokenizer()).generate(
        prompt_list, params_list)]
    before = runner.stats()
    assert run_steps(runner, prompt_list, params_list, steps) == expected
    after = runner.stats()
    runs = sum(after[k] - before[k] for k in ("prefill_runs", "decode_runs"))
    assert runs >= steps  # every group of every step has a truncating request
    assert after["resample_runs"] - before["resample_runs"] == (runs if truncated else 0)
    assert after["runtime_compiles"] == 0


def test_pallas_decode_op_in_the_runner_matches_reference(model, monkeypatch):
    """The decode executable built on JAX's Pallas op (``fused_decode_attention`` off; the
    fused kernel is ``gpu_runner``'s), interpreted on the CPU, over the ``[Hkv, pages,
    page_size, Dh]`` cache gives the reference forward's tokens."""
    kernel = DecodeKernel(PALLAS, pages_per_compute_block=2, k_splits=2, interpret=True)
    monkeypatch.setattr(llama_forward, "choose_decode_kernel", lambda **_: kernel)
    config = dataclasses.replace(ENGINE, decode_graph_capture_batch_sizes=(2,))
    runner = ModelRunner(model, config, 64, PAGE)
    assert runner.forward.decode_kernel == kernel
    runner.compile_all()
    try:
        generate(model, runner, Pages(), prompts(71, 9, 14), steps=3)
        assert runner.stats()["decode_runs"] == 3
        assert runner.stats()["runtime_compiles"] == 0
    finally:
        runner.guard.disarm()


def test_long_cached_context_runs_on_the_token_bucket_graph(model, runner):
    """A prefix of 48 cached tokens (most of MAX_LEN) and 9 new ones: the same executable as a
    fresh prompt of 9 tokens, no compile, and the reference forward's token."""
    pages = Pages()
    (prompt,) = prompts(41, 48)
    table = pages.take(60)  # "a" holds the first 12 pages, "b" shares them and adds 3
    runner.step(StepBatch([request("a", prompt[:32], 0, table[:12])]))
    runner.step(StepBatch([request("a", prompt[32:], 32, table[:12])]))
    before = runner.stats()
    suffix = prompts(42, 9)[0]
    out = runner.step(StepBatch([request("b", suffix, 48, table[:15])]))
    check(model, runner, out.token_ids[0], out.logprobs[0], [*prompt, *suffix], table[:15])
    after = runner.stats()
    assert after["prefill_runs"] == before["prefill_runs"] + 1
    assert after["runtime_compiles"] == 0 and after["eager_runs"] == before["eager_runs"]


def test_pallas_prefill_kernel_in_the_runner_matches_reference(model, monkeypatch):
    """The encoder built on the ragged paged prefill kernel (interpreted on the CPU): one
    executable per token bucket, and fresh, chunked (cached context) and mixed steps give the
    reference forward's tokens."""
    kernel = PrefillKernel(PALLAS, PrefillBlocks(block_q=16, pages_per_block=2), interpret=True)
    monkeypatch.setattr(llama_forward, "choose_prefill_kernel", lambda **_: kernel)
    config = dataclasses.replace(ENGINE, prefill_graph_capture_token_sizes=(16,))
    runner = ModelRunner(model, config, 64, PAGE)
    assert runner.forward.prefill_kernel == kernel
    summary = runner.compile_all()
    encoders = {label for label in summary.seconds_per_label if label.startswith("prefill")}
    assert encoders == {f"prefill T={tokens}" for tokens in runner.buckets.tokens}
    try:
        generate(model, runner, Pages(), prompts(72, 45, 5), steps=2)  # 50 tokens: 2 chunks
        stats = runner.stats()
        assert stats["prefill_runs"] == 2 and stats["chunked_prefill_splits"] == 1
        assert stats["runtime_compiles"] == 0 and stats["eager_runs"] == 0
    finally:
        runner.guard.disarm()


def test_a_gpu_resolves_every_fast_path_for_this_model(model, runner, gpu_runner):
    """What ``gpu_runner`` runs is every GPU default at once, each built as it should be: the
    fused decode kernel, stacked decode weights, one inline encoder executable per token bucket,
    two loaded copies of each decode executable and the Pallas prefill kernel (the CPU resolves
    none of them: ``runner``); "auto" weights are bfloat16 there."""
    settings = gpu_runner.forward.settings
    assert settings.decode_kernel.backend == FUSED and settings.prefill_kernel.backend == PALLAS
    assert settings.stack_decode_weights and gpu_runner.stacked_layers is not None
    assert settings.inline_prefill_attention
    assert [call.stage.name for call in gpu_runner.plans["prefill"].calls] == ["attention"]
    first, second = gpu_runner._decode_turns[2].slots
    assert settings.alternate_decode_executables
    assert first.plan.calls[0].executable is not second.plan.calls[0].executable
    assert resolve_dtype(EngineConfig().dtype, "gpu") == jnp.bfloat16
    assert runner.forward.settings == runner_settings(ENGINE, model, page_size=PAGE, platform="cpu")


def test_gpu_defaults_match_reference(model, gpu_runner):
    """Every GPU default at once, in float32: chunked prompts, two requests per step, decode
    steps, a cached prefix prefilled beside a decode row (a mixed step) give the reference
    forward's tokens, log-probs and K/V pages to ``runner``'s precision, with no runtime
    compile."""
    before = gpu_runner.stats()
    pages = Pages()
    generate(model, gpu_runner, pages, prompts(81, 45, 20), steps=2)  # 65 tokens: 3 chunks
    (prompt,) = prompts(82, 12)
    table = pages.take(13)  # 4 pages: the prompt fills 3, its decoded token starts the 4th
    gpu_runner.step(StepBatch([request("a", prompt, 0, table)]))
    suffix = prompts(83, 9)[0]
    table_b = np.concatenate([table[:3], pages.take(9)])  # "b" shares "a"'s 3 full pages
    out = gpu_runner.step(StepBatch([request("b", suffix, 12, table_b),
                                     request("a", [7], 12, table, outputs=[7])]))
    check(model, gpu_runner, out.token_ids[0], out.logprobs[0], [*prompt, *suffix], table_b)
    check(model, gpu_runner, out.token_ids[1], out.logprobs[1], [*prompt, 7], table)
    after = gpu_runner.stats()
    runs = {key: after[key] - before[key] for key in (
        "chunked_prefill_splits", "mixed_splits", "decode_runs", "eager_runs",
        "runtime_compiles")}
    assert runs == {"chunked_prefill_splits": 2, "mixed_splits": 1, "decode_runs": 3,
                    "eager_runs": 0, "runtime_compiles": 0}


def test_gpu_defaults_in_bfloat16_match_reference_to_its_rounding():
    """The GPU's whole default configuration, its "auto" dtype included: the same model in
    bfloat16, prefilled (chunked, two requests) and decoded by the settings a GPU resolves,
    against the reference forward of that bfloat16 model within ``BF16``."""
    dtype = resolve_dtype(EngineConfig().dtype, "gpu")
    with startup():  # not a compile of the runners serving in this module
        half = LlamaForCausalLM(CONFIG, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    # one bucket per route: what this test runs
    config = dataclasses.replace(ENGINE, prefill_graph_capture_token_sizes=(32,),
                                 prefill_graph_capture_batch_sizes=(2,))
    runner = compiled_gpu_runner(half, config)
    try:
        assert runner.pools["k_pages.0"].dtype == jnp.bfloat16
        generate(half, runner, Pages(), prompts(84, 45, 20), steps=4, tol=BF16)
        stats = runner.stats()
        assert stats["chunked_prefill_splits"] == 2 and stats["decode_runs"] == 4
        assert stats["runtime_compiles"] == 0 and stats["eager_runs"] == 0
    finally:
        runner.guard.disarm()


def decode_argument_count(runner) -> int:
    (call,) = runner._decode_turns[2].slots[0].plan.calls
    return len(call.inputs) + 1 + len(call.param_leaves)  # + the packed metadata


def test_stacked_decode_weights_take_one_argument_per_weight_kind(runner, gpu_runner):
    """Stacked (``gpu_runner``), the decode step takes one argument per weight kind instead of
    one per layer and kind (``runner``); both match the reference (the tests above)."""
    per_layer_leaves = len(jax.tree_util.tree_leaves(runner.forward.layer_states[0]))
    saved = (CONFIG.num_hidden_layers - 1) * per_layer_leaves
    assert decode_argument_count(gpu_runner) == decode_argument_count(runner) - saved


def test_only_small_decode_buckets_take_stacked_weights(runner, gpu_runner):
    """Stacked weights serve decode buckets of up to ``STACKED_DECODE_MAX_ROWS`` rows; a larger
    bucket takes one argument per layer weight, as every bucket does without stacking."""
    small, large = runner_module.STACKED_DECODE_MAX_ROWS, runner_module.STACKED_DECODE_MAX_ROWS + 1
    stacked, per_layer = gpu_runner.decode_plan(small), gpu_runner.decode_plan(large)
    assert stacked.calls[0].params[1] is gpu_runner.stacked_layers
    assert all(a is b for a, b in zip(per_layer.calls[0].params[1], gpu_runner.forward.layer_states,
                                      strict=True))
    assert runner.decode_plan(small) is runner.decode_plan(large) is runner.per_layer_decode_plan


@pytest.mark.parametrize("setting", ["stack_decode_weights", "inline_prefill_attention"])
def test_auto_settings_follow_platform_and_layer_weight_size(setting):
    """Stacked decode weights and inline prefill attention are on by default for small models
    on one GPU only; an explicit value wins."""
    small = [{"w": np.zeros((4, 4), np.float32)}] * 3
    large = [{"w": np.broadcast_to(np.float32(0), (2**28 + 1,))}] * 2  # just over 2 GiB
    rule = {"stack_decode_weights": llama_forward.stacks_decode_weights,
            "inline_prefill_attention": llama_forward.inlines_prefill_attention}[setting]
    assert rule(EngineConfig(), small, "gpu")
    assert not rule(EngineConfig(), large, "gpu")
    assert not rule(EngineConfig(), small, "cpu")
    assert not rule(EngineConfig(tensor_parallel_size=2), small, "gpu")
    assert rule(EngineConfig(**{setting: True}), large, "cpu")
    assert not rule(EngineConfig(**{setting: False}), small, "gpu")


def buffer_addresses(runner) -> list[int]:
    """Where the decode step's donated buffers lie: board, each turn's sampled rows, caches."""
    buffers = [runner.board, *(slot.sampled for slot in runner._decode_turns[2].slots),
               *runner.pools.values()]
    return [b.unsafe_buffer_pointer() for b in buffers]


def test_decode_buffers_are_updated_in_place_from_the_first_step():
    """A new token board and a new turn's sampled-rows buffer are device buffers of their own: a
    view of a numpy array (what ``device_put`` may give on the CPU) cannot be donated, so the
    first decode step would move it. Twenty new buffers of each kind and size."""
    bump = jax.jit(lambda x: x + 1, donate_argnums=0)
    with startup():
        for rows in [1, 2, 16] * 20:
            turns = DecodeTurns([None], rows)
            for new in (new_board(rows), *(slot.sampled for slot in turns.slots)):
                address = new.unsafe_buffer_pointer()
                assert bump(new).unsafe_buffer_pointer() == address


def test_decode_copies_take_turns_and_run_ahead_like_the_reference(model, gpu_runner):
    """With ``alternate_decode_executables`` (``gpu_runner``) a decode bucket holds two loaded
    copies of its executable and successive steps take turns; tokens that run ahead on the board,
    from one copy into the other, match the reference forward, and so do the K/V pages. No
    buffer the steps donate (board, each turn's sampled rows, caches) ever moves."""
    first, second = gpu_runner._decode_turns[2].slots
    prompt_list = prompts(17, 9, 4)
    pages = Pages()
    tables = [pages.take(len(p) + 8) for p in prompt_list]
    pair = [request(str(i), p, 0, t) for i, (p, t) in enumerate(zip(prompt_list, tables))]
    taken = [gpu_runner.decode_inputs(pair)[0] for _ in range(3)]
    assert taken[0] is not taken[1] and taken[2] is taken[0] and set(map(id, taken)) == \
        {id(first), id(second)}
    before = gpu_runner.stats()
    out = gpu_runner.step(StepBatch(pair))
    seqs = [[*p, int(token)] for p, token in zip(prompt_list, out.token_ids)]
    pending = gpu_runner.launch(StepBatch([request(str(i), [s[-1]], len(s) - 1, t)
                                           for i, (s, t) in enumerate(zip(seqs, tables))]))
    addresses = buffer_addresses(gpu_runner)
    for launches_left in range(5, -1, -1):
        following = gpu_runner.launch(StepBatch([
            dataclasses.replace(request(str(i), [0], len(s), t), token_row=i)
            for i, (s, t) in enumerate(zip(seqs, tables))])) if launches_left else None
        out = pending.result()
        for i, seq in enumerate(seqs):
            check(model, gpu_runner, out.token_ids[i], out.logprobs[i], seq, tables[i])
            seq.append(int(out.token_ids[i]))
        pending = following
        assert buffer_addresses(gpu_runner) == addresses
    after = gpu_runner.stats()
    assert after["decode_runs"] == before["decode_runs"] + 6
    assert after["runtime_compiles"] == 0


def test_a_decode_turn_fetches_unread_tokens_before_reusing_its_buffer(model, runner):
    """Three decode steps launched before any is fetched: the third takes the first one's turn
    and donates its sampled-rows buffer, so the first step's tokens are fetched before that; all
    three give the reference forward's tokens."""
    prompt_list = prompts(23, 9, 5)
    pages = Pages()
    tables = [pages.take(len(p) + 4) for p in prompt_list]
    out = runner.step(StepBatch([request(str(i), p, 0, t)
                                 for i, (p, t) in enumerate(zip(prompt_list, tables))]))
    seqs = [[*p, int(token)] for p, token in zip(prompt_list, out.token_ids)]
    launched = [runner.launch(StepBatch([request(str(i), [s[-1]], len(s) - 1, t)
                                         for i, (s, t) in enumerate(zip(seqs, tables))]))]
    for step in range(2):
        launched.append(runner.launch(StepBatch([
            dataclasses.replace(request(str(i), [0], len(s) + step, t), token_row=i)
            for i, (s, t) in enumerate(zip(seqs, tables))])))
    for pending in launched:
        out = pending.result()
        for i, seq in enumerate(seqs):
            check(model, runner, out.token_ids[i], out.logprobs[i], seq, tables[i])
            seq.append(int(out.token_ids[i]))


def test_decode_copies_are_auto_on_one_gpu_only():
    rule = llama_forward.alternates_decode_executables
    assert rule(EngineConfig(), "gpu")
    assert not rule(EngineConfig(), "cpu")
    assert not rule(EngineConfig(tensor_parallel_size=2), "gpu")
    assert rule(EngineConfig(alternate_decode_executables=True), "cpu")
    assert not rule(EngineConfig(alternate_decode_executables=False), "gpu")


def test_default_runner_on_the_cpu_is_segmented_with_per_layer_weights(runner):
    assert not runner.forward.inline_prefill and runner.stacked_layers is None
    first, second = runner._decode_turns[2].slots
    assert not runner.alternate_decode and first.plan is second.plan
    assert len(runner.plans["prefill"].calls) == 2 * CONFIG.num_hidden_layers + 1
    with pytest.raises(ValueError, match="stack_decode_weights"):
        EngineConfig(stack_decode_weights=True, tensor_parallel_size=2)


# Background compile over ladders with rungs to defer: tokens (16, 32, 64), prefill requests
# (1, 2, 4), decode requests (1, 2, 4, 8); the skeleton leaves out tokens 32, requests 2 and
# decode bucket 4 (decode bucket 2 shares the skeleton's two-row executable with bucket 1).
LADDER = dataclasses.replace(
    ENGINE, prefill_graph_capture_token_sizes=(16, 32, 64), prefill_graph_max_tokens=64,
    chunked_prefill_size=64, prefill_graph_capture_batch_sizes=None, prefill_graph_max_bs=4,
    decode_graph_capture_batch_sizes=None, decode_graph_max_bs=8, background_compile=True)


@pytest.fixture(scope="module")
def ladder_cache(tmp_path_factory) -> str:
    """An executable cache for LADDER runners: the first test below fills it, the third loads
    the autotuned plans from it."""
    return str(tmp_path_factory.mktemp("ladder"))


def test_serves_from_the_skeleton_while_the_ladder_compiles(model, ladder_cache, caplog):
    """With background compile, ``compile_all`` returns once the skeleton is compiled. Driving
    the deferred compile one bucket plan at a time: every step takes the smallest ready bucket,
    with no compile on its path (strict guard) and the reference forward's tokens, log-probs and
    K/V; each rung is ready once all its plans are; and once the ladder is complete the same
    requests pad less, with the same tokens. (The ladder cache, which this test fills first: its
    deferred plans are not in the cache.) A warm start on that cache loads the skeleton, serves,
    and loads the rest in the background, compiling nothing."""
    runner = ModelRunner(model, dataclasses.replace(LADDER, compile_cache_dir=ladder_cache),
                         64, PAGE)
    summary = runner.compile_all(start_background=False)
    try:
        assert runner.buckets == Buckets((16, 32, 64), (1, 2, 4), (1, 2, 4, 8))
        assert runner.ready == Buckets((16, 64), (1, 4), (1, 2, 8))
        assert summary.num_deferred == 3  # decode B=4, head B=2, prefill T=32
        assert (runner.stats()["buckets_ready"], runner.stats()["buckets_total"]) == (7, 10)

        def serve() -> tuple[list[list[int]], int]:
            """Three prompts of 26 tokens in one prefill step, then two decode steps of three
            requests, each checked against the reference: the tokens and the padding run."""
            before = runner.stats()["padded_tokens"]
            _, seqs = generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)
            return seqs, runner.stats()["padded_tokens"] - before

        first, padded = serve()
        assert padded == (64 - 26) + 2 * (8 - 3)  # token bucket 64, decode bucket 8
        readiness, compiled_later = [], 0
        while not runner.ladders.complete:
            compiled_later += runner.ladders.compile_deferred(limit=1).num_compiled
            readiness.append(runner.ready)
            assert serve()[0] == first
        assert readiness == [
            Buckets((16, 64), (1, 4), (1, 2, 4, 8)),  # decode B=4
            Buckets((16, 64), (1, 2, 4), (1, 2, 4, 8)),  # head B=2
            Buckets((16, 32, 64), (1, 2, 4), (1, 2, 4, 8)),  # prefill T=32
        ]
        assert runner.ready == runner.buckets
        seqs, padded = serve()
        assert seqs == first and padded == (32 - 26) + 2 * (4 - 3)
        stats = runner.stats()
        assert stats["runtime_compiles"] == 0 and stats["eager_runs"] == 0
        assert (stats["buckets_ready"], stats["buckets_total"]) == (10, 10)
    finally:
        runner.guard.disarm()
    # A warm start loads the skeleton's plans before it serves and the others in the background,
    # compiling nothing: the same tokens from the skeleton, then from the complete ladder.
    warm = ModelRunner(model, dataclasses.replace(LADDER, compile_cache_dir=ladder_cache), 64,
                       PAGE)
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.engine.ladders"):
        summary = warm.compile_all()
        try:
            assert (summary.num_compiled, summary.num_deferred) == (0, 3)
            assert summary.num_loaded == summary.num_executables
            assert warm.ladders.wait(timeout=120) and warm.ready == warm.buckets
            assert generate(model, warm, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first
            assert warm.stats()["runtime_compiles"] == 0
        finally:
            warm.guard.disarm()
    assert f"background compile: 0 executables compiled and {compiled_later} loaded" in caplog.text


def decode_weight_leaves(runner, rows: int) -> int:
    """Parameter arrays the ``rows``-row decode executable in use takes."""
    (call,) = runner._decode_turns[rows].slots[0].plan.calls
    return len(call.param_leaves)


@contextlib.contextmanager
def warm_start(model, config):
    """A second runner of ``config`` whose ``compile_all`` loads every plan before serving (no
    background thread): (runner, its compile summary); its guard is disarmed on the way out."""
    warm = ModelRunner(model, config, 64, PAGE)
    summary = warm.compile_all(start_background=False)
    try:
        yield warm, summary
    finally:
        warm.guard.disarm()


def test_quick_skeleton_serves_then_autotuned_plans_replace_it(model, tmp_path):
    """With a quick skeleton, ``compile_all`` compiles the skeleton with the quick compiler
    (no autotuning; per-layer decode weights even where the decode step stacks them) and defers
    its autotuned plans, which the background compile takes first: each replaces its quick plan
    while the ready rungs stay the skeleton's, then the rest of the ladder follows. Every step
    on the way gives the reference forward's tokens with no compile on its path; a second start
    on the same cache loads the autotuned plans and compiles nothing."""
    config = dataclasses.replace(LADDER, compile_cache_dir=str(tmp_path), quick_skeleton=True,
                                 stack_decode_weights=True)
    runner = ModelRunner(model, config, 64, PAGE)
    outer = runner.forward.outer_state
    per_layer = len(jax.tree_util.tree_leaves((outer, runner.forward.layer_states)))
    stacked = len(jax.tree_util.tree_leaves((outer, runner.stacked_layers)))
    assert stacked < per_layer
    summary = runner.compile_all(start_background=False)
    try:
        skeleton = Buckets((16, 64), (1, 4), (1, 2, 8))
        assert runner.ready == skeleton
        untuned = runner.stats()["plans_untuned"]
        assert untuned == 14 and summary.num_compiled >= untuned  # plans, executables
        assert summary.num_deferred == untuned + 3  # the skeleton autotuned, then the rest
        assert decode_weight_leaves(runner, 2) == per_layer
        _, first = generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)
        while runner.stats()["plans_untuned"]:
            runner.ladders.compile_deferred(limit=1)
            assert runner.stats()["plans_untuned"] == untuned - 1
            untuned -= 1
            assert runner.ready == skeleton
            if untuned == 8:  # quick and autotuned plans side by side
                assert generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first
        assert generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first
        assert decode_weight_leaves(runner, 2) == stacked
        runner.ladders.compile_deferred()
        assert runner.ready == runner.buckets
        assert generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first
        assert runner.stats()["runtime_compiles"] == 0
    finally:
        runner.guard.disarm()
    with warm_start(model, config) as (warm, summary):
        assert summary.num_compiled == 0 and warm.stats()["plans_untuned"] == 0
        assert warm.ready == warm.buckets and decode_weight_leaves(warm, 2) == stacked


def test_prefill_and_sampler_plans_compile_untuned_beside_the_autotuned_ones(model,
                                                                            ladder_cache):
    """With ``prefill_autotune`` off (a GPU's default) the encoders and the full sampler's plans
    are the quick compiler's (no autotuning: the option is in its cache key, and several
    threads), the decode steps and heads the autotuned one's; each takes its skeleton before
    serving and the rest on a background thread of its own. Steps give the reference forward's
    tokens while both threads run and once the ladder is complete, with no compile on their
    path; a warm start on the same cache compiles nothing. (The ladder cache: the autotuned
    plans load from it, the quick compiler's plans compile, their key being new.)"""
    config = dataclasses.replace(LADDER, compile_cache_dir=ladder_cache, prefill_autotune=False)
    runner = ModelRunner(model, config, 64, PAGE)
    runner.compile_all()
    try:
        ladders = runner.ladders
        untuned, tuned = set(ladders.quick.labels), set(ladders.compiler.labels)
        assert ladders.quick.compiler_options == compilers.NO_AUTOTUNE
        assert ladders.quick.threads == max(1, compilers.QUICK_COMPILE_THREADS)
        assert {label for label in untuned if "resample" not in label} == {
            "prefill T=16", "prefill T=32", "prefill T=64"}
        assert tuned == {f"decode B={rows}" for rows in (2, 4, 8)} | {
            f"head B={rows}" for rows in (1, 2, 4)}
        _, first = generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)
        assert ladders.wait(timeout=300) and runner.ready == runner.buckets
        assert generate(model, runner, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first
        assert runner.stats()["runtime_compiles"] == 0
    finally:
        runner.guard.disarm()
    with warm_start(model, config) as (warm, summary):
        assert summary.num_compiled == 0 and summary.num_loaded == summary.num_executables
        assert warm.ready == warm.buckets
        assert generate(model, warm, Pages(), prompts(13, 12, 9, 5), steps=2)[1] == first


def test_prefill_plans_are_autotuned_only_where_asked_or_on_a_cpu():
    rule = compilers.autotunes_prefill
    assert not rule(EngineConfig(), "gpu")
    assert rule(EngineConfig(), "cpu")
    assert rule(EngineConfig(prefill_autotune=True), "gpu")
    assert not rule(EngineConfig(prefill_autotune=False), "cpu")


def test_quick_skeleton_is_auto_on_a_gpu_with_background_compile():
    rule = compilers.uses_quick_skeleton
    assert rule(EngineConfig(), "gpu")
    assert not rule(EngineConfig(), "cpu")
    assert not rule(EngineConfig(background_compile=False), "gpu")
    assert rule(EngineConfig(quick_skeleton=True), "cpu")
    assert not rule(EngineConfig(quick_skeleton=False), "gpu")
    assert not rule(EngineConfig(quick_skeleton=True, background_compile=False), "cpu")


def test_a_background_compile_failure_surfaces_at_the_next_step(model, monkeypatch):
    """A bucket that fails to compile on the background thread is fatal as at start-up: the
    error names the segment and the bucket, and the runner's next step raises it."""
    fail_attention_outputs_at(model, monkeypatch, 4)
    config = dataclasses.replace(LADDER, disable_prefill_graph=True, compile_cache=False)
    runner = ModelRunner(model, config, 64, PAGE)
    runner.compile_all()  # the skeleton's decode executables have 2 and 8 rows
    try:
        with pytest.raises(CompileError, match=r"'decode'.*B=4.*injected failure"):
            runner.ladders.wait()
        assert runner.ready.decode_requests == (1, 2, 8)
        decode = [request("a", [3], 5, Pages().take(6), outputs=[3])]
        with pytest.raises(CompileError, match=r"background compile failed.*'decode'.*B=4"):
            runner.step(StepBatch(decode))
    finally:
        runner.guard.disarm()
