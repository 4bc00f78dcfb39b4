"""Reading a JAX profiler trace for `jamp.inspect.profile`: which events ran the step, and when.

What the trace holds (an XSpace: planes of lines of events, each event with named stats):

* XLA:CPU (thunk runtime): every thunk is an event on the host plane "/host:CPU", on whichever
  thread ran it (tf_XLAExecute / tf_XLAEigen in JAX 0.12, tf_XLAPjRtCpuClient in 0.10), with
  stats `hlo_op` (the HLO instruction), `hlo_module` and a flow id `_p`. Independent thunks run
  in parallel, and all virtual CPU devices share the same cores. A thunk that finishes
  asynchronously (an Eigen matmul, a loop split over the thread pool) ends its event when it has
  handed its work to the pool; its completion is a later event "end: <op>" whose flow id `_c`
  matches: the thunk's work spans both.
* GPUs: kernels lie on the device plane "/device:GPU:<i>", one line per stream ("Stream #7"),
  with the stats of the thunk annotation that launched them (`hlo_op`, `hlo_module`,
  `program_id`); the host plane's events are launches, not work.

Example::

    space = read(logdir)
    timelines, other_ns, source = timelines_of(space, "jit_train_step")
    shares = attribute([(start, end, tier, key), ...])
"""

from __future__ import annotations

import glob
import os
import pathlib
import warnings
from typing import Any, Optional

import jax

# Lines that profiler tools derive from a device's stream lines: counting them too would count
# every kernel twice.
_DERIVED_LINES = frozenset(
    {"XLA Modules", "XLA Ops", "Async XLA Ops", "XLA TraceMe", "Steps", "Source code"}
)
# TPUs record their ops differently (on an "XLA Ops" line) and are not read here.
_DEVICE_PLANES = ("/device:GPU:",)
_END = "end: "


def profile_data():
    """jaxlib's reader of profiler traces. The one place that knows where it lives: it is
    `jax.profiler.ProfileData` on every supported JAX (0.10 to 0.12)."""
    reader = getattr(jax.profiler, "ProfileData", None)
    if reader is None:
        raise RuntimeError(f"JAX {jax.__version__} has no jax.profiler.ProfileData to read traces")
    return reader


def read(trace):
    """A ProfileData from a trace: a directory (its newest .xplane.pb), a file, serialized bytes
    or a ProfileData already."""
    reader = profile_data()
    if isinstance(trace, bytes):
        return reader.from_serialized_xspace(trace)
    if isinstance(trace, (str, os.PathLike)):
        path = pathlib.Path(trace)
        if path.is_dir():
            found = glob.glob(str(path / "**" / "*.xplane.pb"), recursive=True)
            if not found:
                raise FileNotFoundError(f"no .xplane.pb trace under {path}")
            path = pathlib.Path(max(found, key=os.path.getmtime))
        return reader.from_file(str(path))
    return trace


def _stats(event) -> dict[str, Any]:
    # On Python 3.13 jaxlib's stats iterator type warns when it is first built; under -W error
    # that warning would abort the process instead of raising.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return dict(event.stats)


def _plane_events(plane, program: str):
    """(events of `program` as (start, end, hlo_op), ns of other programs' ops) on one plane."""
    lines = list(plane.lines)
    streams = [ln for ln in lines if ln.name.startswith("Stream #")]
    thunks, other = [], 0.0
    completions: dict[Optional[tuple[Any, Any]], Any] = {}  # (a thunk's flow, or None): its end
    for line in streams or [ln for ln in lines if ln.name not in _DERIVED_LINES]:
        for ev in line.events:
            stats = _stats(ev)
            end = ev.start_ns + ev.duration_ns
            op = stats.get("hlo_op")
            if op is None:
                if ev.name.startswith(_END) and "_c" in stats:
                    completions[(stats.get("_ct"), stats["_c"])] = end
                continue
            if stats.get("hlo_module", program) != program:
                other += ev.duration_ns
                continue
            flow = (stats.get("_pt"), stats["_p"]) if "_p" in stats else None
            thunks.append((ev.start_ns, end, str(op), flow))
    events = [(s, max(e, completions.get(f, e)), op) for s, e, op, f in thunks]
    return events, other


def timelines_of(space, program: str) -> tuple[list[list[tuple[float, float, str]]], float, str]:
    """The step's events as timelines of (start ns, end ns, hlo_op), the summed ns of other
    programs' ops, and a few words on where the events came from.

    One timeline per GPU plane that ran `program`; without any GPU plane, one for the host
    plane, whose threads share the machine's cores.
    """
    planes = list(space.planes)
    device = [p for p in planes if p.name.startswith(_DEVICE_PLANES)]
    found, other = [], 0.0
    for plane in device or [p for p in planes if p.name == "/host:CPU"]:
        events, elsewhere = _plane_events(plane, program)
        other += elsewhere
        if events:
            found.append(events)
    source = f"{len(found)} device timeline(s)" if device else "the host's threads (XLA:CPU)"
    return found, other, source


def attribute(events: list[tuple[float, float, int, Any]]) -> dict[Any, float]:
    """Splits a timeline among its events: (start, end, tier, key) -> key -> time.

    Every slice between two event boundaries goes to the events of the lowest tier running in
    it, split evenly: computations (tier 0) before collectives (1) before containers (2). So the
    result adds up to the time covered by any event, never more.

    Example::

      >>> attribute([(0, 4, 0, "a"), (2, 6, 0, "b"), (0, 8, 1, "all-reduce")])
      {'a': 3.0, 'b': 3.0, 'all-reduce': 2.0}
    """
    points = []
    for i, (start, end, _, _) in enumerate(events):
        points += [(start, 1, i), (end, 0, i)]  # at equal times, ends before starts
    points.sort()
    active: list[set[int]] = [set(), set(), set()]
    out: dict[Any, float] = {}
    last = None
    for t, is_start, i in points:
        if last is not None and t > last:
            running = next((a for a in active if a), ())
            for j in running:
                key = events[j][3]
                out[key] = out.get(key, 0.0) + (t - last) / len(running)
        last = t
        (active[events[i][2]].add if is_start else active[events[i][2]].discard)(i)
    return out
