"""KDA reference against fla's golden outputs, and the chunked Pallas prefill (interpreted)
against the reference: ragged packed batches, GVA, initial states, padded requests, checkpoints,
strong decay."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels import kda, kda_intra, kda_ref

GOLDEN = pathlib.Path(__file__).parent / "golden" / "kda_naive.npz"
H, HV, K, V = 1, 2, 16, 16  # GVA: two value heads share one query/key head
LENGTHS = (1, 63, 64, 65, 1000)


def random_inputs(rng, num_tokens, *, strong_decay=True):
    q = rng.standard_normal((num_tokens, H, K)).astype(np.float32)
    k = rng.standard_normal((num_tokens, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((num_tokens, HV, V)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((num_tokens, HV, K)) - 1.0)).astype(np.float32)
    if strong_decay:
        g[strong_decay_mask(rng, g.shape)] = -100.0
    beta = rng.uniform(0.05, 1.0, (num_tokens, HV)).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (q, k, v, g, beta))


def strong_decay_mask(rng, shape):
    """Where g is -100: half the channels of about 4% of the (token, head) rows, so about half
    the 16-row blocks of a head hold one (their pairs are computed one by one) and half do not
    (their pairs go through the block's first row)."""
    rows = rng.uniform(size=(*shape[:-1], 1)) < 0.04
    return rows & (rng.uniform(size=shape) < 0.5)


def reference(inputs, cu, initial_state, **kw):
    batched = [x[None] for x in inputs]
    o, s = kda_ref.recurrent_kda_reference(
        *batched, initial_state=initial_state, output_final_state=True, cu_seqlens=cu, **kw
    )
    return np.asarray(o[0]), np.asarray(s)


def pool_reference(inputs, cu, pool_rows, **kw):
    """``reference`` from states given as pool rows [N, HV, V, K], final states returned so."""
    o, s = reference(inputs, cu, kda_ref.pool_layout(pool_rows), **kw)
    return o, np.asarray(kda_ref.pool_layout(s))


def rel_err(x, y):
    return float(np.linalg.norm(np.asarray(x) - y) / np.linalg.norm(y))


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)  # committed; a missing file is an error (scripts/make_golden.py kda)


@pytest.mark.parametrize("prefix", ["", "gva_", "decode_"])
def test_references_match_fla_naive_golden(golden, prefix):
    meta = json.loads(str(golden["metadata"]))
    case = next(c for c in meta["cases"].values() if c["prefix"] == prefix)
    args = [jnp.asarray(golden[prefix + n]) for n in ("q", "k", "v", "g", "beta")]
    init = jnp.asarray(golden[prefix + "initial_state"]) if case["initial_state_passed"] else None
    scale = float(golden[prefix + "scale"])
    for fn in (kda_ref.recurrent_kda_reference, kda_ref.chunk_kda_reference):
        o, s = fn(*args, scale=scale, initial_state=init, output_final_state=True)
        np.testing.assert_allclose(o, golden[prefix + "o"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s, golden[prefix + "final_state"], rtol=1e-4, atol=1e-4)


def test_chunk_kda_kernel_matches_fla_golden_gva(golden):
    args = [jnp.asarray(golden["gva_" + n]) for n in ("q", "k", "v", "g", "beta")]
    o, s = kda.chunk_kda(*args, scale=float(golden["gva_scale"]), output_final_state=True,
                         interpret=True)
    np.testing.assert_allclose(o, golden["gva_o"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s, golden["gva_final_state"], rtol=1e-4, atol=1e-4)


def test_gate_and_l2norm_match_hand_formulas():
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((3, 2, 4)).astype(np.float32) * 30
    a_log = rng.standard_normal(2).astype(np.float32)
    dt_bias = rng.standard_normal(8).astype(np.float32)
    x = raw + dt_bias.reshape(2, 4)
    expected = -np.exp(a_log)[:, None] * np.logaddexp(0.0, x.astype(np.float64))
    got = kda_ref.kda_gate(jnp.asarray(raw), jnp.asarray(a_log), jnp.asarray(dt_bias))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    norm = kda_ref.l2_normalize(jnp.asarray(raw))
    np.testing.assert_allclose(norm, raw / np.sqrt((raw**2).sum(-1, keepdims=True) + 1e-6),
                               rtol=1e-5)


def test_chunk_form_matches_recurrence_with_gate_and_l2norm():
    rng = np.random.default_rng(2)
    q, k, v, g, beta = random_inputs(rng, 150)
    a_log = jnp.asarray(rng.standard_normal(HV), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV * K), jnp.float32)
    cu = np.array([0, 17, 150])
    init = jnp.asarray(rng.standard_normal((2, HV, K, V)), jnp.float32)
    kw = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": a_log,
              "dt_bias": dt_bias, "initial_state": init, "output_final_state": True, "cu_seqlens": cu}
    batched = [x[None] * 3 for x in (q, k)] + [x[None] for x in (v, g, beta)]
    o_rec, s_rec = kda_ref.recurrent_kda_reference(*batched, **kw)
    o_chk, s_chk = kda_ref.chunk_kda_reference(*batched, **kw)
    assert rel_err(o_chk, np.asarray(o_rec)) < 1e-5
    assert rel_err(s_chk, np.asarray(s_rec)) < 1e-5


