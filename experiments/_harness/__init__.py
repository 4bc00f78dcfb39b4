"""The experiments' shared harness: what every script records, times, tabulates and plots.

- environment: the record of a run (date, command, machine, versions, commit) at the head of a
  results file (`environment`) or beside a part's rows in its JSON (`run_record`), and the
  machine's name that results files are named by (`machine_name`);
- timing: interleaved rounds on a noisy shared machine, a donated-state stepper, ratio statistics;
- data: the synthetic batches the timed steps train on, and the loss on them;
- tables: Markdown cells (ratios, mean ± sd, paired differences, GiB by dtype) and a results file
  whose notes survive a rerun;
- plots: matplotlib's pyplot on the Agg backend, or None without matplotlib;
- xla: what XLA made of a compiled step (dots and convolutions by dtype).

A script run as `python experiments/<script>.py` has experiments/ on its path, so it imports
these as `from _harness.timing import interleaved`.
"""

from __future__ import annotations

import pathlib

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = EXPERIMENTS.parent
RESULTS = EXPERIMENTS / "results"
