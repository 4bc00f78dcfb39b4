"""jamp.engine.recompute_widened: the loss's tail after a widened 16-bit output runs again in the
backward instead of keeping float32 copies (the same values and gradients), and on the H200
program of a wrapped language model's train step no float32 logits are left at the peak."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.engine import _tail, recompute_widened

F32, BF16 = jnp.float32, jnp.bfloat16
N, D, VOCAB = 64, 16, 512  # 32k logits: MIN_ELEMENTS is lowered to reach them


@pytest.fixture(autouse=True)
def _small_tails(monkeypatch):
    monkeypatch.setattr(_tail, "MIN_ELEMENTS", 1024)


def _data():
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (D, VOCAB)) * 0.5
    x = jax.random.normal(k[1], (4, N // 4, D))
    y = jax.random.randint(k[2], (4, N // 4), 0, VOCAB)
    return w, x, y


def _optax_loss(w, x, y):
    """A head in bf16, its logits widened, optax's loss and an accuracy (as users write them)."""
    logits = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": (logits.argmax(-1) == y).mean()}


_FORMS = {  # losses as users write them, on the float32 logits (vocab: the last axis)
    "integer labels": lambda lg, y: optax.softmax_cross_entropy_with_integer_labels(lg, y),
    "one-hot labels": lambda lg, y: optax.softmax_cross_entropy(
        lg, jax.nn.one_hot(y, lg.shape[-1])
    ),
    "log_softmax, picked": lambda lg, y: (
        -jnp.take_along_axis(jax.nn.log_softmax(lg), y[..., None], axis=-1)[..., 0]
    ),
}


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def _one_hot_ce(logits, labels, smoothing=0.0):
    target = jax.nn.one_hot(labels, logits.shape[-1])
    return optax.softmax_cross_entropy(logits, optax.smooth_labels(target, smoothing))


def _z_loss(logits, labels):
    return _ce(logits, labels) + 1e-4 * jax.nn.logsumexp(logits, axis=-1) ** 2


# Next-token losses that shift the logits, not the inputs (Hugging Face's run_clm_flax): `lg`,
# every position's logits (16-bit, or float32 as a wrapped model hands them; `.astype(F32)` is
# where each form widens 16-bit ones); `t`, the tokens; `m`, their padding mask.
_SLICED = {
    "widened, sliced": lambda lg, t, m: _ce(lg.astype(F32)[:, :-1], t[:, 1:]).mean(),
    "sliced, widened": lambda lg, t, m: _ce(lg[:, :-1].astype(F32), t[:, 1:]).mean(),
    "one-hot (HF's recipe)": lambda lg, t, m: optax.softmax_cross_entropy(
        lg.astype(F32)[..., :-1, :], jax.nn.one_hot(t[..., 1:], lg.shape[-1])
    ).mean(),
    "masked mean": lambda lg, t, m: (
        (_ce(lg.astype(F32)[:, :-1], t[:, 1:]) * m[:, 1:]).sum() / m[:, 1:].sum()
    ),
    "label smoothing": lambda lg, t, m: _one_hot_ce(lg.astype(F32)[:, :-1], t[:, 1:], 0.1).mean(),
    "z-loss": lambda lg, t, m: _z_loss(lg.astype(F32)[:, :-1], t[:, 1:]).mean(),
    "reshaped": lambda lg, t, m: _ce(
        lg.astype(F32)[:, :-1].reshape(-1, lg.shape[-1]), t[:, 1:].reshape(-1)
    ).mean(),
    # cut at both ends (a prompt's first positions); a temperature per position, which is zero
    # where the slice cuts (what the tail computes there is not finite: no gradient comes of it)
    "cut at both ends": lambda lg, t, m: _ce(lg.astype(F32)[:, 3:-1], t[:, 4:]).mean(),
    "temperature per position": lambda lg, t, m: _ce(
        lg.astype(F32)[:, :-1] / (1.0 + m[:, 1:, None]), t[:, 1:]
    ).mean(),
}


