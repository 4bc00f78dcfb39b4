"""jamp.train.optim: optimizers and schedules from a dataclass, with clear errors."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jamp.train.optim import OPTIMIZERS, SCHEDULES, OptimConfig, make_optimizer


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_optim_every_combination_takes_a_descent_step(optimizer, schedule):
    cfg = OptimConfig(
        optimizer=optimizer,
        schedule=schedule,
        learning_rate=0.1,
        warmup_steps=1,
        num_train_steps=10,
        weight_decay=1e-4,
    )
    tx, lr = make_optimizer(cfg)
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    for _ in range(3):  # past the warmup's zero learning rate
        grads = {"w": 2 * params["w"]}  # d/dw of |w|^2
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert float(jnp.sum(params["w"] ** 2)) < 5.0
    assert float(lr(0)) >= 0.0


def test_optim_schedules_shape():
    warm = make_optimizer(
        OptimConfig(
            schedule="warmup_cosine", learning_rate=1.0, warmup_steps=10, num_train_steps=100
        )
    )[1]
    np.testing.assert_allclose([warm(0), warm(10), warm(100)], [0.0, 1.0, 0.0], atol=1e-6)
    cos = make_optimizer(OptimConfig(schedule="cosine", learning_rate=1.0, num_train_steps=100))[1]
    np.testing.assert_allclose([cos(0), cos(50), cos(100)], [1.0, 0.5, 0.0], atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"optimizer": "adamax9"}, "adamax9"),
        ({"schedule": "zigzag"}, "zigzag"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"warmup_steps": 5, "num_train_steps": 2}, "warmup_steps"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_optim_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        OptimConfig(**kwargs)
