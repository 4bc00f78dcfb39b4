"""One translation from a recipe to a train step (jamp.train.recipe_step): the training loop,
`--compile_for` (jamp.train.plan) and `python -m jamp.inspect` build the step with the same
settings, and start from the same state. Before, the inspect CLI's own copy left out the
parameter rounding, the reduce dtype and the fp8 state, so on a recipe with 16-bit params and
nearest rounding it reported a different step from the one the run takes."""

import pathlib
import runpy

import numpy as np
import pytest

from jamp.train import loop, plan, recipe_step
from jamp.train.data import prepare_digits

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


class _Built(Exception):
    """Raised by the spy once a step's settings are seen: nothing needs to run further."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    prepare_digits(str(path))
    return path


def _config(data_dir, **overrides):
    config = runpy.run_path(str(CONFIGS / "default.py"))["get_config"]()
    config.data_dir = str(data_dir)
    for name, value in overrides.items():
        config[name] = value
    return config


@pytest.fixture
def seen(monkeypatch):
    """The settings each `make_train_step` call of a recipe's step gets, and the state's."""
    found = []

    def spy(loss_fn, tx, **settings):
        settings.pop("axis_name")  # pmap's axis (the loop) or jit's none (plan, inspect)
        found.append(settings)
        raise _Built

    monkeypatch.setattr(recipe_step, "make_train_step", spy)
    return found


# 16-bit params with nearest rounding, gradients reduced in bf16, accumulation and clipping:
# every setting the step takes from the recipe differs from its default.
RECIPE = dict(
    policy="params=bfloat16,compute=bfloat16,output=float32,reduce=bfloat16",
    param_rounding="nearest",
    accumulation_steps=2,
    max_grad_norm=1.0,
)


def test_the_loop_plan_and_inspect_build_the_same_step(data_dir, tmp_path, seen):
    from jamp.inspect.__main__ import inspect_recipe

    config = _config(data_dir, **RECIPE)
    with pytest.raises(_Built):
        loop.train_and_evaluate(config, tmp_path / "run")
    run, data_cfg, optim_cfg, task = loop.parse_config(_config(data_dir, **RECIPE))
    with pytest.raises(_Built):  # the target's devices are not reached before the step
        plan.compile_at(plan.Recipe(run, data_cfg, optim_cfg, task, target=None), 16)
    with pytest.raises(_Built):
        inspect_recipe(_config(data_dir, **RECIPE), None)
    assert len(seen) == 3
    assert seen[0] == seen[1] == seen[2]
    assert seen[0]["param_rounding"] == "nearest"
    assert seen[0]["reduce_dtype"] == np.dtype("bfloat16")
    assert seen[0]["accumulation_steps"] == 2 and seen[0]["max_grad_norm"] == 1.0


def test_the_three_start_from_the_recipes_own_state(data_dir):
    """`loop.fresh_state`: the run's loss scale and its fp8 state (the inspect CLI's state had no
    fp8 sites, so an fp8 recipe's report traced current scaling instead of delayed)."""
    import jax

    config = _config(data_dir, policy="mixed_fp8")
    run, data_cfg, optim_cfg, task = loop.parse_config(config)
    dataset, model = loop.build_model(run, data_cfg, task)
    from jamp.train.optim import make_optimizer

    tx, _ = make_optimizer(optim_cfg)
    state = loop.fresh_state(run, model, tx, dataset.info)
    assert state.fp8_state is not None and state.fp8_state.sites
    abstract = plan.abstract_state(plan.Recipe(run, data_cfg, optim_cfg, task, target=None))[2]
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
