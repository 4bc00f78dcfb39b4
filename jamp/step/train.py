"""The train step assembled from its stages (`make_train_step`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import optax
from jax import lax

from jamp import copies, rounding
from jamp.fp8.extension import Fp8Extension
from jamp.state import TrainState
from jamp.step.average import average
from jamp.step.check import unscale_and_check
from jamp.step.commit import commit
from jamp.step.gradients import gradients
from jamp.step.update import update

PyTree = Any
Metrics = Mapping[str, jax.Array]
# loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))
LossFn = Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[jax.Array, tuple[PyTree, Metrics]]]


def extensions(fp8_metric_sites: int = 3) -> tuple:
    """What the step threads beside params, model state, optimizer state and loss scale
    (`jamp.extension`), in the order their tracing contexts nest: fp8's delayed-scaling state,
    then the params' 16-bit copies."""
    return (Fp8Extension(fp8_metric_sites), copies.CopiesExtension())


def _check_options(accumulation_steps, max_grad_norm, param_rounding, attribution_depth):
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}.")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}.")
    if param_rounding not in rounding.MODES:
        raise ValueError(
            f"param_rounding must be one of {', '.join(rounding.MODES)}, got {param_rounding!r}."
        )
    if not isinstance(attribution_depth, int) or attribution_depth < 0:
        raise ValueError(f"attribution_depth must be an int >= 0, got {attribution_depth!r}.")


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    axis_name: str | None = None,
    accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    reduce_dtype=None,
    attribution_depth: int = 1,
    fp8_metric_sites: int = 3,
    param_rounding: str = "auto",
) -> Callable[[TrainState, PyTree, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds a pure mixed-precision train step.

    Args:
      loss_fn: `loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))`
        with a scalar loss of any float dtype (it is finished in fp32), `new_model_state` of the
        same structure as `model_state` (`{}` if the model has none), and a dict of scalar metrics.
      tx: the optax transformation the state's `opt_state` was created with.
      axis_name: the pmap axis to average over; None on a single device or under plain jit.
      accumulation_steps: split the batch's leading axis into this many microbatches and apply
        one update with their averaged gradients.
      max_grad_norm: if set, clip the unscaled gradients to this global norm before `tx`.
      reduce_dtype: with `axis_name`, the dtype gradients are averaged across replicas in (a
        policy's, `jamp.precision.reduce_dtype`); None: their own (float32). Under
        `jamp.sharding` the wrapped model's matmuls decide it instead.
      attribution_depth: how deep the per-module finite flags go (`jamp.finite_by_group`): 1
        gives one flag per top-level module of the params tree; 0 a single flag and no
        "grads_finite_by_module" metric.
      fp8_metric_sites: with an fp8 state, how many representative sites (the first, middle and
        last matmuls) report their newest amax and scale per operand in `metrics["fp8"]`.

      param_rounding: how updated 16-bit params (a policy's `params=bf16`) are rounded from the
        float32 update: "stochastic" (unbiased; the random bits come from `rng`, the step and
        each param's path, so replicas, shards and a resumed run round alike), "nearest" (which
        stalls a weight once its updates fall below half its ulp), or "auto" (stochastic for
        bfloat16 params, nearest for float16 ones, which "stochastic" refuses:
        `jamp.rounding.round_tree`). float32 params are unaffected.

    Returns:
      `train_step(state, batch, rng) -> (new_state, metrics)`, where `rng` is one base key for the
      whole run (the step folds in the step number and replica index) and `metrics` holds "loss"
      (unscaled, fp32), "grad_norm" (of the unscaled gradients, before clipping), "loss_scale"
      (after adjusting), "grads_finite" (bool), "skipped_steps" (int32: steps not applied, for
      an overflow or as a fresh fp8 state's measuring step),
      "grads_finite_by_module" (`{module path: bool}`, the averaged gradients' finiteness per
      group of params: on a skipped step, the modules that overflowed) and the loss_fn metrics
      (fp32, averaged over microbatches and replicas; the names above win on a clash); with an
      fp8 state, "fp8" (`{site: {"x_amax", "x_scale", "w_amax", ..., "g_scale"}}`, after the
      update) and "fp8_saturation" (`{site: f32[3]}`, every site: for x, w and g, how far past
      its format's largest value this step's amax went under the scale it was quantised with,
      `jamp.fp8.saturation`; above 1, values were clipped).

    Example:
      >>> def loss_fn(params, model_state, batch, rng):  # a model with batch_stats
      ...   logits, new_ms = model.apply({"params": params, **model_state}, batch["x"],
      ...                                mutable=list(model_state), rngs={"dropout": rng})
      ...   loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      ...   return loss, (new_ms, {})
      >>> train_step = jax.jit(make_train_step(loss_fn, tx), donate_argnums=0)
      >>> state, metrics = train_step(state, batch, jax.random.key(0))
    """
    _check_options(accumulation_steps, max_grad_norm, param_rounding, attribution_depth)
    threaded = extensions(fp8_metric_sites)

    def train_step(state: TrainState, batch: PyTree, rng: jax.Array):
        # Callers pass one base key; folding in the step gives fresh dropout every step ...
        rng = step_rng = jax.random.fold_in(rng, state.step)
        if axis_name is not None:  # ... and the replica index different dropout per replica.
            rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
        # 1-2: the loss scaled by the state's scale, its fp32 gradients, averaged over replicas
        g = gradients(loss_fn, state, batch, rng, accumulation_steps, threaded)
        g = average(g, axis_name, reduce_dtype, threaded)
        # 3: unscaled with the scale of 1, checked once, clipped in true units
        checked = unscale_and_check(g.grads, state.loss_scale, attribution_depth, max_grad_norm)
        # 4-5: updated in float32 and rounded; applied or kept, the scale adjusted, counted
        params, opt_state = update(tx, checked.grads, state, param_rounding, step_rng)
        return commit(state, g, checked, params, opt_state, threaded, bool(attribution_depth))

    # Lets jamp.parallel refuse to pmap a step that would not average across replicas.
    train_step.axis_name = axis_name  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    return train_step
