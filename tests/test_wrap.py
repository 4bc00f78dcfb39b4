"""jamp.wrap: unmodified Flax modules under a policy, checked on the jaxpr."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from jamp.models import SeedCNN, TransformerLM, resnet20
from jamp.wrap import wrap

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
MATMULS = ("dot_general", "conv_general_dilated")


# ----- unmodified "third-party" models


class HardCodedF32(nn.Module):
    """Layers that pin dtype=float32 explicitly, as many published Flax models do."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(16, dtype=jnp.float32, param_dtype=jnp.float32)(x)
        x = nn.LayerNorm(dtype=jnp.float32)(x)
        x = nn.Conv(4, (1,), dtype=jnp.float32)(x[..., None])
        return nn.Dense(3, dtype=jnp.float32)(x.reshape(x.shape[0], -1))


class RawParam(nn.Module):
    """Reads a parameter and multiplies by it directly."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], x.shape[-1]))
        return jnp.tanh(x @ w)


class Shared(nn.Module):
    """One Dense applied twice, plus a nested module and a second method."""

    def setup(self):
        self.proj = nn.Dense(5)
        self.inner = RawParam()

    def __call__(self, x):
        return self.proj(self.inner(self.proj(x)))

    def encode(self, x):
        return self.proj(x)


def _models():
    k = jax.random.key(1)
    images = jax.random.normal(k, (2, 8, 8, 3))
    tokens = jax.random.randint(k, (2, 12), 0, 50)
    feats = jax.random.normal(k, (2, 5))
    return {
        "seed_cnn": (SeedCNN(num_classes=4), images, {"train": True}),
        "resnet": (
            resnet20(num_classes=4, num_filters=4),
            images,
            {"train": True, "mutable": ["batch_stats"]},
        ),
        "transformer": (
            TransformerLM(
                vocab_size=50, num_layers=2, d_model=16, num_heads=2, mlp_dim=32, max_len=16
            ),
            tokens,
            {"train": True},
        ),
        "hard_coded_f32": (HardCodedF32(), feats, {"train": True}),
        "raw_param": (RawParam(), feats, {}),
        "shared": (Shared(), feats, {}),
    }


MODELS = _models()


def _matmul_operand_dtypes(jaxpr):
    """(primitive, operand dtypes) of every matmul and convolution, in sub-programs too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            found.append((eqn.primitive.name, tuple(np.dtype(v.aval.dtype) for v in eqn.invars)))
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += _matmul_operand_dtypes(sub)
    return found


