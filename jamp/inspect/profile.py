"""Where a train step's time goes, per Flax module and per dtype class, measured by the profiler.

`profile_steps` runs a few train steps under the JAX profiler, reads the trace it wrote, maps each
event to the HLO instruction it ran and that instruction to its class (16-bit or fp32 matmul,
convolution, 16- or 32-bit elementwise work, collective, other) and its module path (from the
name stack XLA kept in the compiled program), and divides the time among them as shares of the
measured step time (wall clock of the profiled steps, blocked at the end).

How the time is counted, on every backend alike: each hardware timeline (one per GPU; on a CPU
the host's cores together, since XLA:CPU's devices and its parallel thunks share them) is cut at
every event boundary, and each slice goes to the events running in it, split evenly; collectives
get only slices in which no computation ran (their exposed time), and while loops and async waits
only slices in which nothing else ran. So no instant counts twice, the attributed time is at most
the step time, and what is missing is time in which no op of the step ran (dispatch, transfers).

Example::

    state, prof = profile_steps(p_train_step, state, batches, num_steps=5, rng=rng)
    print(prof.table())          # ends with "shares add up to 93.1 % of the measured step time"
    prof.plot("profile.png")     # one stacked bar per top-level module
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import tempfile
import time
from typing import Any, Callable, Iterable

import jax

from jamp.inspect._nnx_view import nnx_objects, state_of
from jamp.inspect._profile_hlo import CLASSES, LOSS, UNMATCHED, UNNAMED, UPDATE, HloOps
from jamp.inspect._profile_trace import attribute, read, timelines_of

__all__ = ["CLASSES", "Profile", "Row", "analyze_trace", "profile_steps"]

_COLORS = dict(
    zip(CLASSES, ("#1f77b4", "#d62728", "#9467bd", "#8fbbd9", "#f4a3a3", "#2ca02c", "#b0b0b0"))
)


@dataclasses.dataclass(frozen=True)
class Row:
    """Device time of one class of work in one module, per step."""

    module: str  # Flax module path ("DecoderBlock_0/Dense_1"), or "(loss)", "(update)", ...
    op_class: str  # one of CLASSES
    seconds: float  # per step
    share: float  # of the measured step time

    @property
    def top_level(self) -> str:
        return self.module.split("/")[0]


@dataclasses.dataclass(frozen=True)
class Profile:
    """A measured split of the step time; see the module docstring for how time is counted.

    Example::

      prof.by_class()["matmul 16-bit"]      # seconds per step
      prof.attributed_fraction               # 0.931: the rows' shares add up to 93.1 %
    """

    rows: tuple[Row, ...]  # by decreasing time
    step_seconds: float  # wall clock per profiled step
    num_steps: int
    program: str  # the HLO module profiled ("jit_train_step")
    source: str  # which timelines the events came from
    other_programs_seconds: float = 0.0  # per step, of other programs' ops in the trace
    unmatched_ops: tuple[str, ...] = ()  # event names the program's HLO does not have

    @property
    def attributed_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def attributed_fraction(self) -> float:
        return self.attributed_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def by_class(self) -> dict[str, float]:
        """Seconds per step of each class (all classes, in CLASSES order)."""
        out = dict.fromkeys(CLASSES, 0.0)
        for r in self.rows:
            out[r.op_class] += r.seconds
        return out

    def by_top_level(self) -> dict[str, dict[str, float]]:
        """Top-level module -> class -> seconds per step: the model's modules in name order
        (DecoderBlock_2 before DecoderBlock_10), then the groups outside them: the root's own
        operations, (loss), (update), (unnamed), (unmatched)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            out.setdefault(r.top_level, dict.fromkeys(CLASSES, 0.0))[r.op_class] += r.seconds
        groups = (LOSS, UPDATE, UNNAMED, UNMATCHED)

        def order(name):
            rank = groups.index(name) + 2 if name in groups else int(name.startswith("("))
            return rank, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

        return {name: out[name] for name in sorted(out, key=order)}

    def gap_line(self) -> str:
        return (
            f"shares add up to {100 * self.attributed_fraction:.1f} % of the measured step time "
            f"({1e3 * self.attributed_seconds:.2f} of {1e3 * self.step_seconds:.2f} ms per step)"
        )

    def table(self, max_rows: int = 30) -> str:
        """The split as text: per class, per top-level module (shares by class), then the
        `max_rows` largest (module path, class) rows, and the gap to the step time."""
        pct = lambda s: 100 * s / self.step_seconds if self.step_seconds > 0 else 0.0  # noqa: E731
        lines = [
            f"profile of {self.program}: {self.num_steps} steps, "
            f"{1e3 * self.step_seconds:.2f} ms per step (wall clock), events from {self.source}",
            "",
            f"{'class':<22}{'ms/step':>9}{'share':>8}",
        ]
        lines += [f"{c:<22}{1e3 * s:>9.3f}{pct(s):>7.1f}%" for c, s in self.by_class().items()]
        short = ("mm16", "mm32", "conv", "ew16", "ew32", "coll", "other")
        lines += [
            "",
            f"{'top-level module':<30}{'ms/step':>9}{'share':>8}  "
            + "".join(f"{s:>6}" for s in short)
            + "   (% of step)",
        ]
        for top, classes in self.by_top_level().items():
            total = sum(classes.values())
            cells = "".join(f"{pct(s):>6.1f}" if s else f"{'.':>6}" for s in classes.values())
            lines.append(f"{top[:29]:<30}{1e3 * total:>9.3f}{pct(total):>7.1f}%  {cells}")
        shown = self.rows[:max_rows]
        width = min(64, max([len("module path"), *(len(r.module) for r in shown)])) + 2
        lines += ["", f"{'module path':<{width}}{'class':<20}{'ms/step':>9}{'share':>8}"]
        for r in shown:
            lines.append(
                f"{r.module[-width + 2 :]:<{width}}{r.op_class:<20}{1e3 * r.seconds:>9.3f}"
                f"{pct(r.seconds):>7.1f}%"
            )
        if len(self.rows) > max_rows:
            rest = sum(r.seconds for r in self.rows[max_rows:])
            label = f"... {len(self.rows) - max_rows} more rows"
            lines.append(f"{label:<{width + 20}}{1e3 * rest:>9.3f}{pct(rest):>7.1f}%")
        lines += [
            "",
            self.gap_line() + "; the rest is time in which no op of the step ran "
            "(dispatch, input transfers, waits)",
        ]
        if self.other_programs_seconds:
            lines.append(
                f"other programs' ops in the trace: "
                f"{1e3 * self.other_programs_seconds:.3f} ms per step (not in the shares)"
            )
        if self.unmatched_ops:
            lines.append(
                f"events naming no instruction of {self.program}: "
                + ", ".join(self.unmatched_ops[:5])
            )
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, title: str | None = None) -> pathlib.Path:
        """Writes a PNG: one stacked bar per top-level module, one segment per class, in % of
        the measured step time; the title (the program's name unless given) states the gap.
        Returns the path."""
        from matplotlib.figure import Figure  # here: matplotlib is needed only for pictures

        groups = self.by_top_level()
        fig = Figure(figsize=(max(6.0, 0.6 * len(groups) + 2.5), 4.5), layout="constrained")
        ax = fig.add_subplot()
        bottom = [0.0] * len(groups)
        for c in CLASSES:
            heights = [100 * g[c] / max(self.step_seconds, 1e-12) for g in groups.values()]
            if any(heights):
                ax.bar(range(len(groups)), heights, bottom=bottom, color=_COLORS[c], label=c)
                bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(groups)), list(groups), rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("% of the measured step time")
        ax.set_title(
            f"{title or self.program}: {1e3 * self.step_seconds:.2f} ms per step; "
            f"{self.gap_line().split(' (')[0]}",
            fontsize=9,
        )
        ax.legend(fontsize=8, frameon=False)
        path = pathlib.Path(path)
        fig.savefig(path, dpi=120)
        return path

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["attributed_seconds"] = self.attributed_seconds
        out["attributed_fraction"] = self.attributed_fraction
        return out

    def save(
        self, directory: str | os.PathLike, stem: str = "profile", title: str | None = None
    ) -> dict[str, pathlib.Path]:
        """Writes `<stem>.txt` (the table), `<stem>.png` (the plot) and `<stem>.json` (the data)
        into `directory`; returns their paths."""
        directory = pathlib.Path(directory)
        paths = {ext: directory / f"{stem}.{ext}" for ext in ("txt", "png", "json")}
        paths["txt"].write_text(self.table(max_rows=100) + "\n")
        self.plot(paths["png"], title)
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return paths


