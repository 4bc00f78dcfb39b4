"""jamp.inspect.overflow: re-running a batch names the module whose forward output overflowed."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from toy import NnxView, nnx_boom_net

import jamp
from jamp.inspect.overflow import forward_nonfinite


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="reader")(nn.Dense(4)(x))


class Hot(nn.Module):
    """`gain` scales Block_0's input; in fp16 its first Dense reads it as inf once past 65504."""

    gain: float = 1.0

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(4, name="stem")(x) * self.gain
        x = Block()(x)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(2, name="head")(x)


X = jax.random.normal(jax.random.key(1), (3, 5))


def _variables(model):
    return model.init(jax.random.key(0), X)


def test_forward_nonfinite_names_the_innermost_module_first():
    model = jamp.wrap(Hot(gain=1e7), "mixed_float16")
    found = forward_nonfinite(model, _variables(model), X, train=True, rngs={"dropout": KEY})
    assert found.first == "Block_0/Dense_0"
    # The overflow spreads: its enclosing block and everything after it, the model last.
    assert found.modules == (
        "Block_0/Dense_0",
        "Block_0/reader",
        "Block_0",
        "Dropout_0",
        "LayerNorm_0",
        "head",
        "",
    )
    assert not found.output_finite
    assert "Block_0/Dense_0" in found.describe()


def test_forward_nonfinite_finds_nothing_where_fp32_or_a_small_gain_is_finite():
    for policy, gain in (("float32", 1e7), ("mixed_float16", 1.0)):
        model = jamp.wrap(Hot(gain=gain), policy)
        found = forward_nonfinite(model, _variables(model), X)
        assert found.modules == () and found.first is None and found.output_finite
        assert "backward" in found.describe()


def test_forward_nonfinite_on_an_unwrapped_model_and_a_nan_input():
    model = Hot()
    bad = X.at[0, 0].set(jnp.nan)
    found = forward_nonfinite(model, _variables(model), bad)
    assert found.first == "stem"


KEY = jax.random.key(2)


# ----- a jamp.wrapped NNX model (through an apply, as the training program's view has it)


def _nnx_view(policy, activations="compute"):
    view = NnxView(nnx_boom_net(policy, activations=activations))
    return view, view.variables


def test_forward_nonfinite_names_the_nnx_submodule_where_it_began():
    view, variables = _nnx_view("mixed_float16")  # 16-bit activations: boom's output is inf
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))
    found = forward_nonfinite(view, variables, x, train=True)
    assert found.first == "boom" and not found.output_finite
    assert "boom/linear" not in found.modules and "hidden" not in found.modules
    assert set(found.modules) == {"boom", "norm", "head", ""}  # then what it flowed into
    fine, fine_vars = _nnx_view("float32")
    assert forward_nonfinite(fine, fine_vars, x, train=True).modules == ()


def test_loss_forward_flags_of_an_nnx_model():
    from jamp.train import tasks

    view, variables = _nnx_view("mixed_float16")
    batch = {
        "image": 10.0 * jax.random.normal(jax.random.key(1), (16, 4)),
        "label": jnp.zeros(16, int),
    }
    loss_fn = tasks.make_loss_fn(view, "classification", forward_flags=True)
    _, (_, metrics) = jax.jit(loss_fn)(variables["params"], {}, batch, None)
    flags = {path: float(ok) for path, ok in metrics[tasks.FORWARD_FLAGS].items()}
    assert flags == {
        "hidden": 1.0,
        "boom/linear": 1.0,
        "boom": 0.0,
        "norm": 0.0,
        "head": 0.0,
        "": 0.0,
    }


def test_forward_nonfinite_takes_an_nnx_model_as_users_hold_it():
    """forward_nonfinite(model, x): the variables are the model's own; the same modules as
    through the training program's view of it."""
    model = nnx_boom_net("mixed_float16", activations="compute")
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))
    view, variables = _nnx_view("mixed_float16")
    found = forward_nonfinite(model, x)
    assert found == forward_nonfinite(view, variables, x)
    assert found.first == "boom" and not found.output_finite
    assert forward_nonfinite(model, x / 1e6).modules == ()  # the cached re-run, other values
    fine = nnx_boom_net("float32")
    assert forward_nonfinite(fine, x).modules == ()