def _loss_and_grad_jaxpr(model, variables, x, kwargs):
    def loss(params):
        out = model.apply({**variables, "params": params}, x, **kwargs)
        out = out[0] if kwargs.get("mutable") else out
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"]).jaxpr


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("compute", [BF16, F16])
def test_wrap_every_matmul_takes_compute_dtype_operands_forward_and_backward(name, compute):
    module, x, kwargs = MODELS[name]
    model = wrap(module, f"p=f32,c={compute.name},o=f32")
    variables = module.init(jax.random.key(0), x)
    found = _matmul_operand_dtypes(_loss_and_grad_jaxpr(model, variables, x, kwargs))
    assert found, "the model has matmuls"
    wrong = [f for f in found if f[1] != (compute, compute)]
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrap_unwrapped_hard_coded_models_really_compute_in_fp32(name):
    # The control for the test above: without wrap these models' matmuls are float32.
    module, x, kwargs = MODELS[name]
    variables = module.init(jax.random.key(0), x)
    found = _matmul_operand_dtypes(_loss_and_grad_jaxpr(module, variables, x, kwargs))
    assert all(dtypes == (F32, F32) for _, dtypes in found)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrap_creates_same_variables_in_param_dtype(name):
    module, x, _ = MODELS[name]
    ref = module.init(jax.random.key(0), x)
    got = wrap(module, "mixed_bfloat16").init(jax.random.key(0), x)
    assert jax.tree.structure(ref) == jax.tree.structure(got)
    jax.tree.map(np.testing.assert_array_equal, ref, got)
    got16 = wrap(module, "p=bf16,c=bf16,o=f32").init(jax.random.key(0), x)
    assert {a.dtype for a in jax.tree.leaves(got16["params"])} == {BF16}
    jax.tree.map(
        lambda r, g: np.testing.assert_array_equal(r.astype(BF16), g),
        ref["params"],
        got16["params"],
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrap_outputs_in_output_dtype_and_grads_in_param_dtype(name):
    module, x, kwargs = MODELS[name]
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "p=f32,c=bf16,o=f32")

    def loss(params):
        out = model.apply({**variables, "params": params}, x, **kwargs)
        out = out[0] if kwargs.get("mutable") else out
        assert out.dtype == F32
        return jnp.mean(out**2)

    value, grads = jax.jit(jax.value_and_grad(loss))(variables["params"])
    assert np.isfinite(value)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    out16 = wrap(module, "p=f32,c=bf16,o=bf16").apply(variables, x, **kwargs)
    out16 = out16[0] if kwargs.get("mutable") else out16
    assert out16.dtype == BF16


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrap_fp32_policy_is_bit_identical(name):
    module, x, kwargs = MODELS[name]
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "float32")

    def loss(m, params):
        out = m.apply({**variables, "params": params}, x, **kwargs)
        out = out[0] if kwargs.get("mutable") else out
        return jnp.sum(jnp.sin(out)), out

    for fn in (lambda f: f, jax.jit):
        (ref_loss, ref_out), ref_g = fn(
            jax.value_and_grad(lambda p: loss(module, p), has_aux=True)
        )(variables["params"])
        (got_loss, got_out), got_g = fn(jax.value_and_grad(lambda p: loss(model, p), has_aux=True))(
            variables["params"]
        )
        np.testing.assert_array_equal(ref_out, got_out)
        np.testing.assert_array_equal(ref_loss, got_loss)
        jax.tree.map(np.testing.assert_array_equal, ref_g, got_g)


def test_wrap_mixed_grads_close_to_fp32_grads():
    module, x, _ = MODELS["transformer"]
    variables = module.init(jax.random.key(0), x)

    def grads(m):
        return jax.grad(lambda p: jnp.mean(m.apply({"params": p}, x) ** 2))(variables["params"])

    ref, got = grads(module), grads(wrap(module, "mixed_bfloat16"))
    ref_flat, got_flat = (
        jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (ref, got)
    )
    # bf16 operands carry 8 significant bits; fp32 accumulation keeps the sums close.
    assert float(jnp.linalg.norm(got_flat - ref_flat) / jnp.linalg.norm(ref_flat)) < 2e-2


def test_wrap_batch_norm_stats_stay_fp32_and_update():
    module, x, _ = MODELS["resnet"]
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "mixed_float16")
    _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert {a.dtype for a in jax.tree.leaves(updates)} == {F32}
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), variables["batch_stats"], updates["batch_stats"]
    )
    assert any(jax.tree.leaves(changed))
    # Statistics close to those of the fp32 model: normalization did not run in 16 bits.
    _, ref = module.apply(variables, x, train=True, mutable=["batch_stats"])
    jax.tree.map(lambda r, g: np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-3), ref, updates)


def _norm_eqn_dtypes(model, variables, x):
    """dtypes of the variance's rsqrt: the step where 16-bit normalization loses most."""
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables).jaxpr
    return {np.dtype(e.invars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "rsqrt"}


def test_wrap_layer_norm_runs_in_fp32_even_when_the_model_says_bf16():
    # A model that asked for bf16 statistics: the default override still normalizes in fp32.
    module = nn.Sequential(
        [
            nn.Dense(8, dtype=jnp.bfloat16),
            nn.LayerNorm(dtype=jnp.bfloat16, force_float32_reductions=False),
        ]
    )
    x = jnp.ones((2, 4))
    variables = module.init(jax.random.key(0), x)
    assert _norm_eqn_dtypes(module, variables, x) == {BF16}
    assert _norm_eqn_dtypes(wrap(module, "mixed_bfloat16"), variables, x) == {F32}


def test_wrap_overrides_by_class_and_by_path():
    module, x, _ = MODELS["shared"]
    variables = module.init(jax.random.key(0), x)

    def dtypes(model):
        jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables).jaxpr
        return [d for _, d in _matmul_operand_dtypes(jaxpr)]

    assert dtypes(wrap(module, "mixed_bfloat16")) == [(BF16, BF16)] * 3
    # Path pattern: only the nested RawParam stays fp32.
    assert dtypes(wrap(module, "mixed_bfloat16", {"inner": "float32"})) == [
        (BF16, BF16),
        (F32, F32),
        (BF16, BF16),
    ]
    # Class: every Dense in fp16 while the rest is bf16.
    assert dtypes(wrap(module, "mixed_bfloat16", {nn.Dense: "mixed_float16"})) == [
        (F16, F16),
        (BF16, BF16),
        (F16, F16),
    ]