def analyze_trace(trace, hlo_text: str, *, num_steps: int, step_seconds: float) -> Profile:
    """The profile of `num_steps` steps of the program `hlo_text` recorded in `trace`.

    Args:
      trace: the profiler's log directory (its newest trace is read), an .xplane.pb file, a
        serialized XSpace, or a `jax.profiler.ProfileData`.
      hlo_text: the compiled program's HLO (`jitted.lower(*args).compile().as_text()`).
      num_steps: how many steps the trace holds.
      step_seconds: the measured wall-clock time of one step.

    Example::

      prof = analyze_trace(logdir, hlo, num_steps=5, step_seconds=elapsed / 5)
    """
    ops = HloOps(hlo_text)
    timelines, other_ns, source = timelines_of(read(trace), ops.module_name)
    per_key: dict[tuple[str, str], float] = {}
    unmatched = set()
    for events in timelines:
        tagged = []
        for start, end, name in events:
            op = ops.op(name)
            if name not in ops:
                unmatched.add(name)
            tagged.append((start, end, op.tier, (op.module, op.op_class)))
        for key, ns in attribute(tagged).items():
            per_key[key] = per_key.get(key, 0.0) + ns
    # Per step and per timeline: each timeline's slices add up to at most the wall clock.
    scale = 1e-9 / num_steps / max(len(timelines), 1)
    rows = sorted(
        (Row(m, c, ns * scale, ns * scale / step_seconds) for (m, c), ns in per_key.items()),
        key=lambda r: -r.seconds,
    )
    return Profile(
        rows=tuple(rows),
        step_seconds=step_seconds,
        num_steps=num_steps,
        program=ops.module_name,
        source=source,
        other_programs_seconds=other_ns * scale,
        unmatched_ops=tuple(sorted(unmatched)),
    )


