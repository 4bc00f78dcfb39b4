"""The mixed-precision train step, written once, and its eval counterpart.

`make_train_step` returns a pure function `train_step(state, batch, rng) -> (state, metrics)` that
follows one order (see DESIGN.md, "The mixed-precision step, written once"):

  1. fold the step (and the replica index) into the rng;
  2. compute the loss in fp32 and multiply it by the loss scale;
  3. take fp32 gradients with respect to the params (summed over microbatches, if any);
  4. average gradients, loss, metrics and model state across replicas;
  5. unscale with the scale used in 2;
  6. check finiteness, clip the unscaled gradients, run the optax update on the params' float32
     view and round the result to their dtypes (stochastically for bfloat16 params);
  7. keep the old params, optimizer state and model state if the gradients were not finite (and
     the fp8 scaling state, which otherwise takes this step's amaxes, max-reduced in 3 and 4), or
     if a fresh delayed fp8 state only measured on this step (`jamp.fp8.measuring`; take that
     step with `jamp.fp8.calibrating(train_step)` to apply it with true scales instead);
  8. adjust the loss scale and count the step.

Nothing here jits or pmaps: callers wrap the step in `jax.jit`, or use `jamp.parallel`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend import core as jcore

from jamp import copies as copies_lib
from jamp import fp8, rounding
from jamp.engine import recompute_widened
from jamp.grad_stats import grad_stats
from jamp.loss_scale import NoOpLossScale, select_tree
from jamp.state import TrainState, float32_view

#: The step metric `{fp8 site: f32[3], how far past fmax the amaxes of x, w and g went}`
#: (`jamp.fp8.saturation`), with an fp8 state: where delayed scaling clipped values, for
#: adaptive precision.
FP8_SATURATION = "fp8_saturation"
# Folded into the step's key for the params' stochastic rounding: a stream apart from dropout's,
# the same on every replica (the replica index is folded into dropout's alone).
_ROUNDING_STREAM = 0x524F554E

PyTree = Any
Metrics = Mapping[str, jax.Array]
# loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, metrics))
LossFn = Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[jax.Array, tuple[PyTree, Metrics]]]
# eval_fn(params, model_state, batch) -> metrics
EvalFn = Callable[[PyTree, PyTree, PyTree], Metrics]


def _pmean_floats(tree: PyTree, axis_name: str) -> PyTree:
    """Averages the floating-point leaves of `tree` over `axis_name`; other leaves pass through."""

    # Integer leaves (counters in model state) are the same on every replica already, and a pmean
    # of integers would truncate.
    def mean(x):
        return lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x

    return jax.tree.map(mean, tree)


def _metrics_fp32(metrics: Metrics) -> dict[str, jax.Array]:
    """Returns the user's metrics as fp32 arrays, so they can be averaged and logged alike."""
    # Integer counts and bool flags become fp32 too: averaged over replicas they are fractions.
    return jax.tree.map(lambda value: jnp.asarray(value, jnp.float32), dict(metrics))


def _conform(new: PyTree, old: PyTree, what: str) -> PyTree:
    """Returns `new` with the structure check passed and every leaf cast to `old`'s dtype."""
    # A state leaf whose dtype drifts (bf16 statistics, a weakly typed counter) would make the next
    # jitted call compile again, and would break the lax.scan carry and select_tree below.
    if not jax.tree.leaves(old) and not jax.tree.leaves(new):
        return old  # a model without mutable state may hand back {} or None
    if jax.tree.structure(new) != jax.tree.structure(old):  # type: ignore[operator]  # PyTreeDef: jaxlib has no stub
        raise ValueError(
            f"{what} has structure {jax.tree.structure(new)}, "
            f"but the state holds {jax.tree.structure(old)}; they must match."
        )
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, old)


