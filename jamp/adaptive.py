"""Adaptive precision: a module that keeps overflowing in 16 bits moves, on its own, to a safer
dtype, and only that module.

A dynamic loss scale can only shrink one global scale, so a single fragile module drags the
whole model: each of its overflows skips a step, and an overflow the scale cannot fix (a forward
activation past float16's 65504, or a gradient past it even unscaled) skips every step until the
persistent-overflow stop ends the run. This module decides, from the per-step overflow record the
train step already returns, which modules should compute in a wider dtype, and hands the answer
back as `jamp.wrap` overrides. It is pure host-side bookkeeping: no model, no tracing.

One step's record is reduced to the modules it *blames* (`blame`):

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

`Controller.decide` then promotes a module one rung up its ladder (float16 -> bfloat16 where the
platform runs bfloat16 matmuls natively, else float32; fp8 -> bfloat16; bfloat16 -> float32) when

* it was blamed on at least `k` of the last `n` steps, or
* it was blamed on a skipped step with the loss scale already at its floor (the scale cannot back
  off any further, so every later step would be skipped the same way).

Optionally (`demote_after=m`) a promoted module moves one rung back down after `m` consecutive
steps without blame (hysteresis; off by default). A module blamed while already in float32 cannot
be promoted: `Controller.exhausted` names such modules (then the overflow is in the data or the
model, not in the number format).

The state (`AdaptiveState`) is a pytree of small arrays with a structure fixed by the module list,
so it can live in a `TrainState` and be checkpointed and restored bit-exactly.

Pseudo-code::

  observe(state, step, skipped, at_floor, blamed):   # every step
    history[step % n] = blamed (all False on a finite step);  clean = 0 where blamed, else +1
    floor_blamed |= blamed and at_floor
  decide(state, step):                               # at fixed steps
    for each module m:
      if rung[m] < top and (sum(history[:, m]) >= k or floor_blamed[m]):
        rung[m] += 1;  history[:, m] = False;  a Change(step, m, old, new, reason)
      elif demote_after and rung[m] > 0 and clean[m] >= demote_after:
        rung[m] -= 1;  history[:, m] = False
    floor_blamed = False

Example::

  ctl = Controller(policy, modules=["Conv_0", "Dense_0", "Dense_1"])
  state = ctl.init()
  blamed = blame(metrics["grads_finite_by_module"], metrics.get("forward_finite_by_module"))
  state = ctl.observe(state, step, skipped=not metrics["grads_finite"],
                      at_floor=loss_scale_at_floor, blamed=blamed)
  state, changes = ctl.decide(state, step)
  if changes:
      model = jamp.wrap(flax_model, policy, overrides=ctl.overrides(state))  # re-jit the step
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import zlib
from typing import TYPE_CHECKING, Any, Mapping, Optional, Self, Sequence

import jax.numpy as jnp
import jmp
import numpy as np
from flax import struct

from jamp import hardware, precision

#: Defaults, chosen from healthy float16 runs (experiments/adaptive_precision.py): a dynamic
#: loss scale's search at the start of a run or after a growth skips at most a few steps in a row,
#: never 6 of 50 for one module; a fragile module is blamed on every step.
DEFAULT_K = 6
DEFAULT_N = 50

#: Why a module changed dtype, as stored in `AdaptiveState.reason`.
REASONS = (
    "",
    "overflowed on {k} of the last {n} steps",
    "overflowed with the loss scale at its floor",
    "no overflow for {m} steps",
    "overflowed or saturated its fp8 range on {k} of the last {n} steps",
)

#: An fp8 site whose amax went more than this factor past its format's largest value under the
#: delayed scale it was quantised with (`jamp.fp8.saturation`) had values clipped by more than a
#: binade: it is blamed like an overflow. Healthy delayed-scaling runs pass 1 on most steps (a
#: growing tensor sets a new maximum) and 2 about once in 200-300 steps per site
#: (`python -m jamp.train`, digits and lm_pydoc under mixed_fp8), never 6 times in 50.
SATURATION_LIMIT = 2.0


@struct.dataclass
class AdaptiveState:
    """The controller's state: a pytree of small arrays (checkpointable, restorable bit-exactly).

    Attributes:
      rung: int32[M], each module's step up its ladder (0: the policy's own compute dtype).
      history: bool[n, M], which modules were blamed on each of the last n steps (row step % n).
      clean: int32[M], consecutive observed steps each module went without blame.
      changed_at: int32[M], the step of each module's last change (-1: never changed).
      reason: int32[M], why it changed last (an index into `REASONS`).
      floor_blamed: bool[M], blamed on a skipped step at the loss scale's floor since the last
        decision.
      fingerprint: int32, a checksum of the module paths: a restored state made for another model
        (other modules, or the same number in another order) is refused by `Controller.check`.
      modules: the module paths, in the order of the arrays (static).
    """

    rung: Any
    history: Any
    clean: Any
    changed_at: Any
    reason: Any
    floor_blamed: Any
    fingerprint: Any
    modules: tuple[str, ...] = struct.field(pytree_node=False, default=())

    if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for type checkers

        def replace(self, **updates: Any) -> Self: ...


@dataclasses.dataclass(frozen=True)
class Change:
    """One module moving to another compute dtype."""

    step: int  # the last step observed before the change; the change applies from the next one
    module: str
    from_dtype: str
    to_dtype: str
    reason: str

    def describe(self) -> str:
        return (
            f"step {self.step}: {self.module} now computes in {self.to_dtype} "
            f"(was {self.from_dtype}): {self.reason}"
        )


def ladder(compute_dtype, *, bf16_fast: Optional[bool] = None) -> tuple[np.dtype, ...]:
    """The dtypes a module computing in `compute_dtype` moves through, starting with it.

    float16 goes to bfloat16 (same speed class, float32's range) where `bf16_fast` (default: the
    platform runs bfloat16 matmuls natively, `jamp.hardware.support`), else straight to float32;
    fp8 goes to bfloat16; everything ends in float32.
    """
    dtype = np.dtype(compute_dtype)
    f32, bf16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
    if dtype == f32:
        return (f32,)
    if dtype == bf16:
        return (bf16, f32)
    if dtype == np.float16:
        if bf16_fast is None:
            bf16_fast = bool(hardware.support(jnp.bfloat16).native)
        return (dtype, bf16, f32) if bf16_fast else (dtype, f32)
    if dtype.itemsize == 1:  # the fp8 formats
        return (dtype, bf16, f32)
    raise ValueError(f"no precision ladder for compute dtype {dtype.name}")


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


class Controller:
    """Decides which modules compute in which dtype from the per-step overflow record.

    Args:
      policy: the run's policy (a `jmp.Policy` or a name `jamp.get_policy` accepts).
      modules: every module path that may be blamed (the forward flags' paths and the gradient
        groups); fixes the state's structure.
      k, n: promote a module blamed on at least `k` of the last `n` observed steps.
      demote_after: move a promoted module back one rung after this many consecutive steps
        without blame; None: never (the default).
      start: `{module path: compute dtype}` for modules that do not start in the policy's compute
        dtype (overrides such as normalization layers in float32); they climb from there.
      bf16_fast: whether float16 modules go to bfloat16 (True) or float32 (False); default: the
        platform's bfloat16 support.
    """

    def __init__(
        self,
        policy,
        modules: Sequence[str],
        *,
        k: int = DEFAULT_K,
        n: int = DEFAULT_N,
        demote_after: Optional[int] = None,
        start: Optional[Mapping[str, Any]] = None,
        bf16_fast: Optional[bool] = None,
    ):
        if not (isinstance(n, int) and isinstance(k, int) and 1 <= k <= n):
            raise ValueError(f"adaptive precision needs integers 1 <= k <= n, got k={k!r}, n={n!r}")
        if demote_after is not None and not (isinstance(demote_after, int) and demote_after >= 1):
            raise ValueError(
                f"demote_after must be a positive integer or None, got {demote_after!r}"
            )

        self.policy = precision.get_policy(policy)
        self.modules = tuple(dict.fromkeys(modules))
        self.k, self.n, self.demote_after = k, n, demote_after
        base = np.dtype(precision.autocast_dtype(self.policy))
        start = {p: np.dtype(d) for p, d in (start or {}).items()}
        self._ladders = [ladder(start.get(m, base), bf16_fast=bf16_fast) for m in self.modules]
        self._index = {m: i for i, m in enumerate(self.modules)}

    def init(self) -> AdaptiveState:
        m = len(self.modules)
        return AdaptiveState(
            rung=np.zeros(m, np.int32),
            history=np.zeros((self.n, m), bool),
            clean=np.zeros(m, np.int32),
            changed_at=np.full(m, -1, np.int32),
            reason=np.zeros(m, np.int32),
            floor_blamed=np.zeros(m, bool),
            fingerprint=self._fingerprint(),
            modules=self.modules,
        )

    def _fingerprint(self) -> np.int32:
        return np.int32(zlib.crc32("\n".join(self.modules).encode()) & 0x7FFFFFFF)

    def check(self, state: AdaptiveState) -> None:
        """Raises ValueError when `state` was made for other modules or another window."""
        if (
            tuple(state.modules) != self.modules
            or np.shape(state.history) != (self.n, len(self.modules))
            or int(state.fingerprint) != int(self._fingerprint())
        ):
            raise ValueError("the adaptive-precision state belongs to another model or window n")

    def _at(self, state: AdaptiveState, i: int) -> np.dtype:
        # A state restored on a machine whose ladder is shorter (no native bf16): its top rung.
        return self._ladders[i][min(int(state.rung[i]), len(self._ladders[i]) - 1)]

    def dtype_of(self, state: AdaptiveState, module: str) -> np.dtype:
        return self._at(state, self._index[module])

    def observe(
        self,
        state: AdaptiveState,
        step: int,
        *,
        skipped: bool,
        at_floor: bool,
        blamed: Sequence[str] = (),
        saturated: Sequence[str] = (),
    ) -> AdaptiveState:
        """Records one step; changes nothing yet (`decide` does).

        Args:
          step: the step's number (its row in the window is `step % n`).
          skipped: whether the step was skipped (its gradients were non-finite).
          at_floor: whether the loss scale was at its floor after the skipped step (it cannot
            back off any further).
          blamed: the module paths `blame` returned for the step; paths the controller does not
            know are ignored.
          saturated: modules whose fp8 matmuls were clipped on the step (`saturated`), blamed
            whether or not the step was skipped; only modules computing in fp8 count.
        """
        overflowed = np.zeros(len(self.modules), bool)
        if skipped:
            for path in blamed:
                if path in self._index:
                    overflowed[self._index[path]] = True
        mask = overflowed.copy()
        for path in saturated:
            i = self._index.get(path)
            if i is not None and self._at(state, i).itemsize == 1:
                mask[i] = True
        history = np.array(state.history)
        history[step % self.n] = mask
        clean = np.where(mask, 0, np.asarray(state.clean) + 1).astype(np.int32)
        # Only an overflow at the floor promotes at once; a clipped fp8 matmul waits for k of n.
        floor = np.asarray(state.floor_blamed) | (overflowed & bool(at_floor))
        return state.replace(history=history, clean=clean, floor_blamed=floor)

    def decide(self, state: AdaptiveState, step: int) -> tuple[AdaptiveState, list[Change]]:
        """Promotes (or demotes) modules from the steps observed so far; returns the new state
        and the changes, which apply from the step after `step`.

        Deciding only at fixed steps (the training program decides every `k` steps and at its
        checkpoints) makes the decisions a function of the steps alone, not of when the host
        happened to read the metrics: a resumed run decides exactly as the original did.
        """
        rung, history = np.array(state.rung), np.array(state.history)
        clean, changed_at = np.array(state.clean), np.array(state.changed_at)
        reason, floor = np.array(state.reason), np.array(state.floor_blamed)
        counts = history.sum(axis=0)
        changes = []
        for i, module in enumerate(self.modules):
            top = len(self._ladders[i]) - 1
            rung[i] = min(rung[i], top)
            if rung[i] < top and counts[i] >= self.k:
                why, move = (4 if self._ladders[i][rung[i]].itemsize == 1 else 1), 1
            elif rung[i] < top and floor[i]:
                why, move = 2, 1
            elif self.demote_after and rung[i] > 0 and clean[i] >= self.demote_after:
                why, move = 3, -1
            else:
                continue
            old = self._ladders[i][rung[i]]
            rung[i] += move
            history[:, i] = False
            clean[i], changed_at[i], reason[i] = 0, step, why
            changes.append(
                Change(step, module, old.name, self._ladders[i][rung[i]].name, self._reason(why))
            )
        floor[:] = False
        new = state.replace(
            rung=rung.astype(np.int32),
            history=history,
            clean=clean,
            changed_at=changed_at.astype(np.int32),
            reason=reason.astype(np.int32),
            floor_blamed=floor,
        )
        return new, changes

    def _reason(self, why: int) -> str:
        return REASONS[why].format(k=self.k, n=self.n, m=self.demote_after)

    def exhausted(self, state: AdaptiveState, blamed: Sequence[str]) -> list[str]:
        """The blamed modules that cannot be promoted any further (they compute in float32)."""
        return [
            p
            for p in blamed
            if p in self._index
            and int(state.rung[self._index[p]]) >= len(self._ladders[self._index[p]]) - 1
        ]

    def overrides(self, state: AdaptiveState) -> dict[str, jmp.Policy]:
        """`jamp.wrap` overrides for the modules that have moved: path -> policy.

        Deeper paths come first, so that a promoted submodule of a promoted module keeps its own.
        """
        moved = [(m, i) for i, m in enumerate(self.modules) if int(state.rung[i]) > 0]
        moved.sort(key=lambda mi: -mi[0].count("/"))
        return {m: self._policy_in(self._at(state, i)) for m, i in moved}

    def _policy_in(self, dtype: np.dtype) -> jmp.Policy:
        """The run's policy computing in `dtype`; fp8 matmuls only where `dtype` is fp8."""
        if dtype.itemsize == 1:
            return self.policy
        return dataclasses.replace(precision.without_fp8(self.policy), compute_dtype=dtype)

    def promotions(self, state: AdaptiveState) -> list[str]:
        """One line per module that has moved, for a run's summary: "Dense_0: float16 -> float32
        at step 12 (overflowed with the loss scale at its floor)"."""
        lines = []
        for i, module in enumerate(self.modules):
            if int(state.rung[i]) == 0 and int(state.changed_at[i]) < 0:
                continue
            start, now = self._ladders[i][0].name, self._at(state, i).name
            lines.append(
                f"{module}: {start} -> {now} at step {int(state.changed_at[i])} "
                f"({self._reason(int(state.reason[i]))})"
            )
        return lines


