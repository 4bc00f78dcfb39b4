"""jamp.inspect.gemm_rate: a GEMM's share of its dtype's peak by shape, and the public
measurements it was fitted to, reproduced within the errors its docstring states."""

import math

import pytest

from jamp.inspect import gemm_rate
from jamp.target import GPUS

SMS = GPUS["h200"].sm_count  # 132, as the H100's
BF16_PEAK, FP8_PEAK = 989.4e12, 1979e12
CALL = 5.6e-6  # the fixed cost per call that XLA's table shows (the step model's launch)


def _tflops(shape, dtype, peak, fixed=CALL):
    b, m, n, k = shape
    flops = 2 * b * m * n * k
    seconds = fixed + flops / (peak * gemm_rate.efficiency(shape, dtype, SMS))
    return flops / seconds / 1e12


@pytest.mark.parametrize(
    "size, measured",  # XLA's sm_90 matmul table, bf16, M = N = K, batch 1 (TFLOP/s)
    [(1024, 253), (2048, 641), (4096, 780)],
)
def test_bf16_fit_reproduces_xlas_measured_square_gemms(size, measured):
    got = _tflops((1, size, size, size), "bf16", BF16_PEAK)
    assert got == pytest.approx(measured, rel=0.2)


@pytest.mark.parametrize(
    "k, measured",  # tilelang's fp8 K sweep at M = N = 8192 on an H800 (TFLOP/s)
    [(256, 569), (1024, 1129), (4096, 1467), (16384, 1541)],
)
def test_fp8_fit_reproduces_the_published_k_sweep(k, measured):
    assert _tflops((1, 8192, 8192, k), "f8", FP8_PEAK, fixed=0.0) == pytest.approx(
        measured, rel=0.03
    )


def test_waves_padding_and_split_k():
    # 8192 x 768: 64 x 6 = 384 tiles in 3 waves of 132: 97 % busy
    busy = 384 / (3 * SMS)
    k = 768
    fit = gemm_rate.FITS["bf16"]
    want = fit.ceiling * busy * k / (k + fit.k_overhead)
    assert gemm_rate.efficiency((1, 8192, 768, k), "bf16", SMS) == pytest.approx(want)
    # one tile's worth of result over a long contraction: split-K fills the SMs
    one_tile = gemm_rate.efficiency((1, 128, 128, 16384), "bf16", SMS)
    assert one_tile > 20 * (1 / SMS) * fit.ceiling
    # a result past a tile's edge computes zeros
    assert gemm_rate.efficiency((1, 8192, 129, 8192), "bf16", SMS) < 0.55 * fit.ceiling
    # unknown shapes get the ceiling; large ones approach it
    assert gemm_rate.efficiency((0, 0, 0, 0), "f8", SMS) == gemm_rate.FITS["f8"].ceiling
    assert gemm_rate.efficiency((1, 16384, 16384, 16384), "bf16", SMS) > 0.98 * fit.ceiling


def test_fp8_gains_less_at_gpt2_small_shapes_than_at_7b_shapes():
    """Per GEMM, fp8 over bf16: 1.45x at GPT-2 small's K = 768, 1.86x at a 7B model's K = 4096;
    never the 2x of the peaks."""

    def speedup(shape):
        fp8 = gemm_rate.efficiency(shape, "f8", SMS) * FP8_PEAK
        return fp8 / (gemm_rate.efficiency(shape, "bf16", SMS) * BF16_PEAK)

    gpt2 = speedup((1, 8192, 768, 768))
    llama = speedup((1, 8192, 11008, 4096))
    assert 1.3 < gpt2 < 1.5 < 1.7 < llama < 1.9
    assert math.isclose(gemm_rate.FITS["f16"].ceiling, gemm_rate.FITS["bf16"].ceiling)
