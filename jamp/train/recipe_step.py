"""A recipe's train step: the one translation from a run's settings to `jamp.make_train_step`.

The training loop, `--compile_for` (`jamp.train.plan`) and `python -m jamp.inspect` all build
their step here, so the step the report or the compile shows is the step the run takes: the same
loss (per-module output flags under adaptive precision, where the LM's head is then not fused),
accumulation, clipping, reduce dtype and parameter rounding. Their state comes from
`jamp.train.loop.fresh_state`, the same way.

Example::

  step = recipe_step.train_step(run, model, task, tx)  # jit it; or axis_name= under pmap
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from jamp.precision import reduce_dtype
from jamp.step import make_train_step
from jamp.train import tasks
from jamp.train.run_config import RunConfig


def loss_fn(run: RunConfig, model, task: str) -> Callable:
    """The recipe's loss on `model` (`jamp.train.tasks.make_loss_fn`): with per-module output
    flags under adaptive precision, which reads them to find where an overflow began."""
    return tasks.make_loss_fn(model, task, forward_flags=bool(run.adaptive))


def train_step(run: RunConfig, model, task: str, tx, axis_name: Optional[str] = None) -> Callable:
    """`jamp.make_train_step` of the recipe's loss on `model` with the run's settings; under
    `pmap`, `axis_name` names the replicas' axis (the step averages the gradients over it)."""
    reduce = reduce_dtype(run.policy)  # under pmap, the step averages in it; sharded, wrap sums
    return make_train_step(
        loss_fn(run, model, task),
        tx,
        axis_name=axis_name,
        accumulation_steps=run.accumulation_steps,
        max_grad_norm=run.max_grad_norm,
        reduce_dtype=None if reduce == np.float32 else reduce,
        param_rounding=run.step_rounding,
    )
