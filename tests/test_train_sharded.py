"""`python -m jamp.train --config.parallelism=sharded`: the sharded-jit path of the program."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from subproc import cli_env, forked_cli, recipe_state

from jamp.train.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, EVERY = 20, 10
SHARDED = ["--config.parallelism=sharded", "--config.mesh=data=2,fsdp=4"]
OVERRIDES = {
    "num_train_steps": STEPS,
    "checkpoint_every_steps": EVERY,
    "log_every_steps": EVERY,
    "eval_every_steps": 1000,
    "loss_scale_params.growth_interval": 5,
}

# Reading checkpoints leaves Orbax callbacks for closed event loops (see test_checkpoint.py).
pytestmark = [
    pytest.mark.program,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _command(workdir, data_dir, *extra, steps=STEPS):
    flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, "num_train_steps": steps}.items()]
    return [
        sys.executable,
        "-m",
        "jamp.train",
        "--config=default",
        f"--workdir={workdir}",
        f"--config.data_dir={data_dir}",
        *flags,
        *extra,
    ]


def _run(workdir, data_dir, *extra, steps=STEPS, devices=8):
    out = forked_cli(_command(workdir, data_dir, *extra, steps=steps)[3:], devices)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def target(data_dir):
    """A fresh TrainState of the recipe, built the way jamp.train.loop builds it: the restore target."""
    return recipe_state(data_dir)


def _final(workdir, target):
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step=STEPS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir, target):
    workdir = tmp_path_factory.mktemp("sharded") / "run"
    out = _run(workdir, data_dir, *SHARDED)
    assert "sharded jit, mesh data=2, fsdp=4" in out.stdout
    return _final(workdir, target)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_train_sharded_matches_one_device(tmp_path, data_dir, target, reference):
    # The sharded step's gradients are those of the global batch, as on one device (under pmap
    # each device's fp16 gradients are of its own share, larger, and overflow sooner).
    out = _run(tmp_path / "one", data_dir, devices=1)
    assert "pmap over 1 devices" in out.stdout
    one = _final(tmp_path / "one", target)
    assert int(one.skipped_steps) == int(reference.skipped_steps)
    assert float(one.loss_scale.loss_scale) == float(reference.loss_scale.loss_scale)
    # fp16 operands summed in another order, then 20 Adam steps (which turn near-zero gradients'
    # round-off into full steps): compared by the norm of the update.
    got, want, start = (
        np.concatenate([x.ravel() for x in _leaves(t.params)]) for t in (reference, one, target)
    )
    assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want - start)


def test_train_sharded_resumes_bit_identically_after_sigkill(tmp_path, data_dir, target, reference):
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(workdir, data_dir, *SHARDED),
        cwd=ROOT,
        env=cli_env(8),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not (workdir / "checkpoints" / str(EVERY)).exists() and proc.poll() is None:
            assert time.time() < deadline
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = _run(workdir, data_dir, *SHARDED)
    assert f"resuming from the checkpoint at step {EVERY}" in out.stdout
    for got, want in zip(_leaves(_final(workdir, target)), _leaves(reference)):
        np.testing.assert_array_equal(got, want, strict=True)


def test_train_pmap_checkpoint_resumes_sharded_and_back(tmp_path, data_dir, target):
    workdir = tmp_path / "switch"
    _run(workdir, data_dir, steps=EVERY)  # pmap to step 10
    out = _run(workdir, data_dir, *SHARDED, "--config.mesh=fsdp=8", steps=15)
    assert f"resuming from the checkpoint at step {EVERY}" in out.stdout
    out = _run(workdir, data_dir)  # and on to 20 under pmap again
    assert "resuming from the checkpoint at step 15" in out.stdout
    assert int(_final(workdir, target).step) == STEPS