def test_chunk_kernel_normalises_and_gates_inside_like_the_recurrence():
    """q and k unnormalised at three times unit scale, the raw gate: the kernel's own L2 norm
    (its q/k kernel) and gate against the recurrence doing both, over a ragged GVA batch."""
    rng = np.random.default_rng(5)
    q, k, v, g, beta = random_inputs(rng, 150)
    kw = {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
          "A_log": jnp.asarray(rng.standard_normal(HV), jnp.float32),
          "dt_bias": jnp.asarray(rng.standard_normal(HV * K), jnp.float32),
          "initial_state": jnp.asarray(rng.standard_normal((2, HV, K, V)), jnp.float32),
          "output_final_state": True, "cu_seqlens": np.array([0, 17, 150])}
    batched = [x[None] * 3 for x in (q, k)] + [x[None] for x in (v, g, beta)]
    o_ref, s_ref = kda_ref.recurrent_kda_reference(*batched, **kw)
    o, s = kda.chunk_kda(*batched, interpret=True, **kw)
    assert rel_err(o, np.asarray(o_ref)) < 1e-4
    assert rel_err(s, np.asarray(s_ref)) < 1e-4


@pytest.fixture(scope="module")
def ragged_batch():
    """Requests of LENGTHS plus one padded request, packed into a bucket with spare tokens."""
    rng = np.random.default_rng(3)
    lengths = LENGTHS + (7,)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    num_tokens = int(cu[-1]) + 9
    inputs = random_inputs(rng, num_tokens)
    pool = jnp.asarray(rng.standard_normal((10, HV, V, K)), jnp.float32)
    slots = np.array([4, 0, 7, 2, 9, -1], np.int32)
    return inputs, cu, pool, slots


def run_prefill(ragged_batch, ckpt_offsets=None, ckpt_slots=None):
    inputs, cu, pool, slots = ragged_batch
    extra = {}
    if ckpt_offsets is not None:
        extra = {"checkpoint_offsets": jnp.asarray(ckpt_offsets, jnp.int32),
                     "checkpoint_slots": jnp.asarray(ckpt_slots, jnp.int32)}
    o, new_pool = kda.chunk_kda_prefill(
        *inputs, jnp.array(pool), jnp.asarray(slots), jnp.asarray(cu), interpret=True, **extra
    )
    return np.asarray(o), np.asarray(new_pool)


def test_prefill_ragged_gva_states_from_pool_and_padding(ragged_batch):
    inputs, cu, pool, slots = ragged_batch
    real = slots >= 0
    init = np.where(real[:, None, None, None], np.asarray(pool)[np.maximum(slots, 0)], 0)
    o_ref, s_ref = pool_reference(inputs, cu, jnp.asarray(init))
    o, new_pool = run_prefill(ragged_batch)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(new_pool))
    for n in range(len(slots)):
        lo, hi = cu[n], cu[n + 1]
        assert rel_err(o[lo:hi], o_ref[lo:hi]) < 1e-4, n
    assert np.all(o[cu[-1]:] == 0)
    np.testing.assert_allclose(new_pool[slots[real]], s_ref[real], rtol=1e-4, atol=1e-4)
    untouched = np.setdiff1d(np.arange(pool.shape[0]), slots[real])
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])