def _grad(fn, *args):
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(*args)


def test_tail_found_after_the_widening_and_not_across_a_matmul():
    w, x, y = _data()
    jaxpr = jax.make_jaxpr(_optax_loss)(w, x, y).jaxpr
    tail, size = _tail.find_tail(jaxpr)
    assert size == N * VOCAB
    first = min(tail)
    assert jaxpr.eqns[first].primitive.name == "convert_element_type"
    assert not any(jaxpr.eqns[i].primitive.name == "dot_general" for i in tail)

    def then_a_matmul(w, x, y):  # the widened value feeds another matmul: nothing to recompute
        logits = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
        return jnp.sum(logits @ w.T), {}

    assert _tail.find_tail(jax.make_jaxpr(then_a_matmul)(w, x, y).jaxpr) == (set(), 0)


@pytest.mark.parametrize("form", sorted(_FORMS))
def test_values_and_gradients_equal_the_loss_as_written(form):
    w, x, y = _data()

    def loss_fn(w, x, y):
        logits = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
        return _FORMS[form](logits, y).mean(), {"accuracy": (logits.argmax(-1) == y).mean()}

    (loss, aux), grad = _grad(loss_fn, w, x, y)
    (loss2, aux2), grad2 = _grad(recompute_widened(loss_fn), w, x, y)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    assert aux2["accuracy"] == aux["accuracy"]
    np.testing.assert_allclose(grad2, grad, rtol=1e-5, atol=1e-7)


def test_tail_takes_in_the_slice_that_the_widened_value_is_taken_from():
    """16-bit logits sliced, then widened: the slice is the tail's (it runs at all positions)."""
    w, x, t = _data()

    def loss(w, x, t):
        logits = x.astype(BF16) @ w.astype(BF16)
        return _SLICED["sliced, widened"](logits, t, None)

    jaxpr = jax.make_jaxpr(loss)(w, x, t).jaxpr
    tail, size = _tail.find_tail(jaxpr)
    assert jaxpr.eqns[min(tail)].primitive.name == "slice"
    assert size == N * VOCAB * 15 // 16


@pytest.mark.parametrize("form", sorted(_SLICED))
def test_logits_sliced_before_the_loss_give_the_loss_as_written(form):
    """Losses that slice the widened logits (or widen the sliced ones), with one-hot labels, a
    padding mask, label smoothing, a z-loss or the positions flattened: the same values and
    gradients, and the label's logit picked without a scatter into the logits' shape."""
    w, x, t = _data()
    m = (jax.random.uniform(jax.random.key(5), t.shape) < 0.8).astype(F32)

    def loss_fn(w, x, t, m):
        logits = x.astype(BF16) @ w.astype(BF16)
        return _SLICED[form](logits, t, m), {}

    (loss, _), grad = _grad(loss_fn, w, x, t, m)
    (loss2, _), grad2 = _grad(recompute_widened(loss_fn), w, x, t, m)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    np.testing.assert_allclose(grad2, grad, rtol=1e-5, atol=1e-7)
    assert _tail.find_tail(jax.make_jaxpr(loss_fn)(w, x, t, m).jaxpr)[0]
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: recompute_widened(loss_fn)(w, x, t, m)[0]))(w)
    assert not re.search(
        rf"f32\[[0-9,]*{VOCAB}\] = scatter", str(jaxpr)
    )  # none of the logits' size


@pytest.mark.parametrize("mode", [None, "clip", "fill"])
def test_label_pick_keeps_the_gathers_out_of_range_rule(mode):
    w, x, y = _data()
    y = y.at[0, :3].set(jnp.array([-1, VOCAB, VOCAB + 7]))  # negative wraps; past the end: mode

    def picked(w, x, y):
        logits = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
        kw = {} if mode is None else {"mode": mode}
        got = jnp.take_along_axis(logits, y[..., None], axis=-1, **kw)[..., 0]
        return jnp.sum(jnp.where(jnp.isnan(got), 0.0, got) * 1.5), {"nan": jnp.isnan(got).sum()}

    (value, aux), grad = _grad(picked, w, x, y)
    (value2, aux2), grad2 = _grad(recompute_widened(picked), w, x, y)
    assert aux2["nan"] == aux["nan"]
    np.testing.assert_allclose(value2, value, rtol=1e-6)
    np.testing.assert_allclose(grad2, grad, rtol=1e-5, atol=1e-7)
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: recompute_widened(picked)(w, x, y)[0]))(w)
    assert "scatter" not in str(jaxpr)  # the pick's backward is a select, not a scatter


