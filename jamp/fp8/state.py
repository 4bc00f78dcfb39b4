"""The per-site delayed-scaling state a train step threads (`Fp8State`), and what a step does
with it: combine and agree observations, update, measure, report."""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Self, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jamp.fp8.formats import _F32, _FMAX, RECIPES, ROWS, _max_last, scale_for

_NUM = re.compile(r"(\d+)")


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
