"""Stage 1, gradients: the loss in fp32 times the loss scale, and its fp32 gradients with respect
to the params, for the batch or summed over microbatches. What the step's extensions observe
while the loss is traced (fp8's amaxes) comes back beside them."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jamp.engine import recompute_widened
from jamp.extension import Extension
from jamp.loss_scale import NoOpLossScale
from jamp.step._float16 import warn_float16_unscaled
from jamp.step._trees import conform, metrics_fp32

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Grads:
    """What stage 1 hands on: the scaled fp32 gradients, the unscaled fp32 loss, the new model
    state, fp32 metrics, and `{extension field: observations}` of the observing extensions."""

    grads: PyTree
    loss: jax.Array
    model_state: PyTree
    metrics: dict
    observed: dict


def _unpack(out):
    """`loss_fn`'s result, checked: `(loss, (new_model_state, metrics))`."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) and len(out[1]) == 2:
        return out
    got = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
    raise TypeError(
        "loss_fn must return (loss, (new_model_state, metrics)), e.g. "
        f"`return loss, (model_state, {{}})`; got {got}"
    )


def _scaled_loss(loss_fn, loss_scale, model_state, batch, rng, extensions, slots):
    """`(params, watched) -> (scaled loss, aux)`, traced in every extension's context; `watched`
    holds the slots being differentiated (the rest are read from `slots`)."""

    def scaled_loss(params, watched):
        with contextlib.ExitStack() as stack:
            for ext in extensions:
                slot = watched.get(ext.field, slots[ext.field])
                stack.enter_context(ext.tracing(slot, params))
            loss, (new_model_state, metrics) = _unpack(loss_fn(params, model_state, batch, rng))
        if jnp.ndim(loss) != 0:
            raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
        # The reductions in the loss are where 16-bit overflows first: finish it in fp32.
        loss = jnp.asarray(loss, jnp.float32)
        # Scaling the loss scales every gradient, lifting small 16-bit gradients above underflow.
        return loss_scale.scale(loss), (loss, new_model_state, metrics)

    # What the loss computes from a model's widened 16-bit output (the logits) is recomputed in
    # the backward from the 16-bit values, not kept in float32 (jamp.engine.recompute_widened).
    on_trace = warn_float16_unscaled if isinstance(loss_scale, NoOpLossScale) else None
    return recompute_widened(scaled_loss, on_trace)


def batch_grads(
    loss_fn, loss_scale, params, model_state, batch, rng, extensions: Sequence[Extension], slots
) -> Grads:
    """Stage 1 for one batch."""
    scaled_loss = _scaled_loss(loss_fn, loss_scale, model_state, batch, rng, extensions, slots)
    watched = {e.field: slots[e.field] for e in extensions if e.observes(slots[e.field])}
    if watched:
        (grads, observed), (loss, new_model_state, metrics) = jax.grad(
            scaled_loss, argnums=(0, 1), has_aux=True
        )(params, watched)
    else:
        observed = {}
        grads, (loss, new_model_state, metrics) = jax.grad(
            lambda p: scaled_loss(p, watched), has_aux=True
        )(params)
    # fp32 params give fp32 grads already; upcasting covers 16-bit params so that the averaging and
    # unscaling below never round or overflow in 16 bits.
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    new_model_state = conform(
        new_model_state, model_state, "model_state returned by the loss function"
    )
    return Grads(grads, loss, new_model_state, metrics_fp32(metrics), observed)


def split_microbatches(batch: PyTree, num_micro: int) -> PyTree:
    """Reshapes every leaf's leading axis (b, ...) to (num_micro, b // num_micro, ...)."""
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every batch leaf needs the same leading batch axis; got sizes {sizes}.")
    size = sizes.pop()
    assert size is not None  # refused above
    if size % num_micro:
        raise ValueError(
            f"batch size {size} (per device under pmap) is not divisible by "
            f"accumulation_steps={num_micro}."
        )
    return jax.tree.map(lambda x: x.reshape((num_micro, size // num_micro) + x.shape[1:]), batch)


def accumulated_grads(
    loss_fn, loss_scale, params, model_state, batch, rng, num_micro, extensions, slots
) -> Grads:
    """Stage 1 averaged over `num_micro` microbatches run one after another."""
    micro = split_microbatches(batch, num_micro)
    by_field = {e.field: e for e in extensions}

    def body(carry, xs):
        grad_sum, seen, state = carry
        micro_batch, index = xs
        # Each microbatch gets its own dropout mask, as it would as a batch of its own.
        micro_rng = jax.random.fold_in(rng, index)
        g = batch_grads(
            loss_fn, loss_scale, params, state, micro_batch, micro_rng, extensions, slots
        )
        # Summing in fp32 keeps k small scaled gradients from rounding away against each other.
        grad_sum = jax.tree.map(jnp.add, grad_sum, g.grads)
        seen = {field: by_field[field].combine(seen[field], o) for field, o in g.observed.items()}
        return (grad_sum, seen, g.model_state), (g.loss, g.metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    seen = {
        e.field: jax.tree.map(jnp.zeros_like, slots[e.field])
        for e in extensions
        if e.observes(slots[e.field])
    }
    # scan, not a python loop: one traced copy of the model, whatever num_micro is.
    (grad_sum, seen, model_state), (losses, metrics) = lax.scan(
        body, (zeros, seen, model_state), (micro, jnp.arange(num_micro))
    )
    # The mean of microbatch means is the whole-batch mean for equal microbatches: same scale of
    # gradient as one step on the whole batch, so learning rates carry over.
    grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    return Grads(grads, jnp.mean(losses), model_state, metrics, seen)


def gradients(loss_fn, state, batch, rng, accumulation_steps: int, extensions) -> Grads:
    """Stage 1: the batch's scaled gradients under `state`'s loss scale, over
    `accumulation_steps` microbatches, each extension's slot read from `state`."""
    slots = {e.field: getattr(state, e.field) for e in extensions}
    args = (loss_fn, state.loss_scale, state.params, state.model_state, batch, rng)
    if accumulation_steps == 1:
        return batch_grads(*args, extensions, slots)
    return accumulated_grads(*args, accumulation_steps, extensions, slots)
