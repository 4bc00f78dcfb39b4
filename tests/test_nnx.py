"""jamp.wrap on Flax NNX modules, and NNX training through jamp's step: checked on the jaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jcore

import jamp
from jamp import parallel, sharding
from jamp.models import nnx_models

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
MATMULS = ("dot_general", "conv_general_dilated")


class HardCodedF32(nnx.Module):
    """Layers that pin dtype=float32, as many published models do, and a raw `x @ param`."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 16, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(16, dtype=jnp.float32, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 3)))

    def __call__(self, x):
        return jnp.tanh(self.norm(self.dense(x)) @ self.w)

    def features(self, x):
        return self.dense(x)


def _build(name):
    rngs = nnx.Rngs(0, dropout=1)
    key = jax.random.key(1)
    images = jax.random.normal(key, (2, 8, 8, 3))
    if name == "seed_cnn":
        return nnx_models.SeedCNN(4, image_shape=(8, 8, 3), rngs=rngs), images
    if name == "resnet":  # two stages of one block (a projection shortcut): quick to trace
        return nnx_models.ResNet((1, 1), num_filters=4, num_classes=4, rngs=rngs), images
    if name == "resnet20":  # the whole ResNet-20 (4 filters), for the training test
        return nnx_models.resnet20(4, 4, rngs=rngs), images
    if name == "transformer":
        model = nnx_models.TransformerLM(50, 2, 16, 2, 32, 16, dropout_rate=0.1, rngs=rngs)
        return model, jax.random.randint(key, (2, 12), 0, 50)
    return HardCodedF32(rngs), jax.random.normal(key, (2, 5))


NAMES = ("seed_cnn", "resnet", "transformer", "hard_coded_f32")


def _matmul_operand_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            found.append((eqn.primitive.name, tuple(np.dtype(v.aval.dtype) for v in eqn.invars)))
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += _matmul_operand_dtypes(sub)
    return found


def _loss(model, x):
    return jnp.sum(model(x).astype(jnp.float32) ** 2)


def _grad_jaxpr(model, x):
    graphdef, state = nnx.split(model)

    def f(state):
        return nnx.value_and_grad(_loss)(nnx.merge(graphdef, state), x)

    return jax.make_jaxpr(f)(state).jaxpr


# bf16 on every model; f16 on the two small ones (the rewrite is the same code for both).
CASES = [(name, BF16) for name in NAMES] + [("seed_cnn", F16), ("hard_coded_f32", F16)]


@pytest.mark.parametrize("name, compute", CASES)
def test_nnx_every_matmul_takes_compute_dtype_operands_forward_and_backward(name, compute):
    module, x = _build(name)
    found = _matmul_operand_dtypes(_grad_jaxpr(jamp.wrap(module, f"p=f32,c={compute.name}"), x))
    assert found, "the model has matmuls"
    assert [f for f in found if f[1] != (compute, compute)] == []
    # The control: unwrapped, the same model's matmuls are float32.
    assert {d for _, d in _matmul_operand_dtypes(_grad_jaxpr(module, x))} == {(F32, F32)}


@pytest.mark.parametrize("name", NAMES)
def test_nnx_wrap_keeps_the_same_variables_as_fp32_params(name):
    module, x = _build(name)
    model = jamp.wrap(module, "mixed_bfloat16")
    assert isinstance(model, type(module)) and model is not module
    ref, got = nnx.state(module), nnx.state(model)
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    jax.tree.map(_same, ref, got)
    params = nnx.state(model, nnx.Param)
    assert {a.dtype for a in jax.tree.leaves(params)} == {F32}
    assert all(isinstance(v, nnx.Param) for _, v in nnx.iter_graph(model) if _is_param(v))
    # A checkpoint of one restores into the other: the same paths.
    nnx.update(model, nnx.state(module))
    half = jamp.wrap(module, "p=bf16,c=bf16,o=f32")
    assert {a.dtype for a in jax.tree.leaves(nnx.state(half, nnx.Param))} == {BF16}


def _same(a, b):
    """Bitwise equal, also for RNG key arrays."""
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(a, b)


def _is_param(v):
    return isinstance(v, nnx.Variable) and isinstance(v, nnx.Param)