class Projection(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="inner")(x)


class TiedLM(nn.Module):
    """Runs submodules through a nested `apply`, as Hugging Face's Flax models tie their LM head
    to the embedding: the nested module gets a scope of its own."""

    def setup(self):
        self.embed = nn.Embed(20, 6)
        self.body = nn.Dense(6)
        self.lm_head = nn.Dense(20, use_bias=False)
        self.side = Projection()

    def __call__(self, tokens):
        h = jnp.tanh(self.body(self.embed(tokens)))
        table = self.embed.variables["params"]["embedding"]
        logits = self.lm_head.apply({"params": {"kernel": table.T}}, h)
        side = self.side.apply({"params": {"inner": self.body.variables["params"]}}, h)
        return logits + side.sum()


def _matmul_dtypes(model, variables, *args):
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, *args))(variables).jaxpr
    return [d for _, d in _matmul_operand_dtypes(jaxpr)]


def test_wrap_path_override_reaches_a_module_applied_from_inside_another():
    module, tokens = TiedLM(), jnp.arange(8).reshape(2, 4)
    variables = module.init(jax.random.key(0), tokens)
    # body, lm_head, side/inner: in the order they run.
    assert _matmul_dtypes(wrap(module, "mixed_bfloat16"), variables, tokens) == [(BF16, BF16)] * 3
    head = wrap(module, "mixed_bfloat16", {"lm_head": "float32"})
    assert _matmul_dtypes(head, variables, tokens) == [(BF16, BF16), (F32, F32), (BF16, BF16)]
    inner = wrap(module, "mixed_bfloat16", {"side/inner": "float32"})
    assert _matmul_dtypes(inner, variables, tokens) == [(BF16, BF16), (BF16, BF16), (F32, F32)]
    assert _matmul_dtypes(
        wrap(module, "mixed_bfloat16", {"*inner": "float32", "body": "mixed_float16"}),
        variables,
        tokens,
    ) == [(F16, F16), (BF16, BF16), (F32, F32)]


def test_wrap_path_overrides_inside_lifted_transforms_keep_their_paths():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dense(4, name="mix")(nn.Dense(4, name="proj")(c)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                nn.remat(Block),
                variable_broadcast="params",
                split_rngs={"params": False},
                length=2,
            )
            y, _ = scan(name="blocks")(x, None)
            return nn.Dense(3, name="head")(y)

    module, x = Stack(), jnp.ones((2, 4))
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "mixed_bfloat16", {"blocks/mix": "float32", "head": "mixed_float16"})
    assert _matmul_dtypes(model, variables, x) == [(BF16, BF16), (F32, F32), (F16, F16)]


class BatchNorm(nn.Module):
    """Another library's own batch norm (as flaxmodels ships one), not a flax.linen.BatchNorm."""

    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        mean = x.mean(0)
        var = ((x - mean) ** 2).mean(0)
        return (
            (x - mean)
            * jax.lax.rsqrt(var + 1e-5)
            * self.param("scale", nn.initializers.ones, x.shape[-1:])
        )


class FlaxToyRMSNorm(nn.Module):
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def test_wrap_normalization_classes_of_other_libraries_run_in_fp32():
    module = nn.Sequential([nn.Dense(8), BatchNorm(), nn.Dense(8), FlaxToyRMSNorm()])
    x = jax.random.normal(jax.random.key(0), (4, 5))
    variables = module.init(jax.random.key(1), x)
    assert _norm_eqn_dtypes(module, variables, x) == {BF16}  # as the model asks
    for activations in ("float32", "compute"):
        model = wrap(module, "mixed_bfloat16", activations=activations)
        assert _norm_eqn_dtypes(model, variables, x) == {F32}
        assert _matmul_dtypes(model, variables, x) == [(BF16, BF16)] * 2
    # An override matched first wins over the name rule.
    model = wrap(module, "mixed_bfloat16", {FlaxToyRMSNorm: "mixed_bfloat16"})
    assert _norm_eqn_dtypes(model, variables, x) == {F32, BF16}