def test_prefill_checkpoints_at_several_granularities(ragged_batch):
    inputs, cu, pool, slots = ragged_batch
    # request 4 (1000 tokens) checkpoints at 896 = 7*128; request 3 (65 tokens) at 64; request 2
    # (64 tokens) at its full length; request 1 has none; the padded request asks but is ignored
    # for its state slot only through its own (negative) checkpoint slot.
    offsets = np.array([0, 0, 64, 64, 256 * 3, 0], np.int32)
    ckpt_slots = np.array([-1, -1, 1, 3, 5, -1], np.int32)
    o, new_pool = run_prefill(ragged_batch, offsets, ckpt_slots)
    o_plain, pool_plain = run_prefill(ragged_batch)
    np.testing.assert_allclose(o, o_plain, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new_pool[slots[slots >= 0]], pool_plain[slots[slots >= 0]],
                               rtol=1e-6, atol=1e-6)
    for n in (2, 3, 4):
        lo = cu[n]
        prefix = [x[lo:lo + offsets[n]] for x in inputs]
        init = jnp.asarray(np.asarray(pool)[slots[n]][None])
        _, s_ref = pool_reference(prefix, np.array([0, offsets[n]]), init)
        np.testing.assert_allclose(new_pool[ckpt_slots[n]], s_ref[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(new_pool[[6, 8]], np.asarray(pool)[[6, 8]])


def test_prefill_with_a_bf16_pool_rounds_only_the_states_it_stores(ragged_batch):
    inputs, cu, pool, slots = ragged_batch
    pool = pool.astype(jnp.bfloat16)
    offsets = np.array([0, 0, 0, 0, 512, 0], np.int32)
    ckpt_slots = np.array([-1, -1, -1, -1, 5, -1], np.int32)
    o, new_pool = run_prefill((inputs, cu, pool, slots), offsets, ckpt_slots)
    assert new_pool.dtype == jnp.bfloat16
    real = slots >= 0
    start = np.asarray(pool.astype(jnp.float32))
    init = np.where(real[:, None, None, None], start[np.maximum(slots, 0)], 0)
    o_ref, s_ref = pool_reference(inputs, cu, jnp.asarray(init))
    for n in range(len(slots)):
        assert rel_err(o[cu[n]:cu[n + 1]], o_ref[cu[n]:cu[n + 1]]) < 1e-4, n
    one_rounding = {"rtol": 2.0**-8, "atol": 1e-6}  # bf16 keeps 8 bits of the fp32 state
    np.testing.assert_allclose(new_pool[slots[real]].astype(np.float32), s_ref[real],
                               **one_rounding)
    prefix = [x[cu[4]:cu[4] + offsets[4]] for x in inputs]
    _, s_ckpt = pool_reference(prefix, np.array([0, offsets[4]]), jnp.asarray(init[4:5]))
    np.testing.assert_allclose(new_pool[5].astype(np.float32), s_ckpt[0], **one_rounding)
    untouched = [1, 3, 6, 8]
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])


