"""Multi-process training: `python -m jamp.train` as 2 processes x 2 CPU devices, joined by
jax.distributed on 127.0.0.1 with JAX's CPU collectives (gloo), against 1 process x 4 devices.

The two runs see the same global batches and average over the same 4 devices, so they train the
same model; they are not bit-identical because gloo sums the 4 gradients in another order than
XLA's in-process all-reduce. That fp32 round-off (1e-7 relative in the averaged gradient) is then
magnified by the fp16 policy, whose casts of the params to fp16 round differently once a param
differs in its last fp32 bit, and by Adam where a gradient is near zero: after 12 Adam steps of
1e-3 the params differ by ~2e-6, and by up to ~3e-4 in a few weights (see PARAM_RTOL).
A real fault (a process reading the wrong slice, no averaging across processes) changes every
update by the order of the learning rate.

The sharded-jit path (`--config.parallelism=sharded`, state split over `fsdp=4`) is checked the
same way, with its checkpoints: each process writes and reads only its own shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from subproc import cli_env, recipe_state

from jamp.train import data as data_lib
from jamp.train.data import pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = ["--config=configs/synthetic.py:smoke", "--config.image_shape=(8, 8, 1)"]
STEPS = 12  # the smoke variant's num_train_steps
TIMEOUT = 240  # seconds for one run of the program, start-up and compiles included
# Params of the fp16 runs agree to ~2e-6 in most weights (see the module docstring), but the
# chaos of rounding moves a few weights further: the convolutions' weight gradients come back
# in fp32, summed in another order over 2 processes than over 1, and Adam magnifies that where a
# gradient is near zero (since the backward convolutions return fp32, single weights were off
# by up to 3.1e-4 in some runs, whole channels by ~1e-5). A fault changes every update by the
# order of the learning rate. So the test compares in norm, against the update (the params'
# change from their init), as the sharded test below does: measured 2.7e-4 (JAX 0.10) and
# 7.2e-4 (0.12) of the update; a process reading the wrong slice makes it 0.70 (sharded test).
PARAM_RTOL = 1e-2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cmd(workdir, *extra) -> list[str]:
    return [sys.executable, "-m", "jamp.train", *SMOKE, f"--workdir={workdir}", *extra]


class _Process:
    """One process of the program, its output going to files: a pipe that nobody reads while the
    test waits on another process fills up (64 KiB) and stalls the process writing to it, and
    with it the other process, waiting for it in a collective."""

    def __init__(self, cmd, devices):
        self.out, self.err = (tempfile.TemporaryFile("w+") for _ in range(2))
        self.popen = subprocess.Popen(
            cmd, cwd=ROOT, env=cli_env(devices), stdout=self.out, stderr=self.err, text=True
        )

    def send_signal(self, sig):
        self.popen.send_signal(sig)

    def poll(self):
        return self.popen.poll()

    def output(self) -> tuple[str, str]:
        for f in (self.out, self.err):
            f.flush()
            f.seek(0)
        return self.out.read(), self.err.read()

    def close(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self.out.close()
        self.err.close()


@contextlib.contextmanager
def _processes(workdir, num_processes, devices, *extra):
    """Starts the program as `num_processes` processes; kills any left running on the way out."""
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        _Process(
            _train_cmd(
                workdir,
                f"--coordinator_address={address}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
                *extra,
            ),
            devices,
        )
        for i in range(num_processes)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.close()


def _ended(procs) -> list[tuple[int, str, str]]:
    """Waits for every process to end (within TIMEOUT in all): (exit code, stdout, stderr) each.
    Past the time-out, fails with what each process printed last."""
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            proc.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:  # ended first: a running process writes at the file's shared offset
            proc.popen.kill()
            proc.popen.wait()
        tails = "".join(
            f"\n--- process {i}: {out[-1500:]}\n{err[-3000:]}"
            for i, (out, err) in enumerate(p.output() for p in procs)
        )
        pytest.fail(f"the processes ran past {TIMEOUT} s:{tails}")
    return [(p.popen.returncode, *p.output()) for p in procs]


def _wait(procs, stderrs=None) -> list[str]:
    """Waits for every process to succeed (within TIMEOUT in all); returns their stdouts (and
    appends their stderrs to `stderrs` if given)."""
    stdouts = []
    for i, (code, stdout, stderr) in enumerate(_ended(procs)):
        assert code == 0, f"process {i} exited with {code}:\n{stderr[-3000:]}"
        stdouts.append(stdout)
        if stderrs is not None:
            stderrs.append(stderr)
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
    return _read_checkpoint(workdir / "checkpoints" / str(step))


def _read_checkpoint(path):
    """The checkpoint's arrays on the host, whatever devices and processes wrote it."""
    one = jax.sharding.make_single_device_sharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path / "default").item_metadata.tree
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), stored
        )
        tree = checkpointer.restore(path / "default", target)
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


@pytest.mark.program
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


