"""Attention over long sequences on the H200 program: causal and sliding-window masks as cuDNN runs
them, compiled on this machine (no GPU).

Each row is the gradient of a wrapped model's mean output under "mixed_bfloat16", compiled for one
H200 by `jamp.compile_for`: the mask each fused attention runs with (cuDNN's mask type and window),
the time tracing and compiling took here, the predicted attention and step time (a model, not a
measurement) and XLA's planned peak (a plan, not a measured peak). The masks are the models' own:
`nn.make_causal_mask` in jamp's TransformerLM, `iota` comparisons in the attention layer; past
4096 x 4096 jamp reads them by their form (jamp/engine/_attention_forms.py).

Usage: python experiments/long_attention.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from _harness import RESULTS
from _harness.environment import run_record

import jamp
from jamp.models import TransformerLM


class WindowedAttention(nn.Module):
    """Self-attention with a causal mask and, given `window`, a sliding one (query i sees keys
    i - window .. i), both from `iota` comparisons."""

    heads: int
    head_dim: int
    window: Optional[int] = None

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((self.heads, self.head_dim))(x) for _ in range(3))
        pos = jnp.arange(x.shape[1])
        mask = pos[:, None] >= pos[None, :]
        if self.window is not None:
            mask &= pos[:, None] - pos[None, :] <= self.window
        return nn.dot_product_attention(q, k, v, mask=mask)


def rows(quick: bool) -> list[tuple[str, nn.Module, tuple, str]]:
    """(name, model, input shape, input dtype) per row."""
    if quick:
        lm = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=2, mlp_dim=64)
        return [
            ("TransformerLM 1 x 32", TransformerLM(**lm, max_len=8192), (1, 8192), "int32"),
            ("attention 2 x 64, window 1024", WindowedAttention(2, 64, 1024), (1, 8192, 32), "f32"),
        ]
    lm = dict(vocab_size=256, num_layers=1, d_model=512, num_heads=8, mlp_dim=2048)
    out: list[tuple[str, nn.Module, tuple, str]] = [
        (f"TransformerLM 1 x 512, seq {n}", TransformerLM(**lm, max_len=n), (1, n), "int32")
        for n in (4096, 8192, 16384)
    ]
    n = 32768
    out += [
        (f"attention 32 x 128, seq {n}", WindowedAttention(32, 128), (1, n, 4096), "f32"),
        (
            f"attention 32 x 128, seq {n}, window 4096",
            WindowedAttention(32, 128, 4096),
            (1, n, 4096),
            "f32",
        ),
    ]
    return out


def compile_row(module: nn.Module, shape: tuple, dtype: str) -> dict:
    model = jamp.wrap(module, "mixed_bfloat16")
    x = jax.ShapeDtypeStruct(shape, jnp.int32 if dtype == "int32" else jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)

    def grad(p, x):
        return jax.grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32)))(p)

    start = time.perf_counter()
    report = jamp.compile_for(grad, params, x, target="h200")
    seconds = time.perf_counter() - start
    est = report.estimate
    assert est is not None
    return {
        "masks": ", ".join(sorted({a.mask or "?" for a in report.attention if a.fused}))
        or "unfused",
        "seconds": seconds,
        "attention_ms": est.by_kind.get("attention", (0, 0.0))[1] * 1e3,
        "step_ms": est.seconds * 1e3,
        "peak_gib": report.memory.peak / 2**30,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small widths, two rows")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "long_attention_h200.md")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    table = [
        "| model | cuDNN mask | trace + compile here (s) | predicted attention ms | "
        "predicted step ms | planned peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, module, shape, dtype in rows(args.quick):
        r = compile_row(module, shape, dtype)
        table.append(
            f"| {name} | {r['masks']} | {r['seconds']:.1f} | {r['attention_ms']:.2f} | "
            f"{r['step_ms']:.2f} | {r['peak_gib']:.2f} |"
        )
        print(table[-1], flush=True)
    command = " ".join(["python experiments/long_attention.py", *(argv or sys.argv[1:])])
    run = run_record(command, time.perf_counter() - start)
    lines = [
        "# Attention over long sequences, on the H200 program",
        "",
        f"`{run['command']}` on {run['machine']}, {run['date']}; {run['versions']}. One gradient "
        "step of each model under `mixed_bfloat16` (batch 1), compiled for one H200 by "
        "`jamp.compile_for`: times are jamp's prediction (a model, not a measurement), memory "
        "XLA's plan (not a measured peak).",
        "",
        *table,
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
