"""Op-level autocast for JAX functions: rewrite a traced program so its matmuls use a compute dtype.

The engine beneath `jamp.autocast` and `jamp.wrap` is `rewrite(fn, compute_dtype)`: it traces
`fn` to a jaxpr and evaluates it again, replacing every `dot_general` and `conv_general_dilated` whose floating operands are not already in the compute
dtype by its mixed-precision form (`jamp.mixed_ops`). With `activations="float32"` every other
operation runs exactly as traced, so reductions, softmax, normalization and the loss keep their
float32 numerics and every intermediate dtype is unchanged; with `activations="compute"` the
values between matmuls may be carried in the 16-bit compute dtype, operation by operation as
`jamp.activations` decides. Either way the function's inputs and outputs keep their dtypes.

Working on the traced program rather than on module attributes is what lets a policy reach matmuls
that no `dtype=` argument controls: layers that hard-code `dtype=jnp.float32`, raw `x @ param`
products, shared submodules, and matmuls inside `jit`, `scan`, `cond`, `while_loop` and `remat`.
Custom-derivative functions (`jax.custom_jvp` / `custom_vjp`) are the exception: their primal is
rewritten, but under differentiation their own rules run as written, matmuls included. Kernels
(`pallas_call`) run as written; `shard_map` bodies are rewritten and mapped again. A higher-order
primitive not in `REWRITTEN_INSIDE`, with matmuls inside to rewrite, is an
`UnsupportedProgramError` at trace time; what differs between JAX releases is read through
`jamp.jax_compat`. When nothing would change (float32 everywhere), `fn` runs as written.

Where an equation runs is decided by `compute_for(eqn, inherited)`, which returns the compute dtype
for that equation (or None to leave it as traced); `inherited` is the dtype chosen for the enclosing
equation when the interpreter descends into a sub-program. `jamp.wrap` uses the name stack that
Flax module calls leave on each equation to give submodules policies of their own.

Example::

  loss = rewrite(lambda w, x: jnp.tanh(x @ w).sum(), jnp.bfloat16)(w, x)
"""

from jamp.engine._core import ComputeFor, eval_jaxpr
from jamp.engine._guard import RecognitionWarning
from jamp.engine._rewrite import AttentionFusion, PlacementFor, fusion_key, placing, rewrite
from jamp.engine._tail import recompute_widened
from jamp.engine._values import REWRITTEN_INSIDE

__all__ = [
    "AttentionFusion",
    "ComputeFor",
    "PlacementFor",
    "REWRITTEN_INSIDE",
    "RecognitionWarning",
    "fusion_key",
    "eval_jaxpr",
    "placing",
    "recompute_widened",
    "rewrite",
]
