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


@pytest.mark.gpu_compile
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


# ----- the fused, chunked head + loss


def _head_data(dtype=BF16, shape=(3, 37), d=16, vocab=300):
    k = jax.random.split(jax.random.key(5), 4)
    hidden = jax.random.normal(k[0], (*shape, d)).astype(dtype)
    kernel = jax.random.normal(k[1], (d, vocab)) * 0.3
    labels = jax.random.randint(k[2], shape, 0, vocab)
    where = jax.random.bernoulli(k[3], 0.8, shape)
    return hidden, kernel, labels, where


def _unfused(hidden, kernel, labels, where, dtype):
    """The head as a wrapped model computes it (in `dtype`, summed in float32, rounded to
    `dtype`), then the cross-entropy averaged over `where`."""
    logits = jnp.einsum(
        "...d,dv->...v", hidden.astype(dtype), kernel.astype(dtype), preferred_element_type=F32
    ).astype(dtype)
    per = losses.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(per * where) / jnp.sum(where)


def test_masked_vocabulary_entries_are_skipped_as_optax_skips_them():
    """Logits of -inf (a padded vocabulary masked out) add nothing to the log-normalizer; a row
    whose label is the only finite logit has loss 0; the gradient is finite."""
    logits, labels = _data(F32, shape=(4, 6), vocab=40)
    logits = logits.at[..., 33:].set(-jnp.inf)
    logits = logits.at[0, 0].set(-jnp.inf).at[0, 0, labels[0, 0]].set(1.0)
    got = losses.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(got, _optax(logits, labels), rtol=1e-6, atol=1e-6)
    assert float(got[0, 0]) == 0.0
    grad = jax.grad(lambda x: jnp.sum(losses.softmax_cross_entropy_with_integer_labels(x, labels)))
    assert bool(jnp.all(jnp.isfinite(grad(logits))))


@pytest.mark.parametrize("chunk_size", [None, 1, 20, 111, 1000])
def test_fused_head_loss_and_gradients_equal_the_unfused_in_bf16(chunk_size):
    hidden, kernel, labels, where = _head_data()

    def fused(h, k):
        return losses.fused_linear_cross_entropy(h, k, labels, where=where, chunk_size=chunk_size)

    value, grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(hidden, kernel)
    want, want_grads = jax.value_and_grad(
        lambda h, k: _unfused(h, k, labels, where, BF16), argnums=(0, 1)
    )(hidden, kernel)
    assert value.dtype == F32 and value.shape == ()
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert grads[0].dtype == BF16 and grads[1].dtype == F32  # each in its argument's dtype
    for got, ref in zip(grads, want_grads):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 2**-7, err  # within bf16 rounding of the per-logit gradient
    # without differentiation the same value, the gradients never computed
    np.testing.assert_allclose(jax.jit(fused)(hidden, kernel), value, rtol=1e-6)


def test_fused_head_in_float32_matches_optax_and_sums():
    hidden, kernel, labels, _ = _head_data(F32)
    logits = jnp.einsum("...d,dv->...v", hidden, kernel, precision="highest")
    want = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    got = losses.fused_linear_cross_entropy(hidden, kernel, labels, reduction="sum", chunk_size=7)
    np.testing.assert_allclose(got, want.sum(), rtol=1e-4)
    g = jax.grad(
        lambda k: losses.fused_linear_cross_entropy(hidden, k, labels, chunk_size=7, dtype=F32)
    )(kernel)
    g_ref = jax.grad(
        lambda k: optax.softmax_cross_entropy_with_integer_labels(
            jnp.einsum("...d,dv->...v", hidden, k, precision="highest"), labels
        ).mean()
    )(kernel)
    np.testing.assert_allclose(g, g_ref, rtol=1e-3, atol=1e-6)


def test_fused_head_float16_gradients_stay_in_range_under_a_loss_scale():
    """float16 hidden states: the per-logit gradient (softmax minus one-hot) is held in [-1, 1]
    and scaled by the mean's 1 / count and the loss scale only in float32."""
    hidden, kernel, labels, _ = _head_data(jnp.float16, shape=(64, 64))
    scale = 2.0**15
    g = jax.grad(
        lambda h: losses.fused_linear_cross_entropy(h, kernel, labels, chunk_size=512) * scale
    )(hidden)
    g_ref = jax.grad(lambda h: _unfused(h, kernel, labels, jnp.ones(labels.shape), F32) * scale)(
        hidden.astype(F32)
    )
    assert g.dtype == jnp.float16 and bool(jnp.isfinite(g).all())
    err = float(jnp.linalg.norm(g.astype(F32) - g_ref) / jnp.linalg.norm(g_ref))
    assert err < 1e-2, err


