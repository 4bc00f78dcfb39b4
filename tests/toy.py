"""Small models, a loss function and batches shared by the step and parallel tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """No batch-dependent state: a microbatch split changes nothing but round-off."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


class BNNet(nn.Module):
    """Dense -> BatchNorm -> relu -> Dense: has a mutable 'batch_stats' collection."""

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(8)(x))
        return nn.Dense(1)(nn.relu(x))


def make_loss_fn(model):
    def loss_fn(params, model_state, batch, rng):
        del rng
        variables = {"params": params, **model_state}
        if model_state:
            out, new_model_state = model.apply(variables, batch["x"], mutable=list(model_state))
        else:
            out, new_model_state = model.apply(variables, batch["x"]), {}
        loss = jnp.mean((out[:, 0] - batch["y"]) ** 2)
        return loss, (new_model_state, {"mse": loss})

    return loss_fn


def make_batch(size=16, key=1):
    x = jax.random.normal(jax.random.key(key), (size, 4))
    return {"x": x, "y": x @ jnp.array([1.0, -2.0, 0.5, 3.0])}