def _unpack(out):
    """`loss_fn`'s result, checked: `(loss, (new_model_state, metrics))`."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) and len(out[1]) == 2:
        return out
    got = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
    raise TypeError(
        "loss_fn must return (loss, (new_model_state, metrics)), e.g. "
        f"`return loss, (model_state, {{}})`; got {got}"
    )


_WARNED_UNSCALED: list[bool] = []


def _computes_in_float16(jaxpr) -> bool:
    """Whether the program makes float16 arrays (a float16 policy's casts and matmuls; on a CPU
    without float16 matmuls, jamp widens float16 operands for a float32 dot)."""
    for eqn in jaxpr.eqns:
        if any(
            getattr(v.aval, "dtype", None) == jnp.float16 and getattr(v.aval, "ndim", 0)
            for v in eqn.outvars
        ):
            return True
        if any(_computes_in_float16(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def _warn_float16_unscaled(jaxpr) -> None:
    """Once per process: float16 compute under a NoOpLossScale, the commonest fp16 mistake
    (PyTorch's autocast without a GradScaler): small gradients flush to zero in float16."""
    if _WARNED_UNSCALED or not _computes_in_float16(jaxpr):
        return
    _WARNED_UNSCALED.append(True)
    warnings.warn(
        "the train step computes in float16 without a loss scale (the state holds a "
        "NoOpLossScale): gradients below float16's range flush to zero. Create the state with "
        "loss_scale=jamp.loss_scale_for(policy) (a dynamic scale for float16).",
        stacklevel=4,
    )


def _scaled_grads(
    loss_fn, loss_scale, params, model_state, batch, rng, fp8_state=None, copies=None
):
    """Returns (scaled fp32 grads, fp32 loss, new model state, fp32 metrics, fp8 observations)
    for one batch; the observations are None without an fp8 state. `copies`: the state's
    `compute_params`, which the matmuls read instead of casting the params."""

    def scaled_loss(p, f8):
        pairs = () if copies is None else copies_lib.pairs(p, copies)
        # fp8 matmuls traced here read their scales from `scope`
        with fp8.scaling(f8) as scope, copies_lib.ready_casts(pairs):
            loss, (new_model_state, metrics) = _unpack(loss_fn(p, model_state, batch, rng))
        scope.check_reached()  # a site the loss never reached would never update
        if jnp.ndim(loss) != 0:
            raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
        # The reductions in the loss are where 16-bit overflows first: finish it in fp32.
        loss = jnp.asarray(loss, jnp.float32)
        # Scaling the loss scales every gradient, lifting small 16-bit gradients above underflow.
        return loss_scale.scale(loss), (loss, new_model_state, metrics)

    # What the loss computes from a model's widened 16-bit output (the logits) is recomputed in
    # the backward from the 16-bit values, not kept in float32 (jamp.engine.recompute_widened).
    on_trace = _warn_float16_unscaled if isinstance(loss_scale, NoOpLossScale) else None
    scaled_loss = recompute_widened(scaled_loss, on_trace)
    if fp8.uses_state(fp8_state):
        # The derivative with respect to the fp8 state is not a gradient: each fp8 matmul's
        # custom VJP puts this step's amaxes there (see jamp.fp8). The optimizer never sees it.
        (grads, observed), (loss, new_model_state, metrics) = jax.grad(
            scaled_loss, argnums=(0, 1), has_aux=True
        )(params, fp8_state)
    else:
        observed = None
        grads, (loss, new_model_state, metrics) = jax.grad(
            lambda p: scaled_loss(p, fp8_state), has_aux=True
        )(params)
    # fp32 params give fp32 grads already; upcasting covers 16-bit params so that the averaging and
    # unscaling below never round or overflow in 16 bits.
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    new_model_state = _conform(
        new_model_state, model_state, "model_state returned by the loss function"
    )
    return grads, loss, new_model_state, _metrics_fp32(metrics), observed


def _split_microbatches(batch: PyTree, num_micro: int) -> PyTree:
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


def _accumulated_grads(
    loss_fn, loss_scale, params, model_state, batch, rng, num_micro, fp8_state=None, copies=None
):
    """Like `_scaled_grads`, averaged over `num_micro` microbatches run one after another."""
    micro = _split_microbatches(batch, num_micro)

    def body(carry, xs):
        grad_sum, seen, state = carry
        micro_batch, index = xs
        # Each microbatch gets its own dropout mask, as it would as a batch of its own.
        micro_rng = jax.random.fold_in(rng, index)
        grads, loss, state, metrics, observed = _scaled_grads(
            loss_fn, loss_scale, params, state, micro_batch, micro_rng, fp8_state, copies
        )
        # Summing in fp32 keeps k small scaled gradients from rounding away against each other.
        grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
        if observed is not None:  # the step's amax is the largest of its microbatches'
            seen = fp8.combine(seen, observed)
        return (grad_sum, seen, state), (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    seen = jax.tree.map(jnp.zeros_like, fp8_state) if fp8.uses_state(fp8_state) else None
    # scan, not a python loop: one traced copy of the model, whatever num_micro is.
    (grad_sum, seen, model_state), (losses, metrics) = lax.scan(
        body, (zeros, seen, model_state), (micro, jnp.arange(num_micro))
    )
    # The mean of microbatch means is the whole-batch mean for equal microbatches: same scale of
    # gradient as one step on the whole batch, so learning rates carry over.
    grads = jax.tree.map(lambda g: g / num_micro, grad_sum)
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    return grads, jnp.mean(losses), model_state, metrics, seen


def _clip_by_global_norm(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    """Rescales `grads` (whose global norm is `norm`) so the norm is at most `max_norm`."""
    factor = max_norm / jnp.maximum(norm, max_norm)  # 1 when already inside the ball
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


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

    def train_step(state: TrainState, batch: PyTree, rng: jax.Array):
        # Callers pass one base key; folding in the step gives fresh dropout every step ...
        rng = step_rng = jax.random.fold_in(rng, state.step)
        if axis_name is not None:  # ... and the replica index different dropout per replica.
            rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
        loss_scale = state.loss_scale  # keep the scale the grads are computed with for unscaling
        f8 = state.fp8_state
        common = (loss_fn, loss_scale, state.params, state.model_state, batch, rng)
        if accumulation_steps == 1:
            grads, loss, model_state, metrics, observed = _scaled_grads(
                *common, f8, state.compute_params
            )
        else:
            grads, loss, model_state, metrics, observed = _accumulated_grads(
                *common, accumulation_steps, f8, state.compute_params
            )
        if axis_name is not None:
            # Average before checking finiteness: an inf on one replica becomes an inf on all, so
            # every replica takes the same skip decision and the replicas never drift apart. Batch
            # statistics are averaged too, for the same reason.
            if reduce_dtype is not None:  # what crosses the wire; an overflow there is caught
                grads = jax.tree.map(lambda g: g.astype(reduce_dtype), grads)
            grads, loss, model_state, metrics = _pmean_floats(
                (grads, loss, model_state, metrics), axis_name
            )
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            if observed is not None:  # every replica scales its next step alike
                observed = fp8.pmax(observed, axis_name)
        grads = loss_scale.unscale(grads)  # the scale of step 2, not the adjusted one
        # The norm, the verdict and one flag per module from one pass over the gradients, a few
        # kernels for all leaves (on a skipped step the flags say where the overflow was; the
        # gradients are averaged already, so replicas agree).
        stats = grad_stats(grads, attribution_depth)
        finite, grad_norm, finite_by_module = stats.finite, stats.norm, stats.finite_by_group
        if max_grad_norm is not None:  # a threshold in true gradient units, so clip unscaled
            grads = _clip_by_global_norm(grads, grad_norm, max_grad_norm)
        # The update is applied in float32 and rounded to the params' dtypes: 16-bit params take
        # updates below half their ulp in expectation (stochastic) instead of losing them.
        params32 = float32_view(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, params32)
        opt_state = _conform(opt_state, state.opt_state, "the state tx.update returned")
        params = rounding.round_tree(
            optax.apply_updates(params32, updates),
            state.params,
            param_rounding,
            jax.random.fold_in(step_rng, _ROUNDING_STREAM),
        )
        # A skipped step leaves everything but the loss scale and the counters bit-identical,
        # batch statistics included (a nan in them would otherwise poison every later step).
        saturation = None
        applied = finite
        if observed is not None:
            saturation = fp8.saturation(f8, observed)
            # A fresh delayed state's first step only measures: its scales fit no tensor yet.
            applied = finite & jnp.logical_not(fp8.measuring(f8))
            f8 = select_tree(finite, fp8.update(f8, observed), f8)
        params, opt_state, model_state = select_tree(
            applied,
            (params, opt_state, model_state),
            (state.params, state.opt_state, state.model_state),
        )
        # The copies the next step's matmuls read, made from the params kept: one more output of
        # the update's kernels, and on a skipped step the same bits as before.
        compute_params = state.compute_params
        if compute_params is not None:
            compute_params = copies_lib.recast(params, compute_params)
        new_loss_scale = loss_scale.adjust(finite)  # back off on overflow, grow when stable
        skipped_steps = state.skipped_steps + jnp.logical_not(applied).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1,  # counts skipped steps too: schedules and rngs move on
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            loss_scale=new_loss_scale,
            skipped_steps=skipped_steps,
            fp8_state=f8,
            compute_params=compute_params,
        )
        metrics = {
            **metrics,
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_scale": new_loss_scale.loss_scale,
            "grads_finite": finite,
            "skipped_steps": skipped_steps,
        }
        if attribution_depth:
            metrics["grads_finite_by_module"] = finite_by_module
        if fp8.uses_state(f8) and fp8_metric_sites:
            metrics["fp8"] = fp8.metrics(f8, fp8.representative(f8, fp8_metric_sites))
        if saturation is not None:
            metrics[FP8_SATURATION] = saturation
        return new_state, metrics

    # Lets jamp.parallel refuse to pmap a step that would not average across replicas.
    train_step.axis_name = axis_name  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    return train_step


def make_eval_step(
    eval_fn: EvalFn,
    *,
    axis_name: str | None = None,
) -> Callable[[TrainState, PyTree], dict[str, jax.Array]]:
    """Builds a pure eval step that returns fp32 metrics, averaged over replicas.

    Args:
      eval_fn: `eval_fn(params, model_state, batch) -> metrics`, a dict of scalars.
      axis_name: the pmap axis to average the metrics over; None on a single device.

    Returns:
      `eval_step(state, batch) -> metrics`, with every metric an fp32 scalar.

    Example:
      >>> def eval_fn(params, model_state, batch):
      ...   logits = model.apply({"params": params, **model_state}, batch["x"], train=False)
      ...   return {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}
      >>> metrics = jax.jit(make_eval_step(eval_fn))(state, batch)
    """

    def eval_step(state: TrainState, batch: PyTree) -> dict[str, jax.Array]:
        # delayed fp8 scales, as the train step has them (a duck-typed state may have none); a
        # fresh state's unmeasured operands by their own amax, since nothing here measures
        with fp8.scaling(getattr(state, "fp8_state", None), own_when_unmeasured=True):
            metrics = _metrics_fp32(eval_fn(state.params, state.model_state, batch))
        if axis_name is not None:  # equal shards: the mean of shard means is the batch mean
            metrics = lax.pmean(metrics, axis_name)
        return metrics

    eval_step.axis_name = axis_name  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    return eval_step