_BLOCK = re.compile(r"^(.*?)_?(\d+)$")


def blocks(top_level: Sequence[str]) -> list[str]:
    """The model's repeated blocks among its top-level module paths, in call order.

    The blocks are the largest family of numbered modules sharing a name (`DecoderBlock_0` ...
    `DecoderBlock_11`, or NNX's `blocks/0` ...); when no family is larger than the others, every
    top-level module counts (a small CNN: `Conv_0`, `Conv_1`, `Dense_0`, `Dense_1`).
    """
    families: dict[str, list[str]] = {}
    for path in top_level:
        match = _BLOCK.match(path.replace("/", "_"))
        if match:
            families.setdefault(match.group(1), []).append(path)
    sizes = sorted((len(v) for v in families.values()), reverse=True)
    if sizes and sizes[0] >= 2 and (len(sizes) == 1 or sizes[0] > sizes[1]):
        return max(families.values(), key=len)
    return list(top_level)


def placement_overrides(
    patterns: Sequence[str], top_level: Sequence[str], paths: Optional[Sequence[str]] = None
) -> dict[str, str]:
    """Static placement: `{path pattern: "float32"}` overrides for `jamp.wrap`.

    Args:
      patterns: module path patterns (fnmatch, as `jamp.wrap` overrides take), plus the forms
        "first:N" and "last:N": the first / last N of the model's repeated blocks (`blocks`),
        like Megatron's `--first-last-layers-bf16` but for any model.
      top_level: the model's top-level module paths in call order.
      paths: every module path of the model; given, a pattern that matches none of them is an
        error (a misspelt path would otherwise keep nothing in float32, silently).

    Raises:
      ValueError: a malformed "first:"/"last:" form, N larger than the number of blocks, or a
        pattern matching no module.
    """
    found = blocks(top_level)
    out: dict[str, str] = {}
    for pattern in patterns:
        head, sep, count = pattern.partition(":")
        if sep and head in ("first", "last"):
            if not count.isdigit() or not 1 <= int(count) <= len(found):
                raise ValueError(
                    f"{pattern!r}: N must be an integer from 1 to {len(found)}, the number of "
                    f"blocks ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''})"
                )
            chosen = found[: int(count)] if head == "first" else found[-int(count) :]
            out.update({path: "float32" for path in chosen})
        elif sep:
            raise ValueError(f"{pattern!r}: accepted are module path patterns and first:N / last:N")
        else:
            if paths is not None and not any(fnmatch.fnmatchcase(p, pattern) for p in paths):
                shown = [p for p in paths if p][:8]
                more = " ..." if len([p for p in paths if p]) > 8 else ""
                raise ValueError(
                    f"{pattern!r} matches no module of the model; its modules are "
                    f"{', '.join(shown)}{more} (patterns are fnmatch-style: 'blocks/*/attention')"
                )
            out[pattern] = "float32"
    return out