@pytest.mark.parametrize("shape", [(1, 64), (64, 1), (64,), (2, 1, 32), (1, 1, 64)])
def test_label_pick_of_a_batch_with_axes_of_one(shape):
    """`take_along_axis` gathers axes of size 1 as offsets, not batching axes (one sequence per
    device; one position): the pick is still a gather forward and a select backward."""
    k = jax.random.split(jax.random.key(3), 2)
    w = jax.random.normal(k[0], (D, VOCAB)) * 0.5
    x = jax.random.normal(k[1], shape + (D,))
    y = jax.random.randint(k[1], shape, 0, VOCAB)

    def loss(w, x, y):
        logits = (x.astype(BF16) @ w.astype(BF16)).astype(F32)
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked * 1.5), {}

    (value, _), grad = _grad(loss, w, x, y)
    (value2, _), grad2 = _grad(recompute_widened(loss), w, x, y)
    np.testing.assert_allclose(value2, value, rtol=1e-6)
    np.testing.assert_allclose(grad2, grad, rtol=1e-5, atol=1e-6)
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: recompute_widened(loss)(w, x, y)[0]))(w)
    assert "scatter" not in str(jaxpr)


@pytest.mark.parametrize("layout", ["jit", "accumulate", "pmap"])
def test_train_step_matches_the_loss_without_recomputation(monkeypatch, layout):
    """make_train_step's step (and its microbatches, and each replica's share under pmap) with the
    tail recomputed, against the same step with the loss as written: the same loss and update."""
    w, x, y = _data()
    params = {"w": w}
    tx = optax.sgd(0.1)
    found = []
    find_tail = _tail.find_tail
    monkeypatch.setattr(_tail, "find_tail", lambda j: found.append(find_tail(j)) or found[-1])

    def loss_fn(p, model_state, batch, rng):  # a bf16 head widened, then optax's loss
        loss, _ = _optax_loss(p["w"], batch["x"], batch["y"])
        return loss, (model_state, {})

    def run():
        state = jamp.TrainState.create(params, tx)
        batch, key = {"x": x, "y": y}, jax.random.key(2)
        if layout == "pmap":
            step = jamp.parallel.make_p_train_step(
                jamp.make_train_step(loss_fn, tx, axis_name="batch"), axis_name="batch"
            )
            devices = 4
            state, metrics = step(
                jamp.parallel.replicate(state, devices=jax.devices()[:devices]),
                jamp.parallel.shard(batch, devices),
                key,
            )
            return jamp.parallel.unreplicate(state), jamp.parallel.unreplicate(metrics)
        steps = 2 if layout == "accumulate" else 1
        return jax.jit(jamp.make_train_step(loss_fn, tx, accumulation_steps=steps))(
            state, batch, key
        )

    state, metrics = run()
    assert found and all(tail for tail, _ in found)  # the step did recompute a tail
    del found[:]
    monkeypatch.setattr(_tail, "MIN_ELEMENTS", 1 << 62)  # no tail: the loss as written
    state_ref, metrics_ref = run()
    assert found and not any(tail for tail, _ in found)
    np.testing.assert_allclose(metrics["loss"], metrics_ref["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state_ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


_LM_BATCH, _LM_LENGTH, _LM_VOCAB = 8, 128, 8192
_LOGITS_F32 = _LM_BATCH * _LM_LENGTH * _LM_VOCAB * 4


def _h200_step(model, form: str):
    """make_train_step of the wrapped LM `model`, the loss `_FORMS[form]` on its logits (as users
    write it) or `_SLICED[form]`, compiled for one H200 (jamp.compile_for's report)."""
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx))
    shape = (_LM_BATCH, _LM_LENGTH + 1)
    tokens = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "mask": jax.ShapeDtypeStruct(shape, jnp.float32),
    }
    key = jax.eval_shape(lambda: jax.random.key(0))

    def loss_fn(p, model_state, batch_, rng):
        t = batch_["tokens"]
        if form in _SLICED:  # the model sees _LM_LENGTH tokens; the loss slices their logits
            t, m = t[:, :-1], batch_["mask"][:, :-1]
            return _SLICED[form](model.apply({"params": p}, t), t, m), (model_state, {})
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return _FORMS[form](logits, t[:, 1:]).mean(), (model_state, {})

    step = jax.jit(jamp.make_train_step(loss_fn, tx))
    return jamp.compile_for(step, state, tokens, key, target="h200")