@pytest.mark.parametrize("name", NAMES)
def test_nnx_outputs_in_output_dtype_and_grads_fp32_under_nnx_jit(name):
    module, x = _build(name)
    model = jamp.wrap(module, "mixed_bfloat16")
    loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model, x)
    assert np.isfinite(loss)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert {g.dtype for g in leaves} == {F32}
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert _output(model, x).dtype == F32
    assert _output(jamp.wrap(module, "p=f32,c=bf16,o=bf16"), x).dtype == BF16


def _output(model, x):
    """The shape and dtype of `model(x)`, traced only."""
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda s: nnx.merge(graphdef, s)(x), state)


@pytest.mark.parametrize("name", NAMES)
def test_nnx_fp32_policy_is_bit_identical(name):
    module, x = _build(name)
    module.eval()  # no dropout: the two calls must see the same function
    model = jamp.wrap(module, "float32")
    np.testing.assert_array_equal(module(x), model(x))
    run = nnx.jit if name in ("resnet", "transformer") else (lambda f: f)  # eager is slow there
    ref_loss, ref_g = run(nnx.value_and_grad(_loss))(module, x)
    got_loss, got_g = run(nnx.value_and_grad(_loss))(model, x)
    np.testing.assert_array_equal(ref_loss, got_loss)
    jax.tree.map(_same, nnx.state(ref_g, nnx.Param), nnx.state(got_g, nnx.Param))


def test_nnx_mixed_grads_close_to_fp32_grads():
    module, x = _build("transformer")
    module.eval()
    ref = nnx.grad(_loss)(module, x)
    got = nnx.grad(_loss)(jamp.wrap(module, "mixed_bfloat16"), x)
    flat = [jnp.concatenate([g.ravel() for g in jax.tree.leaves(nnx.state(t))]) for t in (ref, got)]
    assert float(jnp.linalg.norm(flat[1] - flat[0]) / jnp.linalg.norm(flat[0])) < 2e-2


def _stats(model):
    """A snapshot of the batch statistics (an NNX state refers to the live variables)."""
    return [np.array(a) for a in jax.tree.leaves(nnx.state(model, nnx.BatchStat))]


def test_nnx_batch_norm_stats_stay_fp32_update_in_train_and_not_in_eval():
    module, x = _build("resnet")
    model = jamp.wrap(module, "mixed_float16")
    before = _stats(model)
    model(x)  # train mode (NNX's default): statistics move
    after = _stats(model)
    assert {a.dtype for a in after} == {F32}
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    # Close to the fp32 model's statistics: normalization did not run in 16 bits.
    module(x)
    for r, g in zip(_stats(module), after):
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-3)
    model.eval()
    model(x)
    for a, b in zip(after, _stats(model)):
        np.testing.assert_array_equal(a, b)


def _eqns(model, x):
    """Every equation of `model(x)`'s program, sub-programs too."""
    graphdef, state = nnx.split(model)
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            found.append(e)
            for sub in jcore.jaxprs_in_params(e.params):
                walk(sub)

    walk(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(x))(state).jaxpr)
    return found


