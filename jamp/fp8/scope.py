"""The context a loss is traced in: which state the fp8 matmuls read (`scaling`), the sites a
function traces (`init_state`), and whether the output head is outside the model."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Optional

import jax

from jamp.fp8.state import Fp8State, _new_site, check_recipe


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
