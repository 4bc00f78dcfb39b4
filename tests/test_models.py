"""jamp.models: plain Flax networks; here, what they compute beyond what Flax's layers do."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jamp.models.cnn import max_pool_2x2


def test_seed_cnn_pooling_equals_flax_max_pool_values_and_gradients():
    x = jax.random.normal(jax.random.key(3), (2, 9, 7, 5))  # odd sizes: VALID drops the last row

    def flax_pool(a):
        return nn.max_pool(a, (2, 2), strides=(2, 2))

    np.testing.assert_array_equal(max_pool_2x2(x), flax_pool(x))
    cot = jax.random.normal(jax.random.key(4), flax_pool(x).shape)
    grads = [jax.grad(lambda a, f=f: jnp.sum(f(a) * cot))(x) for f in (max_pool_2x2, flax_pool)]
    np.testing.assert_array_equal(*grads)
