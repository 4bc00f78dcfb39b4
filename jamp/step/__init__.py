"""The mixed-precision train step, written once as five named stages, and its eval counterpart.

`make_train_step` returns a pure function `train_step(state, batch, rng) -> (state, metrics)`.
After folding the step (and the replica index) into the rng, it runs one order, a stage each
(docs/design.md, "The one order of the step"):

  1. `gradients`: the loss in fp32 times the loss scale, and fp32 gradients with respect to the
     params (summed over microbatches, if any), traced in every extension's context;
  2. `average`: gradients, loss, metrics, model state and the extensions' observations across
     replicas (in the policy's reduce dtype);
  3. `unscale_and_check`: unscale with the scale of 1, check finiteness (once, with one flag per
     module), take the norm, clip the unscaled gradients;
  4. `update`: the optax update on the params' float32 view, rounded to their dtypes
     (stochastically for bfloat16 params);
  5. `commit`: keep the old params, optimizer state and model state if the gradients were not
     finite or an extension holds the step (a fresh delayed fp8 state only measures on its first
     step: `jamp.fp8.measuring`; take it with `jamp.fp8.calibrating(train_step)` to apply it);
     commit each extension's slot; adjust the loss scale; count the step.

What rides in the state beside those (fp8's scaling state, the params' 16-bit copies) is an
extension of the step (`jamp.extension.Extension`): the stages call its small interface instead
of threading it by hand.

Nothing here jits or pmaps: callers wrap the step in `jax.jit`, or use `jamp.parallel`.
"""

from jamp.extension import Extension
from jamp.fp8.extension import FP8_SATURATION
from jamp.step.eval import EvalFn, make_eval_step
from jamp.step.train import LossFn, extensions, make_train_step

__all__ = [
    "FP8_SATURATION",
    "EvalFn",
    "Extension",
    "LossFn",
    "extensions",
    "make_eval_step",
    "make_train_step",
]
