"""Check the MLA decode and prefill kernels against their plain-JAX references on the GPU, then
time both at the Kimi-Linear-48B-A3B attention shape (32 heads, kv_lora_rank 512, rope 64,
16-token pages, bf16).

    python3 benchmarks/bench_mla_attention.py [--out DIR] [--budget-s SECONDS] [--tiny]

Decode (``mla_decode``, which also writes the step's latent row; the pages donated, as a decode
step donates its cache): batch 1, 32 and 64 at context 1024 and 8192, split as
``mla_split_count`` says and unsplit; milliseconds per call beside the reference's (the model's
plain-JAX route: write the rows, gather each request's whole page table, attend) and the floor of
reading the live latent rows and queries once at ``HBM_BYTES_PER_S``. Prefill (``mla_prefill``,
rows already written): one request of 2048 and 8192 new tokens, 2048 after 4096 cached (a second
chunk), 4 x 2048; milliseconds beside the reference's (the chunked plain-JAX loop) and causal
TFLOP/s. Then other knobs for both. Every timing row also reports the max |kernel - reference|
and the relative error. Items run in that order; once --budget-s has passed the rest are
skipped, so the table always prints. Every result is a JSON line, appended to
DIR/bench_mla_attention.jsonl. ``--tiny`` shrinks every shape and interprets the kernels: a
smoke test of this script on the CPU, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_prefill_attention import errors, run_within_budget, wall_ms

from tokenspeed_jax.kernels.mla_decode import (
    MLADecodeBlocks,
    mla_decode,
    mla_decode_reference,
    mla_split_count,
)
from tokenspeed_jax.kernels.mla_prefill import (
    MLAPrefillBlocks,
    mla_prefill,
    mla_prefill_reference,
)
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work

HBM_BYTES_PER_S = 4.3e12  # an H200's device-to-device copy rate


@dataclasses.dataclass(frozen=True)
class Shape:
    heads: int = 32
    rank: int = 512
    rope: int = 64
    page: int = 16
    scale: float = 192 ** -0.5
    decode: tuple = ((1, 1024), (32, 1024), (64, 1024), (1, 8192), (32, 8192), (64, 8192))
    prefill: tuple = (("T=2048", ((0, 2048),)), ("T=8192", ((0, 8192),)),
                      ("T=2048 ctx=4096", ((4096, 2048),)), ("4x2048", ((0, 2048),) * 4))
    decode_variant_case: tuple = (1, 8192)  # (batch, context) the other knobs are timed at
    prefill_variant_case: int = 1  # the index in ``prefill`` of the case they are timed at
    decode_variants: tuple = (MLADecodeBlocks(block_h=32, num_warps=8),
                              MLADecodeBlocks(pages_per_block=4, num_warps=8),
                              MLADecodeBlocks(pages_per_block=1), MLADecodeBlocks(num_warps=8),
                              MLADecodeBlocks(num_stages=2), MLADecodeBlocks(most_splits=4),
                              MLADecodeBlocks(fill_programs=128))
    prefill_variants: tuple = (MLAPrefillBlocks(32, 1, 2, 8), MLAPrefillBlocks(16, 4, 2, 8),
                               MLAPrefillBlocks(64, 1, 2, 8), MLAPrefillBlocks(16, 2, 4, 4))

    @property
    def width(self) -> int:
        return self.rank + self.rope


TINY = Shape(heads=4, rank=32, rope=16, page=4, decode=((1, 40), (3, 70)),
             prefill=(("T=40", ((0, 40),)), ("T=24 ctx=40", ((40, 24),))),
             decode_variant_case=(1, 40),
             decode_variants=(MLADecodeBlocks(pages_per_block=8),),
             prefill_variants=(MLAPrefillBlocks(16, 1, 4),))


def page_tables(rng, lengths, page: int) -> tuple[np.ndarray, int]:
    """Distinct pages for each row's tokens (page 0 never used) and the page count."""
    counts = [-(-n // page) for n in lengths]
    order = rng.permutation(np.arange(1, sum(counts) + 1)).astype(np.int32)
    tables = np.zeros((len(lengths), max(counts)), np.int32)
    for row, count in enumerate(counts):
        tables[row, :count], order = order[:count], order[count:]
    return tables, sum(counts) + 1


def normal(key, shape) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def decode_row(shape: Shape, batch: int, context: int, blocks: MLADecodeBlocks, splits: int,
               interpret: bool, with_reference: bool) -> dict:
    rng = np.random.default_rng(batch)
    tables, num_pages = page_tables(rng, [context + 1] * batch, shape.page)
    kq, kl, kp = jax.random.split(jax.random.PRNGKey(batch), 3)
    q = normal(kq, (batch, shape.heads, shape.width))
    latent = normal(kl, (batch, shape.width))
    pages = normal(kp, (num_pages, shape.page, shape.width))
    args = (jnp.asarray(tables), jnp.full((batch,), context, jnp.int32))
    call = {"scale": shape.scale, "kv_lora_rank": shape.rank}
    step = jax.jit(lambda q, latent, pages, *a: mla_decode(
        q, latent, pages, *a, **call, splits=splits, blocks=blocks, interpret=interpret),
        donate_argnums=(2,))
    state = {"pages": pages.copy()}

    def kernel():
        out, state["pages"] = step(q, latent, state["pages"], *args)
        return out

    start = time.perf_counter()
    jax.block_until_ready(kernel())
    row = {"item": "decode", "case": f"bs={batch} ctx={context}",
           "blocks": f"h{blocks.block_h}/p{blocks.pages_per_block}/w{blocks.num_warps}"
                     f"/s{blocks.num_stages}/m{blocks.most_splits}/f{blocks.fill_programs}",
           "splits": splits,
           "first_call_s": round(time.perf_counter() - start, 2), "kernel_ms": wall_ms(kernel)}
    read = batch * ((context + 1) * shape.width + shape.heads * (shape.width + shape.rank)) * 2
    row["floor_ms"] = read / HBM_BYTES_PER_S * 1e3
    if with_reference:
        reference = jax.jit(lambda *a: mla_decode_reference(*a, **call)[0])
        row["reference_ms"] = wall_ms(lambda: reference(q, latent, pages, *args))
        row.update(errors(kernel(), reference(q, latent, pages, *args)))
    return row


def prefill_row(shape: Shape, label: str, requests, blocks: MLAPrefillBlocks, interpret: bool,
                with_reference: bool) -> dict:
    rng = np.random.default_rng(len(requests))
    tables, num_pages = page_tables(rng, [c + n for c, n in requests], shape.page)
    token_request = np.concatenate([np.full(n, row) for row, (_, n) in enumerate(requests)])
    positions = np.concatenate([np.arange(c, c + n) for c, n in requests]).astype(np.int32)
    kq, kp = jax.random.split(jax.random.PRNGKey(len(positions)))
    q = normal(kq, (len(positions), shape.heads, shape.width))
    pages = normal(kp, (num_pages, shape.page, shape.width))
    work = prefill_work(token_request, positions, num_rows=len(tables), block_q=blocks.block_q)
    call = {"scale": shape.scale, "kv_lora_rank": shape.rank}
    args = (q, pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(work))
    start = time.perf_counter()
    compiled = jax.jit(lambda *a: mla_prefill(*a, **call, blocks=blocks, interpret=interpret)
                       ).lower(*args).compile()
    row = {"item": "prefill", "case": label,
           "blocks": f"q{blocks.block_q}/h{blocks.block_h}/p{blocks.pages_per_block}"
                     f"/w{blocks.num_warps}/s{blocks.num_stages}",
           "compile_s": round(time.perf_counter() - start, 2),
           "kernel_ms": wall_ms(lambda: compiled(*args))}
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in requests)
    row["tflops"] = 2.0 * (shape.width + shape.rank) * shape.heads * pairs / row["kernel_ms"] / 1e9
    if with_reference:
        ref_args = (q, pages, jnp.asarray(tables), jnp.asarray(token_request),
                    jnp.asarray(positions))
        reference = jax.jit(lambda *a: mla_prefill_reference(*a, **call))
        row["reference_ms"] = wall_ms(lambda: reference(*ref_args))
        row.update(errors(compiled(*args), reference(*ref_args)))
    return row


def items(shape: Shape, interpret: bool) -> list:
    """The measurements in order: defaults with references, then the other knobs."""
    decode_defaults, prefill_defaults = MLADecodeBlocks(), MLAPrefillBlocks()
    out = []
    for batch, context in shape.decode:
        best = mla_split_count(batch, shape.heads, decode_defaults)
        out += [lambda b=batch, c=context, s=s, r=s == best: decode_row(
            shape, b, c, decode_defaults, s, interpret, r) for s in sorted({1, best})]
    out += [lambda label=label, r=requests: prefill_row(shape, label, r, prefill_defaults,
                                                        interpret, True)
            for label, requests in shape.prefill]
    batch, context = shape.decode_variant_case
    for blocks in shape.decode_variants:
        splits = mla_split_count(batch, shape.heads, blocks)
        out.append(lambda bl=blocks, s=splits: decode_row(shape, batch, context, bl, s,
                                                          interpret, False))
    label, requests = shape.prefill[shape.prefill_variant_case]
    out += [lambda bl=blocks: prefill_row(shape, label, requests, bl, interpret, False)
            for blocks in shape.prefill_variants]
    return out


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"\n{'item':<8} {'case':<18} {'blocks':<16} {'splits':>6} {'kernel ms':>10} "
          f"{'ref ms':>9} {'floor ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    for row in rows:
        if row["item"] in ("decode", "prefill"):
            print(f"{row['item']:<8} {row['case']:<18} {row['blocks']:<16} "
                  f"{row.get('splits', ''):>6} {row['kernel_ms']:>10.3f} "
                  f"{row.get('reference_ms', nan):>9.3f} {row.get('floor_ms', nan):>9.3f} "
                  f"{row.get('tflops', nan):>8.1f} {row.get('rel', nan):>9.2e}")
        else:
            print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--tiny", action="store_true", help="small shapes, interpreted (CPU)")
    args = parser.parse_args()
    shape = TINY if args.tiny else Shape()
    if not args.tiny and jax.default_backend() != "gpu":
        parser.error("the Kimi-Linear shapes need a GPU; --tiny runs small shapes on the CPU")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    print_table(run_within_budget(items(shape, interpret=args.tiny), args.budget_s, args.out,
                                  "bench_mla_attention.jsonl"))


if __name__ == "__main__":
    main()
