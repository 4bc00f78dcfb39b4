"""Adaptive precision: a module that keeps overflowing in 16 bits moves, on its own, to a safer
dtype, and only that module.

A dynamic loss scale can only shrink one global scale, so a single fragile module drags the
whole model: each of its overflows skips a step, and an overflow the scale cannot fix (a forward
activation past float16's 65504, or a gradient past it even unscaled) skips every step until the
persistent-overflow stop ends the run. This module decides, from the per-step overflow record the
train step already returns, which modules should compute in a wider dtype, and hands the answer
back as `jamp.wrap` overrides. It is pure host-side bookkeeping: no model, no tracing.

One step's record is reduced to the modules it *blames* (`blame`, from `jamp.blame`, which says
how): where a forward overflow began, else the last module in call order that a backward overflow
reached (and at most the one after it); under an fp8 policy also the modules whose fp8 matmuls
had values clipped past `SATURATION_LIMIT` (`saturated`). Nothing is blamed when every module's
gradients overflowed with a finite forward pass: that is the loss scale's job.

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
import zlib
from typing import TYPE_CHECKING, Any, Mapping, Optional, Self, Sequence

import jax.numpy as jnp
import jmp
import numpy as np
from flax import struct

from jamp import hardware, precision

# One step's diagnosis, which the controller observes, and static placement (float32 from the
# first step): modules of their own, re-exported here with the controller (`jamp.adaptive.blame`).
# (`saturated` as an explicit re-export: `Controller.observe` has a parameter of that name.)
from jamp.blame import SATURATION_LIMIT, blame, site_module  # noqa: F401
from jamp.blame import saturated as saturated
from jamp.static_placement import blocks, placement_overrides  # noqa: F401

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
