"""Attention as one call in a 16-bit compute dtype: cuDNN's fused kernel on NVIDIA GPUs, the
same computation written out elsewhere.

`jamp.engine` recognises attention in a traced program (`softmax(q k^T * scale + bias, masked)
v`, in any layout) and hands it here in one layout, BTNH: q [B, T, N, H], k and v [B, S, K, H]
with N a multiple of K (grouped-query heads: q head n reads k / v head n // (N / K)), an additive
bias and a boolean mask broadcastable to [B, N, T, S], a float scale, whether the mask is causal
and a causal mask's sliding window. `attend` runs it:

* on an NVIDIA GPU target, as `jax.nn.dot_product_attention(..., implementation="cudnn")`: one
  fused kernel forward and one backward (flash attention), which keep no [T, S] scores for the
  backward pass, only the output and the softmax statistics. cuDNN computes the softmax in float32
  inside the kernel. Where cuDNN refuses the shapes (head size, sequence lengths, bias layout), the
  refusal is the reason given and the written-out form runs;
* elsewhere, written out: scores from a 16-bit matmul accumulated in float32, the softmax in
  float32, the weights in the compute dtype for the second matmul (`jamp.mixed_ops`), as XLA's own
  form of `jax.nn.dot_product_attention` computes it. On a CPU this is what tests compare with the
  program as traced.

Example::

  out_BTNH, how = attend(q, k, v, scale=0.125, causal=True, compute_dtype=jnp.bfloat16)
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jamp import hardware, mixed_ops

_F32 = np.dtype(np.float32)


def _cudnn_target() -> Optional[str]:
    """None when the program is compiled for an NVIDIA GPU, else why cuDNN is not used."""
    if hardware.target_platform() != "gpu":
        return f"compiled for {hardware.target_platform()}, not an NVIDIA GPU"
    if "AMD" in str(getattr(hardware.target_device(), "device_kind", "")):
        return "an AMD GPU (cuDNN is NVIDIA's)"
    return None


def _saturated(bias, dtype):
    """`bias` in `dtype` with finite values clipped to its range (a float32 `finfo.min` fill
    would be -inf in float16, and a row of -inf a NaN)."""
    info = jnp.finfo(dtype)
    return jnp.clip(bias, float(info.min), float(info.max)).astype(dtype)


def _written_out(q, k, v, bias, mask, scale, causal, window, compute_dtype):
    """The reference form: two mixed-precision matmuls around a float32 softmax."""
    _, t, n, _ = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if n != kv_heads:  # grouped-query heads: each k / v head serves N / K q heads
        k, v = (jnp.repeat(x, n // kv_heads, axis=2) for x in (k, v))
    # [B, T, N, H] x [B, S, N, H] -> [B, N, T, S]
    scores = mixed_ops.mixed_dot_general(
        q, k, (((3,), (3,)), ((0, 2), (0, 2))), compute_dtype, _F32
    )
    logits = scores * np.float32(scale)
    if bias is not None:
        logits = logits + bias.astype(_F32)
    keep = None if mask is None else mask
    if causal:
        tril = jnp.tril(jnp.ones((t, s), bool))
        if window is not None:  # and no key more than `window` before the query
            tril = jnp.logical_and(tril, jnp.triu(jnp.ones((t, s), bool), -window))
        keep = tril if keep is None else jnp.logical_and(keep, tril)
    if keep is not None:
        logits = jnp.where(keep, logits, np.float32(-0.7 * np.finfo(np.float32).max))
    weights = jax.nn.softmax(logits, axis=-1).astype(compute_dtype)
    # [B, N, T, S] x [B, S, N, H] -> [B, N, T, H] -> [B, T, N, H]
    out = mixed_ops.mixed_dot_general(
        weights, v, (((3,), (1,)), ((0, 1), (0, 2))), compute_dtype, compute_dtype
    )
    return jnp.transpose(out, (0, 2, 1, 3))


def attend(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    *,
    bias=None,
    mask=None,
    scale: float,
    causal: bool,
    window: Optional[int] = None,
    compute_dtype,
) -> tuple[jax.Array, str, str]:
    """Attention of q over k / v in `compute_dtype`, fused where the target allows.

    Args:
      q_BTNH, k_BSKH, v_BSKH: queries, keys and values (any float dtype; cast to
        `compute_dtype`). N must be a multiple of K.
      bias: None, or an additive bias broadcastable to [B, N, T, S] (float32 masks' fills such as
        `finfo(float32).min` are clipped to the compute dtype's range).
      mask: None, or a boolean array broadcastable to [B, N, T, S]: False hides a key.
      scale: the factor of q k^T.
      causal: query t sees keys 0 .. t only (top-left aligned).
      window: with `causal`, query t sees keys t - window .. t only (a sliding window: cuDNN
        skips the scores outside it); None for none.
      compute_dtype: float16 or bfloat16.

    Returns:
      (the output [B, T, N, H] in `compute_dtype`, "cudnn" or "xla", why not cuDNN: "" when it is).
    """
    if window is not None and not causal:
        raise ValueError(f"a sliding window ({window}) needs causal=True")
    compute_dtype = np.dtype(compute_dtype)
    q, k, v = (x.astype(compute_dtype) for x in (q_BTNH, k_BSKH, v_BSKH))
    why = _cudnn_target()
    if why is None:
        b, n, t, s = q.shape[0], q.shape[2], q.shape[1], k.shape[1]
        cudnn_bias = None if bias is None else _full_ts(_saturated(bias, compute_dtype), b, n, t, s)
        cudnn_mask = None if mask is None else _full_ts(mask, b, n, t, s)
        try:
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                bias=cudnn_bias,
                mask=cudnn_mask,
                scale=float(scale),
                is_causal=causal,
                local_window_size=None if window is None else (int(window), 0),
                implementation="cudnn",
            )
            return out.astype(compute_dtype), "cudnn", ""
        except (NotImplementedError, ValueError, RuntimeError) as e:  # cuDNN's own refusals
            why = f"cuDNN refused it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    out = _written_out(q, k, v, bias, mask, scale, causal, window, compute_dtype)
    return out.astype(compute_dtype), "xla", why


def _full_ts(x, b, n, t, s):
    """`x` broadcast to [B | 1, N | 1, T, S]: cuDNN takes a bias or mask whose batch and head
    axes may be 1 but whose query and key axes are whole."""
    x = jnp.asarray(x)
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    shape = (b if x.shape[0] != 1 else 1, n if x.shape[1] != 1 else 1, t, s)
    return x if x.shape == shape else jnp.broadcast_to(x, shape)
