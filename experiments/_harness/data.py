"""The synthetic batches the timed steps train on, and the loss on them (no dataset: timing only)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax


def random_batch(
    task: str, size: int, *, vocab: int = 256, seq_len: int = 128, image_size: int = 32
) -> dict:
    """A numpy batch in the training program's form, drawn from a fixed seed: {"tokens": int32
    [size, seq_len + 1]} for "lm", else {"image": f32 [size, H, W, 3], "label": int32 [size]}."""
    rng = np.random.default_rng(0)
    if task == "lm":
        return {"tokens": rng.integers(0, vocab, (size, seq_len + 1)).astype(np.int32)}
    shape = (size, image_size, image_size, 3)
    return {
        "image": rng.standard_normal(shape).astype(np.float32),
        "label": rng.integers(0, 10, size).astype(np.int32),
    }


def xy_loss(apply_fn):
    """A `jamp.make_train_step` loss of `apply_fn({"params": ...}, batch["x"])`'s float32 logits
    against integer labels batch["y"] (a model without dropout or batch statistics)."""

    def loss_fn(params, model_state, batch, rng):
        del rng  # no dropout in these models
        logits = apply_fn({"params": params}, batch["x"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    return loss_fn
