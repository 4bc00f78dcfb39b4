"""Multi-process training: `python -m jamp.train` as 2 processes x 2 CPU devices, joined by
jax.distributed on 127.0.0.1 with JAX's CPU collectives (gloo), against 1 process x 4 devices.

The two runs see the same global batches and average over the same 4 devices, so they train the
same model; they are not bit-identical because gloo sums the 4 gradients in another order than
XLA's in-process all-reduce. That fp32 round-off (1e-7 relative in the averaged gradient) is then
magnified by the fp16 policy, whose casts of the params to fp16 round differently once a param
differs in its last fp32 bit: after 12 Adam steps of 1e-3 the params differ by ~2e-6, and by up
to 5e-5 in one output channel (see PARAM_ATOL).
A real fault (a process reading the wrong slice, no averaging across processes) changes every
update by the order of the learning rate.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from subproc import cli_env

from jamp import data as data_lib
from jamp.data import pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = ["--config=configs/synthetic.py:smoke", "--config.image_shape=(8, 8, 1)"]
STEPS = 12  # the smoke variant's num_train_steps
TIMEOUT = 240  # seconds for one run of the program, start-up and compiles included
# Params of the fp16 runs agree to ~2e-6 here (see the module docstring), except where the
# chaos of fp16 rounding moves a whole output channel: since the first convolution's weight
# gradient comes back in fp32 (its patch-matmul lowering), one channel of the second differs by
# up to 5.1e-5 (104 of 18,432 weights). A fault moves nearly every weight by ~1e-3 (the learning
# rate), so: every weight within 10% of one update, and all but 1% within 1% of one update.
PARAM_ATOL = 1e-4
PARAM_CLOSE_ATOL, PARAM_CLOSE_FRACTION = 1e-5, 0.99


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cmd(workdir, *extra) -> list[str]:
    return [sys.executable, "-m", "jamp.train", *SMOKE, f"--workdir={workdir}", *extra]


@contextlib.contextmanager
def _processes(workdir, num_processes, devices, *extra):
    """Starts the program as `num_processes` processes; kills any left running on the way out."""
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            _train_cmd(
                workdir,
                f"--coordinator_address={address}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
                *extra,
            ),
            cwd=ROOT,
            env=cli_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num_processes)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _wait(procs) -> list[str]:
    """Waits for every process to succeed (within TIMEOUT in all); returns their stdouts."""
    deadline, stdouts = time.monotonic() + TIMEOUT, []
    for i, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, f"process {i} exited with {proc.returncode}:\n{stderr[-3000:]}"
        stdouts.append(stdout)
    return stdouts


def _train_one_process(workdir, devices, *extra):
    out = subprocess.run(
        _train_cmd(workdir, *extra),
        cwd=ROOT,
        env=cli_env(devices),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _checkpoint(workdir, step):
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(workdir / "checkpoints" / str(step) / "default")
    return jax.tree.map(np.asarray, tree)


def _records(workdir, kind):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _dataset(process_index, process_count, batch_size=12):
    cfg = data_lib.DataConfig(
        "synthetic_images",
        batch_size=batch_size,
        image_shape=(4, 4, 1),
        num_synthetic_examples=30,  # 7 eval examples: the last process's share is padding only
        process_index=process_index,
        process_count=process_count,
    )
    return data_lib.get_dataset(cfg, num_devices=batch_size)


@pytest.mark.parametrize("in_memory", [True, False], ids=["in_memory", "grain"])
def test_data_process_slices_concatenate_to_the_global_batch(in_memory, monkeypatch):
    if not in_memory:
        monkeypatch.setattr(pipeline, "CACHE_BYTES", 0)
    one = _dataset(0, 1)
    three = [_dataset(i, 3) for i in range(3)]
    assert [ds.local_batch_size for ds in three] == [4, 4, 4]
    whole = list(itertools.islice(one.train_batches(start_step=5), 4))  # across an epoch's end
    parts = [list(itertools.islice(ds.train_batches(start_step=5), 4)) for ds in three]
    for k, batch in enumerate(whole):
        for key, value in batch.items():
            np.testing.assert_array_equal(value, np.concatenate([p[k][key] for p in parts]))
    whole = list(one.eval_batches())
    parts = [list(ds.eval_batches()) for ds in three]
    assert [len(p) for p in parts] == [len(whole)] * 3  # every process joins every eval step
    for k, batch in enumerate(whole):
        for key, value in batch.items():
            np.testing.assert_array_equal(value, np.concatenate([p[k][key] for p in parts]))
    np.testing.assert_array_equal(parts[2][-1]["mask"], np.zeros(4))


def test_train_bad_distributed_flags_are_one_line(tmp_path):
    out = subprocess.run(
        _train_cmd(tmp_path / "run", "--num_processes=2", "--process_id=0"),
        cwd=ROOT,
        env=cli_env(2),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "multi-process" in lines[0] and "coordinator" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_train_two_processes_match_one_process_with_the_same_devices(tmp_path):
    single, multi = tmp_path / "1x4", tmp_path / "2x2"
    # The two processes stop half way and resume: every process restores the checkpoint.
    with _processes(multi, 2, 2, f"--config.num_train_steps={STEPS // 2}") as procs:
        one = _train_one_process(single, 4)  # meanwhile, all 12 steps
        _wait(procs)
    with _processes(multi, 2, 2) as procs:
        stdouts = _wait(procs)

    # Only process 0 reports and writes metrics.
    assert "eval accuracy" in stdouts[0] and "eval accuracy" not in stdouts[1]
    assert "eval accuracy" in one.stdout
    assert len(list(multi.glob("events.out.tfevents*"))) == 2  # one per start of process 0
    assert (multi / "config.json").exists()
    assert _records(multi, "train")[-1]["step"] == _records(single, "train")[-1]["step"] == STEPS
    assert _records(multi, "eval")[-1]["accuracy"] == _records(single, "eval")[-1]["accuracy"]

    a, b = _checkpoint(single, STEPS), _checkpoint(multi, STEPS)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for name in ("step", "skipped_steps", "loss_scale"):  # counters and powers of two: exact
        for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name])):
            np.testing.assert_array_equal(x, y)
    assert int(b["step"]) == STEPS
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_allclose(y, x, rtol=0, atol=PARAM_ATOL)
        close = np.mean(np.abs(np.asarray(y) - np.asarray(x)) <= PARAM_CLOSE_ATOL)
        assert close >= PARAM_CLOSE_FRACTION, (np.shape(x), close)


def test_train_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    workdir = tmp_path / "run"
    extra = ["--config.num_train_steps=100000", "--config.checkpoint_every_steps=100000"]
    with _processes(workdir, 2, 2, "--config.log_every_steps=5", *extra) as procs:
        deadline = time.monotonic() + TIMEOUT
        while not (workdir / "metrics.jsonl").exists():  # process 0 logged step 5
            assert all(p.poll() is None for p in procs), "a process ended early"
            assert time.monotonic() < deadline, "no metrics within the time-out"
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)  # process 0 is not told
        stdouts = _wait(procs)
    assert "stopped by SIGTERM" in stdouts[1]
    assert "stopped by a signal to another process" in stdouts[0]
    steps = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and steps[0] % 5 == 0 and steps[0] < 100000