def _options():
    # The Python tracer would record every Python call of the loop, slowing the very dispatch
    # whose speed decides how much of the step the device is busy.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def profile_steps(
    step_fn: Callable,
    state,
    batches: Iterable,
    num_steps: int,
    *,
    rng=None,
    warmup_steps: int = 1,
    logdir: str | os.PathLike | None = None,
    hlo_text: str | None = None,
):
    """Runs `warmup_steps + num_steps` train steps, the last `num_steps` under the profiler.

    Args:
      step_fn: the jitted (`jax.jit`, `jamp.sharding`) or pmapped (`jamp.parallel`) step,
        called as `step_fn(state, batch, rng)` (`step_fn(state, batch)` if `rng` is None) and
        returning `(state, metrics)`; or an `nnx.jit` step of NNX objects, called as
        `step_fn(*state, batch)` (`rng` after the batch, if given) and updating them in place,
        returning its metrics (e.g. the loss).
      state: the state as `step_fn` takes it (replicated, sharded); for an `nnx.jit` step, the
        NNX objects it takes before the batch (a model, or a tuple such as `(model,
        optimizer)`), returned as they are, updated.
      batches: yields batches as `step_fn` takes them; exactly one is drawn per step.
      num_steps: steps to profile (a few: every event of every step is kept in memory).
      rng: passed to every step, as the training loop does.
      warmup_steps: steps run first, outside the trace (the first call compiles).
      logdir: where the trace is written (view it in TensorBoard / XProf); a temporary
        directory, removed afterwards, if None.
      hlo_text: the compiled program's HLO; by default `step_fn.lower(...).compile()` gives it
        (a second compilation, served by JAX's persistent cache where that is on).

    Returns:
      (the state after all the steps, the `Profile` of the profiled ones).

    Example::

      state, prof = profile_steps(p_train_step, state, (shard(b) for b in it), 5, rng=rng)
      print(prof.table()); prof.save(workdir)   # profile.txt, profile.png, profile.json

      # NNX: @nnx.jit def train_step(model, optimizer, batch): ...; return loss
      _, prof = profile_steps(train_step, (model, optimizer), batches, 5)
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    batches = iter(batches)
    extra = () if rng is None else (rng,)
    objects = nnx_objects(state)
    if objects is None:

        def run(state, batch):
            return step_fn(state, batch, *extra)

        def lower(state, batch):
            return step_fn.lower(state, batch, *extra)  # jitted / pmapped

    else:  # an nnx.jit step: step_fn(model, optimizer, ..., batch) updates them in place

        def run(state, batch):
            return state, step_fn(*objects, batch, *extra)

        def lower(state, batch):
            return step_fn.lower(*objects, batch, *extra)  # nnx.jit's

    def ready(state, metrics=None):
        jax.block_until_ready((state if objects is None else state_of(objects), metrics))

    for _ in range(warmup_steps):
        state, metrics = run(state, next(batches))
    ready(state)
    first = next(batches)
    if hlo_text is None:
        hlo_text = lower(state, first).compile().as_text()
    with tempfile.TemporaryDirectory(prefix="jamp-profile-") as scratch:
        where = pathlib.Path(logdir) if logdir is not None else pathlib.Path(scratch)
        jax.profiler.start_trace(str(where), profiler_options=_options())
        try:
            start = time.perf_counter()
            batch = first
            for i in range(num_steps):
                state, metrics = run(state, batch)
                if i + 1 < num_steps:
                    batch = next(batches)
            ready(state, metrics)
            elapsed = time.perf_counter() - start
        finally:
            jax.profiler.stop_trace()
        profile = analyze_trace(
            where, hlo_text, num_steps=num_steps, step_seconds=elapsed / num_steps
        )
    return state, profile
