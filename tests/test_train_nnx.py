"""`python -m jamp.train` on Flax NNX models: the real CLI in subprocesses, offline."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from subproc import recipe_state
from test_train import ROOT, _cli, _records, _smoke

from jamp.train.checkpoint import Checkpointer

pytestmark = pytest.mark.program

STEPS, EVERY = 12, 6
FLAGS = [
    "--config.policy=mixed_bfloat16",  # chosen by the same flag as for linen models
    f"--config.num_train_steps={STEPS}",
    f"--config.checkpoint_every_steps={EVERY}",
    "--config.max_checkpoints_to_keep=5",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    workdir = tmp_path_factory.mktemp("nnx") / "run"
    return workdir, _smoke("digits_nnx", workdir, data_dir, *FLAGS)


def test_train_nnx_recipe_trains_under_the_policy_flag(reference):
    workdir, out = reference  # (the fp16 loss-scaled step on NNX models: tests/test_nnx.py)
    assert "compute=bfloat16" in out.stdout and "NoOpLossScale" in out.stdout
    assert _records(workdir, "train")[-1]["loss"] > 0
    assert 0 <= _records(workdir, "eval")[-1]["accuracy"] <= 1


def _restore(workdir, data_dir, step):
    target = recipe_state(data_dir, {"policy": "mixed_bfloat16"}, recipe="digits_nnx")
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step)


def test_train_nnx_resume_is_bit_identical(reference, tmp_path, data_dir):
    workdir, _ = reference
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))  # as if killed after step 6's save
    out = _smoke("digits_nnx", resumed, data_dir, *FLAGS)
    assert f"resuming from the checkpoint at step {EVERY}" in out.stdout
    want, got = _restore(workdir, data_dir, STEPS), _restore(resumed, data_dir, STEPS)
    assert set(want.params) == {"conv1", "conv2", "dense1", "dense2"}  # the NNX attributes
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


RESNET = {  # the NNX ResNet-20, 4 filters, on small synthetic images
    "model": "resnet20_nnx",
    "model_config.num_filters": 4,
    "image_shape": (8, 8, 3),
    "policy": "mixed_bfloat16",
    "num_train_steps": 4,
    "checkpoint_every_steps": 4,
}


def test_train_nnx_resnet_keeps_fp32_batch_statistics(tmp_path, data_dir):
    recipe = tmp_path / "resnet_nnx.py"
    lines = [f"    c.{k} = {v!r}" for k, v in RESNET.items()]
    recipe.write_text(
        "import runpy\n"
        f"_synthetic = runpy.run_path({str(ROOT / 'configs' / 'synthetic.py')!r})\n"
        "def get_config(variant=''):\n"
        "    c = _synthetic['get_config']('smoke')\n" + "\n".join(lines) + "\n    return c\n"
    )
    workdir = tmp_path / "resnet"
    _cli([f"--config={recipe}", f"--workdir={workdir}", f"--config.data_dir={data_dir}"])
    target = recipe_state(data_dir, RESNET, recipe="synthetic")
    with Checkpointer(workdir / "checkpoints") as ckpt:
        state = ckpt.restore(target, 4)
    stats = jax.tree.leaves(state.model_state)
    assert stats and {np.asarray(a).dtype for a in stats} == {np.dtype(np.float32)}
    fresh = jax.tree.leaves(target.model_state)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(stats, fresh))


def test_train_nnx_trace_nonfinite_reruns_a_skipped_batch_through_the_nnx_model(tmp_path, data_dir):
    # A static loss scale far past float16: every step's gradients overflow and are skipped;
    # the re-run of each batch checks every NNX submodule's output (finite: the forward is fine).
    workdir = tmp_path / "run"
    out = _smoke(
        "digits_nnx",
        workdir,
        data_dir,
        "--config.trace_nonfinite=true",
        "--config.policy=mixed_float16",
        "--config.loss_scale=static",
        "--config.loss_scale_params.initial=1e30",
        "--config.num_train_steps=3",
    )
    traces = _records(workdir, "overflow_trace")
    assert [r["step"] for r in traces] == [1, 2, 3], out.stderr[-3000:]
    assert all(r["forward_nonfinite"] == [] for r in traces)
    assert "forward pass finite" in out.stderr
