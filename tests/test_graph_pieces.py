"""graph.pieces: a piece list cut into a plan, checked against the same forward written by hand
(a two-layer toy model with a break between the layers' halves)."""

import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.graph import Break, Piece, PlanBuilder, Segment, run_eager


def embed(params, token_ids):
    return (params["table"][token_ids],)


def layer_in(params, hidden):
    return (hidden * params["scale"],)


def shift(params, meta, q):
    """The break: adds the host's per-run offset."""
    return (q + meta["offset"],)


def layer_out(params, hidden, attn):
    return (hidden + attn * params["scale"],)


LAYERS = [{"scale": jnp.float32(2.0)}, {"scale": jnp.float32(-0.5)}]
TABLE = {"table": jnp.arange(12, dtype=jnp.float32).reshape(4, 3)}


def toy_pieces() -> list[Piece]:
    pieces = [Piece(("embed",), embed, ("token_ids",), ("hidden",), TABLE)]
    for params in LAYERS:
        pieces += [Piece(("in",), layer_in, ("hidden",), ("q",), params),
                   Piece(("shift",), shift, ("q",), ("attn",), meta="shift", donate=("q",)),
                   Piece(("out",), layer_out, ("hidden", "attn"), ("hidden",), params)]
    return pieces


def by_hand(token_ids: np.ndarray, offset: float) -> np.ndarray:
    hidden = np.arange(12, dtype=np.float32).reshape(4, 3)[token_ids]
    for scale in (2.0, -0.5):
        hidden = hidden + (hidden * scale + offset) * scale
    return hidden


def test_pieces_fuse_between_breaks_and_compute_the_forward():
    plan = PlanBuilder().plan(toy_pieces(), ("token_ids",), ("hidden",))
    stages = [call.stage for call in plan.calls]
    # embed+in | shift | out+in | shift | out
    assert [type(s) for s in stages] == [Segment, Break, Segment, Break, Segment]
    assert [s.name for s in stages] == ["embed+in", "shift", "out+in", "shift", "out"]
    token_ids = np.array([3, 0, 2], np.int32)
    out = run_eager(plan, {"token_ids": jnp.asarray(token_ids)}, {"shift": {"offset": 0.25}})
    np.testing.assert_allclose(np.asarray(out["hidden"]), by_hand(token_ids, 0.25))


def test_segments_return_only_what_later_calls_read():
    plan = PlanBuilder().plan(toy_pieces(), ("token_ids",), ("hidden",))
    first = plan.calls[0]
    # embed+in hands on the hidden states (read by out) and q (read by the break), nothing else
    assert sorted(first.outputs) == ["hidden", "q"]
    assert plan.calls[-1].outputs == ("hidden",)


def test_equal_pieces_and_wiring_share_one_stage_and_donate_what_they_overwrite():
    builder = PlanBuilder()
    plan = builder.plan(toy_pieces(), ("token_ids",), ("hidden",))
    breaks = [call for call in plan.calls if isinstance(call.stage, Break)]
    assert breaks[0].stage is breaks[1].stage  # the same break, each call its own layer
    again = builder.plan(toy_pieces(), ("token_ids",), ("hidden",))
    assert [c.stage for c in again.calls] == [c.stage for c in plan.calls]
    middle = plan.calls[2]  # out+in overwrites "hidden": donated; the break donates q
    assert middle.donated == ("hidden",) and breaks[0].donated == ("q",)
    assert [call.params for call in plan.calls[2:3]] == [(LAYERS[0], LAYERS[1])]
