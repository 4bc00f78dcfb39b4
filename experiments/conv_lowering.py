"""Where a convolution is faster as a patch matmul than as XLA:CPU's native convolution.

    python experiments/conv_lowering.py           # ~3 min
    python experiments/conv_lowering.py --quick   # ~1 min

For 3x3 'SAME' convolutions on a CIFAR-shaped batch (64 x 32 x 32) with 1 to 64 input channels,
times forward + backward (both gradients) of one convolution, interleaved in rounds:

  fp32     lax.conv_general_dilated in float32 (default precision)
  native   jamp.mixed_ops.mixed_conv, bf16 operands, XLA's own convolution (which XLA:CPU upcasts)
  patches  the same with the patch-matmul lowering forced: bf16 x bf16 -> fp32 matmuls

and reports each variant's time relative to fp32 (median of per-round ratios). The lowering's
channel limit in jamp/conv_patches.py (MAX_CHANNELS) comes from this table. Writes
experiments/results/conv_lowering_cpu.md.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
from _harness import RESULTS
from _harness.environment import command, cpu_cores, today, versions
from _harness.tables import fmt_ratio
from _harness.timing import interleaved, median_ms, ratio_stats
from jax import lax

from jamp import conv_patches, mixed_ops

DN = ("NHWC", "HWIO", "NHWC")


@contextlib.contextmanager
def _patch_limit(channels):
    saved = conv_patches.MAX_CHANNELS
    conv_patches.MAX_CHANNELS = channels
    try:
        yield
    finally:
        conv_patches.MAX_CHANNELS = saved


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=DN)


def _runners(cin, cout, batch, size):
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (batch, size, size, cin))
    w = jax.random.normal(k2, (3, 3, cin, cout)) * 0.1
    jaxpr = jax.make_jaxpr(_conv)(x, w)
    params = dict(jaxpr.eqns[0].params)

    def grads(conv):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), argnums=(0, 1)))

    def mixed(x, w):
        return mixed_ops.mixed_conv(x, w, params, jnp.bfloat16, jnp.float32)

    fns = {}
    for name, conv, limit in (("fp32", _conv, 0), ("native", mixed, 0), ("patches", mixed, 10**9)):
        with _patch_limit(limit):
            fn = grads(conv).lower(x, w).compile()
        fns[name] = fn
    return {name: (lambda fn=fn: fn(x, w)) for name, fn in fns.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, steps = (5, 2) if args.quick else (9, 3)
    shapes = [(1, 32), (3, 32), (4, 32), (8, 32), (16, 32), (32, 64), (64, 64)]
    rows = []
    for cin, cout in shapes:
        runners = _runners(cin, cout, batch=64, size=32)
        for r in runners.values():
            jax.block_until_ready(r())
        times = interleaved(runners, rounds=rounds, steps=steps)
        fp32_ms = median_ms(times["fp32"])
        native = ratio_stats(times["native"], times["fp32"])
        patches = ratio_stats(times["patches"], times["fp32"])
        rows.append((cin, cout, fp32_ms, native, patches))
        print(
            f"{cin:>3} -> {cout:<3} fp32 {fp32_ms:7.2f} ms  native {native[0]:.2f}x  "
            f"patches {patches[0]:.2f}x",
            flush=True,
        )
    _write_table(rows, rounds, steps)


def _write_table(rows, rounds, steps):
    lines = [
        "# Convolution lowering on CPU: native XLA convolution vs bf16 patch matmul",
        "",
        f"Measured {today()} with `{command()}` on {cpu_cores()} (no GPU); {versions('jax')}. "
        f"Forward + both gradients of one 3x3 SAME convolution, batch 64 x 32 x 32; {rounds} "
        f"interleaved rounds x {steps} steps; ratios are medians of per-round ratios to fp32 "
        "[min-max]. Lower is faster.",
        "",
        "| in -> out channels | fp32 ms | native bf16 / fp32 | patch matmul bf16 / fp32 |",
        "|---|---|---|---|",
    ]
    for cin, cout, ms, native, patches in rows:
        lines.append(f"| {cin} -> {cout} | {ms:.2f} | {fmt_ratio(native)} | {fmt_ratio(patches)} |")
    lines += [
        "",
        "XLA:CPU has no 16-bit convolution: the native bf16 column is its fp32 convolution plus",
        "casts. The patch matmul runs on the fast bf16 x bf16 -> fp32 kernels but materialises a",
        "patch matrix 9x the input; on this memory-bound 2-core VM that pays off only for inputs",
        "with few channels, which sets jamp's limit (jamp/conv_patches.py `MAX_CHANNELS`).",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "conv_lowering_cpu.md"
    path.write_text("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