@pytest.mark.program
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
    # In norm, against the update (the params' change from init), as for the sharded path.
    start = recipe_state(single, {"image_shape": (8, 8, 1)}, recipe="synthetic").params
    got, want, init = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
        for t in (b["params"], a["params"], start)
    )
    ratio = np.linalg.norm(got - want) / np.linalg.norm(want - init)
    assert ratio <= PARAM_RTOL, ratio


@pytest.mark.program
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


# The sharded-jit path as 2 processes x 2 devices against 1 process x 4, the state split over
# fsdp=4. A loss scale above what fp16 gradients bear, growing every 2 steps, makes 6 of the 12
# steps skip (JAX 0.10 and 0.12 alike): the skip decisions, one for all devices of all processes,
# must agree too. Under policy=float32 the two runs' params agree to 2e-7; under fp16 the
# partitioner's gathers and reductions (in whatever dtype it picks, see README) add in another
# order across processes, and Adam turns that round-off of near-zero gradients into whole steps:
# measured, the params differ by 9.4e-4 of the update (their change from init) in norm, by up to
# 1.0e-3 in a weight. A process reading the wrong slice of the batch makes that ratio 0.70.
SHARDED = ["--config.parallelism=sharded", "--config.mesh=fsdp=4"]
SKIPPING = [
    "--config.loss_scale_params.initial=16777216",
    "--config.loss_scale_params.growth_interval=2",
]
SHARDED_RTOL = 1e-2  # of the update, in norm


@dataclasses.dataclass
class _ShardedRuns:
    single: pathlib.Path  # 1 x 4, 12 steps
    multi: pathlib.Path  # 2 x 2: 12 steps, then its step 12 damaged and the run resumed
    intact: pathlib.Path  # the 2 x 2 run's step-12 checkpoint before the damage
    first: list  # stdouts of the uninterrupted 2 x 2 run
    resumed: list  # stdouts of the resumed one
    resumed_stderr: list


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    single, multi, intact = root / "1x4", root / "2x2", root / "intact"
    flags = [*SHARDED, *SKIPPING]
    with _processes(multi, 2, 2, *flags) as procs:
        _train_one_process(single, 4, *flags)  # meanwhile
        first = _wait(procs)
    last = multi / "checkpoints" / str(STEPS)
    shutil.copytree(last, intact)
    # Damage only what process 1 wrote, and alone reads back: its shards of step 12. Both
    # processes must agree to fall back to step 6, or they would resume from different steps.
    damaged = list(last.glob("default/ocdbt.process_1/d/*"))
    assert damaged, sorted(p.name for p in last.rglob("*"))
    for path in damaged:
        path.write_bytes(path.read_bytes()[:100])
    stderrs = []
    with _processes(multi, 2, 2, *flags) as procs:
        resumed = _wait(procs, stderrs)
    return _ShardedRuns(single, multi, intact, first, resumed, stderrs)


@pytest.mark.program
def test_sharded_two_processes_match_one_process_with_the_same_devices(sharded):
    assert "sharded jit, mesh fsdp=4" in sharded.first[0]
    assert "eval accuracy" not in sharded.first[1]  # process 0 reports
    a, b = _checkpoint(sharded.single, STEPS), _read_checkpoint(sharded.intact)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for name in ("step", "skipped_steps", "loss_scale"):  # counters and powers of two: exact
        for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name])):
            np.testing.assert_array_equal(x, y)
    assert int(b["step"]) == STEPS and int(b["skipped_steps"]) > 0
    start = recipe_state(sharded.single, {"image_shape": (8, 8, 1)}, recipe="synthetic").params
    got, want, init = (
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
        for t in (b["params"], a["params"], start)
    )
    assert np.linalg.norm(got - want) <= SHARDED_RTOL * np.linalg.norm(want - init)
    single, multi = _records(sharded.single, "eval")[-1], _records(sharded.multi, "eval")[-1]
    assert abs(multi["accuracy"] - single["accuracy"]) <= 0.01


@pytest.mark.program
def test_sharded_two_process_checkpoint_resumes_on_both_processes(sharded):
    # Step 12 was damaged in process 1's shards only: both processes went back to step 6, the
    # damaged one was set aside, and the resumed run ends where the uninterrupted one did.
    for stdout in sharded.resumed:
        assert "resuming from the checkpoint at step 6" in stdout
    assert "process 1 cannot read its part" in sharded.resumed_stderr[0]
    for stderr in sharded.resumed_stderr:  # the failed reads' leftovers are not printed
        assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert (sharded.multi / "checkpoints" / f"{STEPS}.corrupt").is_dir()
    a, b = _read_checkpoint(sharded.intact), _checkpoint(sharded.multi, STEPS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(y, x, strict=True)


@pytest.mark.program
def test_sharded_mesh_for_other_devices_is_one_line_on_every_process(tmp_path):
    with _processes(tmp_path / "run", 2, 2, *SHARDED, "--config.mesh=fsdp=8") as procs:
        ended = _ended(procs)
    for code, _, stderr in ended:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, lines
        assert "mesh 'fsdp=8' needs 8 devices; there are 4 (cpu x4 over 2 process(es))" in lines[0]
    assert not (tmp_path / "run").exists()
