"""Metric records for the training program: host-side averaging, JSON lines, TensorBoard, summary.

The train step returns a dict of device scalars every step. The loop keeps them on the device,
fetches a window of them every `log_every` steps with one `jax.device_get`, reduces the window with
`mean_metrics` and hands the record to a `MetricWriter`, which appends it to
`workdir/metrics.jsonl` and to TensorBoard event files in `workdir`.

`metrics.jsonl` holds one JSON object per line: `{"step": 100, "kind": "train", "loss": 0.31, ...}`.
Values are numbers (float32 values written with the shortest decimal that reads back as the same
float32), booleans or null. Non-finite values are written as the strings "nan", "inf" and "-inf":
they stay valid JSON (unlike Python's bare NaN) and, unlike null, still tell an overflow (inf) from
a nan; `float(value)` reads all three back. A resumed run appends to the file: steps logged after
the last checkpoint of the previous run appear twice, the later line being the resumed run's.

The library never imports this module; the training program does.

Example:
    >>> with MetricWriter(workdir) as writer:
    ...     writer.write_config(config.to_dict())
    ...     writer.write(100, mean_metrics(jax.device_get(window)), kind="train")
    >>> print(summary_table({"steps": 100, "peak memory (MiB)": peak_memory_mib()}))
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

# Keys `mean_metrics` reduces to their last value: states and running totals, for which a mean
# over the window means nothing. Everything else (loss, accuracy, grad_norm, and grads_finite,
# whose mean is the fraction of finite steps) is averaged.
LAST_VALUE_KEYS = frozenset({"loss_scale", "skipped_steps", "step"})

_RESERVED = ("step", "kind")


def _scalar(name: str, value: Any) -> bool | int | float | None:
    """Returns a metric value as a plain Python bool, int, float or None."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    array = np.asarray(value)  # numpy and jax scalars and 0-d arrays
    if array.shape != ():
        raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {array.shape}")
    if array.dtype == np.bool_:
        return bool(array)
    if np.issubdtype(array.dtype, np.integer):
        return int(array)
    if np.issubdtype(array.dtype, np.floating) or "float" in array.dtype.name:  # bfloat16 too
        if array.dtype.itemsize < 8 and np.isfinite(array):
            # The shortest decimal that reads back as the same float32/16: 0.1, not 0.100000001.
            return float(str(array))
        return float(array.astype(np.float64))
    raise ValueError(f"metric {name!r} must be a number, got {array.dtype}")