@pytest.mark.gpu_compile
def test_h200_train_step_keeps_no_float32_logits_with_optax_loss():
    """make_train_step of a wrapped LM with optax's loss on the float32 logits, H200 program
    (XLA's plan, not a measured peak): without recomputation a float32 batch x length x vocab
    array is live at the peak; with it, none (what float32 is left is the params' gradients);
    and the forward reads the logits in two reductions, not three."""
    from jamp import hlo
    from jamp.hlo.kernels import kernels
    from jamp.models.transformer import TransformerLM

    model = jamp.wrap(
        TransformerLM(
            _LM_VOCAB, num_layers=2, d_model=128, num_heads=2, mlp_dim=256, max_len=_LM_LENGTH
        ),
        "mixed_bfloat16",
    )
    report = _h200_step(model, "integer labels")
    assert report.memory.temporaries_by_dtype["f32"] < _LOGITS_F32 / 2
    # Forward, the loss reads the 16-bit logits twice (their maxima, then the sum of exponentials)
    # and gathers the labels' logits: no third pass over them for the pick.
    passes = [
        k
        for k in kernels(hlo.parse(report.hlo_text))
        if k.kind == "reduction" and "transpose(" not in k.op_name and k.bytes >= _LOGITS_F32 / 2
    ]
    assert len(passes) == 2, [(k.name, k.op_name) for k in passes]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_tail, "MIN_ELEMENTS", 1 << 62)
        assert _h200_step(model, "integer labels").memory.temporaries_by_dtype["f32"] >= _LOGITS_F32


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    "form, bias",
    [("integer labels", True), ("one-hot labels", False), ("log_softmax, picked", False)],
)
def test_h200_losses_as_written_keep_no_float32_logits(form, bias):
    """H200 program (XLA's plan): no float32 value of the logits' size at the peak with
    * a head with a bias (flax's `nn.Dense` default), whose gradient sums the logits' gradient:
      XLA wrote that gradient in float32 for the sum, unless it is written in bf16 first;
    * a loss that forms log_softmax (one-hot labels, as optax's `softmax_cross_entropy` and the
      Flax examples write it): XLA's Triton softmax fusion wrote it in float32 for the product
      with the labels, unless the row statistics stand apart."""
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, t):
            x = nn.Dense(128)(nn.LayerNorm()(nn.Embed(_LM_VOCAB, 128)(t)))
            return nn.Dense(_LM_VOCAB, use_bias=bias)(nn.LayerNorm()(x))

    report = _h200_step(jamp.wrap(LM(), "mixed_bfloat16"), form)
    assert report.memory.temporaries_by_dtype["f32"] < _LOGITS_F32 / 2


