"""The eval step (`make_eval_step`): fp32 metrics under the state's fp8 scales, averaged over
replicas."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
from jax import lax

from jamp import fp8
from jamp.state import TrainState
from jamp.step._trees import metrics_fp32

PyTree = Any
# eval_fn(params, model_state, batch) -> metrics
EvalFn = Callable[[PyTree, PyTree, PyTree], Mapping[str, jax.Array]]


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
            metrics = metrics_fp32(eval_fn(state.params, state.model_state, batch))
        if axis_name is not None:  # equal shards: the mean of shard means is the batch mean
            metrics = lax.pmean(metrics, axis_name)
        return metrics

    eval_step.axis_name = axis_name  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    return eval_step
