"""Tests for jamp.train.metrics: the JSON lines file, TensorBoard events, config.json, window averaging,
the summary table and the memory probes."""

import json
import logging
import math
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from jamp.train.metrics import (
    LAST_VALUE_KEYS,
    MetricWriter,
    mean_metrics,
    peak_device_memory_mib,
    peak_host_memory_mib,
    peak_memory_mib,
    summary_table,
)


def _lines(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _scalars(workdir):
    """Reads every scalar from the TensorBoard event files in `workdir`: {(tag, step): value}."""
    scalars = {}
    files = sorted(workdir.glob("events.out.tfevents.*"))
    assert files, "no event file"
    for path in files:
        for event in _events(path):
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = value.simple_value
    return scalars


def _events(path):
    """Yields the `Event` protos of one event file: TFRecords (u64 length, u32 crc, payload, u32
    crc). The protos ship with tensorboardX, so neither TensorFlow nor TensorBoard is needed."""
    from tensorboardX.proto import event_pb2

    data, offset = path.read_bytes(), 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        yield event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4


def test_metric_writer_jsonl_records_and_types(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(
            10,
            {
                "loss": jnp.asarray(0.1, jnp.float32),
                "grad_norm": np.float64(2.5),
                "skipped_steps": jnp.asarray(3, jnp.int32),
                "grads_finite": np.bool_(True),
                "accuracy": 0.75,
                "lr": jnp.asarray(0.5, jnp.bfloat16),
            },
        )
        writer.write(10, {"accuracy": np.float32(0.5)}, kind="eval")
    train, evaluation = _lines(tmp_path)
    assert train == {
        "step": 10,
        "kind": "train",
        "loss": 0.1,  # float32 written as its shortest decimal, not 0.10000000149011612
        "grad_norm": 2.5,
        "skipped_steps": 3,
        "grads_finite": True,
        "accuracy": 0.75,
        "lr": 0.5,
    }
    assert list(train) == [
        "step",
        "kind",
        "loss",
        "grad_norm",
        "skipped_steps",
        "grads_finite",
        "accuracy",
        "lr",
    ]
    assert type(train["skipped_steps"]) is int and type(train["loss"]) is float
    assert evaluation == {"step": 10, "kind": "eval", "accuracy": 0.5}
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_metric_writer_non_finite_values_are_strict_json(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(
            1,
            {
                "loss": float("nan"),
                "grad_norm": jnp.asarray(jnp.inf, jnp.float16),
                "low": np.float32(-np.inf),
                "missing": None,
            },
        )
    line = (tmp_path / "metrics.jsonl").read_text()
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    (record,) = _lines(tmp_path)
    assert record["loss"] == "nan" and record["grad_norm"] == "inf" and record["low"] == "-inf"
    assert record["missing"] is None
    assert math.isnan(float(record["loss"])) and float(record["low"]) == -math.inf


def test_metric_writer_rejects_bad_metrics(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match="'loss' must be a scalar, got an array of shape"):
            writer.write(1, {"loss": np.ones(8)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            writer.write(1, {"step": 3})


def test_metric_writer_appends_across_instances(tmp_path):
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
        writer.write(2, {"loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "kind": "tr')  # a run killed in the middle of a line
    with MetricWriter(tmp_path, tensorboard=False) as writer:  # the resumed run
        writer.write(3, {"loss": 3.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    records = [json.loads(line) for i, line in enumerate(lines) if i != 2]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_metric_writer_tensorboard_scalars(tmp_path):
    with MetricWriter(tmp_path) as writer:
        writer.write(5, {"loss": np.float32(0.25), "grads_finite": True, "skipped_steps": 2})
        writer.write(5, {"accuracy": 0.5}, kind="eval")
        writer.flush()
    scalars = _scalars(tmp_path)
    assert scalars == {
        ("train/loss", 5): 0.25,
        ("train/grads_finite", 5): 1.0,
        ("train/skipped_steps", 5): 2.0,
        ("eval/accuracy", 5): 0.5,
    }
    assert (tmp_path / "metrics.jsonl").exists()


def test_metric_writer_writes_an_overflows_inf_to_tensorboard_quietly(tmp_path, caplog):
    # A skipped step's gradient norm is inf on purpose; tensorboardX warned about each one.
    with caplog.at_level(logging.WARNING), MetricWriter(tmp_path) as writer:
        writer.write(5, {"grad_norm": np.float32(np.inf), "loss": np.float32(np.nan)})
        writer.flush()
    scalars = _scalars(tmp_path)
    assert scalars[("train/grad_norm", 5)] == np.inf and np.isnan(scalars[("train/loss", 5)])
    assert "NaN or Inf" not in caplog.text


def test_metric_writer_events_carry_module_paths_to_jsonl_and_tensorboard(tmp_path):
    with MetricWriter(tmp_path) as writer:
        writer.write_event(7, "overflow", grads_nonfinite=["Block_0/Dense_1", "head"])
        writer.write(8, {"loss": 0.5})
        with pytest.raises(ValueError, match="reserved"):
            writer.write_event(9, "overflow", step=3)
    lines = _lines(tmp_path)
    assert lines[0] == {
        "step": 7,
        "kind": "overflow",
        "grads_nonfinite": ["Block_0/Dense_1", "head"],
    }
    assert lines[1]["kind"] == "train" and len(lines) == 2
    texts = [
        (value.tag, event.step, value.tensor.string_val[0].decode())
        for path in sorted(tmp_path.glob("events.out.tfevents.*"))
        for event in _events(path)
        for value in event.summary.value
        if value.tensor.string_val
    ]
    assert texts == [("overflow/text_summary", 7, "grads_nonfinite: Block_0/Dense_1, head")]
    with MetricWriter(tmp_path, enabled=False) as quiet:
        quiet.write_event(10, "overflow", grads_nonfinite=[])
    assert len(_lines(tmp_path)) == 2


def test_metric_writer_purge_step_marks_restart(tmp_path):
    from tensorboardX.proto import event_pb2

    with MetricWriter(tmp_path) as writer:
        writer.write(50, {"loss": 1.0})
    # A run resumed from step 40 within the same second: the first run's file must survive.
    with MetricWriter(tmp_path, purge_step=40) as writer:
        writer.write(41, {"loss": 2.0})
    files = sorted(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 2  # one per run; TensorBoard reads them as one timeline
    assert _scalars(tmp_path) == {("train/loss", 50): 1.0, ("train/loss", 41): 2.0}
    restarts = [e for e in _events(files[-1]) if e.session_log.status == event_pb2.SessionLog.START]
    assert [e.step for e in restarts] == [40]


def test_metric_writer_config_json(tmp_path):
    config = {
        "model": "resnet",
        "model_config": {"widths": (16, 32), "dropout": None},
        "optim": {"lr": 0.1, "betas": [0.9, np.float32(0.999)], "clip": float("inf")},
        "dtype": np.dtype("float16"),
        "param_dtype": jnp.bfloat16,
        "module": MetricWriter,
        "steps": np.int64(10),
    }
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write_config(config)
        config["steps"] = 20  # written again, e.g. by a resumed run with more steps
        writer.write_config(config)
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "model": "resnet",
        "model_config": {"widths": [16, 32], "dropout": None},
        "optim": {"lr": 0.1, "betas": [0.9, 0.999], "clip": "inf"},
        "dtype": "float16",
        "param_dtype": "bfloat16",
        "module": "jamp.train.metrics.MetricWriter",
        "steps": 20,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_mean_metrics_means_and_last_values():
    window = [
        {
            "loss": np.float32(1.0),
            "grads_finite": np.bool_(True),
            "loss_scale": np.float32(1024.0),
            "skipped_steps": np.int32(4),
            "step": np.int32(9),
        },
        {
            "loss": np.float32(2.0),
            "grads_finite": np.bool_(False),
            "loss_scale": np.float32(512.0),
            "skipped_steps": np.int32(5),
            "step": np.int32(10),
        },
        {"loss": 6.0, "grads_finite": True, "loss_scale": 512.0, "skipped_steps": 5, "step": 11},
        {"loss": 3.0, "grads_finite": True, "loss_scale": 512.0, "skipped_steps": 5, "step": 12},
    ]
    out = mean_metrics(window)
    assert out == {
        "loss": 3.0,
        "grads_finite": 0.75,
        "loss_scale": 512.0,
        "skipped_steps": 5,
        "step": 12,
    }
    assert type(out["skipped_steps"]) is int and type(out["loss_scale"]) is float
    assert LAST_VALUE_KEYS == {"loss_scale", "skipped_steps", "step"}


def test_mean_metrics_flattens_the_per_module_flags():
    window = [
        {"loss": 1.0, "grads_finite_by_module": {"a": True, "b": False}},
        {"loss": 3.0, "grads_finite_by_module": {"a": True, "b": True}},
    ]
    assert mean_metrics(window) == {
        "loss": 2.0,
        "grads_finite_by_module/a": 1.0,
        "grads_finite_by_module/b": 0.5,
    }


def test_mean_metrics_edge_cases():
    assert mean_metrics([]) == {}
    out = mean_metrics([{"loss": np.float32(np.nan)}, {"loss": 1.0, "accuracy": 0.5}])
    assert out["loss"] == 1.0 and out["accuracy"] == 0.5  # a skipped step's nan is left out
    out = mean_metrics([{"grad_norm": np.inf}, {"grad_norm": np.float32(np.nan)}])
    assert math.isnan(out["grad_norm"])  # nothing finite: the last value shows
    replicated = mean_metrics([{"loss": np.full(8, 2.0), "skipped_steps": np.full(8, 3)}])
    assert replicated == {"loss": 2.0, "skipped_steps": 3}


def test_summary_table_is_aligned():
    table = summary_table(
        {
            "policy": "mixed_float16",
            "steps": 1000,
            "skipped steps": 3,
            "final loss scale": np.float32(32768.0),
            "eval accuracy": 0.97123,
            "throughput (examples/s)": 12345.678,
            "wall time (s)": 61.25,
            "peak memory (MiB)": {"host": 812.44, "device": None},
        }
    )
    lines = table.splitlines()
    assert lines == [
        "policy                   mixed_float16",
        "steps                    1000",
        "skipped steps            3",
        "final loss scale         32768",
        "eval accuracy            0.9712",
        "throughput (examples/s)  12345.7",
        "wall time (s)            61.25",
        "peak memory (MiB)        host 812.4, device n/a",
    ]
    assert summary_table({}) == ""


def test_peak_memory_probes():
    host = peak_host_memory_mib()
    assert host is not None and 10 < host < 1e6  # this process holds jax: tens of MiB at least
    assert peak_device_memory_mib() is None  # the CPU backend keeps no statistics
    assert peak_memory_mib() == {"host": pytest.approx(host, rel=0.5), "device": None}