def _lm(kind: str):
    """A small LM: jamp's TransformerLM wrapped ("wrapped": float32 logits of a bf16 head), or a
    Flax LM computing in bf16 ("bf16": bf16 logits, widened by the loss)."""
    import flax.linen as nn

    from jamp.models.transformer import TransformerLM

    if kind == "wrapped":
        lm = TransformerLM(
            _LM_VOCAB, num_layers=2, d_model=128, num_heads=2, mlp_dim=256, max_len=_LM_LENGTH
        )
        return jamp.wrap(lm, "mixed_bfloat16")

    class LM(nn.Module):
        @nn.compact
        def __call__(self, t):
            x = nn.Dense(128, dtype=BF16)(nn.LayerNorm()(nn.Embed(_LM_VOCAB, 128)(t)))
            return nn.Dense(_LM_VOCAB, dtype=BF16)(nn.LayerNorm()(x))

    return LM()


_SAME_BUFFERS = {"label smoothing", "temperature per position", "cut at both ends"}


@functools.cache
def _h200_peak_inputs_shifted(kind: str) -> int:
    return _h200_step(_lm(kind), "integer labels").memory.peak


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    "kind, form",
    # (label smoothing, a temperature, a cut at both ends: the same buffers as the one-hot and
    # the plain forms; their values and gradients are checked on the CPU above)
    [("wrapped", form) for form in sorted(set(_SLICED) - _SAME_BUFFERS)]
    + [("bf16", "sliced, widened"), ("bf16", "widened, sliced")],
)
def test_h200_logits_sliced_before_the_loss_keep_no_float32_logits(kind, form):
    """H200 program (XLA's plan): a loss that slices the logits (`logits[:, :-1]`, Hugging Face's
    shift) keeps no float32 value of their size at the peak, and the step's peak is that of the
    loss on the logits of shifted inputs: the logits' gradient takes the 16-bit logits' own
    buffer (through the slice's transpose, a pad, XLA gave it one more of their size)."""
    report = _h200_step(_lm(kind), form)
    assert report.memory.temporaries_by_dtype["f32"] < _LOGITS_F32 / 2
    assert report.memory.peak <= _h200_peak_inputs_shifted(kind) * 1.01


def _nnx_h200_step(form: str):
    """The same for a wrapped Flax NNX LM, trained as NNX models are (`jamp.nnx.split`)."""
    from flax import nnx

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(_LM_VOCAB, 128, rngs=rngs)
            self.norm = nnx.LayerNorm(128, rngs=rngs)
            self.hidden = nnx.Linear(128, 128, rngs=rngs)
            self.head = nnx.Linear(128, _LM_VOCAB, rngs=rngs)

        def __call__(self, t):
            return self.head(self.norm(jax.nn.gelu(self.hidden(self.embed(t)))))

    model = jamp.wrap(LM(nnx.Rngs(0)), "mixed_bfloat16")
    functional, params, model_state = jamp.nnx.split(model)
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx, model_state=model_state))

    def loss(model, batch_):
        t = batch_["tokens"]
        if form in _SLICED:
            return _SLICED[form](model(t[:, :-1]), t[:, :-1], batch_["mask"][:, :-1])
        return _FORMS[form](model(t[:, :-1]).astype(jnp.float32), t[:, 1:]).mean()

    shape = (_LM_BATCH, _LM_LENGTH + 1)
    batch = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "mask": jax.ShapeDtypeStruct(shape, jnp.float32),
    }
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = jax.jit(jamp.make_train_step(functional.loss_fn(loss), tx))
    return jamp.compile_for(step, state, batch, key, target="h200")


@pytest.mark.gpu_compile
@pytest.mark.parametrize("form", ["one-hot (HF's recipe)", "masked mean"])
def test_h200_nnx_model_with_sliced_logits_keeps_no_float32_logits(form):
    """A wrapped NNX LM, HF's shift of the logits: no float32 logits at the peak (XLA's plan for
    an H200), and the peak of the loss on the logits of shifted inputs."""
    report = _nnx_h200_step(form)
    assert report.memory.temporaries_by_dtype["f32"] < _LOGITS_F32 / 2
    assert report.memory.peak <= _nnx_h200_step("integer labels").memory.peak * 1.01
