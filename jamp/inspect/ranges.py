"""fp16 range hazards on a real batch: which modules' values leave float16's range, and what the
loss scale buys.

float16 holds magnitudes from 2^-24 (its smallest subnormal) to 65504. `range_report` runs one
batch through a model and, per module path, compares with that range

* the largest |activation| (the module's outputs, from Flax's `capture_intermediates`, or for a
  wrapped NNX model `jamp.nnx.capturing_outputs`): past 65504 it is inf in float16;
* the largest |scaled gradient| (the gradients of its parameters, times the loss scale): past
  65504 the step overflows and is skipped;
* the fraction of its gradient values that round to zero in float16 without the loss scale,
  and at the current scale: what the scale buys;
* the headroom, log2(65504 / largest): how many doublings the values (or the loss scale) can
  still take; negative means it overflows already.

The values are computed in whatever dtype the model runs in (float32 on CPUs), so the report
shows what *would* happen in float16: a module whose values reach 1e5 under bfloat16 breaks as
soon as the policy is switched to float16. Any other format can be checked with `dtype=`.

Example::

  ranges = range_report(model, variables, images, loss_fn=loss, loss_scale=2.0**15)
  print(ranges.table())
  ranges.plot("ranges.png")
  ranges.flagged  # ["Encoder_0/Dense_3"]: the module paths that overflow
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jamp import nnx as jamp_nnx
from jamp.inspect import _paths
from jamp.inspect._nnx_view import NnxView, is_nnx
from jamp.inspect._text import format_table

__all__ = ["ModuleRange", "Ranges", "range_report"]


@dataclasses.dataclass(frozen=True)
class ModuleRange:
    """The magnitudes of one module's outputs and parameter gradients."""

    path: str  # the Flax module path ("" for the root module: the model's output)
    max_activation: Optional[float]  # largest |output|; None: no output captured
    max_scaled_grad: Optional[float]  # largest |grad| x loss scale; None: no parameters
    grad_count: int  # number of gradient values
    flushed_unscaled: float  # fraction of gradient values that round to 0 in `dtype`, scale 1
    flushed_scaled: float  # the same at the loss scale
    max_finite: float  # the format's largest finite value (65504 for float16)

    @property
    def activation_headroom(self) -> Optional[float]:
        """log2(max_finite / largest |output|): doublings left (negative: overflows)."""
        return _headroom(self.max_finite, self.max_activation)

    @property
    def grad_headroom(self) -> Optional[float]:
        """log2(max_finite / largest |scaled grad|)."""
        return _headroom(self.max_finite, self.max_scaled_grad)

    @property
    def overflows(self) -> bool:
        """Whether an output or a scaled gradient is past the format's range (or not finite)."""
        return any(h is not None and h < 0 for h in (self.activation_headroom, self.grad_headroom))


