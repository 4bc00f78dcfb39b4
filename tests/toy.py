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


def h200x8_llama_report(loss_of):
    """The compile report (`jamp.compile_for`) of a small wrapped LlamaLM's sharded train step
    (8 H200s, fsdp=8, batch 16 x 64, AdamW), its loss `loss_of(model, params, tokens)`."""
    import optax

    import jamp
    from jamp import sharding
    from jamp import target as target_lib
    from jamp.models.llama import LlamaLM

    target = target_lib.get_target("h200x8")
    mesh = target.mesh("fsdp=8")
    shape = dict(vocab_size=1024, num_layers=2, d_model=256, num_heads=4, num_kv_heads=2)
    model = jamp.wrap(LlamaLM(**shape, mlp_dim=768, max_len=64), "mixed_bfloat16")
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    tx = optax.adamw(1e-4)
    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx))

    def loss_fn(p, model_state, batch, rng):
        return loss_of(model, p, batch["tokens"]), (model_state, {})

    step = sharding.make_sharded_train_step(
        jamp.make_train_step(loss_fn, tx), mesh, sharding.state_shardings(state, mesh)
    )
    return target_lib.compile_for(
        step,
        state,
        {"tokens": jax.ShapeDtypeStruct((16, 65), jnp.int32)},
        jax.eval_shape(lambda: jax.random.key(0)),
        target=target,
    )


def spy_attend_shapes(monkeypatch):
    """Record the (q, k, v) shapes of every fused attention call (jamp.attention.attend)."""
    from jamp import attention

    calls = []
    original = attention.attend

    def spy(q, k, v, **kw):
        calls.append((q.shape, k.shape, v.shape))
        return original(q, k, v, **kw)

    monkeypatch.setattr(attention, "attend", spy)
    return calls
