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


def nnx_boom_net(policy, activations="auto"):
    """A `jamp.wrap`ped NNX net whose `boom` submodule (a Linear times 1e4) leaves float16's
    range for inputs of size ~10: hidden -> boom(linear) -> norm -> head."""
    from flax import nnx

    import jamp

    class Boom(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return self.linear(x) * 1e4

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 8, rngs=rngs)
            self.boom = Boom(rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.norm(self.boom(nnx.relu(self.hidden(x)))))

    return jamp.wrap(Net(nnx.Rngs(0)), policy, activations=activations)


class NnxView:
    """A wrapped NNX model behind an `apply(variables, x, ...)`, as the training program's view
    has it (what range_report, forward_nonfinite and the loss's forward flags take)."""

    def __init__(self, model):
        import jamp

        self.functional, params, self.model_state = jamp.nnx.split(model)
        self.variables = {"params": params}

    def apply(self, variables, x, train=False, rngs=None, mutable=False):
        del train, rngs, mutable
        return self.functional.merge(variables["params"], self.model_state)(x)
