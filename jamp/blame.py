"""Which modules one step's overflow record blames: what adaptive precision (`jamp.adaptive`,
which re-exports these functions) counts, step by step, before it promotes a module to a wider
dtype. Pure host-side functions of one step's metrics: no model, no tracing.

`blame` reduces one step's record to the modules it blames:

* a forward overflow (some module's output non-finite: the flags of
  `jamp.inspect.overflow.output_flags`) blames the module where it began, the first in call
  order whose output was non-finite;
* otherwise, a backward overflow (some modules' gradients non-finite,
  `metrics["grads_finite_by_module"]`, others finite) blames the last overflowed module in call
  order, and, when the modules before it overflowed too (a non-finite input gradient flows back
  into all of them), also the module after it, whose backward may have made that gradient: at
  most one module more than necessary. When every module's gradients overflowed with a finite
  forward pass, the loss scale was too large and finding a smaller one is the loss scale's job:
  nothing is blamed.

Under an fp8 policy, a module is also blamed on any step where one of its fp8 matmuls had values
clipped: its amax went more than `SATURATION_LIMIT` times past E4M3's (or, for the gradient,
E5M2's) largest value under the delayed scale it was quantised with (`saturated`, from the step's
`jamp.fp8.saturation` metric). Saturation does not skip a step, it loses the top of the range
quietly, so it is counted whether or not the step was skipped.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

#: An fp8 site whose amax went more than this factor past its format's largest value under the
#: delayed scale it was quantised with (`jamp.fp8.saturation`) had values clipped by more than a
#: binade: it is blamed like an overflow. Healthy delayed-scaling runs pass 1 on most steps (a
#: growing tensor sets a new maximum) and 2 about once in 200-300 steps per site
#: (`python -m jamp.train`, digits and lm_pydoc under mixed_fp8), never 6 times in 50.
SATURATION_LIMIT = 2.0


def site_module(site: str, modules: Sequence[str]) -> str:
    """The module an fp8 site belongs to: the site's name is its module's params path
    (`jamp.fp8.site_name`: "Block_0/SelfAttention_0/query/dot_general_1"), that module where
    `modules` holds it, else the nearest of `modules` enclosing it; "" (the model itself) when
    none does ("dot_general": the model's own matmul; a site of `jamp.autocast`'s scopes)."""
    parts = site.split("/")[:-1]
    for end in range(len(parts), 0, -1):
        if "/".join(parts[:end]) in modules:
            return "/".join(parts[:end])
    return ""


def saturated(
    saturation: Mapping[str, Any], modules: Sequence[str], limit: float = SATURATION_LIMIT
) -> tuple[str, ...]:
    """The modules whose fp8 sites were clipped past `limit` on one step (`saturation`: the
    step's `{site: ratios}`, one per operand, `jamp.fp8.saturation`; a scalar per site is read
    the same); a non-finite ratio is an overflow, which `blame` handles."""
    out = []
    for site, ratio in saturation.items():
        ratio = np.asarray(ratio, np.float64)
        if np.all(np.isfinite(ratio)) and np.max(ratio) > limit:
            module = site_module(site, modules)
            if module and module not in out:
                out.append(module)
    return tuple(out)


def blame(
    grads_finite_by_module: Mapping[str, Any],
    forward_finite_by_module: Optional[Mapping[str, Any]] = None,
    order: Optional[Sequence[str]] = None,
) -> tuple[str, ...]:
    """The modules one step's overflow record blames (see the module docstring).

    Args:
      grads_finite_by_module: the step's `{module: finite}` gradient flags (one step's values;
        arrays or numbers, averaged flags count as finite only when exactly 1).
      forward_finite_by_module: `{module path: finite}` of every module's output on the same step
        (`jamp.inspect.overflow.output_flags`), or None where the step did not check them.
      order: module paths in the order their calls finish (`jamp.module_policies`); without it
        the forward flags' own order, and every overflowed gradient group is blamed.

    Returns:
      The blamed module paths: the forward overflow's origin alone; for a backward overflow
      (some gradient groups non-finite, others not) the last overflowed group in call order, and
      when the groups before it overflowed too (a non-finite input gradient flowing back) also
      the module after it, whose backward may have made it; empty when nothing can be blamed.
    """

    def bad(flags):
        return [path for path, ok in flags.items() if not np.all(np.asarray(ok) == 1)]

    if forward_finite_by_module:
        nonfinite = set(bad(forward_finite_by_module))
        if nonfinite:
            ranked = [p for p in (order or forward_finite_by_module) if p in nonfinite]
            ranked += sorted(nonfinite - set(ranked))
            named = [p for p in ranked if p]  # "" is the model itself: the whole model
            return (named[0],) if named else ()
    groups = bad(grads_finite_by_module)
    if not groups or len(groups) == len(grads_finite_by_module):
        return ()
    ranked = [p for p in (order or ()) if p in grads_finite_by_module]
    if len(ranked) < len(grads_finite_by_module):  # no call order for every group
        return tuple(groups)
    # A non-finite cotangent flows back into every module before the one whose backward made it,
    # and that module's own weight gradient may stay finite: blame the last overflowed group in
    # call order and the module after it (the one whose input gradient may have overflowed).
    assert order is not None  # a call order ranked every group
    # The modules at the groups' level (linen's top-level modules; NNX's `blocks/0` ...): those
    # no other called module holds.
    top = [p for p in order if p and not any(p.startswith(q + "/") for q in order if q)]
    last = max(groups, key=ranked.index)
    after = top[top.index(last) + 1 : top.index(last) + 2] if last in top else []
    earlier = ranked[: ranked.index(last)]
    if not any(p in groups for p in earlier):  # it alone: its own weight gradient overflowed
        return (last,)
    return (last, *after)
