"""fp8 matmuls with per-tensor scaling, and the per-site scaling state that a train step threads.

Formats (OCP FP8): E4M3 (`float8_e4m3fn`: 3 mantissa bits, largest 448, no infinity) carries
activations and weights; E5M2 (`float8_e5m2`: 2 mantissa bits, largest 57344, IEEE inf / NaN)
carries gradients, which need range more than precision. A tensor `x` goes into fp8 as
`q = saturate(x * s)` with `s = fmax / (amax * 2**margin)`; the product of two quantised operands
is accumulated in float32 and divided by `s_a * s_b`. Finite values beyond the range saturate to
+-fmax; inf and NaN stay non-finite, so an overflow still skips the step.

Recipes, per matmul site (one `dot_general` of the traced program):

* ``"current"``: `amax` is the tensor's own, now. Stateless; one reduction before each GEMM.
* ``"delayed"``: `s` comes from the largest amax of the last `history` steps, kept in `Fp8State`;
  this step's amax is recorded for the next, in the same kernel that quantises the tensor
  (nothing of this step's amax stands before the GEMM). A site with no history yet has no scale
  to use: take the step that fills it with `calibrating(train_step)`, which quantises every
  tensor by its own amax (current scaling) and records the amaxes — a fresh state's first step,
  and the step after sites join a state (`python -m jamp.train` does both). Scaling by the own
  amax on every step in case a site is new put the reduction and a select before every
  quantisation: 264 more kernels in GPT-2 small's step on the H200 program, 1795 against 1531.
  Without it, `make_train_step` skips a fresh state's first step like an overflow (`measuring`),
  params untouched, the amaxes recorded — but that step quantised by scales of 1, so a gradient
  reaching a site through another fp8 matmul was flushed or clipped there and its amax is
  recorded too small (or zero) for a step or two. A row whose tensor was zero on every step so
  far (a zero-initialised weight) keeps its last scale, 1 at first.

How the state reaches the matmuls and this step's amaxes leave them, with nothing for the user
to thread: the train step runs the loss under `scaling(state)`, and each fp8 matmul traced there
reads its site's scales from it. Differentiating the loss with respect to the state as well as the
params gives, in the state's place, this step's observations (each site's amax of x, w and the
gradient, put there by the matmul's custom VJP); the step max-reduces them over microbatches and
replicas and, after the finite check, calls `update` (a step skipped for an overflow keeps the
state bit-identical, like the params; a fresh state's measuring step records its amaxes). The optimizer never sees the state. A matmul without a site in the state (no
state at all, or one inside a loop body: see `init_state`) uses current scaling.

What the backward pass keeps of an activation is one copy. Sites that read one tensor under a
state (q, k and v of one normalised input; gate and up) quantise it once, with the first reader's
x scale (each records the same amax of it, so their x histories and scales are equal): one fp8
copy is kept, not one per site, and XLA can merge their GEMMs. A site reading a 16-bit value that
the backward keeps anyway (a fused attention's output: `keep_lhs`) keeps that value and quantises
it again in the backward pass, rather than keeping an fp8 copy beside it.

Example::

    model = jamp.wrap(Transformer(cfg), "mixed_fp8")          # stateless: current scaling
    fp8_state = jamp.fp8.init_state(loss_fn, params, {}, batch, key, recipe="delayed")
    state = jamp.TrainState.create(params, tx, fp8_state=fp8_state)
    train_step = jax.jit(jamp.make_train_step(loss_fn, tx), donate_argnums=0)
    first_step = jax.jit(jamp.fp8.calibrating(jamp.make_train_step(loss_fn, tx)), donate_argnums=0)
    state, metrics = first_step(state, batch, key)      # then train_step from the second on

The package, by concern: `formats` (E4M3 / E5M2, quantise, the scale for an amax), `state` (the
per-site state and what a step does with it), `scope` (the context the loss is traced in, and
`init_state`), `names` (site names), `matmul` (the fp8 `dot_general`), `extension` (the state as
an extension of the train step: `jamp.extension`).
"""

from jamp.fp8.formats import (
    CARRIER,
    E4M3,
    E5M2,
    MATMUL_MARKER,
    RECIPES,
    ROWS,
    carrier,
    dequantize,
    is_fp8,
    quantize,
    scale_for,
)
from jamp.fp8.matmul import dot_general
from jamp.fp8.names import former_names, renamed, site_name
from jamp.fp8.scope import head_is_outside, head_outside, init_state, scaling, site_counts
from jamp.fp8.state import (
    Fp8State,
    Site,
    calibrating,
    carry_over,
    check_recipe,
    combine,
    measuring,
    metrics,
    pmax,
    representative,
    saturation,
    update,
    uses_state,
)

__all__ = [
    "CARRIER",
    "E4M3",
    "E5M2",
    "MATMUL_MARKER",
    "RECIPES",
    "ROWS",
    "Fp8State",
    "Site",
    "calibrating",
    "carrier",
    "carry_over",
    "check_recipe",
    "combine",
    "dequantize",
    "dot_general",
    "former_names",
    "head_is_outside",
    "head_outside",
    "init_state",
    "is_fp8",
    "measuring",
    "metrics",
    "pmax",
    "quantize",
    "renamed",
    "representative",
    "saturation",
    "scale_for",
    "scaling",
    "site_counts",
    "site_name",
    "update",
    "uses_state",
]
