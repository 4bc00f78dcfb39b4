"""jamp.inspect.overflow: re-running a batch names the module whose forward output overflowed."""

import flax.linen as nn
import jax
import jax.numpy as jnp

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