class _Bf16Norms(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, dtype=jnp.bfloat16, rngs=rngs)
        self.layer_norm = nnx.LayerNorm(8, dtype=jnp.bfloat16, rngs=rngs)
        self.rms_norm = nnx.RMSNorm(8, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.rms_norm(self.layer_norm(self.dense(x)))


def test_nnx_norms_run_and_hand_back_fp32_even_when_the_model_says_bf16():
    module, x = _Bf16Norms(nnx.Rngs(0)), jnp.ones((2, 4))
    # As written, NNX norms compute in fp32 and hand back bf16 (their `dtype`).
    eqns = _eqns(module, x)
    last_rsqrt = max(i for i, e in enumerate(eqns) if e.primitive.name == "rsqrt")
    assert any(e.outvars[0].aval.dtype == BF16 for e in eqns[last_rsqrt:])
    norm_eqns = [
        e
        for e in _eqns(jamp.wrap(module, "mixed_bfloat16"), x)
        if "jamp_policy_" in str(e.source_info.name_stack)
    ]
    assert {e.primitive.name for e in norm_eqns} >= {"rsqrt", "mul"}  # both norms, tagged
    float_outs = {np.dtype(v.aval.dtype) for e in norm_eqns for v in e.outvars}
    assert float_outs & {BF16, F16} == set() and F32 in float_outs


def test_nnx_overrides_by_class_and_by_attribute_path():
    module, x = _build("seed_cnn")

    def dtypes(model):
        return [d for _, d in _matmul_operand_dtypes(_grad_jaxpr(model, x))]

    assert set(dtypes(jamp.wrap(module, "mixed_bfloat16"))) == {(BF16, BF16)}
    by_class = set(dtypes(jamp.wrap(module, "mixed_bfloat16", {nnx.Conv: "float32"})))
    assert by_class == {(BF16, BF16), (F32, F32)}
    conv_only = [
        d
        for p, d in _matmul_operand_dtypes(
            _grad_jaxpr(jamp.wrap(module, "mixed_bfloat16", {nnx.Conv: "float32"}), x)
        )
        if p == "conv_general_dilated"
    ]
    assert set(conv_only) == {(F32, F32)}
    by_path = _matmul_operand_dtypes(
        _grad_jaxpr(jamp.wrap(module, "mixed_bfloat16", {"dense2": "float32"}), x)
    )
    dense = [d for p, d in by_path if p == "dot_general"]
    assert (F32, F32) in dense and (BF16, BF16) in dense  # dense2 in fp32, dense1 in bf16
    # Attribute paths into lists: blocks/<i>/...
    resnet, images = _build("resnet")
    found = _matmul_operand_dtypes(
        _grad_jaxpr(jamp.wrap(resnet, "mixed_bfloat16", {"blocks/0/*": "float32"}), images)
    )
    assert (F32, F32) in [d for _, d in found] and (BF16, BF16) in [d for _, d in found]


def test_nnx_public_methods_run_under_the_policy_and_submodules_as_written():
    module, x = _build("hard_coded_f32")
    model = jamp.wrap(module, "mixed_bfloat16")
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).features(x))(state).jaxpr
    assert {d for _, d in _matmul_operand_dtypes(jaxpr)} == {(BF16, BF16)}
    np.testing.assert_allclose(model.features(x), module.features(x), rtol=2e-2, atol=2e-2)
    assert model.dense is not module.dense  # a copy: the original is left as it was


def test_nnx_split_merge_dropout_rngs_and_modes():
    module, tokens = _build("transformer")
    model = jamp.wrap(module, "mixed_bfloat16")
    graphdef, state = nnx.split(model)
    again = nnx.merge(graphdef, state)
    assert type(again) is type(model) and jamp.nnx.is_wrapped(again)
    a, b = model(tokens), model(tokens)  # train mode: dropout draws a new mask each call
    assert not np.array_equal(a, b)
    model.eval()
    np.testing.assert_array_equal(model(tokens), model(tokens))
    model.train()
    with pytest.raises(ValueError, match="already wrapped"):
        jamp.wrap(model, "mixed_bfloat16")
    with pytest.raises(TypeError, match="override key"):
        jamp.wrap(module, "mixed_bfloat16", {3: "float32"})


def test_nnx_optimizer_step_under_nnx_jit_learns():
    module, images = _build("resnet")
    model = jamp.wrap(module, "mixed_bfloat16")
    labels = jnp.array([0, 1])
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(model):
        logits = model(images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(15)]
    assert losses[-1] < 0.5 * losses[0]
    assert {a.dtype for a in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}


# ----- the loss-scaled step (jamp.make_train_step) for NNX models


def _classification(model):
    def loss(model, batch):
        logits = model(batch["x"])
        value = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return value, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    return loss


def _fp16_state(name, scale=2.0**24):
    module, images = _build("resnet20" if name == "resnet" else name)
    functional, params, model_state = jamp.nnx.split(jamp.wrap(module, "mixed_float16"))
    tx = optax.adam(1e-3)
    # 2**24 overflows fp16 gradients for sure: the first steps must be skipped, not applied.
    state = jamp.TrainState.create(
        params,
        tx,
        model_state=model_state,
        loss_scale=jamp.DynamicLossScale(scale, growth_interval=5, max_loss_scale=2.0**24),
    )
    batch = {"x": images, "y": jnp.array([0, 1])}
    return functional, state, tx, batch


