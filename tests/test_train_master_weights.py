"""The training program with bfloat16 params and low-bit optimizer state: the flags reach the
state, a stopped-and-resumed run ends bit-identical to an uninterrupted one, the summary says the
bytes per parameter."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from subproc import forked_cli, recipe_state

from jamp import lowbit
from jamp.train.checkpoint import Checkpointer

FLAGS = {
    "policy": "mixed_bfloat16,params=bf16",
    "optimizer_state": "int8",
    "checkpoint_every_steps": 6,
    "log_every_steps": 6,
    "eval_every_steps": 1000,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from jamp.train.data import prepare_digits

    path = tmp_path_factory.mktemp("tfds")
    prepare_digits(str(path))
    return path


def _run(workdir, data_dir, steps):
    flags = {**FLAGS, "num_train_steps": steps, "data_dir": str(data_dir)}
    args = ["--config=configs/default.py", f"--workdir={workdir}"]
    out = forked_cli(args + [f"--config.{k}={v}" for k, v in flags.items()], 2)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@pytest.mark.program
def test_program_bf16_params_8bit_state_resume_bit_identical(tmp_path, data_dir):
    target = recipe_state(data_dir, {k: v for k, v in FLAGS.items() if "every" not in k})
    assert jax.tree.leaves(target.params)[0].dtype == np.dtype("bfloat16")
    assert any(isinstance(x, lowbit.Quantized) for x in jax.tree.leaves(
        target.opt_state, is_leaf=lambda x: isinstance(x, lowbit.Quantized)))  # fmt: skip
    whole = _run(tmp_path / "whole", data_dir, 12)
    assert "state bytes per param" in whole and "bfloat16 params, stochastic rounding" in whole
    _run(tmp_path / "parts", data_dir, 6)
    resumed = _run(tmp_path / "parts", data_dir, 12)
    assert "resuming from the checkpoint at step 6" in resumed
    with Checkpointer(tmp_path / "whole" / "checkpoints") as a:
        ref = a.restore(target)
    with Checkpointer(tmp_path / "parts" / "checkpoints") as b:
        got = b.restore(target)
    assert int(got.step) == int(ref.step) == 12
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
