"""jamp.losses: optax's cross-entropy value and gradient, with a backward that keeps no float32
copy of 16-bit logits (checked on the H200 program where JAX's CUDA plugin is installed)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jamp import losses
from jamp import target as target_lib

F32, BF16 = jnp.float32, jnp.bfloat16


def _data(dtype, shape=(3, 5), vocab=37, scale=4.0):
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (jax.random.normal(k1, (*shape, vocab)) * scale).astype(dtype)
    labels = jax.random.randint(k2, shape, 0, vocab)
    return logits, labels


def _optax(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), labels)


@pytest.mark.parametrize("dtype", [F32, BF16, jnp.float16])
def test_loss_equals_optax_on_the_float32_logits(dtype):
    logits, labels = _data(dtype)
    got = jax.jit(losses.softmax_cross_entropy_with_integer_labels)(logits, labels)
    assert got.dtype == F32 and got.shape == labels.shape
    np.testing.assert_allclose(got, _optax(logits, labels), rtol=1e-6, atol=1e-6)


def test_gradient_equals_optax_in_float32():
    logits, labels = _data(F32)
    weights = jax.random.uniform(jax.random.key(3), labels.shape)

    def total(fn):
        return jax.grad(lambda x: jnp.sum(fn(x, labels) * weights))(logits)

    got = total(losses.softmax_cross_entropy_with_integer_labels)
    np.testing.assert_allclose(got, total(_optax), rtol=1e-5, atol=1e-7)


def test_gradient_of_16_bit_logits_comes_back_in_their_dtype_within_its_rounding():
    logits, labels = _data(BF16)
    got = jax.grad(lambda x: losses.softmax_cross_entropy_with_integer_labels(x, labels).mean())(
        logits
    )
    want = jax.grad(lambda x: _optax(x, labels).mean())(logits.astype(F32))
    assert got.dtype == BF16
    # one rounding of the float32 gradient to bf16 (8 bits of mantissa)
    np.testing.assert_allclose(got.astype(F32), want, rtol=2**-8, atol=1e-6)


def test_large_logits_stay_finite_and_the_label_needs_no_gather():
    logits = jnp.array([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]], F32)
    labels = jnp.array([0, 2])
    got = losses.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(got, [0.0, np.log(3.0)], rtol=1e-6, atol=1e-6)
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda x: losses.softmax_cross_entropy_with_integer_labels(x, labels).sum())
    )(logits)
    names = {e.primitive.name for e in jaxpr.eqns}
    names |= {
        e.primitive.name
        for outer in jaxpr.eqns
        for sub in jax.extend.core.jaxprs_in_params(outer.params)
        for e in sub.eqns
    }
    assert not names & {"gather", "scatter", "scatter-add", "scatter_add"}


def test_bad_arguments_say_what_is_accepted():
    logits, labels = _data(F32)
    with pytest.raises(ValueError, match="labels must have logits' shape"):
        losses.softmax_cross_entropy_with_integer_labels(logits, labels[:, :2])
    with pytest.raises(TypeError, match="labels must be integers"):
        losses.softmax_cross_entropy_with_integer_labels(logits, labels.astype(F32))
    with pytest.raises(TypeError, match="logits must be floating point"):
        losses.softmax_cross_entropy_with_integer_labels(labels, labels)


@pytest.mark.skipif(not target_lib.plugin_available(), reason="JAX's CUDA plugin is not installed")
def test_h200_program_keeps_no_float32_logits_of_a_wrapped_model():
    """The wrapped LM's step on the H200 program: with optax's loss on float32 logits a float32
    batch x length x vocab array is live at the peak; with jamp.losses none is (XLA's plan)."""
    import jamp
    from jamp.models.transformer import TransformerLM

    batch, length, vocab = 8, 128, 8192
    model = jamp.wrap(
        TransformerLM(vocab, num_layers=2, d_model=128, num_heads=2, mlp_dim=256, max_len=length),
        "mixed_bfloat16",
    )
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)

    def f32_at_peak(loss):
        report = jamp.compile_for(
            jax.grad(lambda p, t: loss(model.apply(p, t[:, :-1]), t[:, 1:]).mean()),
            params,
            tokens,
            target="h200",
        )
        return report.memory.temporaries_by_dtype["f32"]

    logits_f32 = batch * length * vocab * 4
    assert f32_at_peak(_optax) >= logits_f32
    # what is left is the float32 gradients of the params (the tied embedding: 4 MiB)
    assert f32_at_peak(losses.softmax_cross_entropy_with_integer_labels) < logits_f32 / 2