def test_wrap_method_rngs_and_extra_arguments():
    module, x, _ = MODELS["shared"]
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "mixed_bfloat16")
    enc = model.apply(variables, x, method="encode")
    np.testing.assert_allclose(
        enc, module.apply(variables, x, method="encode"), rtol=3e-2, atol=3e-2
    )
    enc2 = model.apply(variables, x, method=Shared.encode)
    np.testing.assert_array_equal(enc, enc2)

    lm = TransformerLM(
        vocab_size=50,
        num_layers=1,
        d_model=16,
        num_heads=2,
        mlp_dim=32,
        max_len=16,
        dropout_rate=0.5,
    )
    tokens = MODELS["transformer"][1]
    wlm = wrap(lm, "mixed_bfloat16")
    v = wlm.init(jax.random.key(0), tokens)
    a = wlm.apply(v, tokens, train=True, rngs={"dropout": jax.random.key(1)})
    b = wlm.apply(v, tokens, train=True, rngs={"dropout": jax.random.key(2)})
    c = wlm.apply(v, tokens, train=False)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(c, wlm.apply(v, tokens))


def test_wrap_init_with_output_and_errors():
    module, x, _ = MODELS["raw_param"]
    model = wrap(module, "mixed_bfloat16")
    out, variables = model.init_with_output(jax.random.key(0), x)
    assert out.dtype == F32
    jax.tree.map(np.testing.assert_array_equal, variables, module.init(jax.random.key(0), x))
    with pytest.raises(ValueError, match="already wrapped"):
        wrap(model, "mixed_bfloat16")
    with pytest.raises(TypeError, match="flax.linen.Module"):
        wrap(lambda x: x, "mixed_bfloat16")
    with pytest.raises(ValueError):
        wrap(module, "mixed_float12")


def test_wrap_reaches_matmuls_inside_scan_and_remat():
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = nn.remat(nn.Dense)
            scan = nn.scan(
                lambda mdl, c, _: (mdl(c), None),
                variable_broadcast="params",
                split_rngs={"params": False},
                length=3,
            )
            y, _ = scan(block(x.shape[-1]), x, None)
            return y

    module, x = Scanned(), jnp.ones((2, 4))
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "mixed_bfloat16")
    found = _matmul_operand_dtypes(_loss_and_grad_jaxpr(model, variables, x, {}))
    assert found and all(d == (BF16, BF16) for _, d in found)
    np.testing.assert_allclose(
        model.apply(variables, x), module.apply(variables, x), rtol=3e-2, atol=3e-2
    )


def test_wrap_fp16_train_step_compiles_once_skips_overflow_and_learns():
    import optax

    from jamp.loss_scale import DynamicLossScale
    from jamp.state import TrainState
    from jamp.step import make_train_step

    module, images, _ = MODELS["seed_cnn"]
    labels = jnp.array([0, 1])
    model = wrap(module, "mixed_float16")
    params = model.init(jax.random.key(0), images)["params"]

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    tx = optax.adam(1e-3)
    # 2**40 overflows fp16 gradients for sure: the first steps must be skipped, not applied.
    state = TrainState.create(
        params, tx, loss_scale=DynamicLossScale(2.0**40, growth_interval=5, max_loss_scale=2.0**40)
    )
    step = jax.jit(make_train_step(loss_fn, tx))
    batch = {"x": images, "y": labels}
    state, metrics = step(state, batch, jax.random.key(0))
    assert not bool(metrics["grads_finite"])
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    losses = []
    for _ in range(40):
        state, metrics = step(state, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    assert step._cache_size() == 1
    skipped = int(state.skipped_steps)
    # Every skip halves the scale: from 2**40 to a workable fp16 scale takes a bounded number.
    assert 1 <= skipped <= 40 and float(state.loss_scale.loss_scale) < 2.0**40
    assert losses[-1] < 0.5 * losses[0]
