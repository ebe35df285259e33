"""Pieces: a forward written as a flat list of steps, cut into a ``Plan`` by ``PlanBuilder``.

A *piece* is one step of a forward (an embedding, one layer, half of a layer, an attention
kernel): ``fn(params, *inputs)`` over named values, or, with ``meta`` set, a break
``fn(params, meta, *inputs)``. ``PlanBuilder.plan`` cuts a piece list into calls, so a model
family declares its forward once per route and never writes segments by hand. Invariants:

* Consecutive non-break pieces fuse into one segment; every break piece is a call of its own.
* A segment returns only the values a later call or the plan's outputs read; a break returns
  exactly its piece's outputs, in order.
* Stages are keyed by their pieces' kinds and their wiring with value names replaced by local
  ones (``v0``, ``v1``, ...): calls whose pieces and wiring match share one stage object, so
  identical layers (equal ``kind``, other weights) compile once per bucket (``graph.plan``).
* A stage donates the inputs it overwrites and those its pieces declare in ``donate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tokenspeed_jax.graph.plan import Break, Call, Plan, Segment


@dataclasses.dataclass(frozen=True)
class Piece:
    """One step of a forward: ``fn(params, *inputs)`` (a break: ``fn(params, meta, *inputs)``)."""

    kind: Any  # equal kinds have the same function
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: Any = ()
    meta: str | None = None  # the break's metadata name; None = fused into a segment
    donate: tuple[str, ...] = ()


def _fused(pieces: Sequence[Piece], local: dict[str, str], inputs: tuple[str, ...],
           outputs: tuple[str, ...]) -> Callable[..., tuple]:
    wiring = [(p.fn, [local[n] for n in p.inputs], [local[n] for n in p.outputs]) for p in pieces]

    def fused(params: tuple, *args: Any) -> tuple:
        values = dict(zip(inputs, args))
        for (fn, ins, outs), piece_params in zip(wiring, params):
            values.update(zip(outs, fn(piece_params, *[values[n] for n in ins])))
        return tuple(values[n] for n in outputs)

    return fused


class PlanBuilder:
    """Cuts piece lists into plans, sharing one stage object per distinct (pieces, wiring)."""

    def __init__(self) -> None:
        self._stages: dict[tuple, Segment] = {}

    def _stage(self, pieces: Sequence[Piece], needed: set[str]) -> tuple[Segment, dict]:
        produced: set[str] = set()
        order: list[str] = []
        seg_inputs: list[str] = []
        for piece in pieces:
            for name in piece.inputs:
                if name not in produced and name not in seg_inputs:
                    seg_inputs.append(name)
            for name in (*piece.inputs, *piece.outputs):
                if name not in order:
                    order.append(name)
            produced |= set(piece.outputs)
        if pieces[0].meta is None:
            seg_outputs = [n for n in order if n in produced and n in needed]
        else:  # a break returns exactly its piece's outputs, in order
            seg_outputs = list(pieces[0].outputs)
        local = {name: f"v{i}" for i, name in enumerate(order)}
        donate = {n for p in pieces for n in p.donate} | (set(seg_inputs) & produced)
        key = (tuple((p.kind, tuple(local[n] for n in p.inputs),
                      tuple(local[n] for n in p.outputs)) for p in pieces),
               tuple(local[n] for n in seg_inputs), tuple(local[n] for n in seg_outputs),
               tuple(sorted(local[n] for n in donate if n in seg_inputs)), pieces[0].meta)
        if key not in self._stages:
            ins = tuple(local[n] for n in seg_inputs)
            outs = tuple(local[n] for n in seg_outputs)
            dons = tuple(local[n] for n in seg_inputs if n in donate)
            if pieces[0].meta is None:
                self._stages[key] = Segment("+".join(str(p.kind[0]) for p in pieces),
                                            _fused(pieces, local, ins, outs), ins, outs, dons)
            else:
                self._stages[key] = Break(pieces[0].meta, pieces[0].fn, ins, outs, dons)
        return self._stages[key], {v: k for k, v in local.items()}

    def plan(self, pieces: Sequence[Piece], inputs: Sequence[str],
             outputs: Sequence[str]) -> Plan:
        groups: list[list[Piece]] = []
        for piece in pieces:
            if piece.meta is None and groups and groups[-1][0].meta is None:
                groups[-1].append(piece)
            else:
                groups.append([piece])
        calls = []
        for index, group in enumerate(groups):
            needed = set(outputs) | {n for g in groups[index + 1:] for p in g for n in p.inputs}
            stage, rename = self._stage(group, needed)
            params = group[0].params if group[0].meta is not None else tuple(
                p.params for p in group)
            calls.append(Call(stage, params, rename))
        return Plan(calls, tuple(inputs), tuple(outputs))
