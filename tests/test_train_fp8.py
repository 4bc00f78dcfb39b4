"""`python -m jamp.train` under fp8 policies: the real CLI in subprocesses, offline, on the LM
recipe (the digits CNN's matmuls are few: the LM has 6 per block)."""

from __future__ import annotations

import json
import pathlib
import runpy
import shutil

import jax
import numpy as np
import pytest
from subproc import recipe_state
from test_train import _records, _smoke

import jamp
from jamp.train.checkpoint import Checkpointer

pytestmark = pytest.mark.program

STEPS, EVERY = 12, 6
FLAGS = [
    "--config.policy=mixed_fp8",
    f"--config.num_train_steps={STEPS}",
    f"--config.checkpoint_every_steps={EVERY}",
    "--config.max_checkpoints_to_keep=5",
    "--config.fp8_history=4",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    workdir = tmp_path_factory.mktemp("fp8") / "run"
    out = _smoke("lm_pydoc", workdir, data_dir, *FLAGS)
    return workdir, out


def _restore(workdir, data_dir, step):
    smoke = {  # configs/lm_pydoc.py's smoke variant
        "model_config.num_layers": 1,
        "model_config.d_model": 32,
        "model_config.num_heads": 2,
        "model_config.mlp_dim": 64,
        "seq_len": 16,
        "batch_size": 8,
    }
    target = recipe_state(
        data_dir, {"policy": "mixed_fp8", "fp8_history": 4, **smoke}, recipe="lm_pydoc"
    )
    with Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step)


def test_train_fp8_summary_metrics_and_the_checkpointed_state(reference, data_dir):
    workdir, out = reference
    assert "fp8 scaling" in out.stdout and "delayed (amax history 4)" in out.stdout
    assert "matmul=fp8" in out.stdout
    assert "fp8 emulated" in out.stdout  # the hardware row: this CPU has no fp8 matmuls
    train = _records(workdir, "train")
    keys = [k for k in train[-1] if k.startswith("fp8/")]
    # three representative sites (first, middle, last), six numbers each
    assert len(keys) == 18 and all(
        k.rsplit("/", 1)[1] in {"x_amax", "x_scale", "w_amax", "w_scale", "g_amax", "g_scale"}
        for k in keys
    )
    assert all(np.isfinite(train[-1][k]) and train[-1][k] > 0 for k in keys)
    assert _records(workdir, "eval")[-1]["perplexity"] < 256
    config = json.loads((workdir / "config.json").read_text())
    assert config["fp8_recipe"] == "delayed"
    # The fresh state's first step quantised by each tensor's own amax (fp8.calibrating) and was
    # applied: nothing skipped (the plain step would have skipped it, measuring).
    assert int(_restore(workdir, data_dir, EVERY).skipped_steps) == 0
    assert "only measures" not in out.stdout


def test_train_fp8_resume_is_bit_identical(reference, tmp_path, data_dir):
    workdir, _ = reference
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))  # as if killed after step 6's save
    out = _smoke("lm_pydoc", resumed, data_dir, *FLAGS)
    assert f"resuming from the checkpoint at step {EVERY}" in out.stdout
    want, got = _restore(workdir, data_dir, STEPS), _restore(resumed, data_dir, STEPS)
    history = next(iter(got.fp8_state.sites.values())).amax_history
    assert np.all(np.asarray(history) > 0)  # 12 steps filled the history of 4
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _save_named_as_before(workdir, state, names):
    """A checkpoint of `state` at step EVERY with its fp8 sites renamed by `names`."""
    sites = {names(name): site for name, site in state.fp8_state.sites.items()}
    with Checkpointer(workdir / "checkpoints") as ckpt:
        ckpt.save(EVERY, state.replace(fp8_state=state.fp8_state.replace(sites=sites)))


def test_train_fp8_resumes_a_checkpoint_of_the_former_site_names(reference, tmp_path, data_dir):
    """A checkpoint written when fp8 sites were named by the name stack (the model's class name
    on top: "TransformerLM/DecoderBlock_0/Dense_0/dot_general") restores under the params
    paths ("DecoderBlock_0/Dense_0/dot_general"), histories and scales as they were: the run
    goes on bit-identically. One that names a site this model lacks stops with one line."""
    workdir, _ = reference
    state = _restore(workdir, data_dir, EVERY)
    assert sorted(state.fp8_state.sites)[0] == "DecoderBlock_0/Dense_0/dot_general"
    resumed = tmp_path / "resumed"
    _save_named_as_before(resumed, state, lambda name: f"TransformerLM/{name}")
    out = _smoke("lm_pydoc", resumed, data_dir, *FLAGS)
    assert f"resuming from the checkpoint at step {EVERY}" in out.stdout
    want, got = _restore(workdir, data_dir, STEPS), _restore(resumed, data_dir, STEPS)
    assert got.fp8_state.sites.keys() == want.fp8_state.sites.keys()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    other = tmp_path / "other"  # one site is no matmul of this model's
    gone = "TransformerLM/DecoderBlock_0/Dense_9/dot_general"
    _save_named_as_before(
        other, state, lambda name: gone if "Dense_1" in name else f"TransformerLM/{name}"
    )
    out = _smoke("lm_pydoc", other, data_dir, *FLAGS, check=False)
    assert out.returncode != 0
    assert "named as jamp named them before site names were params paths" in out.stderr
    assert repr(gone) in out.stderr and "Traceback" not in out.stderr


def test_the_lm_loss_in_chunks_keeps_the_last_block_in_fp8(data_dir):
    """The LM's loss applies the output head itself, in chunks (jamp.losses), on the model's
    last hidden states: the model's last matmul is then its last block's, not the head, and is
    fp8 like the others (it was kept bfloat16, taken for the head). The adaptive run's loss,
    on logits, has the same sites: every block matmul, the head (tied embedding) bfloat16."""
    from jamp.train import loop, tasks

    root = pathlib.Path(__file__).resolve().parents[1]
    config = runpy.run_path(str(root / "configs" / "lm_pydoc.py"))["get_config"]("smoke")
    config.update(data_dir=str(data_dir), policy="mixed_fp8")
    run, data_cfg, _, _ = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, "lm")
    sites = {}
    for flags in (False, True):
        variables = dict(loop.adapting.abstract_variables(model, dataset.info))
        params = variables.pop("params")
        batch = {"tokens": jax.numpy.zeros((2, dataset.info.input_shape[0] + 1), "int32")}
        loss_fn = tasks.make_loss_fn(model, "lm", forward_flags=flags)
        state = jamp.fp8.init_state(loss_fn, params, variables, batch, jax.random.key(0))
        sites[flags] = sorted(state.sites)
    blocks = config.model_config.num_layers
    assert sites[False] == sites[True] and len(sites[False]) == 6 * blocks, sites
    assert any(name.endswith(f"Block_{blocks - 1}/Dense_1/dot_general") for name in sites[False])
