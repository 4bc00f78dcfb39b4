"""Loss and evaluation functions for the training program's two tasks.

* ``classification``: batches ``{"image": f32[B,H,W,C], "label": i32[B]}``; softmax cross-entropy.
* ``lm``: batches ``{"tokens": i32[B, L+1]}``; next-token cross-entropy on ``tokens[:, 1:]``.

Eval functions return per-device *sums* over the real (unmasked) examples, so that the host can
divide totals by totals whatever the padding of the last batch.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax.numpy as jnp

from jamp import fp8, losses
from jamp import nnx as jamp_nnx
from jamp.inspect.overflow import output_flags
from jamp.train.overflow_watch import FORWARD
from jamp.wrap import Wrapped, wrap

TASKS = ("classification", "lm")


def _apply(model, params, model_state, inputs, train, rng=None, hidden=False):
    variables = {"params": params, **model_state}
    rngs = {"dropout": rng} if rng is not None else None
    more = {"return_hidden": True} if hidden else {}
    # Returning its hidden states, the model's last matmul is its last block's, not the head.
    with fp8.head_outside() if hidden else contextlib.nullcontext():
        if train and model_state:
            return model.apply(
                variables, inputs, train=True, rngs=rngs, mutable=list(model_state), **more
            )
        return model.apply(variables, inputs, train=train, rngs=rngs, **more), model_state


def _inputs_targets(task, batch):
    if task == "lm":
        return batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    return batch["image"], batch["label"]


def model_inputs(task: str, batch):
    """What the model is called with for a batch of `task`: images, or the input tokens."""
    return _inputs_targets(task, batch)[0]


#: The loss metrics' per-module forward flags (`make_loss_fn(..., forward_flags=True)`).
FORWARD_FLAGS = FORWARD


def _apply_checked(model, params, model_state, inputs, rng):
    """A train-mode apply that also says whether each module's output was finite."""
    if not isinstance(model, nn.Module):  # an NNX model's view: its submodules' outputs
        with jamp_nnx.capturing_outputs() as maxima:
            out, new_state = _apply(model, params, model_state, inputs, True, rng)
        flags = {path: jnp.isfinite(m).astype(jnp.float32) for path, m in maxima.items()}
        return out, new_state, flags
    variables = {"params": params, **model_state}
    out, state = model.apply(
        variables,
        inputs,
        train=True,
        rngs={"dropout": rng} if rng is not None else None,
        mutable=[*model_state, "intermediates"],
        capture_intermediates=True,
    )
    state = dict(state)
    flags = output_flags(state.pop("intermediates", {}))
    # float32, so that the step averages them over replicas like any metric: 1.0 only when
    # every replica's output was finite there.
    return out, state, {path: ok.astype(jnp.float32) for path, ok in flags.items()}


def _fused_head(model):
    """(the model's `output_kernel(params)`, the head's dtype) when the LM loss can apply the
    output head itself, in chunks (`jamp.losses.fused_linear_cross_entropy`): a wrapped linen
    model whose module returns its last hidden states on `return_hidden=True` and names its
    head's kernel, with no override besides a wrap's defaults. Else None."""
    module = getattr(model, "module", None)
    kernel_of = getattr(type(module), "output_kernel", None)
    if not isinstance(model, Wrapped) or kernel_of is None:
        return None
    # The overrides every wrap has (normalization in float32) leave the head alone; any other
    # (keep_in_float32, adaptive precision's) might not.
    if model.overrides != wrap(module, model.policy, activations=model.activations).overrides:
        return None
    return kernel_of, fp8.carrier(model.policy.compute_dtype)


def make_loss_fn(model, task: str, *, forward_flags: bool = False):
    """`loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`.

    With `forward_flags`, `metrics[FORWARD_FLAGS]` says per module path whether
    its output was finite on this step (1.0) or not (0.0): where a forward overflow began.
    """

    fused = _fused_head(model) if task == "lm" and not forward_flags else None

    def loss_fn(params, model_state, batch, rng):
        inputs, targets = _inputs_targets(task, batch)
        extra = {}
        if fused is not None:
            # The head and the loss in chunks of positions: no batch x length x vocabulary logits
            # (jamp.losses.fused_linear_cross_entropy), the head in the policy's dtype.
            kernel_of, dtype = fused
            hidden, new_model_state = _apply(model, params, model_state, inputs, True, rng, True)
            loss, accuracy = losses.fused_linear_cross_entropy(
                hidden, kernel_of(params), targets, dtype=dtype, return_accuracy=True
            )
            return loss, (new_model_state, {"accuracy": accuracy})
        if forward_flags:
            logits, new_model_state, flags = _apply_checked(model, params, model_state, inputs, rng)
            extra[FORWARD_FLAGS] = flags
        else:
            logits, new_model_state = _apply(model, params, model_state, inputs, True, rng)
        # The log-softmax runs in float32 (where 16-bit loses the tail first) inside the loss's
        # reductions; its backward is one pass with no float32 copy of the logits
        # (jamp.losses): for a 50k vocabulary the largest cost of the step outside the matmuls.
        loss = losses.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        accuracy = jnp.mean(logits.argmax(-1) == targets)
        return loss, (new_model_state, {"accuracy": accuracy, **extra})

    return loss_fn


def make_eval_fn(model, task: str):
    """`eval_fn(params, model_state, batch) -> sums` over the examples whose mask is 1."""

    def eval_fn(params, model_state, batch):
        inputs, targets = _inputs_targets(task, batch)
        logits, _ = _apply(model, params, model_state, inputs, False)
        per_example = losses.softmax_cross_entropy_with_integer_labels(logits, targets)
        correct = (logits.argmax(-1) == targets).astype(jnp.float32)
        mask = batch["mask"].astype(jnp.float32)
        if task == "lm":  # every token of a real sequence counts
            mask = jnp.broadcast_to(mask[:, None], targets.shape)
        return {
            "loss_sum": jnp.sum(per_example * mask),
            "correct_sum": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
        }

    return eval_fn


def summarize_eval(task: str, totals: dict) -> dict:
    """Turns summed eval metrics into accuracy (classification) or loss and perplexity (lm)."""
    count = max(float(totals["count"]), 1.0)
    loss = float(totals["loss_sum"]) / count
    if task == "lm":
        return {
            "loss": loss,
            "perplexity": float(jnp.exp(loss)),
            "accuracy": float(totals["correct_sum"]) / count,
        }
    return {"loss": loss, "accuracy": float(totals["correct_sum"]) / count}
