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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Self, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jamp import jax_compat, mixed_ops, scopes

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
#: In an autocast program, this "compute dtype" means: fp8 matmuls, bfloat16 everything else.
MATMUL_MARKER = E4M3
#: The dtype carried between matmuls under an fp8 policy.
CARRIER = np.dtype(jnp.bfloat16)
RECIPES = ("current", "delayed")
#: Rows of a site's state: the activation (lhs), the weight (rhs), the incoming gradient.
ROWS = ("x", "w", "g")
_FMAX = np.array([448.0, 448.0, 57344.0], np.float32)
_F32 = np.dtype(np.float32)
# A scale from a tiny (or subnormal) amax must stay finite.
_SCALE_CAP = 2.0**100


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the autocast marker for fp8 matmuls."""
    return dtype is not None and np.dtype(dtype) == MATMUL_MARKER


def carrier(dtype):
    """The dtype an autocast program computes in between matmuls: bfloat16 for the fp8 marker."""
    return CARRIER if is_fp8(dtype) else dtype


# ----- formats


def quantize(x: jax.Array, scale, dtype) -> jax.Array:
    """`x * scale` in fp8 `dtype`, finite values saturated to its range, inf / NaN kept non-finite.

    Rounding is to nearest, ties to even (XLA's conversion); a finite value beyond the range
    becomes +-fmax rather than NaN (E4M3) or inf (E5M2). A non-finite `x` stays non-finite
    (E4M3 has no infinity: inf becomes NaN there).
    """
    fmax = float(jnp.finfo(dtype).max)
    y = x.astype(_F32) * jnp.asarray(scale, _F32)
    y = jnp.where(jnp.isfinite(x), jnp.clip(y, -fmax, fmax), y)
    return y.astype(dtype)


def dequantize(q: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    """The values `q` stands for: `q / scale`, in `dtype`."""
    return (q.astype(_F32) / jnp.asarray(scale, _F32)).astype(dtype)


def scale_for(amax, fmax, margin: float = 0.0, fallback=1.0):
    """`fmax / (amax * 2**margin)`; `fallback` where amax is zero or not finite."""
    amax = jnp.asarray(amax, _F32)
    ok = jnp.isfinite(amax) & (amax > 0)
    scale = jnp.asarray(fmax, _F32) / (jnp.where(ok, amax, 1.0) * np.float32(2.0**margin))
    return jnp.where(ok, jnp.minimum(scale, _SCALE_CAP), jnp.asarray(fallback, _F32))


#: The longest axis `_max_last` takes as elementwise maxima.
_UNROLLED_MAX = 64


def _amax(x) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(_F32))) if x.size else jnp.zeros((), _F32)


def _max_last(x) -> jax.Array:
    """The maximum over the last axis of a small array (a site's history, its three rows), as
    elementwise maxima of its slices: XLA:GPU fuses those into the kernel that reads the result,
    where a reduction is a kernel of its own (GPT-2 small's fp8 step, history 16, on the H200
    program: 2311 -> 1795 kernels). The same values: a maximum is exact. A long axis (a history
    of hundreds) stays a reduction."""
    if x.shape[-1] > _UNROLLED_MAX:
        return jnp.max(x, axis=-1)
    return functools.reduce(jnp.maximum, [x[..., i] for i in range(x.shape[-1])])


# ----- the state


@struct.dataclass
class Site:
    """One matmul site's scaling state: rows x (activation), w (weight), g (gradient).

    Attributes:
      amax_history: f32[3, history], newest first.
      scale: f32[3], the scales the next step quantises with (delayed recipe).
    """

    amax_history: jax.Array
    scale: jax.Array


@struct.dataclass
class Fp8State:
    """The scaling state of every fp8 matmul site of a program, a pytree for `TrainState`.

    Attributes:
      sites: site name (its module's params path and `dot_general`, `dot_general_1`, ...; see
        `site_name`) -> `Site`.
      recipe: "delayed" (quantise with the state's scales) or "current" (quantise with this
        step's amax; the state only records, for metrics).
      margin: scales are `fmax / (amax * 2**margin)`.
    """

    sites: dict
    recipe: str = struct.field(pytree_node=False, default="delayed")
    margin: float = struct.field(pytree_node=False, default=0.0)

    if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for type checkers

        def replace(self, **updates: Any) -> Self: ...

    @property
    def history(self) -> int:
        """The amax history length (0 for a state without sites)."""
        site = next(iter(self.sites.values()), None)
        return 0 if site is None else int(np.shape(site.amax_history)[1])


def _new_site(history: int) -> Site:
    return Site(jnp.zeros((3, history), _F32), jnp.ones((3,), _F32))


def check_recipe(recipe: str, history: int, margin: float) -> None:
    """Raises ValueError (one line, naming the argument and what it accepts) for a bad value."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if not isinstance(history, int) or isinstance(history, bool) or history < 1:
        raise ValueError(f"history (of amaxes) must be an int >= 1, got {history!r}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0 <= margin <= 64:
        raise ValueError(f"margin must be a number from 0 to 64 (powers of two), got {margin!r}")


def init_state(
    fn: Callable, *args, recipe: str = "delayed", history: int = 16, margin: float = 0.0, **kwargs
) -> Fp8State:
    """The scaling state for every fp8 matmul site that `fn(*args, **kwargs)` traces.

    `fn` is what the train step differentiates, typically its `loss_fn` on a batch; it is traced
    abstractly (nothing runs). Sites are the fp8 `dot_general`s the wrapped model runs directly,
    in `jit`s and in `remat`s, one set per application of the model; those inside the model's
    loop or branch bodies (`nn.scan`, `while`, `cond`), custom-derivative functions and `vmap`s
    run once per iteration (example) or not at all, so one state cannot describe them: they use
    current scaling. A loss that loops over the model itself (`lax.scan` / `lax.map` around
    `model.apply`) sums a site's amaxes over the iterations (scales too small by that factor:
    safe from overflow, less precise at the bottom of the range): use the step's
    `accumulation_steps` for microbatches instead.

    Args:
      fn, args, kwargs: the function and example arguments (arrays or ShapeDtypeStructs).
      recipe: "delayed" or "current" (the state then only records amaxes, for metrics).
      history: how many steps of amax the delayed recipe remembers (current: 1).
      margin: scales are `fmax / (amax * 2**margin)`.

    Returns:
      An `Fp8State` with one `Site` per site, scales 1 and an empty (zero) history.
    """
    check_recipe(recipe, history, margin)
    found: list[str] = []
    token = _ACTIVE.set(_Scope(None, found))
    try:
        # A new function each time: eval_shape caches its trace by the function, and a cached
        # trace finds no sites (a second state for the same loss came out empty).
        jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
    length = history if recipe == "delayed" else 1
    return Fp8State({name: _new_site(length) for name in found}, recipe, float(margin))


@dataclasses.dataclass
class _Scope:
    state: Optional[Fp8State]
    found: Optional[list]  # site names, when `init_state` collects them
    # One tally of site names for every wrapped call traced in the scope: a model applied twice
    # in one loss has two sets of sites, not one whose amaxes would add up.
    counts: dict = dataclasses.field(default_factory=dict)
    reached: set = dataclasses.field(default_factory=set)
    # id(activation) -> (the activation, its amax, its scale); see `_x_scale`.
    first_reader: dict = dataclasses.field(default_factory=dict)
    # A delayed row with no amax recorded yet is scaled by the tensor's own (see `scaling`).
    own_when_unmeasured: bool = False
    # Under `former_names`: former name -> name, and the former names' tally.
    former: Optional[dict] = None
    former_counts: dict = dataclasses.field(default_factory=dict)

    def check_reached(self) -> None:
        """Raises ValueError when the loss traced in this scope left some of the state's sites
        unread: their scales would never update, silently."""
        if self.state is None or not self.state.sites:
            return
        missed = [name for name in self.state.sites if name not in self.reached]
        if missed:
            raise ValueError(
                f"jamp.fp8: the loss reached {len(self.state.sites) - len(missed)} of the fp8 "
                f"state's {len(self.state.sites)} matmul sites (not {missed[0]!r}): build the "
                "state with jamp.fp8.init_state from the same loss function, and do not call a "
                "jax.jit-compiled model inside the loss (a jit cache does not see the fp8 state)"
            )


def site_counts(fallback: dict) -> dict:
    """The site-name tally of the active `scaling` / `init_state` scope, else `fallback`."""
    scope = _ACTIVE.get()
    return fallback if scope is None else scope.counts


_ACTIVE: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar(
    "jamp_fp8_scope", default=None
)


@contextlib.contextmanager
def scaling(state: Optional[Fp8State], own_when_unmeasured: bool = False):
    """While a function is traced in this context, its fp8 matmuls read their scales from `state`
    (delayed recipe) and report this step's amaxes through the derivative with respect to it.

    With `own_when_unmeasured`, a delayed site's operand with no amax recorded yet is scaled by
    its own amax: for an evaluation, which nothing measures (a train step instead skips a fresh
    state's first step, `measuring`, and so keeps every reduction from standing before a
    quantisation).

    Yields the scope; its `check_reached()` says whether the traced function reached every site.
    """
    scope = _Scope(state, None, own_when_unmeasured=own_when_unmeasured)
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


_HEAD_OUTSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jamp_fp8_head_outside", default=False
)


@contextlib.contextmanager
def head_outside():
    """While a wrapped model is traced in this context, its output head is not in its program:
    the model returns its last hidden states and the head is applied outside it
    (`jamp.losses.fused_linear_cross_entropy`). Its last matmul (the last block's) is then fp8
    like the others, where by default a program's last matmul is taken for the head and stays
    bfloat16."""
    token = _HEAD_OUTSIDE.set(True)
    try:
        yield
    finally:
        _HEAD_OUTSIDE.reset(token)


def head_is_outside() -> bool:
    """Whether a trace is in `head_outside`."""
    return _HEAD_OUTSIDE.get()


def uses_state(state: Any) -> bool:
    """Whether `state` is an `Fp8State` with sites (a train step then threads it)."""
    return isinstance(state, Fp8State) and bool(state.sites)


def carry_over(fresh: Fp8State, old: Fp8State) -> Fp8State:
    """`fresh`'s sites (a program whose site set changed: adaptive precision moved a module out
    of fp8, or back) with the histories and scales of those `old` had, as they were; new sites as
    in `fresh`; sites `fresh` lacks are dropped."""
    sites = {name: old.sites.get(name, site) for name, site in fresh.sites.items()}
    return old.replace(sites=sites)


def combine(a: Fp8State, b: Fp8State) -> Fp8State:
    """Two steps' (microbatches') observations as one: the elementwise max."""
    return jax.tree.map(jnp.maximum, a, b)


def pmax(observed: Fp8State, axis_name: str) -> Fp8State:
    """Observations agreed by every replica: the max over `axis_name`."""
    return jax.tree.map(lambda x: lax.pmax(x, axis_name), observed)


def update(state: Fp8State, observed: Fp8State) -> Fp8State:
    """The state after a step whose observations (the derivative w.r.t. the state) are `observed`.

    Pseudo-code, per site and row::

        history = [amax_now] + history[:-1]
        scale = fmax / (max(history) * 2**margin)     # unchanged while the history is all zero
    """

    def one(site: Site, seen: Site) -> Site:
        history = _roll_in(site.amax_history, seen.amax_history[:, 0])
        scale = scale_for(_max_last(history), _FMAX, state.margin, site.scale)
        return Site(history, scale)

    sites = {name: one(site, observed.sites[name]) for name, site in state.sites.items()}
    return state.replace(sites=sites)


def _roll_in(history: jax.Array, now: jax.Array) -> jax.Array:
    """`[now] + history[:-1]` along the last axis, as a select over a padded shift: elementwise,
    so XLA:GPU fuses every site's update (and the skip's select) into a few kernels, where a
    concatenate makes one kernel per site (GPT-2 small: 144 kernels for 72 sites)."""
    column = lax.broadcasted_iota(jnp.int32, history.shape, history.ndim - 1)
    shifted = jnp.pad(history[..., :-1], [(0, 0)] * (history.ndim - 1) + [(1, 0)])
    return jnp.where(column == 0, now[..., None], shifted)


def measuring(state: Optional[Fp8State]) -> jax.Array:
    """Whether a step under `state` only measures: a delayed state that has recorded no amax yet
    (the newest amax of every site is zero, as `init_state` makes it). Its scales are the initial
    ones, 1, not fitted to any tensor: `make_train_step` records that step's amaxes and skips it,
    like an overflow (a hand-written step should discard its update too). Its amaxes are those
    of a step quantised by scales of 1: one taken with `calibrating` instead records each
    tensor's true amax and is applied. False for the current recipe, which quantises with each
    tensor's own amax, and without a state."""
    if state is None or not state.sites or state.recipe != "delayed":
        return jnp.zeros((), jnp.bool_)
    newest = functools.reduce(jnp.maximum, [s.amax_history[:, 0] for s in state.sites.values()])
    return _max_last(newest) == 0


def calibrating(train_step: Callable) -> Callable:
    """`train_step` (from `jamp.make_train_step`: `(state, *args) -> (state, metrics)`, its
    state a `TrainState`) taking its step with every fp8 matmul of a delayed state quantised by
    its tensor's own amax, as the current recipe does, and the amaxes recorded into the state's
    histories and scales as a delayed step records them.

    For a step where some site has no history yet: a fresh state's first step (which the plain
    step would skip, having quantised by scales of 1: see `measuring`), or the step after sites
    joined the state (`carry_over` adds them fresh: the plain step would quantise them by scales
    of 1 and apply the update). Each tensor's amax then stands before its quantisation (a
    reduction and a wait per operand: a slower step, and a second compilation), so take it for
    that one step and go on with `train_step`. A state without sites, or of the current recipe,
    steps as `train_step` does.
    """

    @functools.wraps(train_step)
    def step(state, *args, **kwargs):
        f8 = getattr(state, "fp8_state", None)
        if not uses_state(f8) or f8.recipe != "delayed":
            return train_step(state, *args, **kwargs)
        current = state.replace(fp8_state=f8.replace(recipe="current"))
        new_state, metrics = train_step(current, *args, **kwargs)
        return new_state.replace(fp8_state=new_state.fp8_state.replace(recipe=f8.recipe)), metrics

    return step


def saturation(state: Fp8State, observed: Fp8State) -> dict:
    """`{site: f32[3]}`: for x, w and g, how far past its format's largest value this step's amax
    went under the scale the step quantised with, `amax * scale / fmax` (above 1: values were
    clipped to +-fmax, by that factor at the most). Meaningful for the delayed recipe; 0 on a
    measuring step (`measuring`: scales of 1, fitted to no tensor) and for the current recipe
    (each tensor is quantised with its own amax).

    One `[3]` per site, not its maximum: XLA:GPU computes those beside the scales' update, in
    its kernels, where a scalar per site was a kernel per site (72 in GPT-2 small's step)."""
    if state.recipe != "delayed":
        return {name: jnp.zeros((len(ROWS),), _F32) for name in state.sites}
    off = measuring(state)
    return {
        name: jnp.where(off, 0.0, observed.sites[name].amax_history[:, 0] * site.scale / _FMAX)
        for name, site in state.sites.items()
    }


def metrics(state: Fp8State, names: Optional[Sequence[str]] = None) -> dict:
    """`{site: {"x_amax", "x_scale", "w_amax", ...}}` (the newest amax) for `names` (default all)."""
    out = {}
    for name in state.sites if names is None else names:
        site = state.sites[name]
        out[name] = {
            f"{row}_{what}": value[i]
            for i, row in enumerate(ROWS)
            for what, value in (("amax", site.amax_history[:, 0]), ("scale", site.scale))
        }
    return out


def representative(state: Fp8State, count: int = 3) -> list[str]:
    """Up to `count` site names spread evenly over the sorted names (pytrees keep dicts sorted):
    for a stack of blocks, the first block's, a middle one's and the last one's."""
    # In natural order: Block_2 before Block_10.
    names = sorted(state.sites, key=lambda n: [int(t) if t.isdigit() else t for t in _NUM.split(n)])
    if len(names) <= count:
        return names
    picks = sorted({round(i * (len(names) - 1) / (count - 1)) for i in range(count)})
    return [names[i] for i in picks]


# ----- site names

_TAGS = re.compile(r"jamp_policy_\d+_/?")
_NUM = re.compile(r"(\d+)")


def site_name(name_stack: str, counts: dict, calls: Optional[scopes.LinenCalls] = None) -> str:
    """A stable name for the next `dot_general` at `name_stack`: the params path of the module it
    runs in, "Block_0/SelfAttention_0/query/dot_general" (then "..._1" for a second one there;
    "dot_general" for the model's own), as `variables["params"]` nests the module: without the
    model's class name, a module re-entering its own method (`nn.SelfAttention`) once. `calls`:
    the linen module calls recorded while the program was traced (`jamp.scopes.LinenCalls`),
    which say that path; a `jamp.wrap`ped NNX model's scopes say it themselves
    ("blocks/0/mlp_in/dot_general"). Outside any module (`jamp.autocast` of a plain function)
    the name stack's own scopes name it ("encoder/proj/dot_general"). `counts` is the trace's
    running tally.

    Under `former_names`, the name jamp gave the site before (`_former_base`) is noted too."""
    stack = _TAGS.sub("", name_stack).strip("/")
    path = scopes.nnx_path(stack)
    if path is None and calls is not None:
        path = scopes.linen_path(stack, calls)
    if path is None:
        path = stack
    name = _numbered(f"{path}/dot_general" if path else "dot_general", counts)
    scope = _ACTIVE.get()
    if scope is not None and scope.former is not None:
        scope.former.setdefault(_numbered(_former_base(stack), scope.former_counts), name)
    return name


def _numbered(base: str, counts: dict) -> str:
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}_{index}"


def _former_base(stack: str) -> str:
    """The name a site at `stack` (tags removed) had before site names were params paths, less
    its index: the name stack as linen spells it, the model's class name on top and a module
    re-entering its own method twice ("TransformerLM/Block_0/SelfAttention_0/SelfAttention_0/
    query/dot_general"); a wrapped NNX model's under its class name ("TransformerLM/blocks/0/
    mlp_in/dot_general")."""
    plain = scopes.plain(stack)
    return f"{plain}/dot_general" if plain else "dot_general"


def former_names(fn: Callable, *args, **kwargs) -> dict[str, str]:
    """`{former name: name}` for the fp8 sites that `fn(*args, **kwargs)` traces (as for
    `init_state`): the name each had before site names became params paths
    ("TinyTransformer/Block_0/SelfAttention_0/SelfAttention_0/query/dot_general" ->
    "Block_0/SelfAttention_0/query/dot_general"), one to one. A state stored under the former
    names is restored under the current ones with `renamed`."""
    former: dict[str, str] = {}
    token = _ACTIVE.set(_Scope(None, None, former=former))
    try:
        jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
    return former


def renamed(state: Fp8State, names: dict[str, str]) -> Fp8State:
    """`state` with each site named `names[site]` where `names` (`former_names`) has it.

    Raises ValueError where two sites would get one name (a state holding both spellings)."""
    sites: dict = {}
    for name, site in state.sites.items():
        new = names.get(name, name)
        if new in sites:
            raise ValueError(f"jamp.fp8: two sites of the state are both named {new!r} now")
        sites[new] = site
    return state.replace(sites=sites)


# ----- the fp8 matmul


def _dot(lhs, rhs, dims):
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=_F32)


def _observed_site(site: Site, amaxes) -> Site:
    """The derivative handed back for `site`: this use's amaxes in the newest history column.

    Placed by selects over the array's indices, not stacked: a stack of the three is a
    concatenate, which XLA:GPU makes a kernel per site wherever it is read alone."""
    row = lax.broadcasted_iota(jnp.int32, site.scale.shape, 0)
    ax, aw, ag = (jnp.asarray(a, _F32) for a in amaxes)
    newest = jnp.where(row == 0, ax, jnp.where(row == 1, aw, ag))
    history = _roll_in(jnp.zeros_like(site.amax_history), newest)
    return Site(history, jnp.zeros_like(site.scale))


def _placed(q, placed: Optional[mixed_ops.Placed]):
    """A quantised sharded operand, on its own shards and then where the matmul reads it: the
    gather moves fp8 (one byte per value), as `mixed_ops.Placed` describes for 16 bits."""
    if placed is None:
        return q
    q = lax.with_sharding_constraint(q, placed.sharding)
    return q if placed.gathered is None else lax.with_sharding_constraint(q, placed.gathered)


def _grad_to(d, like_dtype, placed: Optional[mixed_ops.Placed]):
    """A gradient in its operand's dtype; a sharded operand's is summed across devices in the
    reduce dtype, onto the operand's own shards."""
    if placed is None:
        return d.astype(like_dtype)
    d = lax.with_sharding_constraint(d.astype(placed.reduce_dtype), placed.sharding)
    return d.astype(like_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _f8_dot(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep):
    return _f8_fwd(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep)[0]


#: How an fp8 matmul scales its operands: the tensor's own amax; the state's scale; the state's
#: scale where that operand has a recorded amax, else its own (`scaling(own_when_unmeasured)`).
_CURRENT, _DELAYED, _DELAYED_OR_OWN = "current", "delayed", "delayed_or_own"


def _scale(site: Site, row: int, amax, mode: str, margin: float):
    """The scale of one operand, by `mode` (`_CURRENT`, `_DELAYED`, `_DELAYED_OR_OWN`).

    Delayed, nothing of this step's amax reaches the quantisation, so XLA computes the amax
    recorded for the next step in the kernel that quantises (one pass over the tensor); a
    fallback to the tensor's own amax, even behind a `lax.cond`, becomes a select that waits for
    the full reduction (four kernels per operand instead of two on the H200 program)."""
    if mode == _DELAYED:
        return site.scale[row]
    own = scale_for(amax(), _FMAX[row], margin)
    if mode == _CURRENT:
        return own
    return jnp.where(_max_last(site.amax_history[row]) > 0, site.scale[row], own)


def _x_scale(scope: Optional[_Scope], lhs, entry: Site, shared: bool, mode, margin):
    """The activation's amax and scale, outside the matmul's derivative (both are constants to
    it): once per activation in a trace when `shared`, for every site that reads it.

    q, k and v read one normalised input, gate and up another. Each such site records the same
    amax of it, so their activation histories and scales are equal, and the first reader's serve
    them all: the quantisations become one computation, which XLA merges into one fp8 copy kept
    for the backward pass (one per site before: three for q, k, v), and, under sharding, one
    all-reduce of the amax instead of one per site (XLA cannot merge collectives).
    """
    if shared:
        assert scope is not None  # shared only with a scope's state
        held = scope.first_reader.get(id(lhs))
        if held is not None and held[0] is lhs:
            return held[1:]
    x = lax.stop_gradient(lhs)
    ax = _amax(x)
    sx = _scale(jax.tree.map(lax.stop_gradient, entry), 0, lambda: _amax(x), mode, margin)
    if shared:
        assert scope is not None
        scope.first_reader[id(lhs)] = (lhs, ax, sx)
    return ax, sx


def _f8_fwd(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep):
    aw = _amax(rhs)
    sw = _scale(site, 1, lambda: _amax(rhs), mode, margin)
    xq = _placed(quantize(lhs, sx, E4M3), placed[0])
    wq = _placed(quantize(rhs, sw, E4M3), placed[1])
    out = (_dot(xq, wq, dims) * (1.0 / (sx * sw))).astype(out_dtype)
    like = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    # The backward's activation operand: its fp8 copy, or (`keep`) the 16-bit activation itself
    return out, (lhs if keep else xq, wq, sx, sw, ax, aw, site, like)


def _f8_bwd(dims, out_dtype, mode, margin, placed, keep, residuals, g):
    del out_dtype
    xq, wq, sx, sw, ax, aw, site, (lhs_like, rhs_like) = residuals
    if keep:
        # Quantised again, to the forward's very values. The barrier keeps XLA from merging this
        # with the forward's quantisation, which would keep that fp8 copy until here after all,
        # and, holding `g`, from quantising before this gradient exists (with the scale from the
        # state, XLA scheduled every layer's copy at once: 12 x 6 MiB more at GPT-2 small's peak).
        # (The scale stays out: a barrier's operand is a buffer, a kernel per layer to slice.)
        x, g = lax.optimization_barrier((xq, g))
        xq = quantize(x, sx, E4M3)
    ag = _amax(g)
    sg = _scale(site, 2, lambda: _amax(g), mode, margin)
    gq = quantize(g, sg, E5M2)
    (l_dims, l_perm), (r_dims, r_perm) = mixed_ops.backward_dims(dims, xq.ndim, wq.ndim, g.ndim)
    d_lhs = lax.transpose(_dot(gq, wq, l_dims) * (1.0 / (sg * sw)), l_perm)
    d_rhs = lax.transpose(_dot(xq, gq, r_dims) * (1.0 / (sx * sg)), r_perm)
    return (
        _grad_to(d_lhs, lhs_like.dtype, placed[0]),
        _grad_to(d_rhs, rhs_like.dtype, placed[1]),
        _observed_site(site, (ax, aw, ag)),
        jnp.zeros_like(ax),
        jnp.zeros_like(sx),
    )


_f8_dot.defvjp(_f8_fwd, _f8_bwd)


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    out_dtype,
    site: Optional[str] = None,
    placed=(None, None),
    *,
    keep_lhs: bool = False,
):
    """`lax.dot_general` with E4M3 operands forward, E5M2 gradients backward, fp32 accumulation.

    Args:
      lhs, rhs: floating arrays of any dtype (the activation and the weight).
      dimension_numbers: as for `lax.dot_general`.
      out_dtype: dtype of the result.
      site: this matmul's site name, or None (a matmul no state can describe). Under `scaling`,
        a site the state holds is scaled by the state's recipe and reports its amaxes; any other
        uses current scaling. Under `init_state`, the name is collected.
      placed: per operand, a `jamp.mixed_ops.Placed` (a sharded parameter: quantised on its
        shards, gathered in fp8, its gradient reduced in the reduce dtype) or None.
      keep_lhs: `lhs` is a 16-bit value that the backward pass keeps anyway (a fused attention's
        output, which cuDNN's backward reads): keep it rather than a second, fp8 copy of it, and
        quantise it again in the backward pass (to the same values). Ignored for a float32 or
        sharded `lhs`, whose fp8 copy is the smaller one to keep.

    Returns:
      The product, in `out_dtype`; gradients come back in `lhs.dtype` and `rhs.dtype`.
    """
    dims = tuple(tuple(tuple(int(d) for d in axes) for axes in pair) for pair in dimension_numbers)
    scope = _ACTIVE.get()
    if jax_compat.is_batched(lhs) or jax_compat.is_batched(rhs):
        # Under vmap (a model applied per example) one site runs once per example: amaxes would
        # add up in the state, so it scales each example by its own amax, statelessly.
        site = None
    if scope is not None and scope.found is not None and site is not None:
        scope.found.append(site)
    state = scope.state if scope is not None else None
    shared = False
    if state is not None and site in state.sites:
        assert scope is not None  # the state is the scope's
        scope.reached.add(site)
        mode, margin, entry = _CURRENT, state.margin, state.sites[site]
        if state.recipe == "delayed":
            mode = _DELAYED_OR_OWN if scope.own_when_unmeasured else _DELAYED
        shared = True
    else:
        mode, margin, entry = _CURRENT, 0.0 if state is None else state.margin, _new_site(1)
    ax, sx = _x_scale(scope, lhs, entry, shared, mode, float(margin))
    keep = bool(keep_lhs) and placed[0] is None and np.dtype(lhs.dtype).itemsize == 2
    return _f8_dot(
        lhs,
        rhs,
        entry,
        ax,
        sx,
        dims,
        np.dtype(out_dtype),
        mode,
        float(margin),
        tuple(placed),
        keep,
    )