@pytest.mark.parametrize("nilpotency", [4, 16])
def test_nilpotent_inverse_matches_numpy(nilpotency):
    rng = np.random.default_rng(7)
    strict = np.tril(rng.uniform(-1.0, 1.0, (16, 16)), -1)
    if nilpotency == 4:  # strictly lower in 4 x 4 blocks: N^4 = 0
        strict *= np.kron(np.tril(np.ones((4, 4)), -1), np.ones((4, 4)))
    got = kda_intra.nilpotent_inverse(
        jnp.asarray(strict, jnp.float32), nilpotency,
        lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    expected = np.linalg.inv(np.eye(16) + strict)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_per_chunk_kernels_match_numpy_under_strong_decay():
    """The per-chunk kernels against float64 numpy: the query-key matrix, and w and u through
    the inverse, with steps of -100 inside and across 16-row blocks and two 64-key slices; q
    and k arrive unnormalised and the kernels L2-normalise them."""
    rng = np.random.default_rng(11)
    chunk, width, scale = 64, 128, 0.3
    q, k = rng.standard_normal((2, chunk, 1, width))
    v = rng.standard_normal((1, chunk, 1, width))
    g = -rng.uniform(0.0, 1.0, (1, chunk, 1, width))
    g[0, [2, 9, 21, 40], 0, :] = -100.0
    beta = rng.uniform(0.05, 1.0, (1, chunk, 1))
    q_t, k_t, v_t, g_t, beta_c = (jnp.asarray(x, jnp.float32) for x in (
        q, k, v.reshape(chunk, 1, width), g.reshape(chunk, 1, width), beta))
    qg, w, kg, u, aqk, glast = kda_intra.intra_stage(
        q_t, k_t, v_t, g_t, beta_c, jnp.arange(chunk)[None], jnp.array([1]), group=1,
        scale=scale, normalize_qk=True, config=kda.ChunkConfig(), interpret=True)
    assert all(np.all(np.isfinite(x)) for x in (qg, w, kg, u, aqk))

    gc = np.cumsum(g[0, :, 0], axis=0)
    qs, ks = (x[:, 0] / np.linalg.norm(x[:, 0], axis=-1, keepdims=True) for x in (q, k))
    i, j = np.arange(chunk)[:, None], np.arange(chunk)[None, :]
    decay = np.exp(np.where((i >= j)[:, :, None], gc[:, None, :] - gc[None, :, :], -np.inf))
    np.testing.assert_allclose(aqk[0, 0], scale * np.einsum("id,jd,ijd->ij", qs, ks, decay),
                               rtol=1e-5, atol=1e-5)
    b = beta[0, :, 0][:, None]
    kk = np.einsum("id,jd,ijd->ij", ks, ks, decay) * (i > j)
    t_mat = np.linalg.inv(np.eye(chunk) + b * kk)
    np.testing.assert_allclose(u[0, 0], t_mat @ (b * v[0, :, 0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w[0, 0], t_mat @ (b * np.exp(gc) * ks), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kg[0, 0], ks * np.exp(gc[-1] - gc), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(glast[0, 0], gc[-1], rtol=1e-5)


def test_per_chunk_kernels_skip_chunks_past_the_live_ones():
    """Two chunks of tokens, one declared live: the first chunk's outputs are the ones of a
    call with both live, and nothing computed lands in the second (it is never read)."""
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((3, 128, 1, 32))
    g = -rng.uniform(0.0, 1.0, (128, 1, 32))
    beta = rng.uniform(0.05, 1.0, (2, 64, 1))
    inputs = tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)) + (
        jnp.arange(128).reshape(2, 64),)

    def outputs(live):
        return kda_intra.intra_stage(*inputs, jnp.array([live]), group=1, scale=0.3,
                                     normalize_qk=True, config=kda.ChunkConfig(), interpret=True)

    for both, first in zip(outputs(2), outputs(1)):  # qg, w, kg, u, aqk [HV, NC, ...], glast
        np.testing.assert_array_equal(first[:, 0], both[:, 0])
        assert not np.allclose(first[:, 1], both[:, 1])


@pytest.mark.parametrize(("query_heads", "value_heads", "diagonal_heads", "diagonal_rows"),
                         [(1, 2, 1, 4), (1, 2, 2, 1), (2, 4, 4, 16), (2, 2, 2, 4), (4, 4, 2, 2),
                          (1, 3, 4, 4)])
def test_per_chunk_kernels_match_reference_for_head_blocks(query_heads, value_heads,
                                                           diagonal_heads, diagonal_rows):
    """The in-block pairs take up to `diagonal_heads` value heads per program: fewer than, as
    many as, or more than the value heads sharing a query head, blocks without GVA, and a head
    count the setting does not divide (three heads, at most four per program: one program);
    and 1 to 16 rows per program. About half the blocks of each head are near, so a program's
    heads mix near blocks and others."""
    rng = np.random.default_rng(8)
    wide = 32
    cu = np.array([0, 70, 200], np.int32)
    q = rng.standard_normal((200, query_heads, wide)).astype(np.float32)
    k = rng.standard_normal((200, query_heads, wide)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((200, value_heads, wide)).astype(np.float32)
    g = -rng.uniform(0.0, 1.0, (200, value_heads, wide)).astype(np.float32)
    g[strong_decay_mask(rng, g.shape)] = -100.0
    beta = rng.uniform(0.05, 1.0, (200, value_heads)).astype(np.float32)
    inputs = tuple(jnp.asarray(x) for x in (q, k, v, g, beta))
    pool = jnp.asarray(rng.standard_normal((2, value_heads, wide, wide)).astype(np.float32))
    o_ref, s_ref = pool_reference(inputs, cu, pool)
    o, new_pool = kda.chunk_kda_prefill(
        *inputs, pool, jnp.array([0, 1], jnp.int32), jnp.asarray(cu), interpret=True,
        config=kda.ChunkConfig(diagonal_heads=diagonal_heads, diagonal_rows=diagonal_rows))
    assert rel_err(o, o_ref) < 1e-4
    np.testing.assert_allclose(new_pool, s_ref, rtol=1e-4, atol=1e-4)


def test_fused_recurrent_matches_chunk_with_initial_state():
    rng = np.random.default_rng(4)
    q, k, v, g, beta = random_inputs(rng, 130)
    init = jnp.asarray(rng.standard_normal((2, HV, K, V)), jnp.float32)
    cu = jnp.asarray([0, 66, 130], jnp.int32)
    batched = [x[None] for x in (q, k, v, g, beta)]
    kw = {"initial_state": init, "output_final_state": True, "cu_seqlens": cu, "interpret": True}
    o_c, s_c = kda.chunk_kda(*batched, **kw)
    o_r, s_r = kda.fused_recurrent_kda(*batched, **kw)
    o_ref, s_ref = reference((q, k, v, g, beta), np.asarray(cu), init)
    assert rel_err(o_c[0], o_ref) < 1e-4 and rel_err(o_r[0], o_ref) < 1e-5
    assert rel_err(s_c, s_ref) < 1e-4 and rel_err(s_r, s_ref) < 1e-5


def test_prefill_rejects_bad_shapes():
    rng = np.random.default_rng(5)
    q, k, v, g, beta = random_inputs(rng, 8, strong_decay=False)
    pool = jnp.zeros((2, HV, V, K), jnp.float32)
    slots = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunk_kda_prefill(q, k, v, g, beta, pool, slots, jnp.array([0, 4, 8], jnp.int32),
                              interpret=True)
    with pytest.raises(ValueError, match=r"state_pool must be \[P, HV, V, K\]"):
        kda.chunk_kda_prefill(q, k, v, g, beta, jnp.zeros((2, HV, V, 2 * K)), slots,
                              jnp.array([0, 8], jnp.int32), interpret=True)
    with pytest.raises(TypeError, match="float32.*bfloat16.*got float16"):
        kda.chunk_kda_prefill(q, k, v, g, beta, pool.astype(jnp.float16), slots,
                              jnp.array([0, 8], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="diagonal_heads"):
        kda.chunk_kda_prefill(q, k, v, g, beta, pool, slots, jnp.array([0, 8], jnp.int32),
                              config=kda.ChunkConfig(diagonal_heads=0), interpret=True)
    with pytest.raises(ValueError, match="diagonal_rows"):
        kda.chunk_kda_prefill(q, k, v, g, beta, pool, slots, jnp.array([0, 8], jnp.int32),
                              config=kda.ChunkConfig(diagonal_rows=3), interpret=True)
    with pytest.raises(ValueError, match="inverse dot algorithm 'tf16'"):
        kda.ChunkConfig(inverse_dots="tf16")
    with pytest.raises(ValueError, match="multiple"):
        kda.chunk_kda(q[None].repeat(3, 2), k[None].repeat(3, 2), v[None], g[None], beta[None],
                      interpret=True)


def test_near_blocks_by_hand():
    """A block is near when no channel decays by 64 or more from its first row to its last (the
    first row's own gate does not count); one flag per (chunk, block, value head)."""
    g = np.full((2, 64, 2, 3), -0.5, np.float32)  # 7.5 over the 15 steps of each block
    g[0, 17:32, 0, 2] = -4.3  # chunk 0, block 1, head 0, one channel: 64.5
    g[0, 35:48, 1, 0] = -4.0  # chunk 0, block 2, head 1: 52 + 1 = 53
    g[1, 48, :, 1] = -1000.0  # chunk 1, block 3's first row: its own gate does not count
    g[1, 5, 1, :] = -100.0  # chunk 1, block 0, head 1
    near = np.asarray(kda_intra.near_blocks(jnp.cumsum(jnp.asarray(g), axis=1)))
    expected = np.ones((2, 4, 2), np.int32)
    expected[0, 1, 0] = 0
    expected[1, 0, 1] = 0
    np.testing.assert_array_equal(near, expected)


def test_interpret_none_means_interpret_on_cpu():
    assert jax.default_backend() == "cpu"
    from tokenspeed_jax.kernels import pallas_backend

    assert pallas_backend.resolve_interpret(None) is True
    assert pallas_backend.resolve_interpret(False) is False
    with pytest.raises(TypeError):
        pallas_backend.resolve_interpret("yes")


@pytest.mark.parametrize(("most", "value_heads", "group", "expected"),
                         [(4, 32, 1, 4), (4, 3, 3, 3), (4, 6, 3, 3), (4, 6, 2, 2), (4, 12, 3, 3),
                          (8, 16, 4, 8), (1, 32, 2, 1)])
def test_diagonal_heads_per_program(most, value_heads, group, expected):
    assert kda_intra.diagonal_heads(most, value_heads, group) == expected


@pytest.mark.parametrize(("requests", "value_width", "dtype", "config", "expected"), [
    (1, 128, jnp.bfloat16, kda.ChunkConfig(), (32, 3)),  # 128 programs: one wave
    (2, 128, jnp.bfloat16, kda.ChunkConfig(), (64, 3)),
    (4, 128, jnp.bfloat16, kda.ChunkConfig(), (128, 2)),
    (16, 128, jnp.bfloat16, kda.ChunkConfig(), (128, 1)),  # 512 programs at best: share SMs
    (16, 128, jnp.float32, kda.ChunkConfig(), (32, 2)),
    (2, 96, jnp.bfloat16, kda.ChunkConfig(), (96, 2)),  # 64 does not divide 96
    (1, 16, jnp.bfloat16, kda.ChunkConfig(), (16, 3)),
    (16, 128, jnp.bfloat16, kda.ChunkConfig(block_v=64), (64, 3)),
    (1, 128, jnp.bfloat16, kda.ChunkConfig(num_stages=1), (32, 1)),
    (1, 128, jnp.float32, kda.ChunkConfig(num_stages=3), (32, 2)),
])
def test_scan_blocking_for_32_value_heads(requests, value_width, dtype, config, expected):
    assert kda.scan_blocking(requests, 32, value_width, dtype, config) == expected


@pytest.mark.parametrize("scan_wave", [132, 1])
def test_prefill_matches_reference_with_narrow_and_whole_scan_blocks(scan_wave):
    """64 value columns: two 32-column scan blocks in one wave, or with a wave of one program,
    one whole-V block at one stage."""
    rng = np.random.default_rng(13)
    q, k, _, g, beta = random_inputs(rng, 200)
    v = jnp.asarray(rng.standard_normal((200, HV, 64)).astype(np.float32))
    cu = np.array([0, 70, 200], np.int32)
    pool = jnp.asarray(rng.standard_normal((2, HV, 64, K)).astype(np.float32))
    config = kda.ChunkConfig(scan_wave=scan_wave)
    expected_block = 32 if scan_wave > 1 else 64
    assert kda.scan_blocking(2, HV, 64, jnp.bfloat16, config)[0] == expected_block
    o_ref, s_ref = pool_reference((q, k, v, g, beta), cu, pool)
    o, new_pool = kda.chunk_kda_prefill(q, k, v.astype(jnp.bfloat16), g, beta, pool,
                                        jnp.array([0, 1], jnp.int32), jnp.asarray(cu),
                                        config=config, interpret=True)
    assert rel_err(o, o_ref) < 1e-2
    np.testing.assert_allclose(new_pool, s_ref, rtol=2e-2, atol=2e-2)
