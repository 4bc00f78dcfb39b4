"""A convolution with few input channels as one matmul over its patches (a CPU lowering).

XLA:CPU has no 16-bit convolution kernel: it upcasts and runs its fp32 convolution, which is
slow when the input has few channels (an image net's first layer). There, extracting the
patches and running one bf16 x bf16 -> fp32 matmul is 2-5x faster forward and backward
(experiments/results/conv_lowering_cpu.md). This module is that lowering's layout: when it
applies (`lowerable`), the operands channels-last (`channels_last_perms`), the input's patches as
a matrix (`extract`) and their gradient summed back onto the input (`scatter`). The matmuls and
their custom VJP are `jamp.mixed_ops`' (`mixed_conv` chooses this form).
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from jax import lax

from jamp import hardware

# With more channels the patch matrix grows with the window size, and on this memory-bound CPU
# the native convolution wins, so the lowering stops at:
MAX_CHANNELS = 3


def lowerable(lhs, rhs, params) -> bool:
    """Whether a convolution runs as a matmul over its patches: compiled for a CPU, ungrouped,
    undilated, padded (not cropped), on at most `MAX_CHANNELS` input channels."""
    dn = params["dimension_numbers"]
    spatial = len(dn.lhs_spec) - 2
    return (
        hardware.target_platform() == "cpu"
        and spatial >= 1
        and params["feature_group_count"] == 1
        and params["batch_group_count"] == 1
        and all(d == 1 for d in params["lhs_dilation"])
        and all(d == 1 for d in params["rhs_dilation"])
        and all(lo >= 0 and hi >= 0 for lo, hi in params["padding"])
        and lhs.shape[dn.lhs_spec[1]] <= MAX_CHANNELS
    )


def _window_offsets(window):
    return list(itertools.product(*(range(k) for k in window)))


def extract(x, window, strides, padding):
    """[N, *S, C] -> [N, *O, prod(window) * C]: window offsets major, channels minor."""
    zero = jnp.zeros((), x.dtype)
    xp = lax.pad(x, zero, [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in padding] + [(0, 0, 0)])
    out = [(xp.shape[1 + d] - k) // s + 1 for d, (k, s) in enumerate(zip(window, strides))]
    cols = []
    for offs in _window_offsets(window):
        start = (0,) + offs + (0,)
        limit = (x.shape[0],) + tuple(o + (n - 1) * s + 1 for o, n, s in zip(offs, out, strides))
        cols.append(lax.slice(xp, start, limit + (x.shape[-1],), (1,) + tuple(strides) + (1,)))
    return jnp.concatenate(cols, axis=-1)


def scatter(d_patches, x_shape, window, strides, padding):
    """The transpose of `extract`: sums each patch entry back onto its input position."""
    n, *spatial, c = x_shape
    out = d_patches.shape[1:-1]
    d_patches = d_patches.reshape(d_patches.shape[:-1] + (len(_window_offsets(window)), c))
    padded = [s + lo + hi for s, (lo, hi) in zip(spatial, padding)]
    zero = jnp.zeros((), d_patches.dtype)
    total = None
    for k, offs in enumerate(_window_offsets(window)):
        config = [(0, 0, 0)]
        for o, m, s, p in zip(offs, out, strides, padded):
            config.append((o, p - o - (m - 1) * s - 1, s - 1))
        piece = lax.pad(d_patches[..., k, :], zero, config + [(0, 0, 0)])
        total = piece if total is None else total + piece
    start = (0,) + tuple(lo for lo, _ in padding) + (0,)
    return lax.slice(total, start, tuple(a + b for a, b in zip(start, x_shape)))


def channels_last_perms(dn):
    # Transposes taking lhs to [N, *S, C], rhs to [*window, I, O], the result to [N, *S, C].
    lhs = (dn.lhs_spec[0],) + tuple(dn.lhs_spec[2:]) + (dn.lhs_spec[1],)
    rhs = tuple(dn.rhs_spec[2:]) + (dn.rhs_spec[1], dn.rhs_spec[0])
    out = (dn.out_spec[0],) + tuple(dn.out_spec[2:]) + (dn.out_spec[1],)
    return lhs, rhs, out
