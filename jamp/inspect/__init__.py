"""See where precision goes: what a policy did to a model, where the time went, where fp16 breaks.

A library module like the rest of jamp: nothing here imports the training program (its
`__main__` is the command line, `python -m jamp.inspect --config=...`, and may).

* `precision_report(fn, *args)`: the static precision report of a traced (and compiled) step;
  per module and pass, matmul dtypes and FLOPs, elementwise work, what stayed float32 and why,
  the hazards (`jamp.inspect.report`);
* `profile_steps(step_fn, state, batches, n)`: device time per module path and per dtype class,
  from a profiler trace of real steps (`jamp.inspect.profile`);
* `range_report(model, variables, *inputs, loss_fn=..., loss_scale=...)`: fp16 range hazards of
  activations and gradients on a real batch (`jamp.inspect.ranges`);
* `forward_nonfinite(model, variables, *args)`: which module's forward output went non-finite
  first, from a re-run of one batch (`jamp.inspect.overflow`).

Example::

  from jamp import inspect
  print(inspect.precision_report(train_step, state, batch, rng).table())
"""

from jamp.inspect.overflow import ForwardNonfinite, forward_nonfinite
from jamp.inspect.profile import CLASSES, Profile, Row, analyze_trace, profile_steps
from jamp.inspect.ranges import ModuleRange, Ranges, range_report
from jamp.inspect.report import (
    HAZARD_KINDS,
    Hazard,
    MatmulKind,
    Report,
    Totals,
    compiled_hazards,
    precision_report,
)
from jamp.inspect.report import Row as ReportRow

__all__ = [
    "CLASSES",
    "HAZARD_KINDS",
    "ForwardNonfinite",
    "Hazard",
    "MatmulKind",
    "ModuleRange",
    "Profile",
    "Ranges",
    "Report",
    "ReportRow",
    "Row",
    "Totals",
    "analyze_trace",
    "compiled_hazards",
    "forward_nonfinite",
    "precision_report",
    "profile_steps",
    "range_report",
]
