"""KDA state rows under the scheduler, against a fake hybrid model with a recurrent state.

The fake runner's next token depends only on a running hash of every token a sequence has fed,
kept in the state row each step names; checkpoints and restores are done as the real runner does
them. The expectation is the hash of the plain token list, so a shared row, a missing restore, a
stale checkpoint or a prefix hit that skips tokens without their state changes the outputs.
"""

from types import SimpleNamespace

import numpy as np
from test_scheduler import run_to_completion

from tokenspeed_jax.engine.batch import StepBatch
from tokenspeed_jax.engine.block_manager import BlockManager
from tokenspeed_jax.engine.request import Request
from tokenspeed_jax.engine.scheduler import Scheduler
from tokenspeed_jax.engine.state_slots import StateSlots, prefix_page_hash
from tokenspeed_jax.models.cache_spec import PAGE as PAGE_UNIT
from tokenspeed_jax.models.cache_spec import SLOT, unit_bytes
from tokenspeed_jax.models.kimi_linear.family import cache_pools
from tokenspeed_jax.sampling_params import SamplingParams

VOCAB = 97
PRIME = 1_000_003
PAGE = 4
CHUNK = 4
GRANULARITY = 8


def advance(state: int, token: int) -> int:
    return (state * 131 + token + 1) % PRIME


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    state, tokens = 0, list(prompt)
    for t in prompt:
        state = advance(state, t)
    for _ in range(max_tokens):
        tokens.append(state % VOCAB)
        state = advance(state, tokens[-1])
    return tokens[len(prompt):]


class RecurrentFakeRunner:
    def __init__(self, num_rows: int):
        self.rows: list[int | None] = [None] * num_rows

    def step(self, batch: StepBatch) -> list[int]:
        for r in batch.requests:
            if r.restore_slot >= 0:
                self.rows[r.state_slot] = self.rows[r.restore_slot]
        sampled = []
        for r in batch.requests:
            state = 0 if r.start_pos == 0 else self.rows[r.state_slot]
            assert state is not None, f"{r.request_id} continues from an unwritten row"
            boundary = r.end_pos // GRANULARITY * GRANULARITY
            for position, token in enumerate(r.token_ids.tolist(), start=r.start_pos):
                state = advance(state, token)
                if r.checkpoint_slot >= 0 and position + 1 == boundary:
                    self.rows[r.checkpoint_slot] = state
            self.rows[r.state_slot] = state
            if r.sample:
                sampled.append(state % VOCAB)
        return sampled


def run(scheduler: Scheduler, requests: list[Request]) -> None:
    slots = scheduler.state_slots

    def rows_are_held_once(scheduler: Scheduler) -> None:
        held = [r.state_slot for r in scheduler.running]
        assert len(set(held)) == len(held) and all(0 <= s < slots.num_live for s in held)
        assert slots.num_free == slots.num_live - len(held)

    run_to_completion(scheduler, RecurrentFakeRunner(slots.num_slots), requests,
                      check=rows_are_held_once)


def make_requests(seed: int, count: int, prefix: list[int]) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(f"r{i}", prefix + rng.integers(0, VOCAB, rng.integers(1, 12)).tolist(),
                    SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=0.0))
            for i in range(count)]


def test_rows_bound_admission_and_outputs_survive_preemption_and_prefix_hits():
    manager = BlockManager(num_pages=14, page_size=PAGE)
    slots = StateSlots(3, 2, granularity=GRANULARITY, chunk=CHUNK, page_size=PAGE)
    scheduler = Scheduler(manager, max_num_seqs=6, max_num_batched_tokens=16, state_slots=slots)
    requests = make_requests(0, 24, prefix=list(range(10, 29)))  # 19 shared tokens
    run(scheduler, requests)
    for request in requests:
        assert request.output_token_ids == reference_outputs(request.prompt_token_ids,
                                                             request.params.max_tokens)
        assert request.state_slot == -1
    assert scheduler.num_preemptions > 0
    assert slots.checkpoint_hits > 0 and scheduler.prefix_hit_tokens > 0
    assert scheduler.prefix_hit_tokens % GRANULARITY == 0  # hits end on checkpoints only
    assert slots.num_free == slots.num_live
    assert manager.num_free_pages == manager.num_pages


def test_a_request_waits_for_a_free_row():
    manager = BlockManager(num_pages=32, page_size=PAGE)
    slots = StateSlots(2, 0, granularity=GRANULARITY, chunk=CHUNK, page_size=PAGE)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, state_slots=slots)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    step = scheduler.schedule()
    assert [r.request_id for r in step.requests] == ["r0", "r1"]
    assert list(scheduler.waiting) == [requests[2]]
    scheduler.after_step(step)
    scheduler.finish(requests[0], "abort")
    assert slots.num_free == 1
    step = scheduler.schedule()
    assert "r2" in [r.request_id for r in step.requests]


def test_checkpoint_rows_are_reserved_on_chunk_starts_published_after_the_step_and_lru():
    slots = StateSlots(1, 2, granularity=GRANULARITY, chunk=CHUNK, page_size=PAGE)
    tokens = list(range(40))
    assert slots.reserve(tokens, 2, 20) == -1  # does not start on a chunk
    assert slots.reserve(tokens, 8, 15) == -1  # crosses no boundary
    first = slots.reserve(tokens, 0, 20)  # checkpoint at 16
    assert first >= slots.num_live and slots.reserve(tokens, 0, 17) == -1  # already pending
    hashes = [prefix_page_hash(tokens, PAGE, n) for n in range(1, 10)]
    assert slots.find(hashes) == (0, -1)  # pending, not yet published
    slots.publish()
    assert slots.find(hashes) == (4, first)
    second = slots.reserve(tokens, 0, 8)
    slots.publish()
    assert slots.find(hashes[:3]) == (2, second)
    third = slots.reserve(tokens, 0, 24)  # both rows taken: evicts the least recently found
    assert third == first


def test_state_row_bytes_count_the_state_in_its_dtype_and_the_conv_window_in_the_models():
    model = SimpleNamespace(linear_num_heads=2, linear_head_dim=4, conv_kernel_size=4,
                            kda_layers=(0, 2, 3), num_hidden_layers=5, latent_dim=6)

    def row_and_page(dtype: str, state_dtype: str, devices: int = 1) -> tuple[int, int]:
        pools = cache_pools(model, 16, dtype, state_dtype, devices)
        return unit_bytes(pools, SLOT, devices), unit_bytes(pools, PAGE_UNIT, devices)

    state, conv = 2 * 4 * 4, (4 - 1) * 3 * 2 * 4  # values per KDA layer
    latent = 16 * 6  # values per page of each of the two MLA layers
    assert row_and_page("bfloat16", "float32") == (3 * (state * 4 + conv * 2), 2 * latent * 2)
    assert row_and_page("bfloat16", "bfloat16") == (3 * (state * 2 + conv * 2), 2 * latent * 2)
    assert row_and_page("float32", "bfloat16") == (3 * (state * 2 + conv * 4), 2 * latent * 4)
    # two devices: the state rows split by head, the latent pages replicated
    assert row_and_page("bfloat16", "float32", 2) == (3 * (state * 2 + conv), 2 * latent * 2)
