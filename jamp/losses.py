"""Cross-entropy on 16-bit logits without a float32 copy of them: a fused forward and backward.

`optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)` is how a
language model's loss is usually written. Its value is right, but its backward is what autodiff
makes of it: the label's logit is picked with a gather, whose transpose scatters into a float32
zero array the size of the logits, which another kernel then adds to the softmax's part: for
GPT-2 small at batch 8 x 1024 (vocabulary 50304), three float32 arrays of 1.6 GB each pass
through memory, one of them kept until the backward (XLA's plan for an H200).

`softmax_cross_entropy_with_integer_labels` here computes the same value (log-sum-exp with the
maximum subtracted, in float32, whatever the logits' dtype) and has its own backward: one
elementwise pass, `softmax(logits) - onehot(labels)` times the incoming gradient, with the
one-hot as a comparison with the label (no scatter), written in the logits' own dtype. It keeps
the logits as they came (16-bit from a bf16 head) and one float32 value per position. On the
H200 program of jamp's GPT-2-small step (`jamp.wrap(model, "mixed_bfloat16")`, batch 8): peak
memory 6.77 -> 5.26 GiB, float32 at the peak 1.54 GiB -> 32 MB, predicted step time 21.8 ->
20.1 ms.

`fused_linear_cross_entropy(hidden, kernel, labels)` goes further for a language model's
output head: it never forms the batch x sequence x vocabulary logits at all. The positions are
taken in chunks; per chunk, the head's matmul, the log-softmax and the loss's gradient with
respect to the chunk's logits, which two more matmuls turn into the gradients of the hidden
states and of the head's kernel (summed over chunks in float32) before the next chunk. The
gradients are computed on the forward pass, as Liger Kernel's fused linear cross-entropy does:
three matmuls per chunk, as the unfused head and loss have, where recomputing the logits in the
backward would take four. The result is the loss reduced to a scalar (its mean over the
positions `where` selects, or its sum), whose gradient is that scalar's.

Example::

  logits = model.apply(variables, tokens[:, :-1])          # [batch, length, vocab], any float
  loss = jamp.losses.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  hidden = model.apply(variables, tokens[:, :-1], return_hidden=True)   # [batch, length, d]
  loss = jamp.losses.fused_linear_cross_entropy(hidden, kernel_DV, tokens[:, 1:])
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import mixed_ops

_F32 = jnp.float32
#: The name scope of `fused_linear_cross_entropy`'s work (its kernels' op names carry it).
SCOPE = "fused_linear_cross_entropy"
#: Logits per chunk (positions x vocabulary) that `fused_linear_cross_entropy` aims for.
CHUNK_ELEMENTS = 1 << 27
_REDUCTIONS = ("mean", "sum")


def _combine(a, b):
    """Two partial (maximum, sum of exp(x - maximum), label's logit) of a row, merged: one
    exponential per merge, none where a side is still empty (its maximum -inf)."""
    (m_a, s_a, p_a), (m_b, s_b, p_b) = a, b
    top = m_a >= m_b
    m = jnp.where(top, m_a, m_b)
    low = jnp.where(top, m_b, m_a)
    e = jnp.where(low == -jnp.inf, 0.0, jnp.exp(low - m))
    s = jnp.where(top, s_a + s_b * e, s_a * e + s_b)
    return m, s, p_a + p_b


def _row_stats(x, hit):
    """Per row of float32 `x`: (maximum, log-sum-exp, the logit where `hit`), in one pass over
    `x` (an online softmax, as Liger Kernel's and FlashAttention's): one read of the logits where
    max, then sum of exp, then the label's logit would take three."""
    ones = jnp.ones_like(x)
    picked = jnp.where(hit, x, 0.0)
    init = (jnp.array(-jnp.inf, _F32), jnp.array(0.0, _F32), jnp.array(0.0, _F32))
    m, s, p = lax.reduce((x, ones, picked), init, _combine, (x.ndim - 1,))
    return m, jnp.log(s) + m, p


def _onehot(labels, vocab):
    return jnp.arange(vocab, dtype=labels.dtype) == labels[..., None]


@jax.custom_vjp
def _xent(logits, labels):
    return _forward(logits, labels)[0]


def _forward(logits, labels):
    _, lse, picked = _row_stats(logits.astype(_F32), _onehot(labels, logits.shape[-1]))
    return lse - picked, (logits, labels, lse)


def _backward(residuals, g):
    logits, labels, lse = residuals
    x = logits.astype(_F32)
    d = (jnp.exp(x - lse[..., None]) - _onehot(labels, x.shape[-1])) * g[..., None]
    return d.astype(logits.dtype), None


_xent.defvjp(_forward, _backward)


def softmax_cross_entropy_with_integer_labels(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy, as `optax.softmax_cross_entropy_with_integer_labels`, with a
    fused backward that makes no float32 copy of 16-bit logits (see the module docstring).

    Args:
      logits: [..., vocab] unnormalised log-probabilities, any float dtype (bf16 logits are read
        in float32 inside the reductions and their gradient comes back bf16).
      labels: [...] integer labels in [0, vocab); a label outside picks no logit (its loss is the
        log-normalizer alone), where optax's gather would clamp it.

    Returns:
      float32 losses of `labels`' shape.
    """
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integers, got {labels.dtype}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have logits' shape without its last axis: logits {logits.shape}, "
            f"labels {labels.shape}"
        )
    return _xent(logits, labels)


def _chunk(h_c, kernel, y_c, w_c, dtype):
    """One chunk's float32 logits (computed in `dtype`, summed in float32), log-normalizers, and
    per position its weighted loss and its weight where the label's logit is the largest (kept
    per position, summed once after the last chunk: no reduction to a scalar per chunk)."""
    logits = mixed_ops.product(h_c, kernel, (((1,), (0,)), ((), ())), dtype)
    x = logits.astype(_F32)
    hit = _onehot(y_c, x.shape[-1])
    top, lse, picked = _row_stats(x, hit)
    correct = jnp.any(hit, axis=-1) & (picked >= top)
    return x, lse, w_c * (lse - picked), jnp.where(correct, w_c, 0.0)


def _chunks(h, y, w, size):
    """[chunks, size, ...] views of the positions, chunk c holding positions c, c + chunks,
    c + 2 chunks, ...: strided, so that each chunk takes an equal share of every example (and of
    every device's examples, where the batch is sharded: a chunk of consecutive positions would
    lie on one device, and XLA's partitioner would gather all positions onto every device)."""
    n = h.shape[0] // size
    return (
        h.reshape(size, n, h.shape[1]).transpose(1, 0, 2),
        y.reshape(size, n).T,
        w.reshape(size, n).T,
    )


def _unchunk(d_h):
    """The inverse of `_chunks` for [chunks, size, d] per-position values."""
    return d_h.transpose(1, 0, 2).reshape(-1, d_h.shape[2])


def _folds_scale(dtype) -> bool:
    """Whether the loss's normalizer may multiply the per-logit gradients before they are rounded
    to `dtype`: where `dtype` has float32's exponent range (bfloat16, float32). A float16 chunk
    would hold 1/positions below its normal range for a large batch, so there the normalizer
    waits for the float32 results."""
    return jnp.finfo(dtype).maxexp >= jnp.finfo(_F32).maxexp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _linear_xent(h, kernel, y, w, norm, size, dtype, grad_dtypes):
    """(sum of the weighted losses x norm, sum of the weights of the positions whose label's
    logit is the largest x norm); `norm` a float32 scalar."""
    del grad_dtypes
    k = kernel.astype(dtype)

    def body(sums, xs):
        h_c, y_c, w_c = xs
        _, _, loss, correct = _chunk(h_c.astype(dtype), k, y_c, w_c, dtype)
        return (sums[0] + loss, sums[1] + correct), None

    zero = jnp.zeros((size,), _F32)
    (total, correct), _ = lax.scan(body, (zero, zero), _chunks(h, y, w, size))
    return jnp.sum(total) * norm, jnp.sum(correct) * norm


def _linear_xent_fwd(h, kernel, y, w, norm, size, dtype, grad_dtypes):
    k = kernel.astype(dtype)
    folded = _folds_scale(dtype)
    # The hidden states' gradient leaves its matmul rounded to `dtype`, as the unfused head's
    # does (the gradient of a `dtype` operand); float32 where the normalizer comes later.
    d_h_dtype = dtype if folded else _F32
    hs, ys, ws = _chunks(h, y, w, size)

    def one(i, hs):
        """Chunk `i` of `hs`: its losses and hits per position, its hidden states' gradient and
        its share of the kernel's (float32)."""
        h_c, y_c, w_c = (lax.dynamic_index_in_dim(a, i, keepdims=False) for a in (hs, ys, ws))
        h_c = h_c.astype(dtype)
        x, lse, loss, hits = _chunk(h_c, k, y_c, w_c, dtype)
        # d loss / d logits, per position: softmax minus the label's one-hot (in [-1, 1]), times
        # its weight (and, where `dtype`'s range allows, the normalizer; else it comes later in
        # float32, so that a float16 chunk never holds a value below its range).
        scale = w_c * norm if folded else w_c
        d = (jnp.exp(x - lse[:, None]) - _onehot(y_c, x.shape[-1])) * scale[:, None]
        d = d.astype(dtype)
        d_h = mixed_ops.product(d, k, (((1,), (1,)), ((), ())), d_h_dtype)
        d_kernel = mixed_ops.product(h_c, d, (((0,), (0,)), ((), ())), _F32)
        return loss, hits, d_kernel, d_h

    # The first chunk outside the loop: its results start the sums (no zeroed float32 kernel-
    # sized accumulator to write and read back).
    total, correct, d_kernel, d_h0 = one(0, hs)
    # XLA unrolls a loop of one trip (two chunks) and may then run both chunks at once, their
    # logits alive together: the barrier holds the next chunk's reads until this one is done.
    d_kernel, d_h0, hs = lax.optimization_barrier((d_kernel, d_h0, hs))
    d_h = jnp.zeros(hs.shape, d_h0.dtype).at[0].set(d_h0)

    def body(carry, i):
        total, correct, d_kernel, d_h = carry
        loss, hits, d_k, d_h_c = one(i, hs)
        d_h = lax.dynamic_update_index_in_dim(d_h, d_h_c, i, 0)
        return (total + loss, correct + hits, d_kernel + d_k, d_h), None

    if hs.shape[0] > 1:
        (total, correct, d_kernel, d_h), _ = lax.scan(
            body, (total, correct, d_kernel, d_h), jnp.arange(1, hs.shape[0])
        )
    if not folded:
        d_h, d_kernel = d_h * norm, d_kernel * norm
    total, correct = jnp.sum(total), jnp.sum(correct)
    return (total * norm, correct * norm), (_unchunk(d_h), d_kernel)


def _linear_xent_bwd(size, dtype, grad_dtypes, residuals, cotangents):
    del size, dtype
    # Only the loss has a gradient (not the count of correct labels, nor the weights and their
    # normalizer, which are held constant). A cotangent that is the constant 1 (the loss itself
    # differentiated) leaves no multiply in the program.
    g = cotangents[0]
    (d_h, d_kernel), (h_dtype, kernel_dtype) = residuals, grad_dtypes
    return (d_h * g).astype(h_dtype), (d_kernel * g).astype(kernel_dtype), None, None, None


_linear_xent.defvjp(_linear_xent_fwd, _linear_xent_bwd)


def _chunk_size(positions: int, vocab: int, chunk_size) -> int:
    if chunk_size is not None:
        if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return min(int(chunk_size), positions)
    chunks = max(1, math.ceil(positions * vocab / CHUNK_ELEMENTS))
    return math.ceil(positions / chunks)


def fused_linear_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    *,
    where: jax.Array | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    dtype=None,
    return_accuracy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Cross-entropy of the logits `hidden @ kernel` against integer labels, reduced to a scalar,
    without forming the logits (see the module docstring).

    The same value as `softmax_cross_entropy_with_integer_labels(hidden @ kernel, labels)`
    averaged (or summed) over the positions `where` selects, with the head's matmul in `dtype`
    summed in float32 and its result rounded to `dtype`, as a wrapped model's head computes it.

    Args:
      hidden: [..., d] the output head's input (the last hidden states), any float dtype.
      kernel: [d, vocab] the head's weight (for an embedding table tied as the head, its
        transpose `table.T`). Its gradient comes back in its dtype, summed in float32.
      labels: [...] integer labels in [0, vocab) (`hidden`'s shape without its last axis); a
        label outside picks no logit, its loss is the log-normalizer alone.
      where: optional [...] weights per position (a bool mask or floats): "mean" divides the
        weighted sum by their sum.
      reduction: "mean" (default) or "sum".
      chunk_size: positions per chunk; by default as many as keep a chunk's logits near
        `CHUNK_ELEMENTS` (2^27) elements.
      dtype: the matmuls' operand dtype; by default `hidden`'s (bfloat16 hidden states from a
        wrapped model: a bfloat16 head).
      return_accuracy: also return the fraction (or with "sum", the count) of positions whose
        label's logit is the largest (a tie counts as correct), weighted as the loss is.

    Returns:
      The float32 scalar loss, or (loss, accuracy) with `return_accuracy`.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    for name, x in (("hidden", hidden), ("kernel", kernel)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integers, got {labels.dtype}")
    if kernel.ndim != 2 or hidden.shape[-1:] != kernel.shape[:1]:
        raise ValueError(
            f"kernel must be [d, vocab] with d hidden's last axis: hidden {hidden.shape}, "
            f"kernel {kernel.shape}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have hidden's shape without its last axis: hidden {hidden.shape}, "
            f"labels {labels.shape}"
        )
    weights = jnp.ones(labels.shape, _F32) if where is None else jnp.asarray(where, _F32)
    if weights.shape != labels.shape:
        raise ValueError(f"where must have labels' shape {labels.shape}, got {weights.shape}")
    d, vocab = kernel.shape
    h = hidden.reshape(-1, d)
    y = labels.reshape(-1)
    w = weights.reshape(-1)
    size = _chunk_size(max(h.shape[0], 1), vocab, chunk_size)
    pad = -h.shape[0] % size if h.shape[0] else size
    if pad:  # padded positions weigh nothing
        h = jnp.pad(h, ((0, pad), (0, 0)))
        y = jnp.pad(y, (0, pad))
        w = jnp.pad(w, (0, pad))
    compute = np.dtype(dtype if dtype is not None else hidden.dtype)
    grad_dtypes = (np.dtype(hidden.dtype), np.dtype(kernel.dtype))
    w = lax.stop_gradient(w)
    # "mean" divides by the weights' sum inside: the gradients are formed already divided.
    norm = 1.0 / jnp.sum(w) if reduction == "mean" else jnp.ones((), _F32)
    with jax.named_scope(SCOPE):
        total, correct = _linear_xent(h, kernel, y, w, norm, size, compute, grad_dtypes)
    return (total, lax.stop_gradient(correct)) if return_accuracy else total


__all__ = [
    "CHUNK_ELEMENTS",
    "SCOPE",
    "fused_linear_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
]
