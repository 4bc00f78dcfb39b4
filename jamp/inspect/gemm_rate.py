"""How much of its dtype's dense peak a GEMM of a given shape reaches on an NVIDIA GPU: a model
fitted to public matmul measurements, for `jamp.inspect.timing`.

A GEMM kernel computes its result in tiles of 128 x 128, one tile per SM at a time:

* **waves**: `tiles = batch x ceil(M / 128) x ceil(N / 128)` run in `ceil(tiles / SMs)` waves,
  the last one partly idle (8192 x 768 on 132 SMs: 384 tiles, 3 waves, 97 % busy);
* **padding**: a tile past the result's edge computes zeros;
* **split-K**: where the tiles cannot fill the SMs (a small result, a long contraction), the
  contraction is split in two, four, ... pieces run side by side (at least 128 of K each);
* **a tile's fixed cost**: loading its first operands and writing its result cost a tile the
  time of `k_overhead` more steps of its contraction, so its rate is `K / (K + k_overhead)` of
  the dtype's `ceiling`, the share of the dense peak reached at large shapes.

The constants per dtype (`FITS`) are least-squares fits to published measurements:

* bf16 / fp16 and TF32 (float32 operands): XLA's own table of measured matmul rates on Hopper
  (sm_90: `xla/service/gpu/model/matmul_interpolator_data.h`, 375 shapes, batch 1-4, M, N, K
  from 256 to 4096; its fp8 entries exceed the fp8 dense peak and are not used). bf16: ceiling
  0.838, overhead 117; median error 4.3 %, 90 % of shapes within 19 % (with a 5.6 us fixed cost
  per call, which the step model's launch cost stands for). TF32: 0.575 of the TF32 peak (half
  the bf16 one), median error 16.5 %.
* fp8 (E4M3 / E5M2 operands): a K sweep at M = N = 8192 on an H800 (tilelang's
  benchmark/matmul_fp8 README: 569 TFLOP/s at K = 256, 1,129 at 1,024, 1,467 at 4,096, 1,541 at
  16,384): ceiling 0.841, overhead 458, every point within 2 %. Its overhead is four times
  bf16's in steps: each step of an fp8 contraction takes half a bf16 step's time, and an fp8 tile
  writes the same bf16 result. The best fp8 GEMM figures measured with cuBLAS are about 5 %
  lower at the top (1,403 TFLOP/s on an H100, 1,453 on an H200: 71-73 % of 1,979;
  stas00/ml-engineering), where this fit gives 77 % at 8192 cubed.

What follows: at GPT-2 small's shapes (8192 tokens, K = 768) an fp8 GEMM reaches 51 % of the
fp8 peak where bf16 reaches 71 % of its own, so fp8 is 1.45x as fast per GEMM, not 2x; at a 7B
model's (K = 4096, N = 11008) 75 % and 81 %: 1.86x. A model of kernels, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math

#: The output tile a GEMM kernel computes per SM at a time (Hopper's cuBLAS and Triton GEMMs).
TILE = 128
#: Split-K stops at pieces of this many contracted elements.
MIN_SPLIT_K = 128


@dataclasses.dataclass(frozen=True)
class GemmFit:
    """A dtype's GEMM rate: `ceiling`, the share of its dense peak at large shapes; a tile's fixed
    cost in steps of the contraction (`k_overhead`)."""

    ceiling: float
    k_overhead: float


#: Per dtype class of `jamp.hlo.kernels` ("bf16", "f16", "f8", "f32": TF32): see the docstring.
FITS = {
    "bf16": GemmFit(0.838, 117.0),
    "f16": GemmFit(0.838, 117.0),
    "f32": GemmFit(0.575, 0.0),
    "f8": GemmFit(0.841, 458.0),
}


def efficiency(shape: tuple[int, int, int, int], dtype: str, sm_count: int) -> float:
    """The share of `dtype`'s dense peak a GEMM of `shape` (batch, M, N, K) reaches on a GPU of
    `sm_count` SMs: its best split of the contraction. A shape of zeros (unknown) gets the
    ceiling."""
    fit = FITS.get(dtype, FITS["f32"])
    batch, m, n, k = shape
    if not (batch and m and n and k):
        return fit.ceiling
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    padding = (m * n) / (math.ceil(m / TILE) * TILE * math.ceil(n / TILE) * TILE)
    best, split = 0.0, 1
    while split == 1 or (k / split >= MIN_SPLIT_K and tiles * split <= 2 * sm_count):
        pieces = tiles * split
        busy = pieces / (math.ceil(pieces / sm_count) * sm_count)
        per_piece = k / split
        best = max(best, busy * padding * per_piece / (per_piece + fit.k_overhead))
        split *= 2
    return fit.ceiling * best


__all__ = ["FITS", "GemmFit", "TILE", "efficiency"]