def _json_value(value: Any) -> Any:
    """Makes `value` strict JSON: non-finite floats as strings, numpy scalars as Python numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_value(v) for v in value]
    if isinstance(value, type):  # jnp.float32 and the like by dtype name, other classes by name
        try:
            dtype = np.dtype(value)
        except TypeError:
            dtype = None
        if dtype is not None and dtype.kind != "O":
            return dtype.name
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (np.generic, np.ndarray)) or type(value).__module__.startswith("jax"):
        try:
            array = np.asarray(value)
        except Exception:
            return str(value)
        if array.dtype.kind in "biuf" or "float" in array.dtype.name:
            return _json_value(array.tolist() if array.shape else _scalar("config", array))
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # dtypes, enums, paths and the like, as they print


def _keep_nonfinite_quiet(record: logging.LogRecord) -> bool:
    return record.getMessage() != "NaN or Inf found in input tensor."


class MetricWriter:
    """Appends metric records to `workdir/metrics.jsonl` and to TensorBoard event files.

    Args:
        workdir: the run's directory; created if missing.
        tensorboard: also write TensorBoard scalars (needs tensorboardX), tagged "<kind>/<name>".
        purge_step: on resume, the step the run restarts from: TensorBoard then hides what the
            previous run logged from that step on. `metrics.jsonl` is never rewritten.
        enabled: False makes a writer that writes nothing, for the processes other than process
            0 of a multi-process run (they log the same, already averaged, values).

    Example:
        >>> with MetricWriter("/tmp/run") as writer:
        ...     writer.write(10, {"loss": 0.5, "loss_scale": 32768.0})
        ...     writer.write(10, {"accuracy": 0.9}, kind="eval")
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        purge_step: int | None = None,
        enabled: bool = True,
    ):
        self.workdir = Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ImportError(
                    "MetricWriter(tensorboard=True) needs the tensorboardX package "
                    "(pip install tensorboardX), or pass tensorboard=False"
                ) from None
            # tensorboardX names event files by the second and opens them with "wb": a run
            # resumed within the same second would wipe the previous run's events without a
            # suffix of its own. Its flush() does not wait for its writer thread; close() does.
            # An overflow's inf is a value here (a skipped step's grad norm), not an accident:
            # tensorboardX would print "NaN or Inf found in input tensor." for each.
            logging.getLogger("tensorboardX.x2num").addFilter(_keep_nonfinite_quiet)
            self._tb = SummaryWriter(
                str(self.workdir),
                purge_step=purge_step,
                flush_secs=10,
                filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}",
            )

    def _open(self):
        if self._file is None:
            # A run killed mid-line leaves no newline at the end: start on a fresh line.
            torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_line()
            self._file = open(self.path, "a", encoding="utf-8")
            if torn:
                self._file.write("\n")
        return self._file

    def _ends_line(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def write(self, step: int, metrics: Mapping[str, Any], kind: str = "train") -> None:
        """Appends one record; `metrics` maps names to scalars (Python, numpy or jax).

        Raises:
            ValueError: a value is not a scalar number, or a name is "step" or "kind".
        """
        if not self.enabled:
            return
        values = {}
        for name, value in metrics.items():
            if name in _RESERVED:
                raise ValueError(f"metric name {name!r} is reserved for the record's own field")
            values[str(name)] = _scalar(name, value)
        record = {"step": int(step), "kind": str(kind), **values}
        line = json.dumps(_json_value(record), allow_nan=False)
        f = self._open()
        f.write(line + "\n")
        f.flush()  # a crash loses at most the record being written
        if self._tb is not None:
            for name, value in values.items():
                if value is not None:
                    self._tb.add_scalar(f"{kind}/{name}", float(value), int(step))

    def write_event(self, step: int, kind: str, /, **fields: Any) -> None:
        """Appends one record of any JSON values (module paths, lists), not only scalars.

        For what a run notices rather than measures, e.g. `write_event(37, "overflow",
        grads_nonfinite=["Conv_0"])`; TensorBoard gets the record as text under `kind`.
        """
        if not self.enabled:
            return
        for name in fields:
            if name in _RESERVED:
                raise ValueError(f"field name {name!r} is reserved for the record's own field")
        record = {"step": int(step), "kind": str(kind), **fields}
        line = json.dumps(_json_value(record), allow_nan=False)
        f = self._open()
        f.write(line + "\n")
        f.flush()
        if self._tb is not None:
            text = ", ".join(f"{k}: {_format(v)}" for k, v in fields.items())
            self._tb.add_text(str(kind), text, int(step))

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Writes `config` (nested mappings, tuples, None, numbers, strings) to config.json.

        Replaces the file atomically; values JSON cannot hold are written as their `str()`.
        """
        if not self.enabled:
            return
        text = json.dumps(_json_value(config), indent=2, allow_nan=False) + "\n"
        target = self.workdir / "config.json"
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)

    def flush(self) -> None:
        """Makes metrics.jsonl complete on disk; TensorBoard's events follow within ~10 s (or on
        `close`), since tensorboardX's own flush does not wait for its writer thread."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes both outputs; calling it again does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _flat(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested metrics (the step's `grads_finite_by_module`) as "name/key" scalars."""
    flat = {}
    for name, value in record.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{name}/"))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def mean_metrics(records: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Reduces a window of per-step metric dicts (already on the host) to one record.

    Keys in `LAST_VALUE_KEYS` ("loss_scale", "skipped_steps", "step") take their last value;
    every other key takes the mean over the records that have it, in float64 (booleans such as
    "grads_finite" become the fraction of True), over the steps where the value is finite; a key
    with no finite value in the window keeps the last (nan or inf) value. Nested dicts (the
    step's "grads_finite_by_module") become "name/key" entries.

    Args:
        records: per-step dicts of scalars (numpy, jax or Python), oldest first. A value with a
            device axis (replicated metrics) is reduced over it too.

    Returns:
        A dict of Python floats, with ints for integer-valued last-value keys, in first-seen key
        order. Empty for an empty window.

    Example:
        >>> mean_metrics([{"loss": 1.0, "skipped_steps": 0}, {"loss": 3.0, "skipped_steps": 1}])
        {'loss': 2.0, 'skipped_steps': 1}
    """
    out: dict[str, float | int] = {}
    records = [_flat(record) for record in records]
    names = list(dict.fromkeys(name for record in records for name in record))
    for name in names:
        values = [np.asarray(r[name]) for r in records if name in r]
        if name in LAST_VALUE_KEYS:
            last = values[-1]
            value = last.reshape(-1)[-1] if last.shape else last
            out[name] = (
                int(value) if np.issubdtype(value.dtype, np.integer) else float(np.float64(value))
            )
        else:
            means = np.array([np.mean(v, dtype=np.float64) for v in values])
            finite = means[np.isfinite(means)]
            # Skipped steps are counted by "skipped_steps"; their nan/inf loss or gradient norm
            # would otherwise hide the window's real values (and make TensorBoard complain).
            out[name] = float(finite.mean()) if finite.size else float(means[-1])
    return out


def _format(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (list, tuple)):
        return ", ".join(_format(v) for v in value) or "none"
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {_format(v)}" for k, v in value.items())
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def summary_table(rows: Mapping[str, Any]) -> str:
    """Formats an end-of-run summary as two aligned columns of plain text.

    Values: None prints as "n/a", whole floats without decimals, others with 4 significant digits
    (1 decimal from 100 up), mappings as "key value, key value".

    Example:
        >>> rows = {"policy": "mixed_float16", "skipped steps": 3, "eval accuracy": 0.97123}
        >>> print(summary_table(rows))
        policy         mixed_float16
        skipped steps  3
        eval accuracy  0.9712
    """
    if not rows:
        return ""
    width = max(len(str(name)) for name in rows)
    return "\n".join(f"{str(name):<{width}}  {_format(value)}" for name, value in rows.items())


def peak_host_memory_mib() -> float | None:
    """Peak resident memory of this process so far, in MiB (None where `getrusage` lacks it)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if not peak:
        return None
    # Linux reports kilobytes, macOS bytes.
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def peak_device_memory_mib() -> float | None:
    """Largest peak memory use among the local accelerators, in MiB; None where JAX has no
    statistics (the CPU backend)."""
    import jax  # already imported by the program; kept local so the rest needs only numpy

    peaks = []
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 2**20 if peaks else None


def peak_memory_mib() -> dict[str, float | None]:
    """Peak memory so far, in MiB: {"host": process RSS, "device": see peak_device_memory_mib}.

    `summary_table` prints it as "host 812.4, device n/a".
    """
    return {"host": peak_host_memory_mib(), "device": peak_device_memory_mib()}