def test_fused_head_bad_arguments_say_what_is_accepted():
    hidden, kernel, labels, where = _head_data()
    f = losses.fused_linear_cross_entropy
    with pytest.raises(ValueError, match="reduction must be one of mean, sum"):
        f(hidden, kernel, labels, reduction="none")
    with pytest.raises(ValueError, match=r"kernel must be \[d, vocab\]"):
        f(hidden, kernel.T, labels)
    with pytest.raises(ValueError, match="labels must have hidden's shape"):
        f(hidden, kernel, labels[:, :3])
    with pytest.raises(ValueError, match="where must have labels' shape"):
        f(hidden, kernel, labels, where=where[:, :3])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        f(hidden, kernel, labels, chunk_size=0)
    with pytest.raises(TypeError, match="labels must be integers"):
        f(hidden, kernel, labels.astype(F32))


def _h200_head(chunk_size):
    """The H200 program (`jamp.compile_for`) of the gradient of a bf16 head + loss over 8 x 512
    positions, d 256, vocabulary 32k: fused in chunks of `chunk_size`, or unfused (None)."""
    hidden = jax.ShapeDtypeStruct((8, 512, 256), BF16)
    kernel = jax.ShapeDtypeStruct((256, 32768), F32)
    labels = jax.ShapeDtypeStruct((8, 512), jnp.int32)

    def loss(h, k, y):
        if chunk_size is None:
            return _unfused(h, k, y, jnp.ones((8, 512)), BF16)
        return losses.fused_linear_cross_entropy(h, k, y, chunk_size=chunk_size)

    grad = jax.grad(loss, argnums=(0, 1))
    return target_lib.compile_for(grad, hidden, kernel, labels, target="h200")


@pytest.mark.gpu_compile
def test_h200_fused_head_forms_no_logits():
    """The fused head + loss of 8 x 512 positions over a 32k vocabulary, in chunks of 512, on the
    H200 program (XLA's plan): no buffer of all positions x vocabulary, 16- or 32-bit, at any
    time, and in two chunks one chunk's at a time; the unfused head + loss holds several."""
    fused = _h200_head(chunk_size=512).memory
    halves = _h200_head(chunk_size=2048).memory
    unfused = _h200_head(chunk_size=None).memory
    logits_bf16 = 8 * 512 * 32768 * 2
    assert fused.temporaries < logits_bf16 / 2, fused
    # Two chunks: the loop's one trip is unrolled by XLA, and without a barrier both chunks ran
    # at once (1.07x the whole logits).
    assert halves.temporaries < logits_bf16 * 0.75, halves
    assert unfused.temporaries >= logits_bf16, unfused


@pytest.mark.gpu_compile
def test_h200_fused_head_is_predicted_no_slower_than_the_unfused():
    """In two chunks, the fused head + loss's predicted time on the H200 program (jamp's model:
    a roofline per kernel plus its launch, not a measurement) is at most the unfused one's: one
    pass over a chunk's logits for max, log-sum-exp and the label's logit, one for the
    gradient, and no multiply by a constant 1 cotangent."""
    fused = _h200_head(chunk_size=2048).estimate
    unfused = _h200_head(chunk_size=None).estimate
    assert fused.seconds <= unfused.seconds, (fused.lines(), unfused.lines())


def test_fused_head_accuracy_is_the_argmax_accuracy():
    hidden, kernel, labels, where = _head_data(F32)
    logits = jnp.einsum("...d,dv->...v", hidden, kernel, precision="highest")
    labels = labels.at[0, :10].set(jnp.argmax(logits, -1)[0, :10])  # some right for sure
    loss, accuracy = losses.fused_linear_cross_entropy(
        hidden, kernel, labels, where=where, chunk_size=16, dtype=F32, return_accuracy=True
    )
    right = (jnp.argmax(logits, -1) == labels).astype(F32)
    np.testing.assert_allclose(accuracy, jnp.sum(right * where) / jnp.sum(where), rtol=1e-6)
    assert 0 < float(accuracy) < 1
    g = jax.grad(
        lambda h: losses.fused_linear_cross_entropy(h, kernel, labels, return_accuracy=True)[0]
    )(hidden)
    assert g.shape == hidden.shape


@pytest.mark.gpu_compile
def test_h200_fused_head_keeps_each_devices_positions_on_it():
    """A sharded step (8 H200s, fsdp=8, batch split over devices) with the fused head in four
    chunks: every collective is a parameter's gather or a gradient's reduce-scatter over the
    mesh's axis. Chunks of consecutive positions would each lie on one device, and XLA's
    partitioner regrouped them (collective-permutes, gathers of the hidden states over partial
    groups of devices; on Llama 1.5B, 7.5 GiB of float32 all-gathers per step)."""
    from toy import h200x8_llama_report

    from jamp.models.llama import LlamaLM

    def loss_of(model, p, tokens):
        hidden = model.apply({"params": p}, tokens[:, :-1], return_hidden=True)
        kernel = LlamaLM.output_kernel(p)
        return losses.fused_linear_cross_entropy(hidden, kernel, tokens[:, 1:], chunk_size=256)

    report = h200x8_llama_report(loss_of)
    groups = report.collectives
    assert groups and all(g.axes == ("fsdp",) for g in groups), groups
    assert {g.kind for g in groups} <= {"all-gather", "reduce-scatter", "all-reduce"}, groups