@pytest.mark.parametrize("name", ["seed_cnn", "resnet"])
def test_nnx_fp16_train_step_skips_overflow_bit_identically_and_learns(name):
    functional, state, tx, batch = _fp16_state(name)
    step = jax.jit(jamp.make_train_step(functional.loss_fn(_classification(None)), tx))
    new, metrics = step(state, batch, jax.random.key(0))
    assert not bool(metrics["grads_finite"])
    for field in ("params", "opt_state", "model_state"):
        jax.tree.map(np.testing.assert_array_equal, getattr(state, field), getattr(new, field))
    assert float(new.loss_scale.loss_scale) == 2.0**23
    top = {str(key) for key in nnx.to_pure_dict(state.params)}
    assert {group.split("/")[0] for group in metrics["grads_finite_by_module"]} <= top
    losses = []
    for _ in range(40):
        new, metrics = step(new, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    assert step._cache_size() == 1
    assert 1 <= int(new.skipped_steps) <= 40 and losses[-1] < 0.5 * losses[0]
    if name == "resnet":  # batch statistics moved, in fp32
        moved = jax.tree.map(
            lambda a, b: not np.array_equal(a, b), state.model_state, new.model_state
        )
        assert any(jax.tree.leaves(moved))
        assert {a.dtype for a in jax.tree.leaves(new.model_state)} == {F32}
    model = functional.merge(new.params, new.model_state)  # back to an NNX module, still wrapped
    assert jamp.nnx.is_wrapped(model) and model(batch["x"]).dtype == F32


def test_nnx_train_step_reseeds_dropout_from_the_step_key():
    module, tokens = _build("transformer")
    functional, params, model_state = jamp.nnx.split(jamp.wrap(module, "mixed_bfloat16"))
    assert functional.streams == ("default", "dropout") or "dropout" in functional.streams

    def loss(model, batch):
        return jnp.mean(model(batch) ** 2)

    loss_fn = functional.loss_fn(loss)
    a = loss_fn(params, model_state, tokens, jax.random.key(0))[0]
    b = loss_fn(params, model_state, tokens, jax.random.key(0))[0]
    c = loss_fn(params, model_state, tokens, jax.random.key(1))[0]
    assert float(a) == float(b) and float(a) != float(c)
    evaluate = functional.eval_fn(lambda model, batch: {"loss": loss(model, batch)})
    assert float(evaluate(params, model_state, tokens)["loss"]) == float(
        evaluate(params, model_state, tokens)["loss"]
    )


class _NormMLP(nnx.Module):
    """Small and quick to compile: a BatchNorm between two layers (statistics to average)."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def test_nnx_train_step_under_pmap_and_sharded_agrees_with_one_device():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs simulated devices (tests/conftest.py sets 8)")
    n = 2
    model = jamp.wrap(_NormMLP(nnx.Rngs(0)), "mixed_float16")
    functional, params, model_state = jamp.nnx.split(model)
    # SGD: Adam would blow the rounding noise of the bias before the norm (its true gradient is
    # zero) up to a full step, differently on each path.
    tx = optax.sgd(0.1)
    state = jamp.TrainState.create(
        params, tx, model_state=model_state, loss_scale=jamp.DynamicLossScale(2.0**10)
    )
    # Each replica sees the same examples: batch statistics are per replica (no cross-replica
    # BatchNorm), so only then are one device's statistics and gradients the replicas' too.
    x = jnp.tile(jax.random.normal(jax.random.key(0), (4, 5)), (n, 1))
    batch = {"x": x, "y": (x[:, 0] > 0).astype(jnp.int32)}
    loss = _classification(None)
    one, m1 = jax.jit(jamp.make_train_step(functional.loss_fn(loss), tx))(
        state, batch, jax.random.key(0)
    )
    p_step = parallel.make_p_train_step(
        jamp.make_train_step(functional.loss_fn(loss), tx, axis_name="batch")
    )
    p_new, p_metrics = p_step(
        parallel.replicate(state, devices[:n]), parallel.shard(batch, n), jax.random.key(0)
    )
    assert bool(p_metrics["grads_finite"][0]) == bool(m1["grads_finite"]) is True
    mesh = sharding.make_mesh({"data": n}, devices[:n])
    placed = sharding.shard_state(state, mesh)
    s_step = sharding.make_sharded_train_step(
        jamp.make_train_step(functional.loss_fn(loss), tx), mesh, sharding.state_shardings(placed)
    )
    s_new, _ = s_step(placed, sharding.shard_batch(batch, mesh), jax.random.key(0))
    for other in (parallel.unreplicate(p_new), s_new):
        for field in ("params", "model_state"):  # the batch statistics averaged alike
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(
                    np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5
                ),
                getattr(one, field),
                getattr(other, field),
            )
        assert float(other.loss_scale.loss_scale) == float(one.loss_scale.loss_scale)


class _Extras(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, x):
        return {"y": self.dense(x), "count": 3, "name": "extras"}

    def num_layers(self):
        return 1


def test_nnx_a_flax_layer_wrapped_directly_and_methods_returning_python_values():
    x = jnp.ones((2, 3))
    layer = jamp.wrap(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    found = _matmul_operand_dtypes(_grad_jaxpr(layer, x))
    assert found and {d for _, d in found} == {(BF16, BF16)}
    model = jamp.wrap(_Extras(nnx.Rngs(0)), "mixed_bfloat16")
    out = model(x)
    assert out["count"] == 3 and out["name"] == "extras" and out["y"].dtype == F32
    assert model.num_layers() == 1 and isinstance(model.num_layers(), int)


class _TakesRngs(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, other=None, *, rngs=None):
        y = self.drop(self.dense(x), rngs=rngs)
        return y if other is None else other(y)


def test_nnx_rngs_and_modules_passed_as_arguments_keep_their_updates():
    x = jnp.ones((2, 4))
    model = jamp.wrap(_TakesRngs(), "mixed_bfloat16")
    rngs = nnx.Rngs(dropout=1)
    a, b = model(x, rngs=rngs), model(x, rngs=rngs)
    assert int(rngs.dropout.count.get_value()) == 2 and not np.array_equal(a, b)
    norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    model(3 * x, norm, rngs=rngs)
    assert float(jnp.abs(norm.mean.get_value()).sum()) > 0  # its statistics moved


def test_nnx_a_wrapped_norm_itself_runs_in_fp32_and_root_overrides_apply():
    x = jnp.ones((2, 4))
    norm = jamp.wrap(nnx.LayerNorm(4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    assert norm(x).dtype == F32
    assert {np.dtype(v.aval.dtype) for e in _eqns(norm, x) for v in e.outvars} <= {F32}
    layer = jamp.wrap(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "mixed_bfloat16", {nnx.Linear: "float32"})
    assert {d for _, d in _matmul_operand_dtypes(_grad_jaxpr(layer, x))} == {(F32, F32)}


class _Counts(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.calls = 0

    def __call__(self, x):
        self.calls += 1  # plain Python state: lost in any trace, so refused with one line
        return self.dense(x)


def test_nnx_configuration_methods_act_and_attribute_changes_in_a_call_are_refused():
    drop = jamp.wrap(nnx.Dropout(0.5, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    drop.eval()
    assert drop.deterministic
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(drop(x), x)
    with pytest.raises(ValueError, match="changed the module's attributes"):
        jamp.wrap(_Counts(), "mixed_bfloat16")(x)


def test_module_policies_by_attribute_path_in_call_finish_order_changing_nothing():
    from jamp.models import nnx_models

    lm = nnx_models.TransformerLM(
        50, num_layers=2, d_model=16, num_heads=2, mlp_dim=32, max_len=8, rngs=nnx.Rngs(0)
    )
    model = jamp.wrap(lm, "mixed_bfloat16", {"blocks/0": "float32", "blocks/1/mlp_in": "float32"})
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    policies = jamp.nnx.module_policies(model, jnp.zeros((2, 8), jnp.int32))
    dtype = {path: np.dtype(p.compute_dtype).name for path, p in policies.items()}
    order = list(policies)
    assert order[-1] == ""  # the model's own call finishes last
    assert order.index("blocks/0/mlp_in") < order.index("blocks/0") < order.index("blocks/1")
    assert dtype[""] == dtype["blocks/1"] == dtype["blocks/1/attention/query"] == "bfloat16"
    assert dtype["blocks/1/mlp_in"] == dtype["blocks/1/norm1"] == dtype["norm"] == "float32"
    # the nearest overridden module above decides: all of block 0 computes in float32
    assert {d for p, d in dtype.items() if p.startswith("blocks/0")} == {"float32"}
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    with pytest.raises(TypeError, match="jamp.wrap-ped NNX module"):
        jamp.nnx.module_policies(lm, jnp.zeros((2, 8), jnp.int32))
