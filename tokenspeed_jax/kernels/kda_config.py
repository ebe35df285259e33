"""The chunked KDA prefill's tuning knobs, shared by its two stages (`kda_intra`, `kda`).

Invariants: this module imports no other kernel module, so both stages import it and neither
imports the other's settings; a `ChunkConfig` is frozen and validated once, at construction
(`diagonal_rows` divides `SUB_BLOCK`, both dot algorithms are names in `INVERSE_DOTS`).
"""

from __future__ import annotations

import dataclasses

from jax import lax

SUB_BLOCK = 16  # rows sharing one decay reference point; also Triton's smallest dot tile
INVERSE_DOTS = {  # ChunkConfig's names for the inverses' dot algorithms (bf16 inputs on a GPU)
    "fp32": lax.Precision.HIGHEST,  # fp32 FMAs
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
}


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tuning knobs of the chunked prefill kernels."""

    block_v: int | None = None  # V columns of state per scan program (None: `scan_blocking`)
    diagonal_heads: int = 4  # at most this many value heads per program of the in-block pairs
    diagonal_rows: int = 4  # chunk rows per program of the in-block pairs (divides 16)
    diagonal_num_warps: int = 2
    scores_num_warps: int = 2
    solve_num_warps: int = 4
    scan_num_warps: int = 4
    num_stages: int | None = None  # the scan's load pipeline depth (None: `scan_blocking`)
    scan_wave: int = 132  # scan programs run side by side at full depth (an H200's SMs)
    inverse_dots: str = "bf16x3"  # the solve's 64 x 64 inverse products (`INVERSE_DOTS`)
    block_inverse_dots: str = "bf16x3"  # the scores calls' 16 x 16 inverse products

    def __post_init__(self):
        if self.diagonal_rows < 1 or SUB_BLOCK % self.diagonal_rows:
            raise ValueError(f"diagonal_rows must divide {SUB_BLOCK}, got {self.diagonal_rows}")
        for name in (self.inverse_dots, self.block_inverse_dots):
            if name not in INVERSE_DOTS:
                raise ValueError(f"unknown inverse dot algorithm {name!r}; "
                                 f"choose from {sorted(INVERSE_DOTS)}")


DEFAULT_CHUNK_CONFIG = ChunkConfig()