def _headroom(limit: float, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    if not math.isfinite(value):
        return -math.inf
    return math.log2(limit / value) if value > 0 else math.inf


@dataclasses.dataclass(frozen=True)
class Ranges:
    """`range_report`'s result: one `ModuleRange` per module path, in call order."""

    rows: list[ModuleRange]
    loss_scale: float
    dtype: str  # the format checked against, e.g. "float16"

    @property
    def flagged(self) -> list[str]:
        """The module paths whose outputs or scaled gradients overflow the format."""
        return [r.path for r in self.rows if r.overflows]

    def row(self, path: str) -> Optional[ModuleRange]:
        return next((r for r in self.rows if r.path == path), None)

    def table(self) -> str:
        """One line per module: magnitudes, headroom in doublings, flushed fractions."""
        return _table(self)

    __str__ = table

    def plot(self, path) -> pathlib.Path:
        """A PNG at `path`: log2 magnitudes against the format's range, and flushed fractions."""
        return _plot(self, pathlib.Path(path))


def _scale_value(loss_scale: Any) -> float:
    """A number, or any loss-scale object (jamp's or jmp's) with a `loss_scale` attribute."""
    value = getattr(loss_scale, "loss_scale", loss_scale)
    return float(np.asarray(jax.device_get(value)))


def _paths_in_order(tree) -> dict[tuple, Any]:
    """{module path (tuple of keys): subtree}, parents before children, in the tree's order."""
    out: dict[tuple, Any] = {}

    def visit(node, prefix):
        if isinstance(node, dict) or hasattr(node, "items") and not isinstance(node, jax.Array):
            for key, child in node.items():
                visit(child, prefix + (str(key),))
        else:
            out.setdefault(prefix[:-1], []).append(node)  # the last key names the leaf

    visit(tree, ())
    return out


def _activation_maxima(intermediates) -> dict[str, jax.Array]:
    """Largest |output| per module path, from Flax's `intermediates` collection."""
    out = {}
    for path, leaves in _paths_in_order(intermediates).items():
        # Captured outputs live under the method name: {"Dense_0": {"__call__": (y,)}}.
        module = "/".join(k for k in path if k != "__call__")
        floats = [
            jnp.max(jnp.abs(x.astype(jnp.float32)))
            for leaf in leaves
            for x in jax.tree.leaves(leaf)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.size
        ]
        if floats:
            out[module] = jnp.max(jnp.stack(floats))
    return out


def _grad_stats(grads, scale: float, dtype) -> dict[str, dict[str, jax.Array]]:
    """Per module path: largest |scaled grad|, count, and counts flushed to 0 in `dtype`."""
    out = {}
    for path, leaves in _paths_in_order(grads).items():
        flat = [
            g.astype(jnp.float32).ravel() for g in leaves if jnp.issubdtype(g.dtype, jnp.floating)
        ]
        if not flat:
            continue
        scaled = jnp.concatenate(flat)  # the gradients of the scaled loss
        unscaled = scaled / scale
        nonzero = scaled != 0

        def flushed(x, nonzero=nonzero):
            return jnp.sum(nonzero & (x.astype(dtype) == 0))  # rounds to zero in `dtype`

        out["/".join(path)] = {
            "max": jnp.max(jnp.abs(scaled)),
            "count": scaled.size,
            "flushed_unscaled": flushed(unscaled),
            "flushed_scaled": flushed(scaled),
        }
    return out


def range_report(
    model,
    *inputs,
    loss_fn: Optional[Callable] = None,
    loss_scale: Any = 1.0,
    dtype=jnp.float16,
    **apply_kwargs,
) -> Ranges:
    """Per-module magnitudes of activations and scaled gradients on one batch, against `dtype`.

    `range_report(model, variables, *inputs, ...)` for a linen model, `range_report(model,
    *inputs, ...)` for an NNX one (it carries its variables).

    Args:
      model: a linen module (`jamp.wrap`ped or not); a `jamp.wrap`ped NNX model, as users hold
        it; or any object whose `apply(variables, *inputs, **apply_kwargs)` runs a
        `jamp.wrap`ped NNX model (the training program's view of one). NNX submodules' outputs
        are read with `jamp.nnx.capturing_outputs` and named by attribute path.
      *inputs: for linen (and an apply view), its variables (`{"params": ..., **other
        collections}`), then the batch's model inputs, as `model.apply(variables, *inputs)`
        takes them; for an NNX model, the inputs of `model(*inputs)`.
      loss_fn: the loss on this batch, `loss_fn(params) -> loss` (or `(loss, aux)`) for linen,
        `loss_fn(model) -> loss` for an NNX model (as `nnx.grad` takes it); the gradients of
        `loss_scale * loss` with respect to the parameters are checked. None: activations
        only.
      loss_scale: a number, or a loss scale object (`state.loss_scale`).
      dtype: the format to check against (float16: max 65504, smallest subnormal 2^-24).
      **apply_kwargs: passed to `model.apply` (`train=True`, `rngs=`, `mutable=[...]`).

    Returns:
      `Ranges`: `.rows`, `.flagged`, `.table()`, `.plot(path)`.

    Example (the training program's state and loss function)::

      variables = {"params": state.params, **state.model_state}
      ranges = range_report(
          model, variables, batch["image"],
          loss_fn=lambda p: loss_fn(p, state.model_state, batch, rng)[0],
          loss_scale=state.loss_scale, train=True, mutable=list(state.model_state))
    """
    if is_nnx(model):  # its variables are read now and passed to the jitted re-run
        view = NnxView(model)
        variables = view.variables
        if loss_fn is not None:
            model_loss = loss_fn

            def loss_fn(params, rest=None):  # the NNX loss of the model with these params
                return model_loss(view.merge({"params": params, "rest": rest}))

        model = view
    else:
        if not inputs:
            raise TypeError("range_report(model, variables, *inputs): variables are missing")
        variables, inputs = inputs[0], inputs[1:]
    scale = _scale_value(loss_scale)
    mutable = apply_kwargs.pop("mutable", False)
    collections = True if mutable is True else list(mutable or []) + ["intermediates"]

    def measure(variables, inputs):
        if isinstance(model, nn.Module):
            _, state = model.apply(
                variables, *inputs, capture_intermediates=True, mutable=collections, **apply_kwargs
            )
            acts = _activation_maxima(state.get("intermediates", {}))
        else:  # a wrapped NNX model behind an apply (the program's view): its own capture
            with jamp_nnx.capturing_outputs() as acts:
                model.apply(variables, *inputs, mutable=mutable, **apply_kwargs)
            if not acts:
                raise ValueError(
                    f"range_report: {type(model).__name__} is not a linen module, and its apply "
                    "ran no jamp.wrap'ped NNX model (nothing to measure)"
                )
        if loss_fn is None:
            return acts, {}

        def scaled_loss(params):
            if isinstance(model, NnxView):
                loss = loss_fn(params, variables["rest"])
            else:
                loss = loss_fn(params)
            loss = loss[0] if isinstance(loss, tuple) else loss
            return jnp.asarray(loss, jnp.float32) * scale

        grads = jax.grad(scaled_loss)(variables["params"])
        if isinstance(model, NnxView):  # an nnx.State: its nested dict of values
            grads = grads.to_pure_dict()
        return acts, _grad_stats(grads, scale, dtype)

    calls = _paths.ModuleCalls()  # module paths in call order: dicts come back key-sorted
    with calls.recording():
        acts, grads = jax.device_get(jax.jit(measure)(variables, inputs))
    order = [p for p in calls.classes if p in acts or p in grads]
    paths = order + [p for p in list(acts) + list(grads) if p not in order]
    paths = list(dict.fromkeys(paths))
    return Ranges(_rows(paths, acts, grads, dtype), scale, np.dtype(dtype).name)


def _rows(paths: list[str], acts: dict, grads: dict, dtype) -> list[ModuleRange]:
    limit = float(jnp.finfo(dtype).max)
    rows = []
    for path in paths:
        g = grads.get(path) or {}
        count = int(g["count"]) if g else 0
        rows.append(
            ModuleRange(
                path=path,
                max_activation=float(acts[path]) if path in acts else None,
                max_scaled_grad=float(g["max"]) if g else None,
                grad_count=count,
                flushed_unscaled=float(g["flushed_unscaled"]) / count if count else 0.0,
                flushed_scaled=float(g["flushed_scaled"]) / count if count else 0.0,
                max_finite=limit,
            )
        )
    return sorted(rows, key=lambda r: _depth_first(r.path, paths))


def _depth_first(path: str, paths: list[str]):
    # Parents before their children, siblings in call order.
    parts = path.split("/") if path else []
    return [
        paths.index("/".join(parts[: i + 1])) if "/".join(parts[: i + 1]) in paths else -1
        for i in range(len(parts))
    ]


def _fmt(x: Optional[float], spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if math.isnan(x) or (math.isinf(x) and spec == ".3g"):
        return "non-finite"  # the program's own gradient overflowed already
    return format(x, spec)


def _table(ranges: Ranges) -> str:
    rows = []
    for r in ranges.rows:
        flags = []
        if r.activation_headroom is not None and r.activation_headroom < 0:
            flags.append("activation overflows")
        if r.grad_headroom is not None and r.grad_headroom < 0:
            flags.append("scaled grad overflows")
        rows.append(
            [
                r.path or "(root)",
                _fmt(r.max_activation),
                _fmt(r.activation_headroom, "+.1f"),
                _fmt(r.max_scaled_grad),
                _fmt(r.grad_headroom, "+.1f"),
                f"{100 * r.flushed_unscaled:.1f}%" if r.grad_count else "-",
                f"{100 * r.flushed_scaled:.1f}%" if r.grad_count else "-",
                "; ".join(flags),
            ]
        )
    header = [
        "module",
        "max |act|",
        "headroom",
        "max |grad*S|",
        "headroom",
        "to 0 at S=1",
        f"to 0 at S={ranges.loss_scale:g}",
        "",
    ]
    limit = float(jnp.finfo(ranges.dtype).max)
    title = (
        f"{ranges.dtype} ranges (max {limit:g}; headroom = log2(max / value) doublings), "
        f"loss scale S = {ranges.loss_scale:g}"
    )
    flagged = ranges.flagged
    verdict = (
        f"overflowing: {', '.join(p or '(root)' for p in flagged)}" if flagged else "no overflow"
    )
    return "\n".join([title, "", format_table(header, rows, right=(1, 2, 3, 4, 5, 6)), "", verdict])


def _plot(ranges: Ranges, path: pathlib.Path) -> pathlib.Path:
    import matplotlib  # only here: a PNG is the one thing that needs it

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = ranges.rows
    labels = [r.path or "(root)" for r in rows]
    y = np.arange(len(rows))
    top = math.log2(float(jnp.finfo(ranges.dtype).max)) + 2  # where non-finite values are drawn

    def log2(v):
        if not v:
            return np.nan
        return float(np.log2(v)) if math.isfinite(v) else top

    info = jnp.finfo(ranges.dtype)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 0.3 * len(rows) + 2.2), sharey=True, width_ratios=(2, 1)
    )
    left.barh(y - 0.2, [log2(r.max_activation) for r in rows], 0.4, label="max |activation|")
    left.barh(y + 0.2, [log2(r.max_scaled_grad) for r in rows], 0.4, label="max |grad x S|")
    for i, r in enumerate(rows):
        for value, dy in ((r.max_activation, -0.2), (r.max_scaled_grad, 0.2)):
            if value is not None and not math.isfinite(value):
                left.text(top, i + dy, " non-finite", va="center", fontsize=7, color="red")
    left.axvline(math.log2(float(info.max)), color="red", ls="--", label=f"{ranges.dtype} max")
    left.axvline(
        math.log2(float(info.smallest_subnormal)), color="gray", ls=":", label="smallest subnormal"
    )
    left.set_xlabel("log2 magnitude")
    left.set_yticks(y, labels, fontsize=7)
    for tick, r in zip(left.get_yticklabels(), rows):
        tick.set_color("red" if r.overflows else "black")  # the flagged modules
    left.invert_yaxis()
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    flushed = [(100 * r.flushed_unscaled, 100 * r.flushed_scaled) for r in rows]
    right.barh(y - 0.2, [f[0] for f in flushed], 0.4, label="S = 1")
    right.barh(y + 0.2, [f[1] for f in flushed], 0.4, label=f"S = {ranges.loss_scale:g}")
    right.set_xlim(0, max([1.0] + [max(f) * 1.1 for f in flushed]))
    right.set_xlabel(f"% of gradient values rounding to 0 in {ranges.dtype}")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.suptitle(f"{ranges.dtype} range hazards per module (loss scale {ranges.loss_scale:g})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit below the axes
    plt.close(fig)
    return path
